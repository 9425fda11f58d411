import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from colonnade.pulse import bitcodes


@given(
    hnp.arrays(np.uint64, st.integers(0, 300), elements=st.integers(0, 5000)),
    st.integers(0, 12),
    st.integers(1, 7),
)
def test_rice_round_trip(values, k, groups):
    """Written in pieces through a BitSink, read back group by group."""
    cuts = np.linspace(0, values.size, groups + 1).astype(int)
    unary_sink, rem_sink = bitcodes.BitSink(), bitcodes.BitSink()
    unary_bits = 0
    for lo, hi in itertools.pairwise(cuts):
        unary, rem = bitcodes.rice_encode(values[lo:hi], k)
        assert unary.size + rem.size == bitcodes.rice_cost(values[lo:hi], k)
        unary_sink.add(unary)
        rem_sink.add(rem)
        unary_bits += unary.size
    reader = bitcodes.UnaryReader(np.frombuffer(unary_sink.getvalue(), np.uint8))
    rem = np.unpackbits(np.frombuffer(rem_sink.getvalue(), np.uint8))
    q = np.concatenate([reader.read(hi - lo) for lo, hi in itertools.pairwise(cuts)])
    assert reader.bits_used == unary_bits
    r = bitcodes.fixed_decode(rem, values.size, k)
    assert np.array_equal((q << np.uint64(k)) | r, values)


@given(st.lists(st.lists(st.integers(0, 1), max_size=40), max_size=12))
def test_bit_sink_packs_like_packbits(pieces):
    sink = bitcodes.BitSink()
    for piece in pieces:
        sink.add(np.array(piece, np.uint8))
    whole = np.array([b for piece in pieces for b in piece], np.uint8)
    assert sink.getvalue() == np.packbits(whole).tobytes()


@given(st.binary(min_size=1, max_size=40), st.data())
def test_unpack_bits_is_a_slice_of_the_stream(raw, data):
    packed = np.frombuffer(raw, np.uint8)
    start = data.draw(st.integers(0, 8 * len(raw)))
    count = data.draw(st.integers(0, 8 * len(raw) - start))
    assert np.array_equal(
        bitcodes.unpack_bits(packed, start, count), np.unpackbits(packed)[start : start + count]
    )


def test_best_rice_k_is_minimal():
    rng = np.random.default_rng(0)
    gaps = rng.geometric(0.01, 5000).astype(np.uint64)
    k = bitcodes.best_rice_k(gaps)
    costs = [bitcodes.rice_cost(gaps, j) for j in range(20)]
    assert costs[k] == min(costs)
    # Rice on a geometric source is within a few percent of its entropy.
    p = 0.01
    entropy = (-(1 - p) * np.log2(1 - p) - p * np.log2(p)) / p
    assert costs[k] / gaps.size < 1.04 * entropy


def test_unary_reader_rejects_short_stream():
    with pytest.raises(ValueError):
        bitcodes.UnaryReader(np.array([0xFF, 0xFF], np.uint8)).read(1)


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=200))
def test_gaps_round_trip(pos):
    p = np.array(sorted(pos), dtype=np.int64)
    assert np.array_equal(bitcodes.sorted_from_gaps(bitcodes.gaps_from_sorted(p)), p)


@pytest.mark.parametrize(
    "ut,ft", [(np.uint16, np.float16), (np.uint32, np.float32), (np.uint64, np.float64)]
)
def test_ordered_key_is_monotone_for_floats(ut, ft):
    vals = np.array([-np.inf, -3.0, -1e-3, -0.0, 0.0, 1e-3, 2.0, np.inf], dtype=ft)
    keys = bitcodes.ordered_key(vals.view(ut), True, False)
    assert np.all(keys[1:] > keys[:-1])
    assert np.array_equal(bitcodes.from_ordered_key(keys, True, False), vals.view(ut))


def test_one_ulp_is_one_key_step():
    x = np.array([1.0, -1.0, 0.0], dtype=np.float32)
    up = np.nextafter(x, np.float32(np.inf))
    d = bitcodes.ordered_key(up.view(np.uint32), True, False) - bitcodes.ordered_key(
        x.view(np.uint32), True, False
    )
    # 0.0 → smallest subnormal is also one step.
    assert d.tolist() == [1, 1, 1]


@given(hnp.arrays(np.uint16, st.integers(0, 100)))
def test_zigzag_round_trip_and_small(d):
    z = bitcodes.zigzag(d)
    assert np.array_equal(bitcodes.unzigzag(z), d)


def test_zigzag_values():
    d = np.array([0, 0xFFFF, 1, 0xFFFE, 2], dtype=np.uint16)
    assert bitcodes.zigzag(d).tolist() == [0, 1, 2, 3, 4]


@given(hnp.arrays(st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]), st.integers(0, 50)))
@settings(max_examples=50)
def test_byte_planes_round_trip(v):
    data = bitcodes.byte_planes(v)
    back = bitcodes.from_byte_planes(data, v.size, v.dtype.itemsize)
    assert np.array_equal(back, v)
