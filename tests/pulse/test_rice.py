"""The compiled Rice coder and the fused scatter agree with the numpy reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colonnade.pulse import kernels, positions, rice

pytestmark = pytest.mark.skipif(not rice.COMPILED, reason="numba not importable here")


def _chunk(rng, n, density, n_cls):
    """kernels.class_ranks of a random chunk: (order, ranks, class sizes, changed per class)."""
    cls = rng.integers(0, n_cls, n).astype(np.uint8)
    # Some classes dense enough that their unchanged ranks are coded instead.
    per_cls = np.where(rng.random(16) < 0.3, 0.9, density)[cls]
    changed = rng.random(n) < per_cls
    bits = np.zeros(n, np.uint16)
    new = np.where(changed, np.uint16(1), bits)
    src = kernels.ClassSource(kernels.MODE_ARRAY, np.zeros(1, np.uint8), 0, cls)
    return kernels.class_ranks(bits, new, src, lambda: cls, backend="numpy"), cls


def _code(chunks, compiled, monkeypatch):
    monkeypatch.setattr(rice, "COMPILED", compiled)
    enc = positions.RiceEncoder(None)
    for ci, found in enumerate(chunks):
        enc.code(ci, found)
    return enc.groups.tobytes(), enc._unary.getvalue(), enc._rem.getvalue()


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
    density=st.floats(0.001, 0.6),
    n_cls=st.integers(1, 16),
    seed=st.integers(0, 2**31),
)
def test_encoder_writes_the_reference_bits(sizes, density, n_cls, seed):
    rng = np.random.default_rng(seed)
    chunks = [_chunk(rng, n, density, n_cls)[0] for n in sizes]
    with pytest.MonkeyPatch.context() as mp:
        ref = _code(chunks, False, mp)
        got = _code(chunks, True, mp)
    assert got == ref


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=4),
    density=st.floats(0.001, 0.6),
    n_cls=st.integers(1, 16),
    seed=st.integers(0, 2**31),
)
def test_decoder_reads_back_every_chunk(sizes, density, n_cls, seed):
    rng = np.random.default_rng(seed)
    chunks = [_chunk(rng, n, density, n_cls)[0] for n in sizes]
    enc = positions.RiceEncoder(None)
    for ci, found in enumerate(chunks):
        enc.code(ci, found)
    groups = enc.groups
    unary = np.frombuffer(enc._unary.getvalue(), np.uint8)
    rem = np.frombuffer(enc._rem.getvalue(), np.uint8)
    u = r = 0
    for ci, (_order, ranks, counts, _per_class) in enumerate(chunks):
        rows = groups[groups["chunk"] == ci]
        fields = ["cls", "k", "invert", "count", "kept"]
        table = np.stack([rows[f] for f in fields], 1).astype(np.int64)
        # An inverted group states its class size: no counting pass needed.
        inv = table[:, 2] != 0
        assert np.array_equal(table[inv, 3] + table[inv, 4], counts[table[inv, 0]])
        assert not table[~inv, 4].any()
        want, u, r = rice.decode_chunk(unary, u, rem, r, table, sizes[ci])
        assert np.array_equal(want, ranks)
    assert -(-u // 8) == unary.size and -(-r // 8) == rem.size


def test_decoder_reports_short_and_bad_streams():
    rng = np.random.default_rng(3)
    found, _ = _chunk(rng, 2000, 0.05, 4)
    enc = positions.RiceEncoder(None)
    enc.code(0, found)
    g = enc.groups
    table = np.stack([g[f] for f in ("cls", "k", "invert", "count", "kept")], 1).astype(np.int64)
    unary = np.frombuffer(enc._unary.getvalue(), np.uint8)
    rem = np.frombuffer(enc._rem.getvalue(), np.uint8)
    with pytest.raises(ValueError, match="unary stream ends early"):
        rice.decode_chunk(unary[: unary.size // 2], 0, rem, 0, table, 2000)
    with pytest.raises(ValueError, match="remainder stream ends early"):
        rice.decode_chunk(unary, 0, rem[: rem.size // 2], 0, table, 2000)
    with pytest.raises(ValueError, match="group count out of range"):
        bad = table.copy()
        bad[0, 3] = 2001  # more changes than the chunk has elements
        rice.decode_chunk(unary, 0, rem, 0, bad, 2000)
    with pytest.raises(ValueError, match="group count out of range"):
        bad = table.copy()
        bad[0, 2], bad[0, 4] = 1, 2001 - bad[0, 3]  # a class larger than the chunk
        rice.decode_chunk(unary, 0, rem, 0, bad, 2000)
    with pytest.raises(ValueError, match="group count out of range"):
        bad = table.copy()
        bad[0, 2], bad[0, 4] = 0, 5  # a class size on a group that is not inverted
        rice.decode_chunk(unary, 0, rem, 0, bad, 2000)
    # A stream of ones: a gap far beyond the chunk.
    ones = np.full(4000, 0xFF, np.uint8)
    with pytest.raises(ValueError, match="rank beyond its class"):
        rice.decode_chunk(ones, 0, rem, 0, table, 2000)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    density=st.floats(0, 1),
    dtype=st.sampled_from([np.uint8, np.uint16, np.uint32]),
    key=st.sampled_from([kernels.KEY_FLOAT, kernels.KEY_SIGNED, kernels.KEY_UNSIGNED]),
    res=st.sampled_from([kernels.RES_XOR, kernels.RES_DELTA]),
    in_place=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_scatter_rebuild_matches_numpy(n, density, dtype, key, res, in_place, seed):
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    bits = rng.integers(0, int(info.max) + 1, n, dtype=np.uint64).astype(dtype)
    cls = rng.integers(0, 16, n).astype(np.uint8)
    src = kernels.ClassSource(kernels.MODE_ARRAY, np.zeros(1, np.uint8), 0, cls)
    changed = rng.random(n) < density
    new = bits.copy()
    step = rng.integers(1, 40, n).astype(dtype)
    new[changed] = bits[changed] + step[changed] if res else bits[changed] ^ step[changed]
    changed = new != bits
    order, ranks, _counts, per_class = kernels.class_ranks(bits, new, src, lambda: cls)
    xor, delta = kernels.residual_transforms(bits[order], new[order], key)
    values = xor if res == kernels.RES_XOR else delta
    classes = [c for c in range(16) if per_class[c]]
    parts = np.split(ranks, np.cumsum(per_class)[:-1])
    parts = [parts[c] for c in classes]
    results = []
    for backend in ("numpy", "numba"):
        base = bits.copy()
        out = base if in_place else np.zeros_like(base)
        loc, before = kernels.scatter_rebuild(
            n,
            base,
            out,
            src,
            lambda: cls,
            kernels.Wanted.of(classes, parts),
            values,
            res,
            key,
            backend=backend,
        )
        results.append((out.copy(), loc, before))
        assert np.array_equal(out, new)
        assert np.array_equal(loc, order) and np.array_equal(before, bits[order])
    assert all(np.array_equal(a, b) for a, b in zip(*results, strict=True))


def test_bit_writer_grows_and_keeps_bits():
    w = rice.BitWriter(1)
    w.pos = 5
    w.buf[0] = 0b10100000
    w.reserve(100)
    assert w.buf.size >= 13 and w.buf[0] == 0b10100000 and not w.buf[1:].any()


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=5),
    density=st.floats(0.001, 0.9),
    seed=st.integers(0, 2**31),
)
def test_group_table_wire_form_round_trips(sizes, density, seed):
    rng = np.random.default_rng(seed)
    enc = positions.RiceEncoder(None)
    for ci, n in enumerate(sizes):
        enc.code(ci, _chunk(rng, n, density, 16)[0])
    g = enc.groups
    raw = positions.pack_groups(g)
    assert np.array_equal(positions.unpack_groups(raw), g)
    # Every truncation or extension is caught by the lengths.
    for bad in (raw[:-1], raw + b"\0", raw[:3]):
        with pytest.raises(ValueError):
            positions.unpack_groups(bad)


def test_group_table_is_smaller_by_columns():
    # Many chunks at optimizer-like densities: the columns, plane by plane,
    # compress below the rows written out as they are in memory.
    import zstandard

    rng = np.random.default_rng(5)
    enc = positions.RiceEncoder(None)
    for ci in range(200):
        enc.code(ci, _chunk(rng, 4000, 0.02, 12)[0])
    z = zstandard.ZstdCompressor(level=3)
    assert len(z.compress(positions.pack_groups(enc.groups))) < len(
        z.compress(enc.groups.tobytes())
    )


def _table(rows):
    g = np.zeros(len(rows), positions.GROUP_DTYPE)
    for i, r in enumerate(rows):
        g[i] = r
    return positions.pack_groups(g)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([(0, 1, 2, 0, 5, 0), (2, 0, 2, 0, 5, 0)], "out of range"),  # chunk 2 of 2
        ([(0, 16, 2, 0, 5, 0)], "out of range"),  # no class 16
        ([(0, 1, 41, 0, 5, 0)], "out of range"),  # k beyond MAX_RICE_K
        ([(1, 1, 2, 0, 5, 0), (0, 3, 2, 0, 5, 0)], "not in order"),  # chunks fall back
        ([(0, 3, 2, 0, 5, 0), (0, 3, 2, 0, 5, 0)], "not in order"),  # a class twice
        ([(0, 1, 2, 2, 5, 1)], "invert is not 0 or 1"),
        ([(0, 1, 2, 0, 0, 0)], "group count out of range"),  # a group of no changes
        ([(0, 1, 2, 1, 90, 11)], "group count out of range"),  # 101 in a chunk of 100
        ([(1, 1, 2, 0, 51, 0)], "group count out of range"),  # 51 in the last chunk's 50
    ],
)
def test_group_table_checks_name_what_is_wrong(rows, message):
    raw = _table(rows)
    with pytest.raises(ValueError, match=message):
        rice.group_table(raw, n=150, chunk=100, check=True)
    # Read without the checks (and by the uncompiled source) it is what was written.
    t = rice.group_table(raw)
    assert t.tolist() == [list(r) for r in rows]
    out = np.empty((len(rows), 6), np.int64)
    assert rice._group_table(np.frombuffer(raw, np.uint8), len(rows), 0, 1, 40, False, out) == 0
    assert np.array_equal(out, t)


def test_group_table_refuses_lengths_that_do_not_add_up():
    raw = _table([(0, 1, 2, 1, 5, 3), (1, 2, 3, 0, 7, 0)])
    rice.group_table(raw, n=150, chunk=100, check=True)  # well formed
    for bad, message in [
        (raw[:3], "too short"),
        (raw[:20], "partial row"),
        (raw[:-1], "wrong length"),  # the inverted row's kept cut short
        (raw + b"\0", "wrong length"),
    ]:
        with pytest.raises(ValueError, match=message):
            rice.group_table(bad)


def test_decoder_leaves_room_for_the_coded_ranks_still_to_come():
    # An inverted group of a class of 8 with 5 changed: its 3 unchanged ranks
    # are coded (k = 0: each gap in unary alone). The complement fills the
    # group's 5 slots; a first coded rank past 5 would leave the other two no
    # room below 8, and the ranks written before it would overrun the slots.
    table = np.array([[0, 0, 1, 5, 3]], np.int64)  # cls, k, invert, count, kept
    rem = np.zeros(0, np.uint8)
    ok = np.array([0b11111000], np.uint8)  # gaps 5, 0, 0: ranks 5, 6, 7
    want, u, _ = rice.decode_chunk(ok, 0, rem, 0, table, 8)
    assert want.tolist() == [0, 1, 2, 3, 4] and u == 8
    bad = np.array([0b11111110, 0], np.uint8)  # gap 7: rank 7 first
    with pytest.raises(ValueError, match="rank beyond its class"):
        rice.decode_chunk(bad, 0, rem, 0, table, 8)
    if rice.COMPILED:  # the compiled decoder checks no index: nothing past the slots
        guarded = np.full(9, -1, np.int64)
        assert rice._KERNELS[1](bad, 0, rem, 0, table, 8, guarded[:5])[2] == -4
        assert guarded[5:].tolist() == [-1] * 4
    bad = np.array([0b11111101, 0], np.uint8)  # ranks 6, then 7: no room for the third
    with pytest.raises(ValueError, match="rank beyond its class"):
        rice.decode_chunk(bad, 0, rem, 0, table, 8)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), rows=st.integers(0, 12), seed=st.integers(0, 2**31))
def test_group_table_reads_what_packs_back_or_refuses(data, rows, seed):
    # Any bytes: the reader refuses them, or what it read packs back to them.
    # Half the cases start from a real table, cut, extended or with a byte
    # changed, so that the reader gets past its length checks.
    rng = np.random.default_rng(seed)
    if seed % 2:
        g = np.zeros(rows, positions.GROUP_DTYPE)
        for name in ("chunk", "count", "kept"):
            g[name] = rng.integers(0, 1 << 32, rows, dtype=np.uint64)
        g["cls"], g["k"], g["invert"] = (rng.integers(0, 256, rows) for _ in range(3))
        raw = bytearray(positions.pack_groups(g))
        if raw and data:
            raw[data[0] % len(raw)] = data[-1]
        data = bytes(raw[: len(raw) - seed % 3]) if seed % 5 else bytes(raw) + data[:3]
    try:
        t = rice.group_table(data)
    except ValueError:
        return
    assert positions.pack_groups(positions._as_groups(t)) == data


def test_group_table_with_more_rows_than_pairs_is_refused_before_reading():
    # 2 chunks of 16 classes hold 32 groups at most; a count of 10^9 rows is
    # refused without sizing anything by it.
    raw = np.array([10**9], "<u4").tobytes()
    with pytest.raises(ValueError, match="out of range"):
        rice.group_table(raw, n=150, chunk=100, check=True)
    with pytest.raises(ValueError, match="partial row"):
        rice.group_table(raw)
