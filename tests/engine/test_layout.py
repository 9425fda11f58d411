"""The layout every backend's cache follows, and the loop's admission units."""

import numpy as np
import pytest

from colonnade.engine import Engine, SamplingParams, layout
from colonnade.engine.layout import Layout
from colonnade.engine.loop import units
from colonnade.engine.torch_backend import TorchBackend


def test_units_keep_groups_whole_up_to_max_rows():
    p = [[1, 2], [1, 2], [1, 2], [3, 4], [5, 6], [5, 6]]
    assert units(p, 0) == [[0, 1, 2], [3], [4, 5]]
    assert units(p, 2) == [[0, 1], [2], [3], [4, 5]]


def test_layout_extend_aligns_rows_and_trim_drops_unused_columns():
    a, b = Layout(2), Layout(1)
    a.block([[1, 2, 3], [4, 5, 6]], 0)
    b.block([[7]], 0)
    assert a.extend(b) == (0, 2)  # b's single column right-aligned under a's three
    assert a.real.tolist() == [[True] * 3, [True] * 3, [False, False, True]]
    assert a.pos.tolist() == [3, 3, 1] and a.padded
    mask = a.block([[8], [9], [10]], 0).allowed
    assert mask[2, 0, 0].tolist() == [False, False, True, True]  # never sees the pads
    a.keep([2])
    assert a.trim() == 2 and a.real.tolist() == [[True, True]]


def test_layout_compact_right_aligns_each_rows_real_columns_in_order(monkeypatch):
    lay = Layout(2)
    t, f = True, False
    lay.real = np.array([[t, f, f, t, t, f, t], [f, f, f, f, t, f, t]])
    lay.padded = True
    assert lay.compact() is None  # 3 pad columns of 7: below the 32-column floor
    monkeypatch.setattr(layout, "COMPACT_MIN", 0)
    index = lay.compact()
    assert index.tolist() == [[0, 3, 4, 6], [3, 5, 4, 6]]
    assert lay.real.tolist() == [[t, t, t, t], [f, f, t, t]] and lay.padded
    assert lay.compact() is None  # nothing more to drop
    lay.real = np.array([[t, f, t], [t, t, f]])
    assert lay.compact().tolist() == [[0, 2], [0, 1]] and not lay.padded  # back to dense


@pytest.mark.parametrize("bad", [-1])
def test_max_rows_must_not_be_negative(tiny, bad):
    model, tok = tiny
    with pytest.raises(ValueError, match="max_rows"):
        Engine(TorchBackend(model), tok).generate(
            [[1, 2]], [lambda t: None], SamplingParams(), max_rows=bad
        )
