"""Both engines on every architecture of issue 23, on the same published codes.

For each tiny model (tests/mlx_archs.py): what the MLX engine records is a
teacher-forced MLX pass over the same tokens (multi-turn, rows of different
lengths, groups sharing a prefill, rows joining a running batch), and its
gap to the torch int8 engine is within what the DPPO gate absorbs. The
torch engine runs the same models.
"""

import pytest
import torch

from colonnade.bench.engines import PROMPTS, gaps, replies
from colonnade.model import load_int8, tied_aliases
from colonnade.rollout import Engine, SamplingParams
from mlx_archs import ARCHS, arch_model, arch_tokenizer

# MLX computes a row the same way alone or in a batch, cached or not:
# measured 0.0 on every architecture here; stated tolerance 1e-4.
SELF_TOL = 1e-4
# Cross-engine (MLX float32 activations against the torch kernel's bf16):
# the target for the mean; the max is stated, not targeted. An MoE
# token whose top-k experts tie within that rounding is routed differently
# by the two engines: its gap is larger (docs/benchmarks.md).
MEAN_GAP = 0.05
MAX_GAP = {"qwen3_moe": 1.0}


def _engines(arch: str):
    import copy

    from colonnade.rollout.mlx_engine import MlxEngine

    model, state = arch_model(arch)
    tok = arch_tokenizer()
    mlx = MlxEngine.from_state(model, tok, state, "int8")
    torch_int8 = load_int8(copy.deepcopy(model), state, tied_aliases(model))
    return mlx, Engine(torch_int8, tok)


def _prompts(tok, group: int = 1):
    return [tok.encode(p, add_special_tokens=False) for p in PROMPTS for _ in range(group)]


def _self_gap(mlx, episodes) -> torch.Tensor:
    out = []
    for ep in episodes:
        ref = mlx.model.sequence_logprobs(ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        got = torch.tensor(ep.logprobs)
        assert (got[~mine] == 0).all()  # env tokens: no log-prob
        out.append((ref[mine] - got[mine]).abs())
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_records_a_teacher_forced_mlx_pass_and_stays_near_torch(mlx_ready, arch):
    mlx, torch_engine = _engines(arch)
    tok = mlx.tokenizer
    params = SamplingParams(max_turn_tokens=10, max_episode_tokens=120, ignore_eos=True)
    # Rows of different lengths and tool replies: pad columns inside rows,
    # episodes longer than Gemma 3's 24-token window.
    eps = mlx.generate(_prompts(tok), [replies(3) for _ in range(4)], params, seed=1)
    assert all(ep.finish == "done" and len(ep.turns) == 3 and not all(ep.from_model) for ep in eps)
    assert _self_gap(mlx, eps).max() < SELF_TOL
    cross = gaps(eps, torch_engine.model)
    assert cross.mean() < MEAN_GAP and cross.max() < MAX_GAP.get(arch, 0.25), cross


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_groups_share_a_prefill_and_refill_the_batch(mlx_ready, arch):
    mlx, _ = _engines(arch)
    prompts = _prompts(mlx.tokenizer, group=2)
    params = SamplingParams(max_turn_tokens=6, max_episode_tokens=60)
    eps = mlx.generate(
        prompts, [replies(1 + i % 3) for i in range(len(prompts))], params, seed=2, max_rows=3
    )
    assert _self_gap(mlx, eps).max() < SELF_TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_engine_runs_the_architecture(arch):
    # One row (no pad columns): the torch engine's records against its own
    # teacher-forced pass, within the int8 kernel's batch-shape tolerance.
    import copy

    model, state = arch_model(arch)
    engine = Engine(load_int8(copy.deepcopy(model), state, tied_aliases(model)), arch_tokenizer())
    params = SamplingParams(max_turn_tokens=10, max_episode_tokens=80, ignore_eos=True)
    eps = engine.generate(_prompts(engine.tokenizer)[:1], [replies(3)], params, seed=3)
    assert eps[0].finish == "done" and gaps(eps, engine.model).max() < 0.05


@pytest.mark.xfail(
    strict=True,
    reason="torch engine: a sliding-window layer counts pad columns (rows of different "
    "lengths) and drops real ones; log-probs off by up to ~1.6 nats (docs/benchmarks.md)",
)
def test_torch_engine_gemma3_with_padded_rows_matches_teacher_forcing():
    import copy

    model, state = arch_model("gemma3_text")
    engine = Engine(load_int8(copy.deepcopy(model), state, tied_aliases(model)), arch_tokenizer())
    params = SamplingParams(max_turn_tokens=40, max_episode_tokens=160, ignore_eos=True)
    eps = engine.generate(_prompts(engine.tokenizer), [replies(1) for _ in range(4)], params)
    assert gaps(eps, engine.model).max() < 0.05
