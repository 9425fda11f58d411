"""The numba and numpy position kernels agree exactly (same bytes either way)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colonnade.pulse import kernels

pytestmark = pytest.mark.skipif(kernels.BACKEND != "numba", reason="numba not importable here")


def _source(mode, n, n_cls, rng):
    """(bits, ClassSource, classes) for a random chunk under one class mode."""
    bits = rng.integers(0, 2**16, n).astype(np.uint16)
    lut = rng.integers(0, n_cls, 512).astype(np.uint8)
    if mode == kernels.MODE_LUT:
        cls = lut[bits >> 7]
        return bits, kernels.ClassSource(mode, lut, 7, np.zeros(1, np.uint8)), cls
    cls = rng.integers(0, n_cls, n).astype(np.uint8)
    return bits, kernels.ClassSource(mode, np.zeros(1, np.uint8), 0, cls), cls


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 3000),
    density=st.floats(0, 1),
    n_cls=st.integers(1, 16),
    mode=st.sampled_from([kernels.MODE_LUT, kernels.MODE_ARRAY]),
    seed=st.integers(0, 2**31),
)
def test_backends_agree(n, density, n_cls, mode, seed):
    rng = np.random.default_rng(seed)
    bits, src, cls = _source(mode, n, n_cls, rng)
    changed = rng.random(n) < density
    new = np.where(changed, bits ^ bits.dtype.type(1), bits)
    a = kernels.class_ranks(bits, new, src, lambda: cls, backend="numpy")
    b = kernels.class_ranks(bits, new, src, lambda: cls, backend="numba")
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
    order, ranks, counts, per_class = a
    assert counts.sum() == n and order.size == changed.sum() == per_class.sum()
    assert np.array_equal(cls[order], np.repeat(np.arange(16), per_class))
    assert np.array_equal(counts, np.bincount(cls, minlength=16))
    # Inverse: scatter the ranks back to element indices.
    classes = [int(c) for c in np.unique(cls[order])]
    parts = [ranks[cls[order] == c] for c in classes]
    wanted = kernels.Wanted.of(classes, parts)
    flat = kernels.Wanted.flat(
        np.array(classes, int),
        [p.size for p in parts],
        np.concatenate(parts) if parts else np.zeros(0, np.int64),
    )
    assert all(np.array_equal(a, b) for a, b in zip(wanted, flat, strict=True))
    got_cls, got_parts = wanted.groups()
    assert list(got_cls) == classes and all(
        np.array_equal(a, b) for a, b in zip(got_parts, parts, strict=True)
    )
    for backend in ("numpy", "numba"):
        got = kernels.scatter_ranks(n, bits, src, lambda: cls, wanted, backend=backend)
        assert np.array_equal(got, order)
    frozen = bits.copy()
    frozen.flags.writeable = False  # the scatter only reads the base
    assert np.array_equal(kernels.scatter_ranks(n, frozen, src, lambda: cls, wanted), order)


@pytest.mark.parametrize("ranks", [[3, 12], [3, 3], [5, 2]])
def test_scatter_rejects_ranks_beyond_their_class_or_not_rising(ranks):
    # A class's wanted ranks come from gaps, so they rise strictly and stay
    # inside the class; a corrupt list (beyond it, repeating, falling) is
    # refused, and in place the chunk is left as it was (the rank found
    # before the bad one is put back).
    src = kernels.ClassSource(kernels.MODE_ARRAY, np.zeros(1, np.uint8), 0, np.zeros(10, np.uint8))
    bits = np.arange(10, dtype=np.uint16)
    want = kernels.Wanted.of([0], [np.array(ranks)])
    with pytest.raises(ValueError):
        kernels.scatter_ranks(10, bits, src, None, want, backend="numba")
    values = np.ones(2, np.uint16)
    with pytest.raises(ValueError):
        kernels.scatter_rebuild(
            10,
            bits,
            bits,
            src,
            None,
            want,
            values,
            kernels.RES_XOR,
            kernels.KEY_UNSIGNED,
            backend="numba",
        )
    assert np.array_equal(bits, np.arange(10, dtype=np.uint16))


def test_top_magnitude():
    bits = np.array([0x3F80, 0xC100, 0x0001], dtype=np.uint16)  # 1.0, -8.0, tiny
    assert kernels.top_magnitude(bits) >> 7 == 0x82  # -8.0's exponent
    assert kernels.top_magnitude(np.array([0x4100, 0xBF80], np.uint16)) == 0x4100  # 8.0 > |-1|
    assert kernels.top_magnitude(np.array([0x8000, 0x0000], np.uint16)) == 0  # ±0
    assert kernels.top_magnitude(np.zeros(0, np.uint16)) == 0


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=False, width=32), max_size=50),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_top_magnitude_is_the_largest_exponent(values, dtype):
    x = np.array(values, np.float64).astype(dtype)
    bits = x.view(f"u{x.itemsize}")
    mantissa = {np.float16: 10, np.float32: 23, np.float64: 52}[dtype]
    exps = (bits.astype(np.uint64) >> np.uint64(mantissa)) & np.uint64(
        (1 << (x.itemsize * 8 - 1 - mantissa)) - 1
    )
    assert kernels.top_magnitude(bits) >> mantissa == (int(exps.max()) if x.size else 0)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 400), seed=st.integers(0, 2**31), spread=st.floats(0.05, 0.95))
def test_range_coder_round_trip_compiled_and_pure(n, seed, spread):
    from colonnade.pulse import rangecoder

    rng = np.random.default_rng(seed)
    classes = rng.integers(0, 16, n)
    values = rng.geometric(spread, n).astype(np.uint64)
    data = rangecoder.encode_values(values, classes)
    assert np.array_equal(rangecoder.decode_values(data, classes), np.minimum(values, 16))
    # The uncompiled source is the fallback decoder: it must read the same bytes.
    out = np.empty(n, np.uint64)
    used = rangecoder._decode_values(
        np.frombuffer(data, np.uint8), classes.astype(np.uint8), out, rangecoder._RECIP
    )
    assert used >= 0 and np.array_equal(out, np.minimum(values, 16))


def test_range_coder_approaches_entropy():
    from colonnade.pulse import rangecoder

    rng = np.random.default_rng(0)
    classes = rng.integers(0, 4, 50_000)
    values = rng.geometric(0.3 + 0.15 * classes).astype(np.uint64)
    values = np.minimum(values, 16)
    bits = 8 * len(rangecoder.encode_values(values, classes))
    entropy = 0.0
    for c in range(4):
        _, cnt = np.unique(values[classes == c], return_counts=True)
        q = cnt / cnt.sum()
        entropy -= (q * np.log2(q)).sum() * cnt.sum()
    assert bits < 1.02 * entropy


def test_range_coder_reciprocals_divide_exactly():
    # Every count pair the coder can hold: n0 + n1 <= _LIMIT.
    from colonnade.pulse import rangecoder as rc

    n1 = np.arange(rc._LIMIT + 1, dtype=np.int64)
    for n0 in range(rc._LIMIT + 1):
        m = n1[: rc._LIMIT + 1 - n0]
        num, den = (2 * n0 + 1) << rc._BITS, 2 * (n0 + m) + 2
        assert np.array_equal((num * rc._RECIP[den]) >> rc._SHIFT, num // den), n0


def test_range_coder_rejects_truncation():
    from colonnade.pulse import rangecoder

    classes = np.zeros(1000, np.int64)
    values = np.full(1000, 3, np.uint64)
    data = rangecoder.encode_values(values, classes)
    with pytest.raises(ValueError):
        rangecoder.decode_values(data[:2], classes)


def test_range_coder_never_writes_past_its_buffer():
    from colonnade.pulse import rangecoder

    values = np.arange(1, 2000, dtype=np.uint16) % 16 + 1
    classes = np.zeros(values.size, np.uint8)
    small = np.zeros(8, np.uint8)
    # reports instead of overrunning
    assert rangecoder._ENC_V(values, classes, small, rangecoder._RECIP) == -1
    data = rangecoder.encode_values(values, classes)
    assert np.array_equal(rangecoder.decode_values(data, classes), values)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 2000),
    density=st.floats(0, 1),
    width=st.sampled_from([1, 2, 4, 8]),
    key=st.sampled_from([kernels.KEY_UNSIGNED, kernels.KEY_FLOAT, kernels.KEY_SIGNED]),
    seed=st.integers(0, 2**31),
)
def test_fused_residuals_match_numpy(n, density, width, key, seed):
    # The element pass gathers each change's XOR and key delta as it sorts
    # them; the numpy transforms of the same changes must agree bit for bit.
    rng = np.random.default_rng(seed)
    ut = np.dtype(f"u{width}").type
    bits = rng.integers(0, 2 ** (8 * width), n, dtype=np.uint64).astype(ut)
    flip = rng.integers(1, 2 ** (8 * width), n, dtype=np.uint64).astype(ut)
    new = np.where(rng.random(n) < density, bits ^ flip, bits)
    shift = max(0, 8 * width - 9)
    lut = rng.integers(0, 16, 1 << (8 * width - shift)).astype(np.uint8)
    src = kernels.ClassSource(kernels.MODE_LUT, lut, shift, np.zeros(1, np.uint8))
    cls = lut[bits >> ut(shift)]
    a = kernels.class_ranks(bits, new, src, lambda: cls, backend="numba", key=key)
    b = kernels.class_ranks(bits, new, src, lambda: cls, backend="numpy", key=key)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype or x.dtype.kind == y.dtype.kind == "i"
        assert np.array_equal(x, y)
    xor, delta = kernels.residual_transforms(bits[a[0]], new[a[0]], key)
    assert np.array_equal(a[4], xor) and np.array_equal(a[5], delta)


def test_compiled_kernels_close_over_nothing():
    # numba keys a cached closure by a pickle of its cells, which differs in
    # every process: a kernel that closes over another misses its cache and
    # compiles again in each process (seconds on a worker's first patch).
    from colonnade.pulse import rangecoder, rice

    dispatchers = [
        *kernels._NUMBA,
        kernels._find,
        kernels._ahead,
        rangecoder._ENC_V,
        rangecoder._DEC_V,
        rangecoder._learn,
        *rice._KERNELS,
    ]
    for d in dispatchers:
        assert d.py_func.__closure__ is None, d.py_func.__qualname__


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_range_coder_escapes_add_in_order(dtype):
    from colonnade.pulse import rangecoder

    values = np.array([1, 16, 3, 16, 16, 2], dtype)
    assert rangecoder.count_escapes(values) == 3
    rangecoder.add_escapes(values, np.array([0, 5, 200], dtype))
    assert values.tolist() == [1, 16, 3, 21, 216, 2]
    with pytest.raises(TypeError):
        rangecoder.add_escapes(values, np.array([1], np.int64))
    for rest in ([7], [7, 7, 7, 7]):  # fewer or more than the escapes
        with pytest.raises(ValueError, match="escapes"):
            rangecoder.add_escapes(np.array([16, 2, 16], dtype), np.array(rest, dtype))
