"""Every damaged patch raises PatchError naming what is wrong; none yields a state."""

import struct
import time

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colonnade.pulse import PatchError, apply, encode, prepare
from colonnade.pulse import format as fmt
from pulse_helpers import bits_equal, perturb


def _states():
    gen = torch.Generator().manual_seed(7)
    old = {
        "emb": torch.randn(64, 32, generator=gen) * 0.02,
        "norm": torch.ones(32),
        "head": torch.randn(16, 32, generator=gen) * 0.02,
    }
    new = {k: v + 3e-4 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
    new["extra"] = torch.arange(10, dtype=torch.int32)
    return old, new


OLD, NEW = _states()
BASE = prepare(OLD, "bf16")
PATCH, _ = encode(OLD, NEW, precision="bf16")
HEAD_LEN = struct.unpack_from("<I", PATCH, 12)[0]
REGIONS = {
    "magic": (0, 8),
    "version": (8, 10),
    "header_len": (12, 16),
    "header": (16, 16 + HEAD_LEN),
    "header_crc": (16 + HEAD_LEN, 20 + HEAD_LEN),
    "payload": (20 + HEAD_LEN, len(PATCH) - 32),
    "digest": (len(PATCH) - 32, len(PATCH)),
}


def test_intact_patch_applies():
    apply(BASE, PATCH)


@pytest.mark.parametrize("region", sorted(REGIONS))
def test_bit_flip_in_every_region_is_caught(region):
    lo, hi = REGIONS[region]
    for pos in sorted({lo, (lo + hi) // 2, hi - 1}):
        for bit in (0, 7):
            bad = bytearray(PATCH)
            bad[pos] ^= 1 << bit
            with pytest.raises(PatchError) as e:
                apply(BASE, bytes(bad))
            assert any(w in str(e.value) for w in ("corrupt", "truncated", "magic", "version"))


@pytest.mark.parametrize("cut", [0, 5, 15, 16, 100, len(PATCH) // 2, len(PATCH) - 1])
def test_truncation_is_reported_as_such(cut):
    with pytest.raises(PatchError, match="truncated"):
        apply(BASE, PATCH[:cut])


@pytest.mark.parametrize("version", [1, 2, 99])
def test_other_versions_are_refused_naming_both(version):
    # Version 1 (SHA-256 state hashes) and 2 (no class sizes in the group
    # table) are what earlier releases wrote.
    bad = bytearray(PATCH)
    struct.pack_into("<H", bad, 8, version)
    with pytest.raises(PatchError, match=rf"format version {version} .* reads version 3"):
        apply(BASE, bytes(bad))


def test_not_a_patch():
    with pytest.raises(PatchError, match="bad magic"):
        apply(BASE, b"PK\x03\x04" + b"\0" * 100)


_reseal = fmt.seal  # valid checksums around arbitrary content: a lying sender


c = fmt.unpack(PATCH)
HEADER_BYTES = bytes(memoryview(PATCH)[16 : 16 + HEAD_LEN])
PAYLOAD = bytes(c.payload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(0, len(PAYLOAD) - 1), value=st.integers(0, 255))
def test_resealed_payload_damage_never_returns_a_wrong_state(pos, value):
    bad = bytearray(PAYLOAD)
    if bad[pos] == value:
        value ^= 0xFF
    bad[pos] = value
    try:
        out = apply(BASE, _reseal(HEADER_BYTES, bytes(bad)))
    except PatchError:
        return
    # A byte the decoder never needs (e.g. range-coder flush slack) may change
    # without effect; then the state must be exactly the right one.
    assert bits_equal(out, prepare(NEW, "bf16"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(0, len(HEADER_BYTES) - 1), value=st.integers(32, 126))
def test_resealed_header_damage_never_crashes(pos, value):
    bad = bytearray(HEADER_BYTES)
    if bad[pos] == value:
        return
    bad[pos] = value
    try:
        out = apply(BASE, _reseal(bytes(bad), PAYLOAD))
    except PatchError:
        return
    # A header edit that keeps the meaning (e.g. JSON whitespace) may apply,
    # but then the result must be the right state, which its hash proves.
    assert set(out) == set(prepare(NEW, "bf16"))


def test_lying_header_fields_rejected():
    import json

    h = json.loads(zstandard.ZstdDecompressor().decompress(HEADER_BYTES))
    for mutate in (
        lambda h: h.update(payload_bytes=h["payload_bytes"] + 1),
        lambda h: h["tensors"][0].update(dtype="Q4"),
        lambda h: h["tensors"][0].update(changed=-1),
        lambda h: h["tensors"][0].update(shape=[2**30, 2**30]),
        lambda h: h.update(precision="fp4"),
        lambda h: h["tensors"].append(dict(h["tensors"][0])),
    ):
        hh = json.loads(zstandard.ZstdDecompressor().decompress(HEADER_BYTES))
        mutate(hh)
        hb = zstandard.ZstdCompressor().compress(json.dumps(hh).encode())
        with pytest.raises(PatchError):
            apply(BASE, _reseal(hb, PAYLOAD))
    assert h  # the original header parsed


@pytest.mark.parametrize("elements", [1 << 36, 1 << 44])
def test_a_full_tensor_too_large_to_allocate_is_a_patch_error(elements):
    import json

    # A zstd frame of a few bytes declaring the size of a huge full tensor:
    # zstandard allocates the declared size first, which raised MemoryError.
    frame = b"\x28\xb5\x2f\xfd\xe0" + (2 * elements).to_bytes(8, "little") + b"\x01\x00\x00"
    h = json.loads(zstandard.ZstdDecompressor().decompress(HEADER_BYTES))
    h["tensors"] = [{"name": "big", "op": "full", "dtype": "BF16", "shape": [elements],
                     "zstd": True, "blocks": [len(frame)]}]  # fmt: skip
    h["payload_bytes"] = len(frame)
    hb = zstandard.ZstdCompressor().compress(json.dumps(h).encode())
    with pytest.raises(PatchError, match="declares"):
        apply(BASE, _reseal(hb, frame))


def test_resealed_damage_to_an_in_place_apply_leaves_the_base_as_it_was(monkeypatch):
    """Damage the decoder finds part-way (a rank past its class, a short
    stream) after some chunks of a tensor were rebuilt in the base's own
    memory, maybe on other threads: every element goes back, and nothing is
    still writing once apply has raised."""
    import colonnade.pulse.codec as codec_mod

    monkeypatch.setattr(codec_mod, "CHUNK_ELEMS", 256)  # many chunks a tensor, on the pool
    gen = torch.Generator().manual_seed(3)
    old = {"w": torch.randn(64, 512, generator=gen), "v": torch.randn(8192, generator=gen)}
    new = {k: perturb(v, 0.03, gen) for k, v in old.items()}  # sparse: rice-coded positions
    patch, _ = encode(old, new, precision="bf16")
    head_len = struct.unpack_from("<I", patch, 12)[0]
    header = bytes(memoryview(patch)[16 : 16 + head_len])
    c = fmt.unpack(patch)
    assert {t["pos"] for t in c.header["tensors"]} == {"rice"}
    payload = bytes(c.payload)
    rng = torch.Generator().manual_seed(5)
    failed = 0
    for _ in range(60):
        base = prepare(old, "bf16")
        snapshot = {k: v.clone() for k, v in base.items()}
        bad = bytearray(payload)
        for pos in torch.randint(0, len(bad), (3,), generator=rng).tolist():
            bad[pos] ^= 1 << int(torch.randint(0, 8, (1,), generator=rng))
        try:
            apply(base, _reseal(header, bytes(bad)), in_place=True)
        except PatchError:
            failed += 1
            assert bits_equal(base, snapshot)
            time.sleep(0.001)  # nothing left running may write after the raise
            assert bits_equal(base, snapshot)
    assert failed > 30


def test_a_group_table_that_claims_huge_counts_is_a_patch_error():
    # A resealed group table whose counts sum past the tensor: refused before
    # anything is sized by them (residual classes, wanted ranks).
    import json

    from colonnade.pulse import positions

    gen = torch.Generator().manual_seed(11)
    old = {"w": torch.randn(64, 64, generator=gen)}
    new = {"w": perturb(old["w"], 0.03, gen)}
    patch, _ = encode(old, new, precision="bf16")
    c = fmt.unpack(patch)
    (entry,) = c.header["tensors"]
    assert entry["pos"] == "rice"
    first = entry["blocks"][0]
    g = positions.unpack_groups(zstandard.ZstdDecompressor().decompress(c.payload[:first]))
    for field, value in (("count", 2**32 - 1), ("count", 0), ("kept", 2**31)):
        bad = g.copy()
        bad[field][0] = value
        if field == "kept":
            bad["invert"][0] = 1
        table = zstandard.ZstdCompressor().compress(positions.pack_groups(bad))
        h = json.loads(json.dumps(c.header))
        h["tensors"][0]["blocks"][0] = len(table)
        h["payload_bytes"] += len(table) - first
        hb = zstandard.ZstdCompressor().compress(json.dumps(h).encode())
        with pytest.raises(PatchError, match="group count out of range"):
            apply(prepare(old, "bf16"), _reseal(hb, table + bytes(c.payload[first:])))


def test_in_place_rebuilds_tensors_that_share_memory_as_copies():
    # Two names over one storage (a tied head): each leaf is hashed as soon
    # as its tensor is done, so neither may be rewritten under the other.
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(32, 16, generator=gen).bfloat16()
    base = {"emb": w, "head": w, "norm": torch.ones(16).bfloat16()}
    new = {"emb": perturb(w.float(), 0.05, gen).bfloat16(), "head": w.clone(), "norm": base["norm"]}
    patch, _ = encode(base, new, precision="bf16")
    before = w.clone()
    got = apply(base, patch, in_place=True)
    assert bits_equal(got, prepare(new, "bf16"))
    assert torch.equal(w, before)  # the shared storage was not written
