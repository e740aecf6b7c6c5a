"""tensorizer's ``stream_io``: ``open_stream`` and ``CAInfo`` over tensorstream's sources.

``open_stream(path_uri, mode, ...)`` returns a file-like object: a plain ``open()``
file for local paths, a seekable reader over an ``http(s)://`` or ``s3://`` source
(ranged reads, no curl subprocess), or a writer over an S3 multipart sink that
uploads on ``close()``. Readers and writers handed to this package's
``TensorDeserializer`` / ``TensorSerializer`` are unwrapped to their source or
sink, so loads from them keep tensorstream's parallel ranged readers.

S3 settings resolve as tensorizer 2.12.1 resolves them: explicit arguments, then
the s3cmd config (``s3_config_path``, else ``_s3_default_config_paths``), then
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, then CoreWeave's object storage
(``default_s3_read_endpoint`` for reads, ``default_s3_write_endpoint`` for
writes). Keys not found that way come from tensorstream's usual chain
(``AWS_ACCESS_KEY_ID``..., the AWS config). Empty strings mean a public bucket.

Redis (``redis://``) is not supported: ``NotImplementedError``.
"""

from __future__ import annotations

import configparser
import io
import os
from typing import Any

from tensorstream.errors import ConfigError, SourceError
from tensorstream.sources.base import Sink, Source, StorageOptions
from tensorstream.sources.registry import open_sink, open_source

__all__ = [
    "CAInfo",
    "CURLStreamFile",
    "RedisStreamFile",
    "open_stream",
    "s3_download",
    "s3_upload",
    "storage_options",
]

#: tensorizer's defaults: CoreWeave's accelerated read endpoint and its write endpoint.
default_s3_read_endpoint = "accel-object.ord1.coreweave.com"
default_s3_write_endpoint = "object.ord1.coreweave.com"
#: Where an s3cmd config is looked for when ``s3_config_path`` is not given.
_s3_default_config_paths: tuple[str, ...] = (os.path.expanduser("~/.s3cfg"),)

_REDIS = (
    "redis:// streams are not supported by tensorstream.compat.tensorizer "
    "(tensorizer's RedisStreamFile / TensorDeserializer.to_redis); serve the file from "
    "local disk, HTTP or S3 instead"
)


class CAInfo:
    """How to verify HTTPS certificates: a CA file, a CA directory, or not at all.

    Exactly one of ``cacert``, ``capath`` or ``allow_untrusted=True`` must be given;
    pass ``certificate_handling=None`` for the system's default verification.

    Raises:
        ValueError: none or several given, or the file/directory does not exist.
    """

    __slots__ = ("cacert", "capath", "allow_untrusted")

    def __init__(
        self,
        *,
        cacert: str | None = None,
        capath: str | None = None,
        allow_untrusted: bool = False,
    ) -> None:
        if (cacert is not None) + (capath is not None) + bool(allow_untrusted) != 1:
            raise ValueError(
                "CAInfo takes exactly one of cacert=, capath= or allow_untrusted=True; "
                "for default verification pass certificate_handling=None instead"
            )
        if cacert is not None and not os.path.isfile(cacert):
            raise ValueError(f"CAInfo(cacert={cacert!r}): no such file")
        if capath is not None and not os.path.isdir(capath):
            raise ValueError(f"CAInfo(capath={capath!r}): no such directory")
        self.cacert = cacert
        self.capath = capath
        self.allow_untrusted = bool(allow_untrusted)

    def apply(self, options: dict[str, Any]) -> None:
        """Set the matching ``StorageOptions`` fields in ``options``."""
        if self.allow_untrusted:
            options["verify_tls"] = False
        else:
            options["ca_bundle"] = self.cacert or self.capath

    def __hash__(self) -> int:
        return hash((self.cacert, self.capath, self.allow_untrusted))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CAInfo) and hash(self) == hash(other)

    def __repr__(self) -> str:
        if self.allow_untrusted:
            return "CAInfo(allow_untrusted=True)"
        return (
            f"CAInfo(cacert={self.cacert!r})" if self.cacert else f"CAInfo(capath={self.capath!r})"
        )


