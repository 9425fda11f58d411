"""The MLX model (mlx-lm): the published int8 codes in its quantized layers, bit for bit."""

import numpy as np
import pytest
import torch

from colonnade.model import load_int8, load_model, sequence_logprobs, tied_aliases
from colonnade.model.int8 import Int8Linear, float_value, int8_state
from colonnade.pulse.quant import SCALE_SUFFIX, quantize_rows
from mlx_archs import ARCHS, arch_model, arch_tokenizer

IDS_TEXT = "the quick brown fox <search>gene GX3 binds</search> to PRT21 in the liver"


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_layout_dequantizes_to_the_codes_times_scale_bit_for_bit(mlx_ready):
    from colonnade.engine.mlx_backend import dequantized, int8_layout, quantized_linear

    gen = torch.Generator().manual_seed(0)
    for in_features in (32, 96, 192, 512):
        w = torch.randn(40, in_features, generator=gen) * torch.logspace(-5, 1, 40)[:, None]
        codes, scale = quantize_rows(w)
        got = dequantized(quantized_linear(int8_layout(codes, scale), None))
        assert np.array_equal(_bits(got), _bits((codes.float() * scale[:, None]).numpy()))


def test_widths_no_group_divides_run_dequantized(mlx_ready):
    from colonnade.engine.mlx_backend import int8_layout

    codes, scale = quantize_rows(torch.randn(8, 40))
    assert int8_layout(codes, scale) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_every_weight_is_bit_identical_to_the_torch_engine(mlx_ready, arch):
    # Linears: MLX's 8-bit layout against the torch engine's Int8Linear.
    # Everything else (norms, embeddings, the MoE experts published in
    # bf16): the same float32 values the torch engine copies in.
    from mlx.utils import tree_flatten

    from colonnade.engine.mlx_backend import MlxModel, dequantized

    model, state = arch_model(arch)
    mm = MlxModel(model.config, tied_aliases(model), "int8")
    mm.load(state)
    torch_int8 = load_int8(_copy(model), state, tied_aliases(model))
    quantized = 0
    for name in mm.linear_names:
        got = dequantized(mm.linear(name))
        mod = torch_int8.get_submodule(name)
        want = (
            mod.dequantized()
            if isinstance(mod, Int8Linear)
            else float_value(state, name + ".weight", {})
        )
        assert np.array_equal(_bits(got), _bits(want.numpy())), name
        quantized += type(mm.linear(name)).__name__ == "QuantizedLinear"
    assert quantized == len(mm.linear_names)  # every width here has an MLX group size
    params = dict(tree_flatten(mm.net.parameters()))
    for name in mm.tensor_names:
        key, cut = mm.experts.get(name, (name, None))
        want = float_value(state, tied_aliases(model).get(key, key), {})
        want = want if cut is None else cut(want)
        assert np.array_equal(_bits(np.array(params[name])), _bits(want.float().numpy())), name
    if arch == "qwen3_moe":
        experts = [k for k in state if ".experts." in k]
        assert experts and all(state[k].dtype == torch.bfloat16 for k in experts)
        assert not any(k + SCALE_SUFFIX in state for k in experts)  # published in bf16


def _copy(model):
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_float_forward_matches_transformers(mlx_ready, arch):
    # mlx-lm built from the transformers config (rotary settings, Gemma 3's
    # layer pattern and window, fused MoE experts) computes the same model.
    from colonnade.engine.mlx_backend import MlxModel

    model, _ = arch_model(arch)
    tok = arch_tokenizer()
    ids = tok.encode(IDS_TEXT * 2, add_special_tokens=False)  # longer than Gemma's window
    with torch.no_grad():
        ref = sequence_logprobs(model, ids, 1)
    mm = MlxModel(model.config, tied_aliases(model), "fp32")
    mm.load(dict(model.state_dict()))
    assert (mm.sequence_logprobs(ids, 1) - ref).abs().max() < 1e-4


@pytest.fixture(scope="module")
def llama_int8(mlx_ready, tiny):
    from colonnade.engine.mlx_backend import MlxModel

    model, _ = tiny
    state = int8_state(model)
    mm = MlxModel(model.config, tied_aliases(model), "int8")
    mm.load(state)
    return mm, state


