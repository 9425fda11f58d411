"""The torch element pass writes the same patch as the compiled one.

On CUDA, codec runs the element pass in torch (torch_pass) so that only the
changes leave the GPU; no GPU is needed to hold it to the compiled pass's
bytes: the same torch ops run on CPU tensors here.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colonnade.pulse import apply, encode, kernels, prepare, torch_pass
from colonnade.pulse import codec as codec_mod
from colonnade.pulse.context import class_map
from colonnade.pulse.tensors import to_bits
from pulse_helpers import bits_equal, perturb, random_tensor

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32]


def _both(monkeypatch, old, new, precision):
    out = {}
    for way in ("numba", "torch"):
        monkeypatch.setattr(codec_mod, "ELEMENT_PASS", way)
        out[way] = encode(old, new, precision=precision)[0]
    return out["numba"], out["torch"]


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 30), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_same_bytes_as_the_compiled_pass(shape, dtype, density, seed):
    gen = torch.Generator().manual_seed(seed)
    old = {"w": random_tensor(tuple(shape), dtype, gen), "b": random_tensor((9,), dtype, gen)}
    new = {k: perturb(v, density, gen) for k, v in old.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec_mod, "CHUNK_ELEMS", 64)  # many chunks
        a, b = _both(mp, old, new, "exact")
    assert a == b
    assert bits_equal(apply(old, b), new)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_optimizer_step_same_bytes(monkeypatch, precision):
    # exp classes (bf16) and row-scale classes of int8 codes, over chunks.
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 0, 300)[:, None]
    old = {"lin.weight": w, "norm": torch.ones(200)}
    new = {
        "lin.weight": w + 1e-3 * torch.randn(300, 200, generator=gen),
        "norm": old["norm"] + 0.02,
    }
    monkeypatch.setattr(codec_mod, "CHUNK_ELEMS", 5000)
    a, b = _both(monkeypatch, old, new, precision)
    assert a == b
    assert bits_equal(apply(prepare(old, precision), b), prepare(new, precision))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), density=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_chunk_changes_match_class_ranks(n, density, seed):
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(
        (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 2, n)).astype(np.float32)
    )
    old = w.bfloat16()
    new = torch.where(torch.from_numpy(rng.random(n) < density), (w * 1.01).bfloat16(), old)
    state = {"w": old}
    ob, nb = to_bits(old), to_bits(new)
    cmap = class_map("w", "exp", state, ob)
    want = kernels.class_ranks(ob, nb, cmap.source(0, n), lambda: cmap.classes(0, n), key=1)
    e0, (got,) = (
        torch_pass.changes("w", "exp", state, old, new, max(n, 1), key=1) if n else (0, [want])
    )
    assert e0 == cmap.e0
    for x, y in zip(want, got, strict=True):
        assert np.array_equal(x, y)
