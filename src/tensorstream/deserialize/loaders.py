"""The two load paths: CPU (page-cache views or arena tensors) and staged (devices).

Both take their inputs explicitly and report each finished tensor to a
``RecordPipeline``; neither holds state between calls.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tensorstream.deserialize.arena import ArenaAllocator
from tensorstream.deserialize.coldread import read_instead_of_map
from tensorstream.deserialize.fetch import Completion, run_readers
from tensorstream.deserialize.index import TensorRecord
from tensorstream.deserialize.pipeline import RecordPipeline
from tensorstream.deserialize.place import (
    FileMap,
    StagedCopier,
    byte_view,
    empty_for,
    staging_size,
)
from tensorstream.deserialize.plan import ReadRange, Segment, plan_ranges
from tensorstream.deserialize.prefault import populate, prefault_enabled
from tensorstream.sources.base import RangeReader, Source

__all__ = ["load_cpu", "load_staged"]

#: Staged pieces are whole 2 MiB encryption chunks, so they can be decrypted alone.
_QUANTUM = 2 << 20

log = logging.getLogger("tensorstream")


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def cpu_pool() -> ThreadPoolExecutor:
    """One shared pool for per-tensor CPU work (hashing, decryption)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="tensorstream-cpu")
        return _POOL


def load_cpu(
    source: Source,
    records: Sequence[TensorRecord],
    readers: int,
    pipeline: RecordPipeline,
    fmap: FileMap | None,
    verify: bool | str,
    progress: Callable[[int], None],
    into: Mapping[Any, torch.Tensor] | None = None,
    cold_readers: int | None = None,
) -> None:
    """Load into CPU memory: views of ``fmap`` where possible, arena tensors otherwise,
    and the caller's own tensors for the keys of ``into`` (``deserialize/inplace.py``).

    With ``verify``, every tensor is read into arena memory and the hash is checked
    on that copy, so what the caller gets is exactly what was verified: a later
    rewrite or truncation of the file cannot change (or SIGBUS) the tensors.

    Without it, a file mostly absent from the page cache is read into arena memory by
    the ``readers`` too, rather than viewed (``coldread``): the disk reads then run on
    the reader threads instead of faulting in on the caller's first touch. Such a read
    runs ``cold_readers`` readers where given (the caller left the count open: the disk,
    not the cores, sets what pays, ``readercount.COLD_READERS``).
    """
    alloc = ArenaAllocator()
    try:
        if fmap is not None and pipeline.decryptor is not None:
            _decrypt_from_map(records, pipeline, fmap, verify, progress, alloc, into or {})
            return
        reading_cold = max(readers, cold_readers or 0)
        if verify:
            fmap = None  # copies, not views: the verified bytes must be the returned ones
        elif fmap is not None and _cold(source, records, fmap, reading_cold):
            fmap, readers = None, reading_cold
        _load_cpu(source, records, readers, pipeline, fmap, verify, progress, alloc, into or {})
    finally:
        alloc.close()


def _cold(source: Source, records: Sequence[TensorRecord], fmap: FileMap, readers: int) -> bool:
    fd = getattr(source, "fileno", None)
    fd = fd if isinstance(fd, int) else None
    return read_instead_of_map(fd, records, source.display_uri, readers, fmap.mapping)


def _destination(
    r: TensorRecord, into: Mapping[Any, torch.Tensor], alloc: ArenaAllocator
) -> torch.Tensor:
    """Where a tensor that is not a page-cache view goes: the caller's own tensor
    (``into``), zeros for a meta tensor, else fresh arena memory."""
    if r.key in into:
        return into[r.key].zero_() if r.is_meta else into[r.key]
    if r.is_meta:
        return torch.zeros(r.shape, dtype=r.dtype)
    return alloc.empty(r.dtype, r.shape)


