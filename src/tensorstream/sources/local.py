"""Local files: positional reads for sources; temp file + fsync + rename for sinks.

A sink's temp file is locked while written, so a later writer of the same target
can tell the leftovers of a killed writer (``kill -9``) from a live one and remove
them; a failed write (a full disk) is a ``SourceError`` and leaves only the target's
previous content.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import tempfile
import threading
import time

from tensorstream.errors import (
    AccessDeniedError,
    SourceError,
    SourceNotFoundError,
    TruncatedFileError,
)
from tensorstream.sources import termination
from tensorstream.sources.base import Sink, Source, StorageOptions
from tensorstream.sources.fileobj import write_error
from tensorstream.sources.uri import ParsedURI

__all__ = ["LocalSink", "LocalSource", "pread_exact", "remove_stale_partials"]

_log = logging.getLogger("tensorstream.sources")

_WRITEBACK_EVERY = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():  # type: ignore[no-untyped-def]
    """libc's sync_file_range (Linux); Python's os module does not expose it."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def _open_error(path: str, exc: OSError, verb: str) -> SourceError:
    if isinstance(exc, FileNotFoundError):
        return SourceNotFoundError(f"no such file: {path}; check the path")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(f"permission denied {verb} {path}")
    if isinstance(exc, IsADirectoryError):
        return SourceError(f"{path} is a directory; give the path of a file inside it")
    if verb == "writing":
        return write_error(path, exc)
    return SourceError(f"cannot open {path} for {verb}: {exc}")