def _enforce_scheme(endpoint: str, allow_http: bool = False, force_http: bool = False) -> str:
    """An endpoint with its scheme: HTTPS unless plain HTTP was forced or configured."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return ("http://" if force_http else "https://") + endpoint
    if scheme.lower() == "https":
        return "http://" + rest if force_http else endpoint
    if scheme.lower() == "http" and (force_http or allow_http):
        return endpoint
    raise ValueError(
        f"S3 endpoint {endpoint!r} is not HTTPS; pass force_http=True to allow plain HTTP"
    )


def _s3cfg(config_path: str | bytes | os.PathLike[Any] | None) -> dict[str, str]:
    """The ``[default]`` section of the first readable s3cmd config, or ``{}``."""
    if config_path is not None:
        paths: tuple[Any, ...] = (config_path,)
        if not os.path.exists(config_path):
            raise FileNotFoundError(f"s3_config_path {os.fsdecode(config_path)!r} does not exist")
    else:
        paths = _s3_default_config_paths
    for path in paths:
        parser = configparser.ConfigParser()
        if parser.read(os.fsdecode(path)):
            if "default" not in parser:
                raise ConfigError(f"{os.fsdecode(path)} has no [default] section")
            return dict(parser["default"])
    return {}


def storage_options(
    path_uri: str,
    mode: str = "rb",
    s3_access_key_id: str | None = None,
    s3_secret_access_key: str | None = None,
    s3_endpoint: str | None = None,
    s3_config_path: str | bytes | os.PathLike[Any] | None = None,
    force_http: bool | None = None,
    *,
    s3_region_name: str | None = None,
    certificate_handling: CAInfo | None = None,
) -> StorageOptions:
    """tensorstream ``StorageOptions`` equivalent to these tensorizer arguments.

    Returns:
        Options with the endpoint resolved as tensorizer does (see the module doc).
    """
    fields: dict[str, Any] = {}
    if certificate_handling is not None:
        certificate_handling.apply(fields)
    if not path_uri.lower().startswith("s3://"):
        return StorageOptions(**fields)
    allow_http = False
    if s3_access_key_id is None or s3_secret_access_key is None:
        cfg = _s3cfg(s3_config_path)
        if s3_access_key_id is None:
            s3_access_key_id = cfg.get("access_key") or None
        if s3_secret_access_key is None:
            s3_secret_access_key = cfg.get("secret_key") or None
        s3_endpoint = s3_endpoint or cfg.get("host_base") or None
        if force_http is None and cfg.get("use_https") in ("True", "False"):
            force_http = cfg["use_https"] == "False"
    if not s3_endpoint:
        s3_endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        allow_http = bool(s3_endpoint)
    if not s3_endpoint:
        writing = any(c in mode for c in "wax+")
        s3_endpoint = default_s3_write_endpoint if writing else default_s3_read_endpoint
    endpoint = _enforce_scheme(s3_endpoint, allow_http, bool(force_http))
    if s3_access_key_id == "" and s3_secret_access_key == "":
        fields["s3_unsigned"] = True
    elif s3_access_key_id and s3_secret_access_key:
        fields.update(s3_access_key_id=s3_access_key_id, s3_secret_access_key=s3_secret_access_key)
    return StorageOptions(s3_endpoint=endpoint, s3_region=s3_region_name, **fields)


def _open_failure(where: str, exc: SourceError) -> SourceError:
    """The same error class, with tensorizer's "Failed to open stream" wording in front."""
    try:
        return type(exc)(f"Failed to open stream {where}: {exc}")
    except TypeError:  # an error class with a different constructor
        return SourceError(f"Failed to open stream {where}: {exc}")


def _open_source(uri: str, options: StorageOptions) -> Source:
    try:
        return open_source(uri, options)
    except SourceError as exc:
        from tensorstream.sources.uri import redact_uri

        raise _open_failure(redact_uri(uri), exc) from exc


