"""Bit-level building blocks: Rice codes, order-preserving keys, zigzag.

All vectorised numpy, all pure: the codec composes them and the tests pin
each one down on its own.
"""

from __future__ import annotations

import numpy as np

MAX_RICE_K = 40


def rice_cost(values: np.ndarray, k: int) -> int:
    """Bits a Rice code with parameter k spends on `values`."""
    return int(np.sum(values >> np.uint64(k), dtype=np.uint64)) + values.size * (1 + k)


def best_rice_k(values: np.ndarray) -> int:
    """The k that minimises the exact Rice cost (searched around the mean)."""
    if values.size == 0:
        return 0
    mean = float(values.mean())
    guess = max(0, int(np.floor(np.log2(mean * np.log(2) + 1e-12))) if mean > 1 else 0)
    candidates = range(max(0, guess - 1), min(MAX_RICE_K, guess + 2) + 1)
    return min(candidates, key=lambda k: rice_cost(values, k))


def rice_encode(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Unpacked bits (uint8 0/1) of the unary quotients and the k-bit remainders.

    Quotients and remainders go to separate streams so both decode without a
    sequential parse: the unary stream splits at its zeros, the remainder
    stream is fixed-width.
    """
    v = values.astype(np.uint64, copy=False)
    # In place where it can be: the groups of a large tensor run to millions.
    ends = (v >> np.uint64(k)).view(np.int64)
    ends += 1
    np.cumsum(ends, out=ends)
    unary = np.ones(int(ends[-1]) if ends.size else 0, dtype=np.uint8)
    ends -= 1
    unary[ends] = 0
    del ends
    if k == 0:
        return unary, np.zeros(0, dtype=np.uint8)
    # The remainder bits in the narrowest integer that holds k bits (a
    # uint64 matrix of m x k would be 8 bytes a bit).
    width = np.uint8 if k <= 8 else np.uint16 if k <= 16 else np.uint64
    low = (v & np.uint64((1 << k) - 1)).astype(width)
    shifts = np.arange(k - 1, -1, -1, dtype=width)
    rem = ((low[:, None] >> shifts) & width(1)).astype(np.uint8, copy=False).ravel()
    return unary, rem


def unpack_bits(packed: np.ndarray, start: int, count: int) -> np.ndarray:
    """Bits [start, start + count) of a packed stream (np.packbits order), unpacked."""
    lo = start // 8
    chunk = np.unpackbits(packed[lo : -(-(start + count) // 8)])
    return chunk[start - 8 * lo : start - 8 * lo + count]


class UnaryReader:
    """Reads unary quotients off one packed bit stream, group after group.

    Unpacks only the stretch each read needs (growing its guess until it
    holds enough zeros), so a decoder never holds the whole stream a byte
    per bit.
    """

    def __init__(self, packed: np.ndarray) -> None:
        self.packed = packed
        self.bits_used = 0
        self._total = 8 * packed.size

    def read(self, count: int) -> np.ndarray:
        if count == 0:
            return np.zeros(0, np.uint64)
        want = 2 * count + 64
        while True:
            span = min(want, self._total - self.bits_used)
            zeros = np.flatnonzero(unpack_bits(self.packed, self.bits_used, span) == 0)
            if zeros.size >= count:
                break
            if span == self._total - self.bits_used:
                raise ValueError("unary stream ends early")
            want *= 2
        z = zeros[:count]
        self.bits_used += int(z[-1]) + 1
        return (np.diff(z, prepend=-1) - 1).astype(np.uint64)


def fixed_decode(bits: np.ndarray, count: int, k: int) -> np.ndarray:
    """`count` big-endian k-bit integers from an unpacked bit stream."""
    if k == 0:
        return np.zeros(count, dtype=np.uint64)
    if bits.size < count * k:
        raise ValueError("remainder stream ends early")
    m = bits[: count * k].reshape(count, k).astype(np.uint64)
    weights = np.uint64(1) << np.arange(k - 1, -1, -1, dtype=np.uint64)
    return (m * weights).sum(axis=1, dtype=np.uint64)


def gaps_from_sorted(positions: np.ndarray) -> np.ndarray:
    """Gaps between sorted distinct positions: first position, then steps minus one."""
    gaps = np.diff(positions.astype(np.int64, copy=False), prepend=-1)
    gaps -= 1
    return gaps.view(np.uint64)


def sorted_from_gaps(gaps: np.ndarray) -> np.ndarray:
    return np.cumsum(gaps.astype(np.int64) + 1) - 1


def ordered_key(bits: np.ndarray, is_float: bool, is_signed: bool) -> np.ndarray:
    """Map bit patterns to unsigned keys whose order is the numeric order.

    Floats are sign-magnitude: negative values are flipped so that one ulp up
    is +1 in key space, across zero too. Signed ints become offset binary.
    Steps of a few ulps then become small integers, which code in far fewer
    bits than their XOR costs.
    """
    ut = bits.dtype.type
    top = ut(1) << ut(bits.dtype.itemsize * 8 - 1)
    if is_float:
        neg = (bits & top) != 0
        return np.where(neg, ~bits, bits | top)
    if is_signed:
        return bits ^ top
    return bits


def from_ordered_key(keys: np.ndarray, is_float: bool, is_signed: bool) -> np.ndarray:
    ut = keys.dtype.type
    top = ut(1) << ut(keys.dtype.itemsize * 8 - 1)
    if is_float:
        pos = (keys & top) != 0
        return np.where(pos, keys & ~top, ~keys)
    if is_signed:
        return keys ^ top
    return keys


def zigzag(delta: np.ndarray) -> np.ndarray:
    """Two's-complement wrap-around differences to small unsigned codes (0,-1,1,-2 → 0,1,2,3)."""
    ut = delta.dtype.type
    width = ut(delta.dtype.itemsize * 8 - 1)
    top_set = (delta >> width) != 0
    return np.where(top_set, ~(delta << ut(1)), delta << ut(1))


def unzigzag(z: np.ndarray) -> np.ndarray:
    ut = z.dtype.type
    odd = (z & ut(1)) != 0
    half = z >> ut(1)
    return np.where(odd, ~half, half)


def byte_planes(values: np.ndarray) -> bytes:
    """Little-endian byte planes: all low bytes, then the next bytes, and so on.

    Small residuals leave the high planes almost all zero, which zstd folds
    to nothing; interleaved, those zeros would be spread through the stream.
    """
    size = values.dtype.itemsize
    b = values.astype(values.dtype.newbyteorder("<"), copy=False).view(np.uint8)
    return b.reshape(-1, size).T.tobytes()


def from_byte_planes(data: bytes, count: int, size: int) -> np.ndarray:
    if len(data) != count * size:
        raise ValueError(f"residual planes hold {len(data)} bytes, expected {count * size}")
    planes = np.frombuffer(data, dtype=np.uint8).reshape(size, count)
    dt = np.dtype(f"<u{size}")
    return np.ascontiguousarray(planes.T).view(dt).ravel().astype(dt.newbyteorder("="))


class BitSink:
    """Unpacked bits (uint8 0/1) in, packed bytes out, as np.packbits of the
    whole stream would give them (MSB first, zero padding at the end).

    Lets a coder emit its streams piece by piece, holding them packed (one
    bit a bit) instead of a byte per bit until the end.
    """

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._pending = np.zeros(0, np.uint8)

    def add(self, bits: np.ndarray) -> None:
        if bits.size == 0:
            return
        buf = np.concatenate((self._pending, bits)) if self._pending.size else bits
        whole = buf.size - buf.size % 8
        if whole:
            self._parts.append(np.packbits(buf[:whole]).tobytes())
        self._pending = buf[whole:].copy()

    def getvalue(self) -> bytes:
        tail = np.packbits(self._pending).tobytes() if self._pending.size else b""
        return b"".join(self._parts) + tail
