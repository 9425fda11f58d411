"""State and payload hashes: a per-tensor tree, BLAKE3 unless asked otherwise.

    leaf(t)  = H(raw little-endian bytes of t)
    table    = "colonnade-state-v2\\n" + one line per tensor, sorted by name:
               "{len(name)}:{name}|{dtype}|[{dims}]|{nbytes}|{hex leaf}\\n"
    state    = "{algo}:" + hex H(table)

Every hash names its algorithm (`blake3:…`, `sha256:…`), so a reader
checks with whatever the writer used; BLAKE3 is the default (PyPI `blake3`:
several times SHA-256's speed on one core, and it spreads a large input over
the cores), SHA-256 a setting for those who must have it. Independent of dict
order, memory layout and device, so trainer and worker agree on any
machines; the table lets a receiver check tensors one by one, and the leaves
hash in parallel.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import torch

from .tensors import dtype_name, to_bits

ALGOS = ("blake3", "sha256")
DEFAULT = "blake3"
DOMAIN = b"colonnade-state-v2\n"
_HEX = frozenset("0123456789abcdef")
# From this size BLAKE3 hashes one input on every core.
_THREADED_BYTES = 1 << 20


def _new(algo: str, threaded: bool = False):
    if algo == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO if threaded else 1)
    if algo == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash {algo!r}: choose one of {', '.join(ALGOS)}")


def algo_of(h: str) -> str:
    """The algorithm a hash string names; ValueError if it is not one of ours."""
    if not is_hash(h):
        raise ValueError(f"not a hash string: {str(h)[:80]!r} (want blake3:<64 hex> or sha256:…)")
    return h.split(":", 1)[0]


def is_hash(x: object) -> bool:
    """`{algo}:{64 lowercase hex}` with a known algorithm."""
    if not isinstance(x, str) or ":" not in x:
        return False
    algo, hexpart = x.split(":", 1)
    return algo in ALGOS and len(hexpart) == 64 and set(hexpart) <= _HEX


def digest_bytes(data: bytes | memoryview, algo: str = DEFAULT) -> str:
    h = _new(algo, threaded=len(data) >= _THREADED_BYTES)
    h.update(data)
    return f"{algo}:{h.hexdigest()}"


def digest_file(path: Path, algo: str = DEFAULT) -> str:
    h = _new(algo, threaded=True)
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return f"{algo}:{h.hexdigest()}"


def leaf_hash(t: torch.Tensor, algo: str = DEFAULT, threaded: bool = True) -> str:
    """One tensor's hex leaf hash (a line of the state's table); `threaded`:
    a large tensor on every core (BLAKE3), else on this thread alone."""
    bits = to_bits(t)
    h = _new(algo, threaded=threaded and bits.nbytes >= _THREADED_BYTES)
    h.update(memoryview(bits).cast("B"))
    return h.hexdigest()


def tensor_table(state: Mapping[str, torch.Tensor], algo: str = DEFAULT) -> dict[str, str]:
    """{name: hex leaf hash} of every tensor (hashed in parallel)."""
    names = sorted(state)
    if algo == "blake3":  # BLAKE3 threads large tensors itself
        leaves = [leaf_hash(state[n], algo) for n in names]
    else:  # hashlib frees the GIL: tensors in parallel
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            leaves = list(pool.map(lambda n: leaf_hash(state[n], algo), names))
    return dict(zip(names, leaves, strict=True))


def _line(name: str, t: torch.Tensor, leaf: str) -> bytes:
    dims = ",".join(str(d) for d in t.shape)
    nbytes = t.numel() * t.element_size()
    return f"{len(name)}:{name}|{dtype_name(t)}|[{dims}]|{nbytes}|{leaf}\n".encode()


def state_hash(
    state: Mapping[str, torch.Tensor],
    algo: str = DEFAULT,
    leaves: Mapping[str, str] | None = None,
) -> str:
    """The state's hash: `{algo}:{hex}` over its tensor table.

    leaves: {name: leaf_hash(state[name], algo)} already computed for some
    tensors (the caller vouches they are of these very bits); the rest are
    hashed here.
    """
    known = {n: leaf for n, leaf in (leaves or {}).items() if n in state}
    table = {**tensor_table({n: t for n, t in state.items() if n not in known}, algo), **known}
    h = _new(algo)
    h.update(DOMAIN)
    for name in sorted(table):
        h.update(_line(name, state[name], table[name]))
    return f"{algo}:{h.hexdigest()}"


def matches(state: Mapping[str, torch.Tensor], expected: str) -> bool:
    """Whether `state` hashes to `expected`, with the algorithm it names."""
    return state_hash(state, algo_of(expected)) == expected
