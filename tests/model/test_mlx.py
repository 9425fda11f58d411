"""The MLX model: the published int8 codes in MLX's layout, and its forward pass."""

import numpy as np
import pytest
import torch

from colonnade.model import int8_state, load_int8, load_model, sequence_logprobs, tied_aliases
from colonnade.model.int8 import float_value
from colonnade.pulse.quant import SCALE_SUFFIX, quantize_rows

IDS_TEXT = "the quick brown fox <search>gene GX3 binds</search> to PRT21 in the liver"


@pytest.fixture(scope="module")
def mlx_model(mlx_ready, tiny):
    from colonnade.model.mlx_llama import MlxLlama

    model, _ = tiny
    state = int8_state(model)
    mm = MlxLlama(model, tied_aliases(model), "int8")
    mm.load(state)
    return mm, state


def test_layout_dequantizes_to_the_codes_times_scale_bit_for_bit(mlx_ready):
    from colonnade.model.mlx_llama import QLinear, int8_layout

    gen = torch.Generator().manual_seed(0)
    for in_features in (32, 96, 192, 512):
        w = torch.randn(40, in_features, generator=gen) * torch.logspace(-5, 1, 40)[:, None]
        codes, scale = quantize_rows(w)
        got = QLinear(int8_layout(codes, scale), None).dequantized()
        want = (codes.float() * scale[:, None]).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_widths_no_group_divides_run_dequantized(mlx_ready):
    from colonnade.model.mlx_llama import int8_layout

    codes, scale = quantize_rows(torch.randn(8, 40))
    assert int8_layout(codes, scale) is None


def test_every_linear_of_the_model_is_bit_identical_to_the_torch_engine(mlx_model, tiny_dir):
    from colonnade.model.mlx_llama import QLinear

    mm, state = mlx_model
    torch_int8, _ = load_model_int8(tiny_dir, state)
    assert mm.linears and all(isinstance(lin, QLinear) for lin in mm.linears.values())
    for name, lin in mm.linears.items():
        want = torch_int8.get_submodule(name).dequantized().numpy()
        assert np.array_equal(lin.dequantized().view(np.uint32), want.view(np.uint32)), name


def load_model_int8(tiny_dir, state):
    model, tok = load_model(tiny_dir)
    return load_int8(model, state, tied_aliases(model)), tok


def test_float_forward_matches_transformers(mlx_ready, tiny):
    from colonnade.model.mlx_llama import MlxLlama

    model, tok = tiny
    ids = tok.encode(IDS_TEXT, add_special_tokens=False)
    ref = sequence_logprobs(model, ids, 1)
    mm = MlxLlama(model, tied_aliases(model), "fp32")
    mm.load(dict(model.state_dict()))
    assert (mm.sequence_logprobs(ids, 1) - ref).abs().max() < 1e-4


def test_int8_forward_is_close_to_the_torch_int8_engine(mlx_model, tiny_dir):
    # Same weights bit for bit; the torch kernel rounds activations to bf16
    # inside its matmul, MLX keeps them in float32: that is the whole gap.
    mm, state = mlx_model
    torch_int8, tok = load_model_int8(tiny_dir, state)
    ids = tok.encode(IDS_TEXT, add_special_tokens=False)
    diff = (mm.sequence_logprobs(ids, 1) - sequence_logprobs(torch_int8, ids, 1)).abs()
    assert diff.max() < 0.05


def test_loading_a_patched_state_rebuilds_only_what_changed(mlx_model):
    mm, state = mlx_model
    name = "model.layers.0.mlp.up_proj.weight"
    patched = dict(state)
    codes = state[name].clone()
    codes[0, 0] = -codes[0, 0] if codes[0, 0] != 0 else 5
    patched[name] = codes
    assert mm.load(patched) == 1
    got = mm.linears["model.layers.0.mlp.up_proj"].dequantized()
    want = float_value(patched, name, {}).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert mm.load(state) == 1 and mm.load(state) == 0
    assert state[name + SCALE_SUFFIX] is patched[name + SCALE_SUFFIX]


def test_unsupported_architecture_is_refused_in_one_line(mlx_ready, tiny):
    from colonnade.model.mlx_llama import MlxLlama, MlxUnavailable

    model, _ = tiny
    model.config.model_type = "gpt2"
    try:
        with pytest.raises(MlxUnavailable, match="use --engine torch"):
            MlxLlama(model, {}, "int8")
    finally:
        model.config.model_type = "llama"
