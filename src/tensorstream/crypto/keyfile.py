"""Key files: a raw 32-byte key stored at any sink/source URI; local files get mode 0600.

The file holds exactly the 32 key bytes (what ``EncryptionParams.random().key``
gives). For keys made by hand, a file with 64 hexadecimal digits (optionally
followed by a newline, e.g. ``openssl rand -hex 32 > model.key``) is read too.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import TYPE_CHECKING

from tensorstream.crypto.kdf import KEY_BYTES
from tensorstream.errors import ConfigError

if TYPE_CHECKING:
    from tensorstream.sources.base import StorageOptions

__all__ = ["read_keyfile", "write_keyfile"]

_log = logging.getLogger(__name__)
_MAX_KEYFILE = 4096


def write_keyfile(
    uri: str | os.PathLike[str], key: bytes, options: StorageOptions | None = None
) -> None:
    """Store ``key`` at ``uri`` atomically (local paths: mode 0600, temp file + rename).

    Args:
        uri: a local path, ``file://`` or ``s3://`` URI.
        key: the 32-byte key.
        options: how to reach remote storage (credentials, endpoint).

    Raises:
        ConfigError: the key is not 32 bytes.
        SourceError: the location cannot be written.

    Example:
        >>> write_keyfile("/tmp/model.key", EncryptionParams.random().key)  # doctest: +SKIP
    """
    from tensorstream.sources import open_sink

    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise ConfigError(f"refusing to write {uri}: a key must be exactly {KEY_BYTES} bytes")
    with open_sink(uri, options) as sink:
        set_mode = getattr(sink, "set_mode", None)
        if set_mode is not None:  # local files; object stores have no POSIX mode
            set_mode(0o600)
        sink.write(bytes(key))


def read_keyfile(uri: str | os.PathLike[str], options: StorageOptions | None = None) -> bytes:
    """Load the 32-byte key stored at ``uri``.

    Args:
        uri: a local path, ``file://``, ``http(s)://`` or ``s3://`` URI.
        options: how to reach remote storage (credentials, endpoint).

    Returns:
        The raw key bytes.

    Raises:
        ConfigError: the file is not 32 raw bytes nor 64 hex digits (names the file).
        SourceError: the location cannot be read (``SourceNotFoundError`` if missing).
    """
    from tensorstream.sources import open_source

    with open_source(uri, options) as source:
        size = source.size
        name = source.display_uri
        if size > _MAX_KEYFILE:
            raise ConfigError(
                f"{name} is {size} bytes, not a key file: a key file holds exactly "
                f"{KEY_BYTES} raw bytes (or {2 * KEY_BYTES} hex digits)"
            )
        data = source.read(0, size)
        local = source.local_path
    key = _parse(data)
    if key is None:
        raise ConfigError(
            f"{name} is {size} bytes, not a key file: a key file holds exactly {KEY_BYTES} "
            f"raw bytes (or {2 * KEY_BYTES} hex digits); write one with write_keyfile()"
        )
    if local is not None:
        _warn_if_shared(local)
    return key


def _parse(data: bytes) -> bytes | None:
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
    return None


def _warn_if_shared(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        _log.warning(
            "key file %s is readable by other users (mode %o); run: chmod 600 %s",
            path,
            stat.S_IMODE(mode),
            path,
        )
