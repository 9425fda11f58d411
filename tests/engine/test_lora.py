"""A published state with LoRA adapters runs them unmerged on every engine
path: int8 linears on CPU (fused siblings included), the dequantized float
path CUDA and MPS take, the compiled step and MLX. Each computes what the
int8 base dequantized with the adapters merged in computes; a patch of the
adapters alone is copied in place, never reloading the base; a state
without adapters runs as before, with no hook anywhere."""

from __future__ import annotations

import pytest
import torch
from test_backends import _prompts, _replies

from colonnade.engine import Engine, SamplingParams, engine_for, refresh, torch_compile
from colonnade.engine.loader import load_torch
from colonnade.engine.torch_backend import TorchBackend
from colonnade.model import load_model, publishable_state, sequence_logprobs, tied_aliases
from colonnade.model.int8 import Int8Linear
from colonnade.model.lora import (
    A_SUFFIX,
    B_SUFFIX,
    TARGETS,
    adapted,
    is_adapter,
    merge,
    targets_in,
)
from colonnade.model.unmerged import adapted_modules
from colonnade.pulse import dequantize_state, prepare

CPU = torch.device("cpu")
RANK = 4
TEXTS = [
    "<search>gene GX3 protein</search> <information>GX3 binds to PRT21</information>",
    "the quick brown fox <answer>PRT7</answer>",
]
# The torch int8 kernel rounds activations to bf16 inside its matmul: the
# gap to a float32 pass of the same weights (test_backends' int8 tolerance).
TOL, MEAN_TOL = 0.1, 0.02


