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
    q = (v >> np.uint64(k)).astype(np.int64)
    unary = np.ones(int(q.sum()) + v.size, dtype=np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0
    if k == 0:
        return unary, np.zeros(0, dtype=np.uint8)
    shifts = np.arange(k - 1, -1, -1, dtype=np.uint64)
    rem = ((v[:, None] >> shifts) & np.uint64(1)).astype(np.uint8).ravel()
    return unary, rem


class UnaryReader:
    """Reads unary quotients off one bit stream, group after group.

    The stream's zeros are found once; each read is then a slice of them.
    """

    def __init__(self, bits: np.ndarray) -> None:
        self.zeros = np.flatnonzero(bits == 0)
        self.taken = 0

    def read(self, count: int) -> np.ndarray:
        if self.taken + count > self.zeros.size:
            raise ValueError("unary stream ends early")
        z = self.zeros[max(0, self.taken - 1) : self.taken + count]
        if self.taken == 0:
            z = np.concatenate(([-1], z))
        self.taken += count
        return (np.diff(z) - 1).astype(np.uint64)

    @property
    def bits_used(self) -> int:
        return int(self.zeros[self.taken - 1]) + 1 if self.taken else 0


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
    p = positions.astype(np.int64, copy=False)
    return np.diff(p, prepend=-1).astype(np.uint64) - np.uint64(1)


def sorted_from_gaps(gaps: np.ndarray) -> np.ndarray:
    return np.cumsum(gaps.astype(np.int64) + 1) - 1


def ordered_key(bits: np.ndarray, is_float: bool, is_signed: bool) -> np.ndarray:
    """Map bit patterns to unsigned keys whose order is the numeric order.

    Floats are sign-magnitude: negative values are flipped so that one ulp up
    is +1 in key space, across zero too. Signed ints become offset binary.
    Steps of a few ulps then become small integers, which code in ~1-2 bits
    instead of the several bits their XOR costs.
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