def _load_cpu(
    source: Source,
    records: Sequence[TensorRecord],
    readers: int,
    pipeline: RecordPipeline,
    fmap: FileMap | None,
    verify: bool | str,
    progress: Callable[[int], None],
    alloc: ArenaAllocator,
    into: Mapping[Any, torch.Tensor],
) -> None:
    viewable = [
        fmap is not None and not r.is_meta and r.key not in into and fmap.can_view(r)
        for r in records
    ]
    alloc.reserve(
        [
            r.data_length
            for r, v in zip(records, viewable, strict=True)
            if not v and r.key not in into
        ]
    )
    views: dict[int, torch.Tensor] = {}
    dests: list[torch.Tensor | None] = []
    headers: list[bytearray | None] = []
    for i, r in enumerate(records):
        if viewable[i]:
            assert fmap is not None
            views[i] = fmap.tensor(r)
            dests.append(None)
        else:
            dests.append(_destination(r, into, alloc))
        headers.append(bytearray(r.header_size) if r.header_size and fmap is None else None)
    data_views = [byte_view(d) if d is not None else None for d in dests]
    # fresh memory the readers fill: fault each segment in with one call first (prefault)
    fresh = [d.data_ptr() if d is not None and d.numel() else 0 for d in dests]
    populate_fresh = prefault_enabled()
    log.debug(
        "%s: %d bytes viewed in place, %d read into arenas by up to %d readers",
        source.display_uri,
        sum(r.data_length for i, r in enumerate(records) if i in views),
        sum(r.data_length for i, r in enumerate(records) if dests[i] is not None),
        readers,
    )

    def route(seg: Segment) -> memoryview | None:
        if seg.part == "header":
            buf = headers[seg.record]
            return None if buf is None else memoryview(buf)[seg.dest_offset :][: seg.length]
        view = data_views[seg.record]
        if view is None:  # mapped: ask for read-ahead; the page cache is the tensor
            assert fmap is not None
            fmap.prefetch(seg.offset, seg.length)
            return None
        if populate_fresh and fresh[seg.record]:
            populate(fresh[seg.record] + seg.dest_offset, seg.length)
        return view[seg.dest_offset : seg.dest_offset + seg.length]

    def on_complete(i: int) -> None:
        r = records[i]
        header: Any = headers[i]
        if fmap is not None and r.header_size:
            header = fmap.bytes_at(r.header_offset, r.header_size)
        if i in views:
            assert fmap is not None
            tensor, data = views[i], fmap.bytes_at(r.data_offset, r.data_length)
        else:
            tensor, data = dests[i], data_views[i]  # type: ignore[assignment]
        if not r.is_meta:
            pipeline.process(r, header, data, verify)  # type: ignore[arg-type]
        pipeline.finish(r, tensor)  # type: ignore[arg-type]

    to_read = [i for i, r in enumerate(records) if data_views[i] is not None and r.data_length]
    if fmap is not None and records and not to_read:
        # Every tensor is a view of the page cache: nothing to read, only read-ahead to
        # ask for, then the per-tensor header checks, cheaper inline than on threads.
        start, end = records[0].header_offset, max(r.end for r in records)
        fmap.prefetch(start, end - start)
        for i in sorted(range(len(records)), key=lambda i: -records[i].data_length):
            on_complete(i)
        progress(sum(r.data_length for r in records))
        return

    has_headers = pipeline.index.has_headers
    remaining = [(r.header_size if has_headers else 0) + r.data_length for r in records]
    plan = plan_ranges(records, readers, split_records=True)
    completion = Completion(remaining, on_complete, cpu_pool())
    completion.fire_empty()
    run_readers(source, plan, route, completion, progress)


