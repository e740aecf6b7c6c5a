"""Reader threads: stream planned byte ranges straight into destination memory.

Each reader owns a list of ranges and walks each with one sequential stream (one
HTTP/S3 request per range; ``pread`` for local files). Every segment lands in the
memory a ``route`` function names for it, so tensor bytes are never copied through
an intermediate buffer. When a record's last byte arrives, ``on_complete`` runs on
the CPU pool (header checks, decryption, hashing) while the readers keep reading.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from tensorstream.deserialize.plan import ReadRange, Segment
from tensorstream.sources.base import Source

__all__ = ["Completion", "run_readers"]

#: route(segment) -> memory to fill, or None when the segment needs no reading
Route = Callable[[Segment], "memoryview | None"]


class Completion:
    """Counts bytes per record and fires a callback once a record is whole."""

    def __init__(
        self,
        remaining: Sequence[int],
        on_complete: Callable[[int], None],
        pool: ThreadPoolExecutor,
    ) -> None:
        self._remaining = list(remaining)
        self._on_complete = on_complete
        self._pool = pool
        self._lock = threading.Lock()
        self.futures: list[Future[None]] = []

    def add(self, record: int, nbytes: int) -> None:
        with self._lock:
            self._remaining[record] -= nbytes
            done = self._remaining[record] == 0
        if done:
            future = self._pool.submit(self._on_complete, record)
            with self._lock:
                self.futures.append(future)

    def fire_empty(self) -> None:
        """Records with nothing to read (meta tensors, empty tensors) complete at once."""
        for i, left in enumerate(self._remaining):
            if left == 0:
                self.futures.append(self._pool.submit(self._on_complete, i))

    def wait(self) -> None:
        while True:
            with self._lock:
                pending = [f for f in self.futures if not f.done()]
            if not pending:
                break
            wait(pending)
        for f in list(self.futures):
            f.result()


def _read_ranges(
    source: Source,
    ranges: Sequence[ReadRange],
    route: Route,
    completion: Completion,
    progress: Callable[[int], None],
    stop: threading.Event,
) -> int:
    done = 0
    for rng in ranges:
        with source.open_range(rng.start, rng.end) as stream:
            pos = rng.start
            for seg in rng.segments:
                if stop.is_set():
                    return done
                dest = route(seg)
                if seg.offset > pos:
                    stream.skip(seg.offset - pos)
                if dest is not None:
                    stream.readinto_exact(dest)
                    done += seg.length
                else:
                    stream.skip(seg.length)
                pos = seg.offset + seg.length
                completion.add(seg.record, seg.length)
                progress(seg.length)
    return done


def run_readers(
    source: Source,
    plan: Sequence[Sequence[ReadRange]],
    route: Route,
    completion: Completion,
    progress: Callable[[int], None] = lambda n: None,
) -> int:
    """Run one thread per planned reader; return the bytes read.

    The first error stops the other readers at their next segment and is raised.
    """
    stop = threading.Event()
    if not plan:
        completion.wait()
        return 0
    with ThreadPoolExecutor(len(plan), thread_name_prefix="tensorstream-read") as readers:
        futures = [
            readers.submit(_read_ranges, source, ranges, route, completion, progress, stop)
            for ranges in plan
        ]
        try:
            total = 0
            for f in futures:
                total += f.result()
        except BaseException:
            stop.set()
            raise
    completion.wait()
    return total
