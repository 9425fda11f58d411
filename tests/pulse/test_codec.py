"""Round trips and edge cases of PULSE encode/apply."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colonnade.pulse import (
    PatchError,
    apply,
    encode,
    prepare,
    quantize_rows,
    read_header,
    state_hash,
)
from colonnade.pulse import codec as codec_mod
from pulse_helpers import bits_equal, perturb, random_tensor

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def round_trip(old, new, precision="exact"):
    patch, stats = encode(old, new, precision=precision)
    base = prepare(old, precision)
    out = apply(base, patch)
    assert bits_equal(out, prepare(new, precision))
    return patch, stats


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3),
    dtype=st.sampled_from(DTYPES),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.3, 0.7, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_any_shape_dtype_density(shape, dtype, density, seed):
    gen = torch.Generator().manual_seed(seed)
    old = {"w": random_tensor(tuple(shape), dtype, gen), "b": random_tensor((7,), dtype, gen)}
    new = {k: perturb(v, density, gen) for k, v in old.items()}
    _, stats = round_trip(old, new)
    expect = sum(int((v.reshape(-1) != new[k].reshape(-1)).sum()) for k, v in old.items())
    if dtype.is_floating_point:  # NaN-free inputs: bitwise and value change agree
        assert stats.changed == sum(
            int(np.count_nonzero(codec_mod.to_bits(v) != codec_mod.to_bits(new[k])))
            for k, v in old.items()
        )
    else:
        assert stats.changed == expect


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_precisions_round_trip(precision):
    gen = torch.Generator().manual_seed(1)
    old = {"lin.weight": torch.randn(64, 48, generator=gen) * 0.02, "norm": torch.ones(48)}
    new = {
        "lin.weight": old["lin.weight"] + 1e-4 * torch.randn(64, 48, generator=gen),
        "norm": old["norm"] + 1e-3,
    }
    patch, _stats = round_trip(old, new, precision)
    assert read_header(patch)["precision"] == precision
    if precision == "int8":
        held = prepare(new, "int8")
        assert held["lin.weight"].dtype == torch.int8
        assert held["lin.weight::scale"].dtype == torch.float32
        assert held["norm"].dtype == torch.bfloat16


def test_no_change_is_tiny_and_exact():
    gen = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(256, 256, generator=gen).to(torch.bfloat16)}
    patch, stats = round_trip(old, {"w": old["w"].clone()})
    assert stats.changed == 0 and len(patch) < 400
    assert read_header(patch)["tensors"] == []


def test_new_dropped_dtype_and_shape_changes_travel_whole():
    gen = torch.Generator().manual_seed(0)
    old = {
        "keep": torch.randn(8, 8, generator=gen),
        "gone": torch.randn(3, generator=gen),
        "retyped": torch.randn(4, generator=gen),
        "reshaped": torch.randn(4, 4, generator=gen),
    }
    new = {
        "keep": old["keep"].clone(),
        "added": torch.randn(5, generator=gen),
        "retyped": old["retyped"].to(torch.float16),
        "reshaped": old["reshaped"].reshape(2, 8),
    }
    patch, _ = round_trip(old, new)
    ops = {t["name"]: t["op"] for t in read_header(patch)["tensors"]}
    assert ops == {"added": "full", "gone": "drop", "retyped": "full", "reshaped": "full"}


def test_zero_dim_and_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(16, 12, generator=gen)
    old = {"scalar": torch.tensor(1.5), "t": big.t()}  # transposed view: non-contiguous
    new = {"scalar": torch.tensor(2.5), "t": (big + 1e-3).t()}
    assert not old["t"].is_contiguous()
    round_trip(old, new)


def test_chunks_and_many_classes(monkeypatch):
    # Small chunks exercise chunk boundaries the way >2^22-element tensors do.
    monkeypatch.setattr(codec_mod, "CHUNK_ELEMS", 1000)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(7, 1111, generator=gen) * torch.logspace(-6, 0, 1111)
    old = {"w": w.to(torch.bfloat16)}
    new = {"w": (w + 1e-5 * torch.randn(7, 1111, generator=gen)).to(torch.bfloat16)}
    patch, stats = round_trip(old, new)
    assert read_header(patch)["chunk_elems"] == 1000 and stats.changed > 0


def test_dense_change_prefers_mask():
    gen = torch.Generator().manual_seed(0)
    old = {"w": torch.randint(0, 2, (4096,), generator=gen, dtype=torch.int8)}
    new = {"w": torch.randint(0, 2, (4096,), generator=gen, dtype=torch.int8)}
    patch, stats = round_trip(old, new)
    assert 0.4 < stats.density < 0.6
    assert read_header(patch)["tensors"][0]["pos"] in ("mask", "rice")


def test_positions_beyond_32_bits_fit_in_the_format():
    # A >2^32-element tensor cannot be allocated in a test; the chunk index is
    # 32-bit and chunk offsets are int64, so positions reach 2^32 * 2^22.
    from colonnade.pulse.positions import GROUP_DTYPE

    assert GROUP_DTYPE["chunk"].itemsize == 4
    assert (2**32 - 1) * codec_mod.CHUNK_ELEMS > 2**40


def test_hash_depends_on_names_dtypes_shapes_and_bits():
    t = torch.arange(6, dtype=torch.float32)
    base = state_hash({"a": t})
    assert base == state_hash({"a": t.clone()})
    assert base != state_hash({"b": t})
    assert base != state_hash({"a": t.reshape(2, 3)})
    assert base != state_hash({"a": t.view(torch.int32)})
    t2 = t.clone()
    t2[3] = np.nextafter(np.float32(3), np.float32(4)).item()
    assert base != state_hash({"a": t2})
    assert state_hash({"a": t, "b": t}) == state_hash({"b": t, "a": t})


def test_quantizer_is_deterministic_and_symmetric():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=gen)
    w[5] = 0
    codes, scale = quantize_rows(w)
    codes2, scale2 = quantize_rows(w.clone())
    assert torch.equal(codes, codes2) and torch.equal(scale, scale2)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert scale[5] == 0 and int(codes[5].abs().max()) == 0
    err = (codes.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


def test_apply_rejects_wrong_base():
    gen = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(100, generator=gen)}
    new = {"w": old["w"] + 1}
    patch = encode(old, new, precision="exact")[0]
    with pytest.raises(PatchError, match="wrong base"):
        apply({"w": old["w"] + 2}, patch)


def test_apply_leaves_base_untouched_and_shares_unchanged():
    gen = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(50, generator=gen), "b": torch.randn(50, generator=gen)}
    new = {"a": old["a"] + 1, "b": old["b"]}
    snapshot = {k: v.clone() for k, v in old.items()}
    out = apply(old, encode(old, new, precision="exact")[0])
    assert bits_equal(old, snapshot)
    assert out["b"] is old["b"]


def test_a_tensor_shared_by_both_states_is_unchanged_without_a_compare(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    kept = torch.randn(64, 64, generator=gen)
    old = {"base": kept, "adapter": torch.randn(8, 64, generator=gen)}
    new = {"base": kept, "adapter": old["adapter"] * 2}
    same_bits = {"base": kept.clone(), "adapter": new["adapter"]}
    expected = encode(old, same_bits, precision="exact")[0]
    compared = []
    changes = codec_mod._encode_changes
    monkeypatch.setattr(codec_mod, "_encode_changes",
                        lambda name, *a: compared.append(name) or changes(name, *a))  # fmt: skip
    patch = encode(old, new, precision="exact")[0]
    assert compared == ["adapter"] and patch == expected  # the same patch, base not read


def test_scales_keep_16_bits_so_every_code_times_scale_is_exact():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen) * torch.logspace(-4, 1, 64)[:, None]
    codes, scale = quantize_rows(w)
    assert bool(((scale.view(torch.int32) & 0xFF) == 0).all())
    assert bool((scale >= w.abs().amax(dim=1) / 127).all())  # rounded up, never clipped
    assert bool((codes.abs().amax(dim=1) == 127).all())  # and still the full range
    q = torch.arange(256, dtype=torch.float64)
    exact = scale.double()[:, None] * q[None]
    assert torch.equal((scale[:, None] * q.float()[None]).double(), exact)


def test_bitmask_read_and_written_in_slices(monkeypatch):
    # A contiguous run of changes: the bitmask beats the rank code, and the
    # residuals follow it in ascending order across every slice boundary.
    from colonnade.pulse import positions

    monkeypatch.setattr(positions, "MASK_STEP", 1000)
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(-100, 100, (10_007,), generator=gen, dtype=torch.int8)
    new = w.clone()
    new[1234:7777] += 1
    patch, stats = round_trip({"w": w}, {"w": new})
    assert read_header(patch)["tensors"][0]["pos"] == "mask"
    assert stats.changed == 7777 - 1234


def test_hashes_name_their_algorithm_and_both_round_trip():
    from colonnade.pulse.hashing import algo_of, is_hash, matches, tensor_table

    gen = torch.Generator().manual_seed(3)
    old = {f"t{i}": torch.randn(64, 32, generator=gen).to(torch.bfloat16) for i in range(4)}
    new = {k: perturb(v, 0.05, gen) for k, v in old.items()}
    for algo in ("blake3", "sha256"):
        patch, stats = encode(old, new, precision="bf16", hash_algo=algo)
        assert algo_of(stats.result_hash) == algo and is_hash(stats.base_hash)
        assert read_header(patch)["result_hash"] == stats.result_hash
        out = apply(prepare(old, "bf16"), patch)
        assert matches(out, stats.result_hash) and state_hash(out, algo) == stats.result_hash
    assert state_hash(old) != state_hash(old, "sha256")
    assert state_hash(old).startswith("blake3:")
    # The table checks tensors one by one: one changed tensor, one changed leaf.
    a, b = tensor_table(old), tensor_table({**old, "t2": new["t2"]})
    assert [k for k in a if a[k] != b[k]] == ["t2"]
    for bad in ("", "blake3:xyz", "md5:" + "0" * 64, "blake3:" + "A" * 64, None):
        assert not is_hash(bad)


def _int8_and_bf16_states(seed=3):
    gen = torch.Generator().manual_seed(seed)
    old = {"lin.weight": torch.randn(96, 80, generator=gen) * 0.02, "norm": torch.ones(80)}
    new = {
        "lin.weight": old["lin.weight"] + 3e-4 * torch.randn(96, 80, generator=gen),
        "norm": old["norm"] + 2e-2,
    }
    return old, new


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_apply_in_place_writes_into_the_base(monkeypatch, precision):
    # Many chunks, so that chunk passes run on the pool while others are rebuilt.
    monkeypatch.setattr(codec_mod, "CHUNK_ELEMS", 512)
    old, new = _int8_and_bf16_states()
    base = prepare(old, precision)
    patch = encode(old, new, precision=precision)[0]
    expect = apply(base, patch)
    ids = {k: v.data_ptr() for k, v in base.items()}
    out = apply(base, patch, in_place=True)
    assert bits_equal(out, expect) and bits_equal(base, expect)
    assert {k: v.data_ptr() for k, v in out.items()} == ids  # no second copy


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_failed_in_place_apply_puts_the_base_back(precision):
    old, new = _int8_and_bf16_states()
    base = prepare(old, precision)
    snapshot = {k: v.clone() for k, v in base.items()}
    # Decodes in full, then fails its result hash: every written bit goes back.
    liar = encode(old, new, precision=precision, result_hash=state_hash(base))[0]
    with pytest.raises(PatchError, match="rebuilt state hashes"):
        apply(base, liar, in_place=True)
    assert bits_equal(base, snapshot)


def test_state_hash_takes_leaves_already_computed():
    from colonnade.pulse.hashing import leaf_hash

    gen = torch.Generator().manual_seed(3)
    state = {n: torch.randn(50, generator=gen) for n in ("a", "b", "c")}
    leaves = {"b": leaf_hash(state["b"]), "gone": "00" * 32}  # names not in the state are ignored
    assert state_hash(state, leaves=leaves) == state_hash(state)
    # The leaves given are trusted, not recomputed: a wrong one changes the hash.
    assert state_hash(state, leaves={"a": leaf_hash(state["b"])}) != state_hash(state)


@pytest.mark.parametrize("algo", ["blake3", "sha256"])
def test_hashes_made_beside_the_work_are_the_state_hashes(algo):
    # encode hashes each new tensor on its worker, apply each rebuilt one:
    # both must name exactly what state_hash says of the whole state.
    gen = torch.Generator().manual_seed(4)
    old = {f"w{i}": torch.randn(300, 40, generator=gen) for i in range(5)}
    new = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
    new["extra"] = torch.randn(7, generator=gen)
    patch, stats = encode(old, new, precision="bf16", hash_algo=algo)
    assert stats.result_hash == state_hash(prepare(new, "bf16"), algo)
    assert bits_equal(apply(prepare(old, "bf16"), patch), prepare(new, "bf16"))