def test_int8_forward_is_close_to_the_torch_int8_engine(llama_int8, tiny_dir):
    # Same weights bit for bit; the torch kernel rounds activations to bf16
    # inside its matmul, MLX keeps them in float32: that is the whole gap.
    mm, state = llama_int8
    model, tok = load_model(tiny_dir)
    torch_int8 = load_int8(model, state, tied_aliases(model))
    ids = tok.encode(IDS_TEXT, add_special_tokens=False)
    with torch.no_grad():
        diff = (mm.sequence_logprobs(ids, 1) - sequence_logprobs(torch_int8, ids, 1)).abs()
    assert diff.max() < 0.05


def test_loading_a_patched_state_rebuilds_only_what_changed_in_place(llama_int8):
    from colonnade.engine.mlx_backend import dequantized

    mm, state = llama_int8
    name = "model.layers.0.mlp.up_proj"
    untouched = mm.linear("model.layers.0.mlp.down_proj")
    patched = dict(state)
    codes = state[name + ".weight"].clone()
    codes[0, 0] = -codes[0, 0] if codes[0, 0] != 0 else 5
    patched[name + ".weight"] = codes
    assert mm.load(patched) == 1
    want = float_value(patched, name + ".weight", {}).numpy()
    assert np.array_equal(_bits(dequantized(mm.linear(name))), _bits(want))
    assert mm.linear("model.layers.0.mlp.down_proj") is untouched
    assert mm.load(state) == 1 and mm.load(state) == 0


def test_unsupported_architecture_is_refused_in_one_line(mlx_ready):
    from transformers import GPT2Config

    from colonnade.engine.mlx_backend import MlxModel, UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match=r"'gpt2'.*use --engine torch") as e:
        MlxModel(GPT2Config(n_layer=1), {}, "int8")
    assert "\n" not in str(e.value)


def test_an_mlx_model_following_an_in_place_follower_equals_one_built_fresh(mlx_ready, tmp_path):
    # Workers' followers rebuild each version inside the state the MLX model
    # loaded from; it must see every tensor a patch rewrote (new objects over
    # the same memory) and hold copies of its own (mx.array copies).
    from colonnade.engine.mlx_backend import MlxModel, dequantized
    from colonnade.model.int8 import publishable_state
    from colonnade.protocol import Follower
    from colonnade.protocol.weights import Publisher
    from colonnade.store import LocalStore

    model, _ = arch_model(ARCHS[0])
    store = LocalStore(tmp_path)
    pub = Publisher(store, _signer(), "int8", anchor_every=10)
    state = publishable_state(model)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        pub.publish(state)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    aliases = tied_aliases(model)
    follower = Follower(store, anchor_every=10, trust=_signer().trust)
    follower.sync(0)
    mm = MlxModel(model.config, aliases, "int8")
    mm.load(follower.state)
    at_v0 = {n: _bits(dequantized(mm.linear(n))).copy() for n in mm.linear_names}
    follower.sync(2)
    for n in mm.linear_names:  # its own copies: the follower's rewrite did not reach it
        assert np.array_equal(_bits(dequantized(mm.linear(n))), at_v0[n]), n
    assert mm.load(follower.state) > 0
    copying = Follower(store, 10, _signer().trust, in_place=False)
    copying.sync(2)
    fresh = MlxModel(model.config, aliases, "int8")
    fresh.load(copying.state)
    moved = 0
    for n in mm.linear_names:
        got = _bits(dequantized(mm.linear(n)))
        assert np.array_equal(got, _bits(dequantized(fresh.linear(n)))), n
        moved += not np.array_equal(got, at_v0[n])
    assert moved > 0


_SIGNER = []


def _signer():
    """One trainer key for the module: its publisher and followers agree."""
    if not _SIGNER:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from colonnade.protocol.signing import Signer

        _SIGNER.append(Signer(Ed25519PrivateKey.generate(), "r1"))
    return _SIGNER[0]