def pread_exact(fd: int, offset: int, buf: memoryview, display: str) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` (``preadv`` until done).

    Raises:
        SourceError: the read failed (EIO, ESTALE...), naming ``display`` and the offset.
        TruncatedFileError: the file ends before ``buf`` is full.
    """
    want = len(buf)
    done = 0
    while done < want:
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as exc:  # EIO from a failing disk, ESTALE on NFS...
            raise SourceError(
                f"reading {want} bytes at offset {offset + done} of {display} failed: "
                f"{exc.strerror or exc}; check the disk or mount"
            ) from exc
        if n == 0:
            raise TruncatedFileError(
                f"{display} ends at byte {offset + done}, expected {want - done} more "
                f"bytes (a read of {want} at offset {offset}); the file is truncated"
            )
        done += n


class LocalSource(Source):
    """A local file read with ``pread``; many readers share one descriptor."""

    def __init__(self, uri: ParsedURI, options: StorageOptions | None = None) -> None:
        self._path = uri.target
        self.display_uri = uri.target
        try:
            self._fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _open_error(self._path, exc, "reading") from exc
        info = os.fstat(self._fd)
        if stat.S_ISDIR(info.st_mode):  # open(2) accepts a directory; reading it fails
            os.close(self._fd)
            self._fd = -1
            raise _open_error(self._path, IsADirectoryError(self._path), "reading")
        self._size = info.st_size

    @property
    def size(self) -> int:
        return self._size

    @property
    def preferred_readers(self) -> int:
        return min(4, os.cpu_count() or 1)

    @property
    def local_path(self) -> str:
        return self._path

    @property
    def fileno(self) -> int:
        return self._fd

    def read_into(self, offset: int, buf: memoryview) -> None:
        pread_exact(self._fd, offset, buf, self._path)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


#: A partial whose PID runs again is still stale once unwritten for this long.
_STALE_AFTER = 600.0
_create_lock = threading.Lock()
_PARTIAL = re.compile(r"\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.partial")


def _lock_partial(fd: int) -> bool:
    """Take the exclusive lock that marks a temp file as being written (non-blocking)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def remove_stale_partials(target: str) -> list[str]:
    """Delete temp files that earlier, killed writers of ``target`` left behind.

    A writer names its temp file ``.<name>.<pid>.<random>.partial`` and holds an
    exclusive ``flock`` on it until it commits or aborts; the kernel drops the lock
    when the process dies, even of SIGKILL. A partial is removed only when its lock
    can be taken (no live writer holds it) and its writer cannot be between creating
    and locking it: the PID is not running, or is this process (whose sinks create
    and lock under one mutex), or the file was last written ``_STALE_AFTER`` seconds
    ago (the PID was reused, e.g. by a restarted container). Partials of other targets
    in the same directory never match the name.

    Returns:
        The paths removed (errors are ignored: cleaning up is best effort).
    """
    directory = os.path.dirname(target) or "."
    prefix = f".{os.path.basename(target)}"
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        match = _PARTIAL.fullmatch(name, len(prefix))
        if match is None:
            continue
        path = os.path.join(directory, name)
        pid = int(match["pid"])
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            age = time.time() - os.fstat(fd).st_mtime
            if pid != os.getpid() and _pid_alive(pid) and age < _STALE_AFTER:
                continue
            if _lock_partial(fd):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed:
        _log.info(
            "removed %d stale temp file(s) of %s left by killed writers", len(removed), target
        )
    return removed


class LocalSink(Sink):
    """Writes to a hidden temp file beside the target; ``commit`` fsyncs and renames.

    The temp file is ``.<name>.<pid>.<random>.partial``, locked with ``flock`` while
    it is written; opening a sink first removes the stale partials of the same target
    that killed writers left (see ``remove_stale_partials``). SIGTERM aborts it.
    """

    def __init__(self, uri: ParsedURI, options: StorageOptions | None = None) -> None:
        self._target = uri.target
        self.display_uri = uri.target
        self._done = True  # until the temp file exists: nothing to abort
        directory = os.path.dirname(self._target) or "."
        if os.path.isdir(self._target):
            raise SourceError(f"{self._target} is a directory; give a file path to write")
        try:
            os.makedirs(directory, exist_ok=True)
            with _create_lock:  # another thread's sink never sees our partial unlocked
                remove_stale_partials(self._target)
                fd, self._tmp = tempfile.mkstemp(
                    prefix=f".{os.path.basename(self._target)}.{os.getpid()}.",
                    suffix=".partial",
                    dir=directory,
                )
                _lock_partial(fd)  # held until the descriptor closes (commit, abort, death)
        except OSError as exc:
            raise _open_error(self._target, exc, "writing") from exc
        self._fd = fd
        self._pos = 0
        self._done = False
        self._mode = 0o666 & ~_umask()
        self._unflushed = 0
        termination.track(self)

    @property
    def position(self) -> int:
        return self._pos

    @property
    def fileno(self) -> int:
        return self._fd

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        size = len(view)
        try:
            while len(view):
                n = os.pwrite(self._fd, view, self._pos)
                self._pos += n
                view = view[n:]
        except OSError as exc:
            raise write_error(self._target, exc) from exc
        self._start_writeback(size)

    def pwrite(self, offset: int, data: memoryview | bytes) -> None:
        """Write at any offset (local files only); used by parallel writers."""
        view = memoryview(data).cast("B")
        size = len(view)
        try:
            while len(view):
                n = os.pwrite(self._fd, view, offset)
                offset += n
                view = view[n:]
        except OSError as exc:
            raise write_error(self._target, exc) from exc
        self._pos = max(self._pos, offset)
        self._start_writeback(size)

    def _start_writeback(self, nbytes: int) -> None:
        """Every few dozen MiB, ask the kernel to start writing back (without waiting),
        so the fsync at commit has only the tail left to flush."""
        self._unflushed += nbytes
        if self._unflushed >= _WRITEBACK_EVERY and _sync_file_range is not None:
            self._unflushed = 0
            _sync_file_range(self._fd, 0, 0, _SYNC_FILE_RANGE_WRITE)

    def patch(self, offset: int, data: bytes) -> None:
        self.pwrite(offset, data)

    def commit(self) -> None:
        if self._done:
            return
        try:
            os.fchmod(self._fd, self._mode)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self._tmp, self._target)
            dir_fd = os.open(os.path.dirname(self._target) or ".", os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            self.abort()
            # fsync reports a full disk too (delayed allocation): same message as write.
            raise write_error(self._target, exc) from exc
        except BaseException:
            self.abort()
            raise
        self._done = True
        termination.untrack(self)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        # Forget the descriptor before closing it: writer threads still running (abort
        # can come from a signal handler) then fail with EBADF instead of writing into
        # whatever file reuses the number.
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass
        termination.untrack(self)

    def set_mode(self, mode: int) -> None:
        """Restrict permissions before commit (key files use 0o600)."""
        try:
            os.fchmod(self._fd, mode)
        except OSError as exc:
            raise write_error(self._target, exc) from exc
        self._mode = mode

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abort()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
