"""Write encoded records to a sink in file order, with bounded memory in flight.

Owns the data path of ``TensorSerializer``: each planned record is handed to the
hash/encrypt pool (``encode``) and written once its header is ready. Random-access
sinks (local files) take header and data from the writer threads at their offsets;
the others (S3 multipart, ``O_DIRECT``) get them appended in file order. At most
``4 x workers`` records, and ``INFLIGHT_COPY_BYTES`` of copies made for writing
(GPU -> host, non-contiguous, encryption), are in flight at once.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tensorstream.errors import SerializationError
from tensorstream.serialize.encode import PlannedRecord, copy_cost, host_view, submit_encode
from tensorstream.sources.base import Sink
from tensorstream.utils.progress import ByteProgress

__all__ = ["INFLIGHT_COPY_BYTES", "stream_records"]

#: Copies made for writing (GPU -> host, non-contiguous, encryption) stay under this.
INFLIGHT_COPY_BYTES = 256 << 20


def stream_records(
    records: list[PlannedRecord],
    *,
    sink: Sink,
    pool: ThreadPoolExecutor,
    io: ThreadPoolExecutor,
    workers: int,
    encryptor: Any,
    headers: list[bytes] | None,
    progress: bool,
) -> None:
    """Hash (and encrypt) ``records`` on ``pool``; write them in file order.

    Args:
        io: the writer threads of a random-access sink.
        workers: size of ``pool``; bounds the records in flight.
        headers: when not ``None``, each written tensor header is appended (manifest).
        progress: draw a progress bar.
    """
    # Random-access sinks take records from several threads at their offsets;
    # the others (S3, O_DIRECT) get them appended in file order.
    pwrite = getattr(sink, "pwrite", None)
    if not getattr(sink, "random_access", True):
        pwrite = None
    bar = ByteProgress(sum(r.layout.data_length for r in records), "serialize", enabled=progress)
    window: deque[tuple[PlannedRecord, Future[tuple[bytes, memoryview]], list[Future[Any]]]]
    window = deque()
    inflight_copy = 0
    lock = threading.Lock()

    def finish_oldest() -> None:
        nonlocal inflight_copy
        record, encoded, writes = window.popleft()
        header, payload = encoded.result()
        if headers is not None:
            headers.append(header)
        if pwrite is not None:
            writes.append(io.submit(pwrite, record.layout.header_offset, header))
            for w in writes:
                w.result()
        else:
            if sink.position != record.layout.header_offset:
                raise SerializationError(
                    f"internal layout error at tensor {record.pending.display_name!r}"
                )
            sink.write(header)
            sink.write(payload)
        if record.encrypted and encryptor is not None:
            encryptor.release(payload)  # written: its staging buffer is free
        with lock:
            inflight_copy -= copy_cost(record)
        bar.update(record.layout.data_length)

    try:
        for record in records:
            # the view keeps its host tensor alive until the record is written
            data = host_view(record)
            encoded = submit_encode(pool, encryptor, record, data)
            writes: list[Future[Any]] = []
            if pwrite is not None and record.layout.data_length and not record.encrypted:
                writes.append(io.submit(pwrite, record.layout.data_offset, data))
            elif pwrite is not None and record.encrypted:
                writes.append(
                    io.submit(
                        lambda f=encoded, off=record.layout.data_offset: pwrite(off, f.result()[1])
                    )
                )
            window.append((record, encoded, writes))
            with lock:
                inflight_copy += copy_cost(record)
            while window and (len(window) > 4 * workers or inflight_copy > INFLIGHT_COPY_BYTES):
                finish_oldest()
        while window:
            finish_oldest()
    finally:
        bar.close()
