"""atheris fuzz targets for the two parsers of bytes from the network.

    python fuzz_targets.py {patch|batch} CORPUS_DIR [libFuzzer flags...]

patch: `pulse.apply` on a fixed base may return a state or raise PatchError,
nothing else. batch: `decode_batch` (and `verify` before it) may return a
batch within bounds or raise SchemaError / SignatureRejected, nothing else.
Any other exception is a crash: atheris prints it and exits non-zero.

Random bytes rarely get past a magic number and two checksums, so most inputs
are framed first: the first byte picks a mode. For patches, 0 is raw bytes;
1, 2 and 3 reseal (valid checksums) a fuzzed header text and payload, the
valid header over a damaged payload, or the valid header with a few fields
edited to other legal values, so mutations reach the header schema and the
block decoders. For batches, 0 is raw bytes, 1 zstd-wrapped safetensors
bytes (header and tensors), 2 a signed envelope. CORPUS_DIR is seeded with
valid inputs of every mode.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import atheris

# Coverage feedback from colonnade's own code; the numba-compiled loops are
# left alone (instrumented bytecode does not compile) and run as workers run them.
with atheris.instrument_imports(
    include=["colonnade"],
    exclude=["colonnade.pulse.kernels", "colonnade.pulse.rangecoder", "colonnade.pulse.rice"],
):
    import torch
    import zstandard
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from colonnade import pulse
    from colonnade.protocol import (
        EpisodeRecord,
        GroupRecord,
        RolloutBatch,
        SchemaError,
        decode_batch,
        encode_batch,
    )
    from colonnade.protocol.signing import SignatureRejected, sign, verify
    from colonnade.pulse import format as fmt
    from colonnade.pulse.tensors import DTYPES

VOCAB, MAX_TOKENS = 64, 32
RUN_ID = "r1"
ROLLOUT_KEY = "w1/rollouts/00000000/000000.safetensors.zst"  # keys.rollout_key(0, "w1", 0)


# -- patch -------------------------------------------------------------------------------


def _pairs() -> list[tuple[dict, bytes, str]]:
    """(base, patch, result hash): a bf16 patch, and an int8 one as the trainer publishes."""
    gen = torch.Generator().manual_seed(3)
    old = {"emb": torch.randn(48, 32, generator=gen) * 0.02, "norm": torch.ones(32)}
    new = {k: v + 3e-4 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
    new["extra"] = torch.arange(10, dtype=torch.int32)
    out = []
    for precision in ("bf16", "int8"):
        a, b = pulse.prepare(old, precision), pulse.prepare(new, precision)
        patch = pulse.diff(a, b, precision="exact")
        out.append((a, patch, pulse.state_hash(b)))
    return out


PAIRS = _pairs()


def _parts(patch: bytes) -> tuple[bytes, bytes]:
    """(header JSON text, payload) of a valid patch."""
    head_len = struct.unpack_from("<I", patch, 12)[0]
    text = zstandard.ZstdDecompressor().decompress(patch[16 : 16 + head_len])
    return text, bytes(fmt.unpack(patch).payload)


def reseal(text: bytes, payload: bytes) -> bytes:
    """A patch with valid framing and checksums around any header text and payload."""
    return fmt.seal(zstandard.ZstdCompressor().compress(text), payload)


def _poke(payload: bytes, rest: bytes) -> bytes:
    """The payload with (u16 offset, byte) pairs from `rest` written in."""
    bad = bytearray(payload)
    for i in range(0, len(rest) - 2, 3):
        if bad:
            bad[int.from_bytes(rest[i : i + 2], "little") % len(bad)] = rest[i + 2]
    return bytes(bad)


CHOICES = {
    "op": sorted(fmt.OPS),
    "dtype": sorted(DTYPES),
    "ctx": sorted(fmt.CONTEXTS),
    "pos": sorted(fmt.POSITION_CODES),
    "res": sorted(fmt.RESIDUAL_CODES),
    "rlayout": sorted(fmt.RESIDUAL_LAYOUTS),
    "zstd": [True, False],
}


def _edit(t: dict, fdp) -> None:
    """One schema-valid edit of a tensor entry: a lying, not a garbled, header."""
    kind = fdp.ConsumeIntInRange(0, 3)
    if kind == 0:
        field = fdp.PickValueInList(sorted(CHOICES))
        t[field] = fdp.PickValueInList(CHOICES[field])
    elif kind == 1:
        t[fdp.PickValueInList(["changed", "e0"])] = fdp.ConsumeIntInRange(-1, 1 << 20)
    elif kind == 2:
        t["shape"] = [fdp.ConsumeIntInRange(0, 4096) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    elif t.get("blocks"):
        t["blocks"][fdp.ConsumeIntInRange(0, len(t["blocks"]) - 1)] = fdp.ConsumeIntInRange(0, 4096)


def _lying_header(good: bytes, rest: bytes) -> bytes:
    """The valid header with a few field edits, block sizes kept adding up; resealed."""
    fdp = atheris.FuzzedDataProvider(rest)
    text, payload = _parts(good)
    h = json.loads(text)
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        _edit(h["tensors"][fdp.ConsumeIntInRange(0, len(h["tensors"]) - 1)], fdp)
    if fdp.ConsumeBool():
        h["chunk_elems"] = fdp.ConsumeIntInRange(1, 1 << 20)
    total = sum(sum(t.get("blocks", [])) for t in h["tensors"])
    h["payload_bytes"] = total
    payload = (payload + bytes(max(0, total - len(payload))))[:total]
    return reseal(json.dumps(h).encode(), payload)


def patch_input(data: bytes) -> tuple[dict, bytes, str | None]:
    """(base, patch, the hash a returned state must have, or None if the header changed)."""
    if len(data) < 2:
        return PAIRS[0][0], data, None
    mode, (base, good, sha) = data[0] % 4, PAIRS[data[1] % len(PAIRS)]
    rest = data[2:]
    if mode == 0:  # raw bytes
        return base, rest, None
    if mode == 1:  # [u16 length][header text][payload]
        n = int.from_bytes(rest[:2], "little")
        return base, reseal(rest[2 : 2 + n], rest[2 + n :]), None
    if mode == 2:  # the valid header over a damaged payload
        text, payload = _parts(good)
        return base, reseal(text, _poke(payload, rest)), sha
    return base, _lying_header(good, rest), None


def fuzz_patch(data: bytes) -> None:
    base, patch, sha = patch_input(data)
    try:
        out = pulse.apply(base, patch)
    except pulse.PatchError:
        return
    # Under the intact header, a state that comes back is exactly the right one.
    assert sha is None or pulse.state_hash(out) == sha


def patch_seeds() -> list[bytes]:
    seeds = []
    for i, (_, good, _) in enumerate(PAIRS):
        text, payload = _parts(good)
        framed = struct.pack("<H", len(text)) + text + payload
        seeds += [bytes([0, i]) + good, bytes([1, i]) + framed]
        seeds += [bytes([2, i]) + b"\0\0\0", bytes([3, i]) + bytes(8)]
    return seeds


# -- batch -------------------------------------------------------------------------------


def _batch_doc() -> bytes:
    ep = EpisodeRecord([1, 2, 3], [True, True, False], [-0.1, -0.2, 0.0], "done")
    batch = RolloutBatch("w1", 0, 0, [GroupRecord("s1", [ep, ep])], {"reward": 0.5})
    return encode_batch(batch)


VALID_BATCH = _batch_doc()
# A fixed key: signed inputs in the corpus stay valid from run to run.
PRIVATE = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
KEYRING = {"w1": PRIVATE.public_key()}


def batch_input(data: bytes) -> bytes:
    """The bytes the trainer reads, per mode: raw, safetensors zstd-wrapped, or signed."""
    if not data:
        return b""
    mode, rest = data[0] % 3, data[1:]
    if mode == 0:
        return rest
    if mode == 1:
        return zstandard.ZstdCompressor().compress(rest)
    return verify(rest, RUN_ID, ROLLOUT_KEY, KEYRING, "w1")  # may raise SignatureRejected


def fuzz_batch(data: bytes) -> None:
    try:
        batch = decode_batch(batch_input(data), VOCAB, MAX_TOKENS)
    except (SchemaError, SignatureRejected):
        return
    for g in batch.groups:  # whatever passes is within bounds
        for e in g.episodes:
            assert all(0 <= t < VOCAB for t in e.tokens)
            assert all(lp <= 0 for lp in e.logprobs)
            assert len(e.tokens) == len(e.from_model) == len(e.logprobs) <= MAX_TOKENS


def batch_seeds() -> list[bytes]:
    raw = zstandard.ZstdDecompressor().decompress(VALID_BATCH)
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    head["__metadata__"]["colonnade"] = head["__metadata__"]["colonnade"].replace("done", "length")
    text = json.dumps(head).encode()
    return [
        b"\0" + VALID_BATCH,
        b"\1" + raw,
        b"\1" + len(text).to_bytes(8, "little") + text + raw[8 + n :],
        b"\2" + sign(PRIVATE, RUN_ID, ROLLOUT_KEY, VALID_BATCH),
    ]


TARGETS = {"patch": (fuzz_patch, patch_seeds), "batch": (fuzz_batch, batch_seeds)}


def main() -> None:
    name, corpus = sys.argv[1], Path(sys.argv[2])
    target, seeds = TARGETS[name]
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds()):
        (corpus / f"seed-{i}").write_bytes(seed)
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