class _SourceStream(io.RawIOBase):
    """A seekable, read-only file over a tensorstream ``Source`` window ``[begin, end)``."""

    def __init__(self, source: Source, begin: int | None = None, end: int | None = None) -> None:
        super().__init__()
        try:
            size = source.size
        except SourceError as exc:
            source.close()
            raise _open_failure(source.display_uri, exc) from exc
        begin = 0 if begin is None else begin
        end = size if end is None else min(end, size)
        if begin < 0 or end < 0 or begin >= end and (begin, end) != (0, 0):
            source.close()
            raise ValueError(f"invalid byte range begin={begin}, end={end} (size {size})")
        self._source = source
        self._begin, self._end, self._pos = begin, end, begin
        self.name = source.display_uri
        #: The source itself when the stream covers all of it (the loaders use it directly).
        self.tensorstream_source: Source | None = source if (begin, end) == (0, size) else None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos - self._begin

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: self._begin, io.SEEK_CUR: self._pos, io.SEEK_END: self._end}[whence]
        self._pos = max(self._begin, base + offset)
        return self._pos - self._begin

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._end - self._pos))
        if n:
            self._source.read_into(self._pos, view[:n])
            self._pos += n
        return n

    def readall(self) -> bytes:
        return self.read(self._end - self._pos)

    def close(self) -> None:
        if not self.closed:
            self._source.close()
        super().close()


class CURLStreamFile(_SourceStream):
    """tensorizer's HTTP(S) reader, here ranged GETs through tensorstream's HTTP source.

    Args:
        uri: ``http(s)://`` URL.
        begin: first byte offset (default 0).
        end: exclusive end offset (default: end of the object).
        headers: extra request headers.
        buffer_size: accepted for compatibility; unused.
        certificate_handling: ``CAInfo`` for HTTPS verification, or ``None``.
    """

    def __init__(
        self,
        uri: str,
        begin: int | None = None,
        end: int | None = None,
        headers: dict[str, str] | None = None,
        *,
        buffer_size: int | None = None,
        certificate_handling: CAInfo | None = None,
    ) -> None:
        if (begin is not None and begin < 0) or (end is not None and end <= (begin or 0)):
            raise ValueError(f"invalid byte range begin={begin}, end={end}")
        options = storage_options(uri, certificate_handling=certificate_handling)
        if headers:
            options = _with_headers(options, headers)
        super().__init__(_open_source(uri, options), begin, end)


def _with_headers(options: StorageOptions, headers: dict[str, str]) -> StorageOptions:
    import dataclasses

    return dataclasses.replace(options, headers=tuple(headers.items()))


