"""Bytes from strangers (rollout batches, patches, heartbeats), opened within stated bounds.

- `decompress`: zstandard's trap is that it allocates the output size a
  frame declares, whatever `max_output_size` says, so a frame of a few bytes
  that declares 2^61 bytes raised MemoryError and one declaring a few GB was
  a memory bomb. The declared size is checked first; the bound still holds
  for frames that declare none.
- `json_depth`: Python's JSON parser recurses once per nesting level, so a
  600-byte document nested deeply enough raised RecursionError out of the
  parser (and a shallower one out of whatever walked the result). The depth
  is measured on the raw bytes, in a few vectorised passes, before parsing.
- `host_port`: a network address someone else wrote (a stage's, in the
  inbox), or a flag's, as (host, port): a host name, an IPv4 address or a
  bracketed IPv6 one, nothing a URL could smuggle in beside it.
- `need`, `is_int`, `is_number`: the checks of a parsed value's type and
  range, one version for the protocol's documents, a patch's header, metric
  rows and config files. A bool is not a number here (JSON's `true` would
  pass Python's `isinstance(x, int)`), and a number is finite unless asked.

numpy and zstandard are imported where they are used, so that reading a
config (which takes the checks from here) stays light.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]")
MAX_JSON_DEPTH = 32  # protocol documents nest 5 levels at most
MAX_INT = 1 << 62  # past any count, size or version a document holds honestly
# One decompression context per thread (contexts are not thread-safe): making
# one costs more than decompressing a small block, and a patch has hundreds.
_local = threading.local()


def decompress(data: bytes, limit: int, require_size: bool = False) -> bytes:
    """`data` decompressed to at most `limit` bytes, or ValueError saying why.

    `require_size`: refuse frames that do not declare their size.
    """
    import zstandard

    try:
        declared = zstandard.frame_content_size(data)
        if declared < 0 and require_size:
            raise ValueError("zstd frame declares no size")
        if declared > limit:
            raise ValueError(f"zstd frame declares {declared} bytes, more than the {limit} allowed")
        dctx = getattr(_local, "dctx", None)
        if dctx is None:
            dctx = _local.dctx = zstandard.ZstdDecompressor()
        return dctx.decompress(data, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None
    except MemoryError:  # what is left of the trap: a declared size under the limit
        raise ValueError(f"zstd frame declares {declared} bytes, too many to allocate") from None


def zstd_frame_size(data: bytes) -> int:
    """The bytes the zstd frame at the start of `data` takes (header, blocks,
    checksum), from its block headers alone; ValueError for what is not a
    whole frame. zstandard decompresses the first frame and ignores whatever
    follows it, so a reader that wants no trailing bytes compares this with
    the length."""
    import zstandard

    try:
        at = zstandard.frame_header_size(data)
        checksum = zstandard.get_frame_parameters(data).has_checksum
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None
    while True:
        if at + 3 > len(data):
            raise ValueError("zstd: truncated frame")
        head = int.from_bytes(data[at : at + 3], "little")
        last, kind, size = head & 1, (head >> 1) & 3, head >> 3
        if kind == 3:
            raise ValueError("zstd: reserved block type")
        at += 3 + (1 if kind == 1 else size)  # an RLE block holds one byte
        if last:
            break
    at += 4 if checksum else 0
    if at > len(data):
        raise ValueError("zstd: truncated frame")
    return at


def json_depth(data: bytes) -> int:
    """The deepest nesting of [ and { outside strings in a JSON text.

    Escapes are neutralised first (backslash pairs, then escaped quotes:
    both non-overlapping, left to right, as a JSON reader pairs them), so
    the quotes left toggle strings. Invalid JSON may be measured wrongly,
    but the parser then fails no deeper than the bytes before its error.
    """
    import numpy as np

    plain = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    a = np.frombuffer(plain, dtype=np.uint8)
    if a.size == 0:
        return 0
    outside = (np.cumsum(a == ord('"')) % 2) == 0
    step = np.zeros(a.size, dtype=np.int32)
    step[((a == ord("[")) | (a == ord("{"))) & outside] = 1
    step[((a == ord("]")) | (a == ord("}"))) & outside] = -1
    return int(np.cumsum(step).max(initial=0))


def check_json(data: bytes, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> None:
    """ValueError unless `data` is within `max_bytes` and nests at most `max_depth`."""
    if len(data) > max_bytes:
        raise ValueError(f"document of {len(data)} bytes exceeds {max_bytes}")
    depth = json_depth(data)
    if depth > max_depth:
        raise ValueError(f"document nests {depth} levels deep, more than {max_depth}")


class SchemaError(ValueError):
    """A document that does not match its schema (or is too large)."""


def need(cond: bool, what: str) -> None:
    """SchemaError(`what`) unless `cond`."""
    if not cond:
        raise SchemaError(what)


def is_int(x: Any, lo: float = 0, hi: float = MAX_INT) -> bool:
    """Whether `x` is an int (a bool is not) from `lo` to `hi`, both included."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def is_number(x: Any, finite: bool = True) -> bool:
    """Whether `x` is an int or a float (a bool is not), finite unless `finite` is False."""
    return (
        isinstance(x, int | float) and not isinstance(x, bool) and (not finite or math.isfinite(x))
    )


def host_port(text: Any, any_port: bool = False) -> tuple[str, int]:
    """(host, port) of `HOST:PORT` (`[V6]:PORT` for IPv6, the brackets
    dropped); ValueError naming what is wrong. `any_port`: port 0 (any free
    one, for a listener) is taken too."""
    if not isinstance(text, str):
        raise ValueError("an address is HOST:PORT")
    host, sep, port = text.rpartition(":")
    digits = port.isascii() and port.isdigit() and len(port) <= 5
    if not sep or not _HOST.fullmatch(host) or not digits:
        raise ValueError(f"{text[:300]!r}: an address is HOST:PORT ([V6]:PORT for IPv6)")
    if not (0 if any_port else 1) <= int(port) <= 65535:
        raise ValueError(f"{text!r}: the port is {0 if any_port else 1} to 65535")
    return host.strip("[]"), int(port)