def _adapters(model, seed: int) -> dict[str, torch.Tensor]:
    """Random nonzero A and B' (scale folded) for every target linear of `model`."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in targets_in(model, TARGETS):
        m = model.get_submodule(name)
        out[name + A_SUFFIX] = torch.randn(RANK, m.in_features, generator=gen) * 0.1
        out[name + B_SUFFIX] = torch.randn(m.out_features, RANK, generator=gen) * 0.1
    return out


@pytest.fixture(scope="module")
def states(tiny):
    """(v1, v2, the keys v2 changed, the base alone): published int8 states;
    v2 is v1 patched in its adapters only (the base tensors the same objects)."""
    model, _ = tiny
    base = publishable_state(model)
    v1 = prepare({**base, **_adapters(model, 1)}, "int8")
    new = prepare(_adapters(model, 2), "int8")
    v2 = {**v1, **new}
    assert adapted(v1) and all(v1[k].dtype == torch.bfloat16 for k in new)  # never int8
    return v1, v2, set(new), prepare(base, "int8")


def _ids(tok) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in TEXTS]


def _logprobs(model, tok) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([sequence_logprobs(model, ids, 1) for ids in _ids(tok)])


def _reference(tiny_dir, state):
    """A float32 model of the int8 base dequantized with the adapters merged in."""
    model, _ = load_model(tiny_dir)
    missing, unexpected = model.load_state_dict(merge(dequantize_state(state)), strict=False)
    assert not unexpected and set(missing) <= set(tied_aliases(model))
    return model.eval()


def _int8_engine(tiny_dir, state) -> Engine:
    model, tok = load_model(tiny_dir)
    return engine_for(model, tok, state, "int8", CPU, "torch", version=1)


class _FloatBackend(TorchBackend):
    """The torch backend on the path CUDA and MPS take (the codes dequantized
    into float linears), run here on the CPU."""

    ELSEWHERE = torch.device("cuda")  # only its type is read: nothing runs there

    def refresh(self, state, changed) -> None:
        load_torch(self.model, state, self.aliases, self.precision, self.ELSEWHERE, changed)


def _float_engine(tiny_dir, state) -> Engine:
    model, tok = load_model(tiny_dir)
    aliases = tied_aliases(model)
    load_torch(model, state, aliases, "int8", _FloatBackend.ELSEWHERE)
    return Engine(_FloatBackend(model.eval(), "int8", aliases), tok, version=1)


TORCH_PATHS = {"int8": _int8_engine, "float": _float_engine}


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_the_torch_engine_runs_the_merged_models_logprobs_unmerged(path, states, tiny_dir):
    v1, _, _, base = states
    engine = TORCH_PATHS[path](tiny_dir, v1)
    net, tok = engine.backend.model, engine.tokenizer
    assert set(adapted_modules(net)) == set(adapted(v1))
    if path == "int8":  # the base runs the published codes, fused where siblings are
        q = net.get_submodule("model.layers.0.self_attn.q_proj")
        assert isinstance(q, Int8Linear) and q._siblings is not None
        assert torch.equal(q.codes, v1["model.layers.0.self_attn.q_proj.weight"])
    want = _logprobs(_reference(tiny_dir, v1), tok)
    gap = (_logprobs(net, tok) - want).abs()
    assert gap.max() < TOL and gap.mean() < MEAN_TOL
    # The adapters matter: the base alone stands far further off.
    alone = (_logprobs(_reference(tiny_dir, base), tok) - want).abs()
    assert alone.mean() > 10 * max(gap.mean(), 1e-4)


def _base_versions(net) -> dict[str, int]:
    """The in-place write counter of every base tensor (Int8Linear codes included)."""
    tensors = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    return {n: t._version for n, t in tensors.items() if ".adapter_" not in n}


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_a_patch_of_the_adapters_alone_is_copied_in_place(path, states, tiny_dir):
    v1, v2, changed, _ = states
    engine = TORCH_PATHS[path](tiny_dir, v1)
    net, tok = engine.backend.model, engine.tokenizer
    before, held = _base_versions(net), adapted_modules(net)
    refresh(engine, v2, changed, 2)
    assert _base_versions(net) == before  # no base tensor was written
    assert adapted_modules(net) == held  # the same modules, their adapters rewritten
    fresh = TORCH_PATHS[path](tiny_dir, v2)
    assert torch.equal(_logprobs(net, tok), _logprobs(fresh.backend.model, tok))
    # And back: v1's adapters give v1's log-probs again.
    refresh(engine, v1, changed, 3)
    assert torch.equal(
        _logprobs(net, tok), _logprobs(TORCH_PATHS[path](tiny_dir, v1).backend.model, tok)
    )


def _hooks(net) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_a_state_without_adapters_runs_no_hook(path, states, tiny_dir):
    v1, _, _, base = states
    plain = TORCH_PATHS[path](tiny_dir, base)
    net, tok = plain.backend.model, plain.tokenizer
    assert _hooks(net) == 0 and not adapted_modules(net)
    # A whole state without adapters takes them away again.
    engine = TORCH_PATHS[path](tiny_dir, v1)
    assert _hooks(engine.backend.model) == len(adapted(v1))
    refresh(engine, base, None, 2)
    assert _hooks(engine.backend.model) == 0
    assert torch.equal(_logprobs(engine.backend.model, tok), _logprobs(net, tok))


def test_compile_auto_measures_a_model_with_adapters_apart(states, tiny_dir):
    # `auto` keeps one measured choice per model shape: adapters add small
    # ops to every step, so a choice measured without them is not theirs.
    v1, _, _, base = states
    with_adapters = torch_compile.signature(_int8_engine(tiny_dir, v1).backend)
    without = torch_compile.signature(_int8_engine(tiny_dir, base).backend)
    assert with_adapters == f"{without} lora {len(adapted(v1))}x r{RANK}"


@pytest.fixture(scope="module")
def mlx_engines(mlx_ready, tiny_dir, states):
    """(MLX int8 engine, torch int8 engine) over v1."""
    v1 = states[0]
    model, tok = load_model(tiny_dir)
    mlx = engine_for(model, tok, v1, "int8", CPU, "mlx", version=1)
    return mlx, _int8_engine(tiny_dir, v1)


# Where greedy's best two tokens stand this close, engines that differ only by
# rounding may pick either (test_cross_backend); anywhere else they agree.
NEAR_TIE = 0.05


def test_mlx_runs_the_adapters_as_the_torch_engine(mlx_engines, states, tiny_dir):
    mlx, torch_engine = mlx_engines
    v1 = states[0]
    tok = mlx.tokenizer
    want = _logprobs(_reference(tiny_dir, v1), tok)
    got = torch.cat([mlx.backend.model.sequence_logprobs(ids, 1) for ids in _ids(tok)])
    assert (got - want).abs().max() < 1e-3  # MLX keeps activations in float32
    mine = _logprobs(torch_engine.backend.model, tok)
    assert (got - mine).abs().max() < 0.05  # the torch int8 kernel's bf16 rounding
    params = SamplingParams(temperature=0, max_turn_tokens=6, max_episode_tokens=60)
    a = mlx.generate(_prompts(tok), [_replies(2) for _ in range(4)], params)
    b = torch_engine.generate(_prompts(tok), [_replies(2) for _ in range(4)], params)
    for x, y in zip(a, b, strict=True):
        pairs = zip(x.tokens, y.tokens, strict=False)
        n = next((i for i, (s, t) in enumerate(pairs) if s != t), None)
        if n is None:
            assert x.tokens == y.tokens and x.turns == y.turns
            continue
        # The episodes part only at a near tie of the torch engine's own.
        head = x.prompt_ids + x.tokens[:n]
        net = torch_engine.backend.model
        lp = [
            float(sequence_logprobs(net, [*head, t], len(head))[0])
            for t in (x.tokens[n], y.tokens[n])
        ]
        assert abs(lp[0] - lp[1]) < NEAR_TIE, (n, lp)


def test_mlx_takes_a_patch_of_the_adapters_alone_in_place(mlx_ready, states, tiny_dir):
    v1, v2, _, _ = states
    model, tok = load_model(tiny_dir)
    engine = engine_for(model, tok, v1, "int8", CPU, "mlx", version=1)
    mm = engine.backend.model
    linears = {n: mm.linear(n) for n in mm.linear_names}
    assert mm.load(v2) == len(adapted(v2))  # the adapters, nothing else
    assert all(mm.linear(n) is layer for n, layer in linears.items())  # the base as it was
    fresh = engine_for(load_model(tiny_dir)[0], tok, v2, "int8", CPU, "mlx")
    for ids in _ids(tok):
        assert torch.equal(
            mm.sequence_logprobs(ids, 1), fresh.backend.model.sequence_logprobs(ids, 1)
        )
    # A whole state without adapters runs the bases alone again (as they were).
    base = {k: t for k, t in v1.items() if not is_adapter(k)}
    plain = engine_for(load_model(tiny_dir)[0], tok, base, "int8", CPU, "mlx")
    refresh(engine, base, None, 3)
    assert all(mm.linear(n) is layer for n, layer in linears.items())
    for ids in _ids(tok):
        assert torch.equal(
            mm.sequence_logprobs(ids, 1), plain.backend.model.sequence_logprobs(ids, 1)
        )


@pytest.mark.slow  # compiles a model (tens of seconds on 2 cores)
def test_the_compiled_step_runs_the_adapters_and_their_patches(states, tiny_dir):
    v1, v2, changed, _ = states
    eager = _int8_engine(tiny_dir, v1)
    b = eager.backend
    compiled = Engine(TorchBackend(b.model, b.precision, b.aliases, compile="on"), eager.tokenizer)
    assert compiled.backend.prepare()
    tok = eager.tokenizer
    params = SamplingParams(temperature=0, max_turn_tokens=5, max_episode_tokens=60)
    tokens = []
    for state in (v1, v2):
        # One model under both engines: a refresh of it is both engines'.
        refresh(compiled, state, changed, 2)
        assert compiled.backend.compiled  # adapters copied in place: the graph stays
        want = eager.generate(_prompts(tok), [_replies(2) for _ in range(4)], params)
        got = compiled.generate(_prompts(tok), [_replies(2) for _ in range(4)], params)
        for x, y in zip(want, got, strict=True):
            assert x.tokens == y.tokens and x.turns == y.turns
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-2
        tokens.append([e.tokens for e in got])
    assert tokens[0] != tokens[1]  # the graph ran the patched adapters, not v1's
