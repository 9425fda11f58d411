"""The MLX and torch backends, run over the same published codes, agree."""

import pytest
import torch
from test_backends import _prompts, _replies

from colonnade.engine import SamplingParams, engine_for
from colonnade.model import int8_state, load_model


@pytest.fixture(scope="module")
def engines(mlx_ready, tiny_dir):
    """(MLX int8 engine, torch int8 engine) over the same published codes."""
    model, tok = load_model(tiny_dir)
    state, cpu = int8_state(model), torch.device("cpu")
    mlx = engine_for(model, tok, state, "int8", cpu, "mlx", version=3)
    return mlx, engine_for(model, tok, state, "int8", cpu, "torch", version=3)


# Two engines that differ only in rounding may pick different greedy tokens
# where the best two are this close; anywhere else they must agree.
NEAR_TIE = 0.05


def test_greedy_mlx_and_torch_episodes_agree_and_logprobs_are_close(engines):
    # The cross-engine mismatch the DPPO gate must absorb: same int8 codes,
    # the torch kernel rounds activations to bf16, MLX keeps float32.
    mlx, torch_engine = engines
    tok = mlx.tokenizer
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=60)
    a = mlx.generate(_prompts(tok), [_replies(2) for _ in range(4)], params)
    b = torch_engine.generate(_prompts(tok), [_replies(2) for _ in range(4)], params)
    agreed = 0
    for x, y in zip(a, b, strict=True):
        ids = x.prompt_ids + x.tokens
        with torch.no_grad():
            logits = torch_engine.backend.model(input_ids=torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[len(x.prompt_ids) - 1 : -1], -1)
        mine = torch.tensor(x.from_model)
        chosen = lp.gather(-1, torch.tensor(x.tokens)[:, None]).squeeze(-1)
        # Every greedy MLX token is torch's greedy token or a near tie of it.
        assert (lp.max(-1).values - chosen)[mine].max() < NEAR_TIE
        assert (chosen[mine] - torch.tensor(x.logprobs)[mine]).abs().max() < 0.05
        agreed += x.tokens == y.tokens and x.turns == y.turns
    assert agreed >= 1  # and whole episodes come out the same where no tie is met


def test_the_same_draws_give_the_same_tokens_on_both_backends_but_near_a_boundary(engines):
    # The inverse-CDF rule in token-id order: two engines that differ only by
    # rounding pick different tokens only where a draw falls within that
    # rounding of the boundary between two tokens' intervals.
    import numpy as np

    from colonnade.protocol.draws import draw_key, uniforms

    mlx, torch_engine = engines
    tok = mlx.tokenizer
    params = SamplingParams(temperature=1.0, max_turn_tokens=8, max_episode_tokens=24)
    prompts = [p for p in _prompts(tok) for _ in range(8)]
    keys = [draw_key("r", 3, "w", 0, "t", i) for i in range(len(prompts))]
    a = mlx.generate(prompts, [lambda t: None] * len(prompts), params, keys=keys)
    b = torch_engine.generate(prompts, [lambda t: None] * len(prompts), params, keys=keys)
    same = 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        n = next(
            (j for j, (s, t) in enumerate(zip(x.tokens, y.tokens, strict=False)) if s != t), None
        )
        if n is None:
            same += 1
            continue
        # The first token where they part: the draw sat on (or within rounding
        # of) the edge of the interval either engine gave its own token.
        u = uniforms(keys[i], [n])[0]
        edges = [x.below[n], x.below[n] + np.exp(x.logprobs[n]),
                 y.below[n], y.below[n] + np.exp(y.logprobs[n])]  # fmt: skip
        assert min(abs(u - e) for e in edges) < 0.02, (i, n, u, edges)
    assert same >= len(prompts) * 3 // 4
