"""The every-byte pass that ends each timed load, and the checksum it yields.

A loader that only maps a file (safetensors) or hands back views has not moved any bytes
yet, so every load case reads every byte of every tensor once inside the timed region. The
pass sums each tensor's bytes as int64 words (wrapping) on one thread: ~11 GB/s on the
2-vCPU dev VM, where a ``uint8`` sum runs at 0.5 GB/s and ``zlib.crc32`` at 2 GB/s, so it does
not dominate any loader's time. One thread, because torch's two-thread reduction there swung
between 20 and 1.1 GB/s from one process to the next whenever another process held a core
(each reduction's barrier then waits out a scheduler time slice). Its standalone speed on resident
memory is measured by the ``touch-resident`` case and reported beside the loaders.

Sums are exact modulo 2**64 whatever the reduction order, so two loaders that return the
same bytes get the same checksum.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["TouchResult", "touch_all"]


class TouchResult:
    """What the pass saw: tensor count, bytes, checksum, and tensors that needed a copy."""

    __slots__ = ("bytes", "checksum", "copied", "tensors")

    def __init__(self, tensors: int, nbytes: int, checksum: str, copied: int) -> None:
        self.tensors = tensors
        self.bytes = nbytes
        self.checksum = checksum
        self.copied = copied


def _word_sum(t: torch.Tensor) -> tuple[int, int, bool]:
    """(sum of int64 words mod 2**64, byte count, whether a copy was needed)."""
    import torch

    flat = t.detach().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    n = raw.numel()
    if not n % 8 and not raw.data_ptr() % 8:
        return int(raw.view(torch.int64).sum()) & (2**64 - 1), n, False
    # Words counted from the tensor's first byte, zero-padded at its end, so the sum does
    # not depend on where the loader placed it: through a small scratch buffer that stays
    # in cache, a piece at a time. (A whole padded copy into new memory cost the 49 views
    # at 2-byte offsets of a 1 GiB tensorizer file 0.14 s of fresh-page faults that no user
    # of those views pays: touch 0.25 s against 0.10 for tensorizer's own tensors.)
    scratch = _scratch()
    total = 0
    for start in range(0, n, scratch.numel()):
        piece = raw[start : start + scratch.numel()]
        words = -(-piece.numel() // 8) * 8
        scratch[piece.numel() : words] = 0
        scratch[: piece.numel()].copy_(piece)
        total += int(scratch[:words].view(torch.int64).sum())
    return total & (2**64 - 1), n, True


@functools.cache
def _scratch() -> torch.Tensor:
    """1 MiB of word-aligned bytes, made once per process (fits a core's L2)."""
    import torch

    return torch.zeros(2**20, dtype=torch.uint8)


def touch_all(tensors: Iterable[tuple[str, torch.Tensor]]) -> TouchResult:
    """Read every byte of every tensor once and checksum the lot.

    Args:
        tensors: (name, CPU tensor) pairs, in any order.

    Returns:
        Count, total bytes, a 16-hex-digit checksum over (name, bytes, word sum) sorted by
        name, and how many tensors needed an aligned copy.
    """
    import torch

    rows = []
    nbytes = copied = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, t in tensors:
            s, n, c = _word_sum(t)
            rows.append(f"{name}:{n}:{s:016x}")
            nbytes += n
            copied += c
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()[:16]
    return TouchResult(len(rows), nbytes, digest, copied)
