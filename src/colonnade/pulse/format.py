"""The PULSE container: framing, header schema and integrity checks.

Layout (all integers little-endian; see docs/pulse-format.md):

    magic        8 bytes   b"\\x89PULSE\\r\\n"
    version      u16       FORMAT_VERSION
    flags        u16       0 (reserved)
    header_len   u32
    header       zstd-compressed JSON (utf-8), header_len bytes
    header_crc   u32       CRC-32 of the header bytes
    payload      the tensors' blocks, back to back, in header order
    digest       32 bytes  BLAKE3 of everything before it

Reading checks, in order: magic, version, length, header CRC, digest, schema.
Each failure raises PatchError naming the region, so a truncated download is
told apart from a bit flip or a patch for another base.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import blake3
import zstandard

from colonnade import untrusted
from colonnade.choices import STORED_PRECISIONS
from colonnade.untrusted import is_int, need

from .errors import PatchError
from .hashing import is_hash
from .tensors import DTYPES

MAGIC = b"\x89PULSE\r\n"
# 2: BLAKE3 container digest; base and result named by algorithm-tagged tree hashes.
# 3: an inverted rice group states its class size (`kept`), so apply need not count it.
FORMAT_VERSION = 3
_PREFIX = struct.Struct("<8sHHI")
_CRC = struct.Struct("<I")
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 64 << 20
MAX_NAME_BYTES = 1024
MAX_ELEMENTS = 1 << 48

OPS = frozenset({"patch", "full", "drop"})
POSITION_BLOCKS = {"rice": 3, "mask": 1}
RESIDUAL_LAYOUTS = {"planes": 1, "sym2": 2, "rc": 2}
POSITION_CODES = frozenset(POSITION_BLOCKS)
RESIDUAL_CODES = frozenset({"xor", "delta"})
CONTEXTS = frozenset({"exp", "rowscale", "none"})


@dataclass(frozen=True)
class Container:
    header: dict[str, Any]
    payload: memoryview


def pack(header: dict[str, Any], blocks: list[bytes]) -> bytes:
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    # Compressed: tensor names repeat their prefixes, and on a lightly changed
    # model the header is a visible share of the patch.
    return seal(zstandard.ZstdCompressor(level=9).compress(text), b"".join(blocks))


def seal(head: bytes, payload: bytes) -> bytes:
    """The framing around a compressed header and a payload: prefix, CRC, BLAKE3.

    Public for the corruption tests and fuzzers, which reseal damaged
    contents to get past the checksums as a lying sender would.
    """
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(head))
    body = b"".join([prefix, head, _CRC.pack(zlib.crc32(head)), payload])
    return body + blake3.blake3(body).digest()


def unpack(data: bytes | memoryview) -> Container:
    """Parse and check a patch's framing and header; payload stays a view."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise PatchError(f"truncated patch: {len(view)} bytes is shorter than the fixed prefix")
    magic, version, _flags, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise PatchError("not a PULSE patch (bad magic)")
    if version != FORMAT_VERSION:
        raise PatchError(
            f"PULSE format version {version} is not read by this build, which reads version "
            f"{FORMAT_VERSION} (re-encode the patch with the same colonnade as its reader)"
        )
    if head_len > MAX_HEADER_BYTES:
        raise PatchError(f"corrupt patch: header length {head_len} exceeds the limit")
    head_end = _PREFIX.size + head_len
    if len(view) < head_end + _CRC.size + DIGEST_BYTES:
        raise PatchError(
            f"truncated patch: {len(view)} bytes cannot hold its {head_len}-byte header"
        )
    head = bytes(view[_PREFIX.size : head_end])
    (crc,) = _CRC.unpack_from(view, head_end)
    if zlib.crc32(head) != crc:
        raise PatchError("corrupt patch: header checksum mismatch")
    header = _parse_header(head)
    payload_start = head_end + _CRC.size
    expected = payload_start + header["payload_bytes"] + DIGEST_BYTES
    if len(view) < expected:
        raise PatchError(f"truncated patch: {len(view)} bytes, header promises {expected}")
    if len(view) > expected:
        raise PatchError(f"corrupt patch: {len(view) - expected} unexpected trailing bytes")
    body_end = expected - DIGEST_BYTES
    if blake3.blake3(view[:body_end]).digest() != bytes(view[body_end:]):
        raise PatchError("corrupt patch: payload digest mismatch (bit flip or damaged transfer)")
    return Container(header, view[payload_start:body_end])


