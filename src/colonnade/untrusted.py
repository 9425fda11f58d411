"""Decompressing bytes from strangers (rollout batches, patches) within a stated bound.

One place for zstandard's trap: it allocates the output size a frame
declares, whatever `max_output_size` says, so a frame of a few bytes that
declares 2^61 bytes raised MemoryError and one declaring a few GB was a
memory bomb. The declared size is checked first; the bound still holds for
frames that declare none.
"""

from __future__ import annotations

import zstandard


def decompress(data: bytes, limit: int, require_size: bool = False) -> bytes:
    """`data` decompressed to at most `limit` bytes, or ValueError saying why.

    `require_size`: refuse frames that do not declare their size.
    """
    try:
        declared = zstandard.frame_content_size(data)
        if declared < 0 and require_size:
            raise ValueError("zstd frame declares no size")
        if declared > limit:
            raise ValueError(f"zstd frame declares {declared} bytes, more than the {limit} allowed")
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None
    except MemoryError:  # what is left of the trap: a declared size under the limit
        raise ValueError(f"zstd frame declares {declared} bytes, too many to allocate") from None