class RedisStreamFile:
    """Not supported: tensorstream has no Redis source."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_REDIS)


class _SinkStream(io.RawIOBase):
    """A write-only file over a tensorstream ``Sink``; ``close()`` commits (uploads)."""

    def __init__(self, sink: Sink) -> None:
        super().__init__()
        self.tensorstream_sink = sink
        self.name = sink.display_uri

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.tensorstream_sink.position

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.tensorstream_sink.write(view)
        return len(view)

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.tensorstream_sink.commit()

    def abort(self) -> None:
        """Discard what was written; nothing appears at the target."""
        if not self.closed:
            super().close()
            self.tensorstream_sink.abort()

    def detach_sink(self) -> None:
        """Mark the stream closed after its sink was committed or aborted elsewhere."""
        super().close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def open_stream(
    path_uri: str | os.PathLike[str],
    mode: str = "rb",
    s3_access_key_id: str | None = None,
    s3_secret_access_key: str | None = None,
    s3_endpoint: str | None = None,
    s3_config_path: str | bytes | os.PathLike[Any] | None = None,
    buffer_size: int | None = None,
    force_http: bool | None = None,
    *,
    begin: int | None = None,
    end: int | None = None,
    s3_region_name: str | None = None,
    s3_signature_version: str | None = None,
    certificate_handling: CAInfo | None = None,
) -> Any:
    """Open a local path, ``http(s)://`` URL or ``s3://`` URI as a binary file object.

    Args:
        path_uri: what to open; an ``os.PathLike`` is always a local path.
        mode: ``"rb"`` anywhere; ``"wb"``/``"wb+"``/``"ab"`` for S3 (uploaded on
            ``close()``, atomically); any binary mode for local paths.
        s3_access_key_id, s3_secret_access_key: S3 keys; ``""`` for a public bucket.
        s3_endpoint: S3 endpoint; see the module docstring for the fallbacks.
        s3_config_path: s3cmd config to read keys and endpoint from.
        buffer_size: buffering of local files.
        force_http: use plain HTTP for the S3 endpoint.
        begin, end: byte window ``[begin, end)`` of a remote object (local: ``begin``
            seeks).
        s3_region_name: region to sign for.
        s3_signature_version: accepted for compatibility (always SigV4).
        certificate_handling: ``CAInfo`` for HTTPS, or ``None`` for the defaults.

    Returns:
        A file-like object; pass it to ``TensorDeserializer`` / ``TensorSerializer``.

    Raises:
        ValueError: a mode the scheme cannot do.
        NotImplementedError: ``redis://``.
        OSError: the stream could not be opened (``"Failed to open stream ..."``).
    """
    local_only = isinstance(path_uri, os.PathLike)
    path = os.fspath(path_uri)
    scheme = path.partition("://")[0].lower() if "://" in path and not local_only else ""
    binary = "".join(sorted(mode))
    if scheme in ("http", "https"):
        if binary != "br":
            raise ValueError(f'only mode "rb" can open {scheme}:// streams, got {mode!r}')
        return CURLStreamFile(path, begin, end, certificate_handling=certificate_handling)
    if scheme == "redis":
        raise NotImplementedError(_REDIS)
    if scheme == "s3":
        if binary not in ("br", "bw", "ab", "+bw", "+ab"):
            raise ValueError(
                f'only modes "rb", "wb[+]" and "ab[+]" can open s3:// streams, got {mode!r}'
            )
        options = storage_options(
            path,
            mode,
            s3_access_key_id,
            s3_secret_access_key,
            s3_endpoint,
            s3_config_path,
            force_http,
            s3_region_name=s3_region_name,
            certificate_handling=certificate_handling,
        )
        if "r" in mode:
            return _SourceStream(_open_source(path, options), begin, end)
        return _SinkStream(open_sink(path, options))
    if scheme not in ("", "file"):
        raise ValueError(f"unsupported URI scheme {scheme!r} in {path!r}")
    if "b" not in mode:
        raise ValueError(f"local streams must be opened in a binary mode, got {mode!r}")
    if scheme == "file":
        path = path.partition("://")[2]
    if any(c in mode for c in "wax") and os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    handle = open(
        path, mode, buffering=io.DEFAULT_BUFFER_SIZE if buffer_size is None else buffer_size
    )
    handle.seek(begin or 0)
    return handle


def s3_upload(
    path: str,
    target_uri: str,
    s3_access_key_id: str | None = None,
    s3_secret_access_key: str | None = None,
    s3_endpoint: str | None = default_s3_write_endpoint,
    s3_region_name: str | None = None,
    s3_signature_version: str | None = None,
) -> None:
    """Upload the local file ``path`` to the ``s3://`` URI ``target_uri``."""
    with (
        open(path, "rb") as src,
        open_stream(
            target_uri,
            "wb",
            s3_access_key_id,
            s3_secret_access_key,
            s3_endpoint,
            s3_region_name=s3_region_name,
        ) as dst,
    ):
        while chunk := src.read(16 << 20):
            dst.write(chunk)


def s3_download(
    path_uri: str,
    s3_access_key_id: str | None = None,
    s3_secret_access_key: str | None = None,
    s3_endpoint: str | None = default_s3_read_endpoint,
    buffer_size: int | None = None,
    force_http: bool = False,
    begin: int | None = None,
    end: int | None = None,
    *,
    s3_region_name: str | None = None,
    s3_signature_version: str | None = None,
    certificate_handling: CAInfo | None = None,
) -> Any:
    """A read stream over the ``s3://`` URI ``path_uri`` (same as ``open_stream(..., "rb")``)."""
    return open_stream(
        path_uri,
        "rb",
        s3_access_key_id,
        s3_secret_access_key,
        s3_endpoint,
        force_http=force_http,
        begin=begin,
        end=end,
        s3_region_name=s3_region_name,
        certificate_handling=certificate_handling,
    )
