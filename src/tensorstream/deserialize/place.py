"""Where loaded bytes live: a private map of the page cache, fresh CPU tensors, or
device tensors filled through pinned staging buffers with overlapping copies.

Fresh CPU memory for CPU loads comes from ``arena.ArenaAllocator``; ``empty_for``
stays the allocator of device loads (and their pinned staging keeps its own)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence

import torch

from tensorstream.deserialize.index import TensorRecord
from tensorstream.deserialize.plan import ReadRange
from tensorstream.sources.base import Source

__all__ = ["FileMap", "StagedCopier", "byte_view", "empty_for", "staging_size"]

_PAGE = mmap.PAGESIZE


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous CPU tensor's memory."""
    if t.numel() == 0:
        return memoryview(bytearray())
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def empty_for(record: TensorRecord, device: torch.device, pin: bool = False) -> torch.Tensor:
    return torch.empty(record.shape, dtype=record.dtype, device=device, pin_memory=pin)


class FileMap:
    """A copy-on-write private mapping of a local file, shared by the tensors viewing it.

    Tensors are views of the page cache: no fresh memory, no copy. Writes to them stay
    private to this process. Each tensor's storage covers exactly its own bytes (so
    ``torch.save`` of one tensor writes only that tensor) and holds a reference to the
    mapping, which lives as long as any tensor uses it.
    """

    def __init__(self, source: Source) -> None:
        fileno = getattr(source, "fileno", None)
        fd = fileno if isinstance(fileno, int) else os.open(source.local_path, os.O_RDONLY)
        self._map = mmap.mmap(
            fd, source.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        if fd is not fileno:
            os.close(fd)
        self._viewed = 0
        self._viewed_lock = threading.Lock()

    @property
    def mapping(self) -> mmap.mmap:
        """The mapping itself (for ``mincore``: page-cache residency of its pages)."""
        return self._map

    @property
    def viewed_bytes(self) -> int:
        """Bytes handed out as views of the mapping (not read: the page cache is shared)."""
        return self._viewed

    @staticmethod
    def can_view(record: TensorRecord) -> bool:
        """Torch needs element-aligned storage offsets to view the bytes in place."""
        return record.data_offset % max(1, record.dtype.itemsize) == 0

    def tensor(self, record: TensorRecord) -> torch.Tensor:
        """A zero-copy tensor over the record's bytes, with a storage of exactly them.

        ``frombuffer`` with ``offset``/``count`` makes a storage that starts and ends at
        the tensor (slicing one whole-file tensor would share the file-sized storage).
        """
        if not record.data_length:
            return torch.empty(record.shape, dtype=record.dtype)
        raw = torch.frombuffer(
            self._map, dtype=torch.uint8, count=record.data_length, offset=record.data_offset
        )
        with self._viewed_lock:
            self._viewed += record.data_length
        return raw.view(record.dtype).reshape(record.shape)

    def bytes_at(self, offset: int, length: int) -> memoryview:
        return memoryview(self._map)[offset : offset + length]

    def prefetch(self, offset: int, length: int) -> None:
        """Start reading the range into the page cache without waiting (MADV_WILLNEED).

        Costs nothing when the file is cached and keeps a mapped load of a cold file
        parallel. Populating the views instead (``MADV_POPULATE_READ`` in 8 MiB pieces
        on the reader threads, so the caller's first touch finds the pages mapped) was
        measured for issue #12 (docs/benchmarks.md, 1 GiB, warm, load + touch, medians
        of 3 per run): on our own file, every tensor a view, 6.19 / 5.93 GB/s against
        15.88 / 12.67 with this hint (the load took 0.115 s instead of 0.02 and the
        touch pass 0.05 s either way: first access maps this file's large folios
        cheaply); on tensorizer's file, where the readers copy the unaligned half
        anyway, 2.15 / 2.31 / 2.29 against 2.08 / 2.00 / 2.26 in three runs, every
        range overlapping, and 44-103 MiB more peak RSS. An earlier single-thread try
        saved nothing either (56 ms per 265 MB). So no populating: this hint only.
        """
        if length <= 0:
            return
        start = offset - offset % _PAGE
        self._map.madvise(mmap.MADV_WILLNEED, start, offset + length - start)

    def release(self, offset: int, length: int) -> None:
        """Unmap the whole pages inside a range already copied out (MADV_DONTNEED).

        The file stays in the page cache; only this process stops counting those
        pages as resident, so a load that decrypts out of the mapping peaks at the
        size of the model, not twice it. A page touched again simply maps back in.
        """
        start = -(-offset // _PAGE) * _PAGE
        end = (offset + length) // _PAGE * _PAGE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


class StagedCopier:
    """Per-reader double-buffered staging for device targets.

    Bytes are read into one pinned host buffer while the previous one is copied to the
    device asynchronously on the reader's own stream; a buffer is reused only after its
    copy has finished. Written device-agnostic; on CPU it degrades to plain copies.
    """

    def __init__(self, device: torch.device, size: int) -> None:
        self.device = device
        accel = device.type != "cpu"
        self._module = getattr(torch, device.type) if accel else None
        pin = accel and torch.cuda.is_available() if device.type == "cuda" else False
        self.buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.views = [byte_view(b) for b in self.buffers]
        self.events: list[object | None] = [None, None]
        self.stream = self._module.Stream(device) if self._module is not None else None
        self.turn = 0
        self.size = size

    def next_buffer(self) -> tuple[int, memoryview]:
        i = self.turn
        self.turn ^= 1
        event = self.events[i]
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
            self.events[i] = None
        return i, self.views[i]

    def copy_out(self, i: int, n: int, dest: torch.Tensor, dest_offset: int) -> None:
        """Copy ``n`` staged bytes into ``dest``'s bytes at ``dest_offset``."""
        target = dest.reshape(-1).view(torch.uint8)[dest_offset : dest_offset + n]
        src = self.buffers[i][:n]
        if self.stream is None:
            target.copy_(src)
            return
        with self._module.stream(self.stream):  # type: ignore[union-attr]
            target.copy_(src, non_blocking=True)
            event = self._module.Event()  # type: ignore[union-attr]
            event.record(self.stream)
        self.events[i] = event

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def staging_size(plan: Sequence[Sequence[ReadRange]], limit: int, quantum: int) -> int:
    """Buffer size: no larger than the biggest range, a multiple of ``quantum``."""
    largest = max((r.size for ranges in plan for r in ranges), default=quantum)
    size = min(limit, largest)
    return max(quantum, -(-size // quantum) * quantum)