def _parse_header(head: bytes) -> dict[str, Any]:
    try:
        text = untrusted.decompress(head, MAX_HEADER_BYTES, require_size=True)
    except ValueError as e:
        raise PatchError(f"corrupt patch: header does not decompress ({e})") from None
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PatchError(f"corrupt patch: header is not JSON ({e})") from None
    try:
        validate_header(header)
    except (KeyError, TypeError, ValueError) as e:
        raise PatchError(f"corrupt patch: invalid header ({e})") from None
    return header


def validate_header(h: Any) -> None:
    """Schema of the header; SchemaError (a ValueError), KeyError or TypeError on any deviation."""
    need(isinstance(h, dict), "header must be an object")
    need(h["precision"] in STORED_PRECISIONS, f"unknown precision {h['precision']!r}")
    need(is_hash(h["base_hash"]) and is_hash(h["result_hash"]), "bad base_hash/result_hash")
    need(is_int(h["chunk_elems"], 1, 1 << 32), "bad chunk_elems")
    need(isinstance(h["tensors"], list), "tensors must be a list")
    total = 0
    seen: set[str] = set()
    for t in h["tensors"]:
        _validate_entry(t)
        need(t["name"] not in seen, f"tensor {t['name']!r} listed twice")
        seen.add(t["name"])
        total += sum(t["blocks"])
    need(is_int(h["payload_bytes"], 0, 1 << 48), "bad payload_bytes")
    need(total == h["payload_bytes"], "block lengths do not add up to payload_bytes")


def _validate_entry(t: Any) -> None:
    need(isinstance(t, dict), "tensor entry must be an object")
    name = t["name"]
    need(isinstance(name, str) and 0 < len(name.encode()) <= MAX_NAME_BYTES, "bad tensor name")
    need(t["op"] in OPS, f"unknown op {t['op']!r}")
    blocks = t["blocks"]
    need(isinstance(blocks, list) and all(is_int(b, 0, 1 << 48) for b in blocks), "bad blocks")
    if t["op"] == "drop":
        need(not blocks, "drop carries no blocks")
        return
    need(t["dtype"] in DTYPES, f"unknown dtype {t['dtype']!r}")
    shape = t["shape"]
    need(isinstance(shape, list) and all(is_int(d, 0, MAX_ELEMENTS) for d in shape), "bad shape")
    n = 1
    for d in shape:
        n *= d
    need(n <= MAX_ELEMENTS, "tensor too large")
    if t["op"] == "full":
        need(len(blocks) == 1 and isinstance(t["zstd"], bool), "full wants one block and zstd")
        return
    need(t["pos"] in POSITION_CODES, f"unknown position code {t['pos']!r}")
    need(t["res"] in RESIDUAL_CODES, f"unknown residual code {t['res']!r}")
    need(t["ctx"] in CONTEXTS, f"unknown context {t['ctx']!r}")
    need(is_int(t["e0"], -1, 4096) and is_int(t["changed"], 0, n), "bad e0/changed")
    need(t["rlayout"] in RESIDUAL_LAYOUTS, f"unknown residual layout {t['rlayout']!r}")
    want = POSITION_BLOCKS[t["pos"]] + RESIDUAL_LAYOUTS[t["rlayout"]]
    need(len(blocks) == want, "wrong number of blocks")
