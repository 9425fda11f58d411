"""The numba and numpy position kernels agree exactly (same bytes either way)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colonnade.pulse import kernels

pytestmark = pytest.mark.skipif(kernels.BACKEND != "numba", reason="numba not importable here")


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 3000),
    density=st.floats(0, 1),
    n_cls=st.integers(1, 16),
    seed=st.integers(0, 2**31),
)
def test_backends_agree(n, density, n_cls, seed):
    rng = np.random.default_rng(seed)
    cls = rng.integers(0, n_cls, n).astype(np.uint8)
    changed = rng.random(n) < density
    a = kernels.class_ranks(changed, cls, backend="numpy")
    b = kernels.class_ranks(changed, cls, backend="numba")
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
    order, ranks, counts = a
    assert counts.sum() == n and order.size == changed.sum()
    # Inverse: scatter the ranks back to element indices.
    classes = np.unique(cls[order]) if order.size else np.zeros(0, np.int64)
    parts = [ranks[cls[order] == c] for c in classes]
    for backend in ("numpy", "numba"):
        assert np.array_equal(kernels.scatter_ranks(cls, classes, parts, backend=backend), order)


def test_scatter_rejects_rank_beyond_class():
    cls = np.zeros(10, np.uint8)
    with pytest.raises(ValueError):
        kernels.scatter_ranks(cls, np.array([0]), [np.array([3, 12])], backend="numba")
