"""One contiguous tensor over several page-aligned ranges of a file, without a copy.

vLLM fuses q/k/v (and gate/up) into one parameter; in a ``.tensors`` file they are
separate tensors with headers between them. When each part starts on a page and every
part but the last is whole pages long, the parts' pages can be mapped one after another
into one reserved range of address space (``MAP_FIXED`` over a ``PROT_NONE``
reservation): a contiguous view of the page cache, with no fresh memory and no copy.
Our writer page-aligns tensors of 64 KiB or more for this
(:func:`tensorstream.serialize.layout.data_alignment`).

Private (copy-on-write), like :class:`~tensorstream.deserialize.place.FileMap`'s views:
writing the tensor never writes the file. The tensor's storage is exactly its bytes and
holds the mapping; the whole range is unmapped when the storage is freed. Linux only;
anything unexpected gives ``None`` and the caller copies instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import sys
import weakref
from collections.abc import Sequence

import torch

__all__ = ["stitch", "stitchable"]

log = logging.getLogger("tensorstream")

#: This machine's page size: what mappings are made of. Our writer page-aligns to 4 KiB,
#: so on a kernel with larger pages the parts are read instead.
_PAGE = mmap.PAGESIZE
# Linux's values; Python's mmap module exports neither
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value


def stitchable(ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether ``(offset, length)`` file ranges can be mapped side by side: every one
    starts on a page, and every one but the last is whole pages long."""
    return (
        bool(ranges)
        and all(length > 0 and offset % _PAGE == 0 for offset, length in ranges)
        and all(length % _PAGE == 0 for _, length in ranges[:-1])
    )


@functools.cache  # one lookup per process, not one per fused parameter
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def stitch(fd: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor | None:
    """The bytes of ``ranges`` of the open file ``fd``, in order, as one contiguous
    ``uint8`` tensor mapped from the page cache; ``None`` if they are not
    :func:`stitchable` or the mapping fails (the caller copies them instead)."""
    libc = _libc() if stitchable(ranges) else None
    if libc is None:
        return None
    total = sum(length for _, length in ranges)
    span = -(-total // _PAGE) * _PAGE
    base = libc.mmap(None, span, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, _MAP_FAILED):
        return None
    at = base
    for offset, length in ranges:
        got = libc.mmap(
            at,
            length,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_PRIVATE | _MAP_FIXED,
            fd,
            offset,
        )
        if got != at:
            log.debug("stitch: mapping %d bytes at file offset %d failed", length, offset)
            libc.munmap(base, span)
            return None
        at += length
    window = (ctypes.c_ubyte * total).from_address(base)
    # torch.frombuffer keeps ``window`` alive as long as the storage: unmap after both
    weakref.finalize(window, libc.munmap, base, span)
    return torch.frombuffer(window, dtype=torch.uint8)
