"""URI scheme -> backend, imported lazily so a local load never imports boto3 or urllib3."""

from __future__ import annotations

import importlib
import os
from types import MappingProxyType

from tensorstream.errors import ConfigError
from tensorstream.sources.base import Sink, Source, StorageOptions
from tensorstream.sources.uri import parse_uri

__all__ = ["SINKS", "SOURCES", "open_sink", "open_source"]

# scheme -> ("module:Class", pip extra that provides its dependencies)
_SOURCES = {
    "file": ("tensorstream.sources.local:LocalSource", None),
    "http": ("tensorstream.sources.http:HttpSource", "http"),
    "https": ("tensorstream.sources.http:HttpSource", "http"),
    "s3": ("tensorstream.sources.s3:S3Source", "s3"),
}
_SINKS = {
    "file": ("tensorstream.sources.local:LocalSink", None),
    "s3": ("tensorstream.sources.s3:S3Sink", "s3"),
}
SOURCES = MappingProxyType(_SOURCES)
SINKS = MappingProxyType(_SINKS)


def _load(table: dict[str, tuple[str, str | None]], scheme: str, what: str) -> type:
    try:
        target, extra = table[scheme]
    except KeyError:
        if what == "sink" and scheme in ("http", "https"):
            raise ConfigError(
                f"cannot write to {scheme}:// URIs: HTTP servers are read-only here; "
                "write to a local path or s3:// and serve that"
            ) from None
        raise ConfigError(
            f"unsupported URI scheme {scheme!r} for a {what}; use one of: "
            + ", ".join(sorted(table))
        ) from None
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"pip install 'tensorstream[{extra}]'" if extra else "reinstall tensorstream"
        raise ConfigError(f"{scheme}:// support needs extra packages ({exc}); run: {hint}") from exc
    return getattr(module, class_name)


def open_source(uri: str | os.PathLike[str], options: StorageOptions | None = None) -> Source:
    """Open ``uri`` (path, ``file://``, ``http(s)://``, ``s3://``) for reading."""
    parsed = parse_uri(uri)
    cls = _load(_SOURCES, parsed.scheme, "source")
    return cls(parsed, options or StorageOptions())


def open_sink(uri: str | os.PathLike[str], options: StorageOptions | None = None) -> Sink:
    """Open ``uri`` for an atomic write: nothing appears there until ``commit()``."""
    parsed = parse_uri(uri)
    cls = _load(_SINKS, parsed.scheme, "sink")
    return cls(parsed, options or StorageOptions())
