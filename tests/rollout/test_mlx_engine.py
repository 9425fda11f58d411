"""The MLX engine keeps the torch engine's contract: same records, same rules."""

import pytest
import torch

from colonnade.model import int8_state, load_int8, load_model, tied_aliases
from colonnade.rollout import Engine, SamplingParams
from rollout.test_engine import _prompts, _replies


@pytest.fixture(scope="module")
def engines(mlx_ready, tiny_dir):
    """(MLX int8 engine, torch int8 engine) over the same published codes."""
    from colonnade.rollout.mlx_engine import MlxEngine

    model, tok = load_model(tiny_dir)
    aliases = tied_aliases(model)
    state = int8_state(model)
    mlx = MlxEngine.from_state(model, tok, state, "int8", version=3)
    return mlx, Engine(load_int8(model, state, aliases), tok, 3)


def test_multi_turn_logprobs_equal_a_teacher_forced_mlx_pass(engines):
    mlx, _ = engines
    tok = mlx.tokenizer
    params = SamplingParams(max_turn_tokens=6, max_episode_tokens=120)
    eps = mlx.generate(_prompts(tok), [_replies(3)() for _ in range(4)], params, seed=1)
    assert all(ep.finish == "done" and len(ep.turns) == 3 and ep.version == 3 for ep in eps)
    diffs = []
    for ep in eps:
        ref = mlx.model.sequence_logprobs(ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        got = torch.tensor(ep.logprobs)
        assert (~mine).any() and (got[~mine] == 0).all()  # env tokens: masked, no log-prob
        diffs.append((ref[mine] - got[mine]).abs())
    assert torch.cat(diffs).max() < 1e-4


# Two engines that differ only in rounding may pick different greedy tokens
# where the best two are this close; anywhere else they must agree.
NEAR_TIE = 0.05


def test_greedy_mlx_and_torch_episodes_agree_and_logprobs_are_close(engines):
    # The cross-engine mismatch the DPPO gate must absorb: same int8 codes,
    # the torch kernel rounds activations to bf16, MLX keeps float32.
    mlx, torch_engine = engines
    tok = mlx.tokenizer
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=60)
    a = mlx.generate(_prompts(tok), [_replies(2)() for _ in range(4)], params)
    b = torch_engine.generate(_prompts(tok), [_replies(2)() for _ in range(4)], params)
    agreed = 0
    for x, y in zip(a, b, strict=True):
        ids = x.prompt_ids + x.tokens
        with torch.no_grad():
            logits = torch_engine.model(input_ids=torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[len(x.prompt_ids) - 1 : -1], -1)
        mine = torch.tensor(x.from_model)
        chosen = lp.gather(-1, torch.tensor(x.tokens)[:, None]).squeeze(-1)
        # Every greedy MLX token is torch's greedy token or a near tie of it.
        assert (lp.max(-1).values - chosen)[mine].max() < NEAR_TIE
        assert (chosen[mine] - torch.tensor(x.logprobs)[mine]).abs().max() < 0.05
        agreed += x.tokens == y.tokens and x.turns == y.turns
    assert agreed >= 1  # and whole episodes come out the same where no tie is met


def test_batch_rows_match_rows_run_alone(engines):
    mlx, _ = engines
    params = SamplingParams(temperature=0, max_turn_tokens=4, max_episode_tokens=40)
    prompts = _prompts(mlx.tokenizer)
    together = mlx.generate(prompts, [_replies(k + 1)() for k in range(4)], params)
    alone = [mlx.generate([p], [_replies(k + 1)()], params)[0] for k, p in enumerate(prompts)]
    assert len({len(e.tokens) for e in together}) > 1  # rows left at different steps
    for x, y in zip(together, alone, strict=True):
        assert x.tokens == y.tokens
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)


def test_stop_strings_and_budgets_hold(engines):
    mlx, _ = engines
    params = SamplingParams(max_turn_tokens=50, max_episode_tokens=30, stop=("</search>",))
    eps = mlx.generate(_prompts(mlx.tokenizer), [_replies(5)() for _ in range(4)], params)
    for ep in eps:
        assert len(ep.tokens) <= 30 and ep.finish in {"done", "eos", "length"}
        assert all("</search>" not in t[: -len("</search>")] for t in ep.turns)


def test_shared_prefix_and_refill_keep_mlx_log_probs(engines):
    # The MLX session takes joining groups too (left-padded caches): what
    # it records is still the teacher-forced MLX pass, within 1e-4.
    from rollout.test_continuous import _groups, _responders

    mlx, _ = engines
    tok = mlx.tokenizer
    prompts = _groups(tok, 3)
    params = SamplingParams(max_turn_tokens=5, max_episode_tokens=60)
    eps = mlx.generate(
        prompts, _responders(len(prompts), lambda i: 1 + i % 3), params, seed=2, max_rows=4
    )
    diffs = []
    for ep in eps:
        ref = mlx.model.sequence_logprobs(ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        diffs.append((ref[mine] - torch.tensor(ep.logprobs)[mine]).abs())
    assert torch.cat(diffs).max() < 1e-4
