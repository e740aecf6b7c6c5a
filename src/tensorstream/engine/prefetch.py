"""Start fetching a model's weights file before torch is imported.

``import torch`` is most of a cold start (1-5 s) and needs no weights, so ``LLM`` starts
the fetch first and lets it run beside the import and the model build. This module
imports neither torch nor the deserializer.

* Remote (``http(s)://``, ``s3://``): ranged reads of 32 MiB pieces into a memfd
  (anonymous shared memory), through the same ``Source`` the deserializer would use
  (retries, ``If-Match`` on the ETag). One reader runs while the caller imports torch;
  :meth:`Prefetch.boost` (or :meth:`Prefetch.take`) adds the rest. :meth:`Prefetch.take` hands back an :class:`ArenaSource`
  over it whose ``fileno``/``local_path`` make the deserializer map it as it maps a local
  file: tensors are zero-copy views, and the header checks, ``verify_hash`` and
  decryption run on those very bytes, unchanged.
* Local files: ``posix_fadvise(WILLNEED)`` of the file, so a cold page cache fills
  during the import; the deserializer then maps the file as usual.

Errors of the fetch are ``tensorstream.errors`` exceptions raised by :meth:`take`; any
other failure of the fetch machinery (no memfd, out of memory) makes ``take`` return
None so the caller loads the usual way. :meth:`close` stops and joins every thread.
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import sys
import threading
import time
from typing import Any

from tensorstream.errors import TensorStreamError
from tensorstream.sources.base import Source, StorageOptions
from tensorstream.sources.local import pread_exact

__all__ = ["ArenaSource", "Prefetch", "populate"]

logger = logging.getLogger(__name__)

#: Bytes one reader asks for between checks of the cancel flag.
_CHUNK = 8 << 20
#: Bytes per ranged request; readers take the next piece when done with one.
_PIECE = 32 << 20


class ArenaSource(Source):
    """A fetched object held in a memfd: read with ``pread``, mapped by ``fileno``."""

    def __init__(self, fd: int, size: int, display_uri: str) -> None:
        self._fd = fd
        self._size = size
        self.display_uri = display_uri

    @property
    def size(self) -> int:
        return self._size

    @property
    def preferred_readers(self) -> int:
        return min(4, os.cpu_count() or 1)

    @property
    def local_path(self) -> str:
        # The deserializer maps by ``fileno``; the path only tells it the bytes are local.
        return f"/proc/self/fd/{self._fd}"

    @property
    def fileno(self) -> int:
        return self._fd

    def read_into(self, offset: int, buf: memoryview) -> None:
        pread_exact(self._fd, offset, buf, self.display_uri)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Prefetch:
    """One weights file fetched on background threads, started at construction.

    Args:
        uri: the file the loader will read (path, ``file://``, ``http(s)://``, ``s3://``).
        storage: credentials and endpoints, as the loader would use them.
        readers: most parallel ranged reads for remote objects, once boosted; default
            the source's own count.
    """

    def __init__(
        self, uri: str, storage: StorageOptions | None = None, readers: int | None = None
    ) -> None:
        self.uri = uri
        self._storage = storage or StorageOptions()
        self._readers = readers
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self._source: ArenaSource | None = None
        self._lock = threading.Lock()
        self._boosted = False
        self._work: tuple[Source, mmap.mmap] | None = None
        self._helpers: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._pieces: Any = iter(())
        self._most = 1
        #: Wall time of the background fetch, once it has ended.
        self.fetch_seconds: float | None = None
        self._started = time.perf_counter()
        self._scheme = _scheme(uri)
        if self._scheme not in ("file", "http", "https", "s3") or (
            self._scheme != "file" and not hasattr(os, "memfd_create")
        ):
            self._thread: threading.Thread | None = None
            return
        if self._scheme != "file":
            # Imported here, not on the thread: two threads importing at once (torch on
            # the main one) can meet on the import locks.
            from tensorstream.sources.registry import SOURCES

            try:
                importlib.import_module(SOURCES[self._scheme][0].partition(":")[0])
            except ImportError:  # the loader reports the missing extra itself
                self._thread = None
                return
        self._thread = threading.Thread(target=self._run, name="tensorstream-prefetch", daemon=True)
        self._thread.start()

    @property
    def remote(self) -> bool:
        """Whether ``take`` can return fetched bytes (local files are only read ahead)."""
        return self._thread is not None and self._scheme != "file"

    def take(self) -> Source | None:
        """Wait for the fetch; the fetched object, or None to load from ``uri`` as usual.

        The caller owns (and closes) the returned source.

        Raises:
            TensorStreamError: the storage failed (missing object, access denied...),
                exactly as a load from ``uri`` would have.
        """
        if self._thread is None:
            return None
        self.boost()  # nothing else runs while the caller waits
        self._thread.join()
        if isinstance(self._error, TensorStreamError):
            raise self._error
        if self._error is not None:
            logger.debug("prefetch of %s failed (%r); loading directly", self.uri, self._error)
        source, self._source = self._source, None
        return source

    def close(self) -> None:
        """Stop the fetch, wait for its threads and free what it holds."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join()
        if self._source is not None:
            self._source.close()
            self._source = None

    def _run(self) -> None:
        try:
            if self._scheme == "file":
                _advise(self.uri)
            else:
                self._source = self._fetch()
        except BaseException as exc:  # delivered to the caller by take()
            self._error = exc
        finally:
            self.fetch_seconds = time.perf_counter() - self._started

    def _fetch(self) -> ArenaSource:
        from tensorstream.sources.registry import open_source

        with open_source(self.uri, self._storage) as remote:
            size = remote.size
            fd = os.memfd_create("tensorstream-prefetch", getattr(os, "MFD_CLOEXEC", 1))
            try:
                os.ftruncate(fd, size)
                if size:
                    self._fill(remote, fd, size)
                if self._cancel.is_set():
                    raise _Cancelled
                return ArenaSource(fd, size, remote.display_uri)
            except BaseException:
                os.close(fd)
                raise

    def _fill(self, remote: Source, fd: int, size: int) -> None:
        """This thread reads pieces until none is left; ``boost`` adds readers."""
        most = self._readers or max(1, remote.preferred_readers)
        piece = _PIECE if remote.supports_ranges else size
        self._pieces = iter([(at, min(size, at + piece)) for at in range(0, size, piece)])
        self._most = most if remote.supports_ranges else 1
        arena = mmap.mmap(fd, size)
        try:
            with self._lock:
                self._work = (remote, arena)
                if self._boosted:
                    self._add_readers()
            self._read_pieces(remote, arena)
        finally:
            with self._lock:
                self._work = None  # no reader joins from now on
                helpers = list(self._helpers)
            for helper in helpers:
                helper.join()
            try:
                arena.close()
            except BufferError:  # a view outlived its reader; the GC unmaps it later
                pass
        if self._errors:
            raise self._errors[0]

    def boost(self) -> None:
        """Fetch with all readers from now on (the caller's imports are done).

        Until then one reader fetches: more would each take the GIL from the import
        hundreds of times a second, which slowed ``import torch`` several-fold here.
        """
        with self._lock:
            self._boosted = True
            if self._work is not None:
                self._add_readers()

    def _add_readers(self) -> None:
        """Start the missing readers (caller holds ``_lock``, ``_work`` is set)."""
        remote, arena = self._work
        while len(self._helpers) + 1 < self._most:
            helper = threading.Thread(
                target=self._read_pieces,
                args=(remote, arena),
                name=f"tensorstream-prefetch-{len(self._helpers) + 1}",
                daemon=True,
            )
            self._helpers.append(helper)
            helper.start()

    def _next_piece(self) -> tuple[int, int] | None:
        with self._lock:
            if self._cancel.is_set():
                return None
            return next(self._pieces, None)

    def _read_pieces(self, remote: Source, arena: mmap.mmap) -> None:
        try:
            with memoryview(arena) as whole:
                while (piece := self._next_piece()) is not None:
                    start, end = piece
                    with remote.open_range(start, end) as reader:
                        pos = start
                        while pos < end and not self._cancel.is_set():
                            take = min(_CHUNK, end - pos)
                            with whole[pos : pos + take] as part:
                                reader.readinto_exact(part)
                            pos += take
        except BaseException as exc:
            self._errors.append(exc)
            self._cancel.set()  # the other readers stop: the load fails anyway


class _Cancelled(Exception):
    """The fetch was stopped by ``close()``; never seen by callers."""


def _scheme(uri: str) -> str:
    head, sep, _ = str(uri).partition("://")
    return head.lower() if sep else "file"


#: madvise(2) advice that maps a range's pages now (Linux >= 5.14).
_MADV_POPULATE_READ = 22


def populate(address: int, length: int) -> None:
    """Map the pages of ``[address, address + length)`` now instead of at first touch.

    Tensors that view a file mapping fault every page in on the first forward; done on
    the loader's thread, that work overlaps the model build instead. Best effort: older
    kernels and other systems simply skip it.
    """
    page = mmap.PAGESIZE
    start = address - address % page
    end = address + length
    if length <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        # ctypes releases the GIL for the call: the main thread keeps building.
        libc.madvise(start, end - start, _MADV_POPULATE_READ)
    except (OSError, AttributeError):
        pass


def _advise(uri: str) -> None:
    """Ask the kernel to read the file into the page cache (no-op when it is there)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    path = str(uri).removeprefix("file://")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # the loader reports a missing file with its own message
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
