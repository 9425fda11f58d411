"""Forging rollout batches byte by byte, as a hostile worker would.

`split` takes an honest batch apart into its safetensors header (a dict),
its metadata fields and its tensors; `forge` puts edited parts back together
into the bytes a worker uploads, with offsets recomputed unless the header
given already carries its own.
"""

from __future__ import annotations

import json

import numpy as np
import zstandard

from colonnade.protocol.schemas import META_KEY, pack_batch

DTYPES = {"I32": "<i4", "F32": "<f4", "U8": "u1", "I64": "<i8", "F64": "<f8", "BOOL": "?"}


def split(batch) -> tuple[dict, dict, dict[str, np.ndarray]]:
    """(safetensors header without metadata, the batch's JSON fields, tensors)."""
    raw = pack_batch(batch)
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    fields = json.loads(head.pop("__metadata__")[META_KEY])
    body = raw[8 + n :]
    tensors = {
        name: np.frombuffer(body[t["data_offsets"][0] : t["data_offsets"][1]], DTYPES[t["dtype"]])
        for name, t in head.items()
    }
    return head, fields, tensors


def raw_bytes(
    fields: dict, tensors: dict[str, np.ndarray], head: dict | None = None, trailing: bytes = b""
) -> bytes:
    """Uncompressed safetensors bytes. `head` (name -> entry) replaces the
    entries that would be computed from `tensors`."""
    entries, chunks, at = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dtype = next(k for k, v in DTYPES.items() if np.dtype(v) == a.dtype.newbyteorder("<"))
        entries[name] = {
            "dtype": dtype,
            "shape": list(a.shape),
            "data_offsets": [at, at + a.nbytes],
        }
        chunks.append(a.tobytes())
        at += a.nbytes
    entries.update(head or {})
    header = {"__metadata__": {META_KEY: json.dumps(fields)}, **entries}
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(chunks) + trailing


def forge(fields: dict, tensors: dict[str, np.ndarray], **kw) -> bytes:
    """What a worker uploads: `raw_bytes`, zstd-compressed."""
    return zstandard.ZstdCompressor().compress(raw_bytes(fields, tensors, **kw))


def compress(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(raw)