def _decrypt_from_map(
    records: Sequence[TensorRecord],
    pipeline: RecordPipeline,
    fmap: FileMap,
    verify: bool | str,
    progress: Callable[[int], None],
    alloc: ArenaAllocator,
    into: Mapping[Any, torch.Tensor],
) -> None:
    """Decrypt each tensor out of the file mapping into arena memory (or ``into``).

    libsodium reads the ciphertext from the page cache and writes the plaintext once,
    where reading into the tensor and then decrypting it in place touches every byte
    twice. Tensors run biggest first, one per pool thread, their 2 MiB chunks spread
    over the crypto pool; each one's pages are unmapped once done, so resident memory
    stays near the model's size.
    """
    if records:
        start, end = records[0].header_offset, max(r.end for r in records)
        fmap.prefetch(start, end - start)  # read-ahead when the file is not cached

    failed = threading.Event()
    order = sorted(records, key=lambda r: -r.data_length)
    # Carved here, on one thread, in the order the pool takes them.
    alloc.reserve([r.data_length for r in order if not r.is_meta and r.key not in into])
    dests = {r.header_offset: _destination(r, into, alloc) for r in order}

    def one(r: TensorRecord) -> None:
        if failed.is_set():  # a wrong key fails every tensor: stop at the first
            return
        dest = dests[r.header_offset]
        if r.is_meta:
            pipeline.finish(r, dest)
            return
        header = fmap.bytes_at(r.header_offset, r.header_size) if r.header_size else None
        ciphertext = fmap.bytes_at(r.data_offset, r.data_length) if r.data_length else None
        try:
            pipeline.process(r, header, byte_view(dest), verify, ciphertext=ciphertext)
        except BaseException:
            failed.set()
            raise
        finally:
            fmap.release(r.data_offset, r.data_length)
        pipeline.finish(r, dest)
        progress(r.data_length)

    futures = [(r, cpu_pool().submit(one, r)) for r in order]
    errors: list[tuple[int, BaseException]] = []
    for r, future in futures:  # all finish before raising: none may write into freed memory
        try:
            future.result()
        except BaseException as exc:
            errors.append((r.header_offset, exc))
    if errors:
        raise min(errors, key=lambda e: e[0])[1]  # the first failing tensor in the file


def load_staged(
    source: Source,
    records: Sequence[TensorRecord],
    readers: int,
    pipeline: RecordPipeline,
    device: torch.device,
    verify: bool,
    progress: Callable[[int], None],
    staging_limit: int,
) -> None:
    """Load onto ``device`` through double-buffered (pinned) staging, one stream per reader.

    With hashing or decryption every tensor is read by one reader, so its staged
    pieces pass through the host in order.
    """
    dests = [
        torch.zeros(r.shape, dtype=r.dtype, device=device) if r.is_meta else empty_for(r, device)
        for r in records
    ]
    headers = [bytearray(r.header_size) for r in records]
    on_host = verify or pipeline.decryptor is not None
    plan = plan_ranges(records, readers, split_records=not on_host)
    staging = staging_size(plan, staging_limit, _QUANTUM)
    errors: list[BaseException] = []

    def reader(ranges: Sequence[ReadRange]) -> None:
        copier = StagedCopier(device, staging)
        try:
            for rng in ranges:
                with source.open_range(rng.start, rng.end) as stream:
                    pos = rng.start
                    for seg in rng.segments:
                        if errors:
                            return
                        if seg.offset > pos:
                            stream.skip(seg.offset - pos)
                        pos = seg.offset + seg.length
                        if seg.part == "header":
                            stream.readinto_exact(memoryview(headers[seg.record]))
                            continue
                        _stage_segment(
                            stream,
                            copier,
                            records[seg.record],
                            seg,
                            headers[seg.record],
                            dests[seg.record],
                            pipeline,
                            on_host,
                            verify,
                            progress,
                        )
            copier.finish()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(rs,), daemon=True) for rs in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for r, dest, header in zip(records, dests, headers, strict=True):
        if not r.data_length:
            # meta and empty tensors stream no data: check (and verify) their header here
            pipeline.process(r, header, memoryview(b""), verify)
        elif not on_host:
            pipeline.check(r, header if r.header_size else None)
        pipeline.finish(r, dest)


def _stage_segment(
    stream: RangeReader,
    copier: StagedCopier,
    record: TensorRecord,
    seg: Segment,
    header: bytearray,
    dest: torch.Tensor,
    pipeline: RecordPipeline,
    on_host: bool,
    verify: bool,
    progress: Callable[[int], None],
) -> None:
    parsed = pipeline.check(record, header) if on_host and seg.dest_offset == 0 else None
    check = pipeline.hash_check(record, parsed, header) if parsed is not None and verify else None
    done = 0
    while done < seg.length:
        i, buf = copier.next_buffer()
        n = min(len(buf), seg.length - done)
        piece = buf[:n]
        stream.readinto_exact(piece)
        if parsed is not None and pipeline.decryptor is not None:
            pipeline.decryptor.decrypt_piece(record, parsed, piece, seg.dest_offset + done)
        if check is not None:
            check.update(piece)
        copier.copy_out(i, n, dest, seg.dest_offset + done)
        done += n
        progress(n)
    if check is not None:
        pipeline.finish_check(record, check)
