import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from colonnade.pulse import bitcodes


@given(
    hnp.arrays(np.uint64, st.integers(0, 300), elements=st.integers(0, 5000)), st.integers(0, 12)
)
def test_rice_round_trip(values, k):
    unary, rem = bitcodes.rice_encode(values, k)
    assert unary.size + rem.size == bitcodes.rice_cost(values, k)
    reader = bitcodes.UnaryReader(np.concatenate([unary, np.zeros(7, np.uint8)]))
    q = reader.read(values.size)
    assert reader.bits_used == unary.size
    r = bitcodes.fixed_decode(rem, values.size, k)
    assert np.array_equal((q << np.uint64(k)) | r, values)


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
        bitcodes.UnaryReader(np.ones(10, np.uint8)).read(1)


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
