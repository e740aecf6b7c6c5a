"""Local files: positional reads for sources; temp file + fsync + rename for sinks."""

from __future__ import annotations

import os
import tempfile

from tensorstream.errors import (
    AccessDeniedError,
    SourceError,
    SourceNotFoundError,
    TruncatedFileError,
)
from tensorstream.sources.base import Sink, Source, StorageOptions
from tensorstream.sources.uri import ParsedURI

__all__ = ["LocalSink", "LocalSource"]

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
    return SourceError(f"cannot {verb} {path}: {exc}")


class LocalSource(Source):
    """A local file read with ``pread``; many readers share one descriptor."""

    def __init__(self, uri: ParsedURI, options: StorageOptions | None = None) -> None:
        self._path = uri.target
        self.display_uri = uri.target
        try:
            self._fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _open_error(self._path, exc, "reading") from exc
        self._size = os.fstat(self._fd).st_size

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
        want = len(buf)
        done = 0
        while done < want:
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n == 0:
                raise TruncatedFileError(
                    f"{self._path} ends at byte {offset + done}, expected {want - done} more "
                    f"bytes (a read of {want} at offset {offset}); the file is truncated"
                )
            done += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalSink(Sink):
    """Writes to a hidden temp file beside the target; ``commit`` fsyncs and renames."""

    def __init__(self, uri: ParsedURI, options: StorageOptions | None = None) -> None:
        self._target = uri.target
        self.display_uri = uri.target
        directory = os.path.dirname(self._target) or "."
        if os.path.isdir(self._target):
            raise SourceError(f"{self._target} is a directory; give a file path to write")
        try:
            os.makedirs(directory, exist_ok=True)
            fd, self._tmp = tempfile.mkstemp(
                prefix=f".{os.path.basename(self._target)}.", suffix=".partial", dir=directory
            )
        except OSError as exc:
            raise _open_error(self._target, exc, "writing") from exc
        self._fd = fd
        self._pos = 0
        self._done = False
        self._mode = 0o666 & ~_umask()
        self._unflushed = 0

    @property
    def position(self) -> int:
        return self._pos

    @property
    def fileno(self) -> int:
        return self._fd

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(self._fd, view, self._pos)
            self._pos += n
            view = view[n:]
        self._start_writeback(len(data))

    def pwrite(self, offset: int, data: memoryview | bytes) -> None:
        """Write at any offset (local files only); used by parallel writers."""
        view = memoryview(data).cast("B")
        size = len(view)
        while len(view):
            n = os.pwrite(self._fd, view, offset)
            offset += n
            view = view[n:]
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
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass

    def set_mode(self, mode: int) -> None:
        """Restrict permissions before commit (key files use 0o600)."""
        os.fchmod(self._fd, mode)
        self._mode = mode

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self.abort()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
