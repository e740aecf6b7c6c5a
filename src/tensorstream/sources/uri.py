"""Parse storage locations: local paths, file://, http(s)://, s3://bucket/key."""

from __future__ import annotations

import os
import posixpath
import urllib.parse
from dataclasses import dataclass

from tensorstream.errors import ConfigError

__all__ = ["ParsedURI", "join_uri", "parse_uri", "redact_uri"]


@dataclass(frozen=True)
class ParsedURI:
    scheme: str  # "file", "http", "https" or "s3"
    #: For "file": an absolute filesystem path. Otherwise the URI as given.
    target: str
    #: s3 only
    bucket: str = ""
    key: str = ""

    @property
    def display(self) -> str:
        return redact_uri(self.target)


def parse_uri(uri: str | os.PathLike[str]) -> ParsedURI:
    if isinstance(uri, os.PathLike):
        return ParsedURI("file", os.path.abspath(os.fspath(uri)))
    if not isinstance(uri, str) or not uri:
        raise ConfigError(f"expected a path or URI string, got {uri!r}")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return ParsedURI("file", os.path.abspath(os.path.expanduser(uri)))
    scheme = scheme.lower()
    if scheme == "file":
        return ParsedURI("file", urllib.parse.unquote(urllib.parse.urlsplit(uri).path))
    if scheme in ("http", "https"):
        return ParsedURI(scheme, uri)
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not bucket:
            raise ConfigError(f"S3 URI {uri!r} has no bucket; expected s3://bucket/key")
        return ParsedURI("s3", uri, bucket=bucket, key=key)
    return ParsedURI(scheme, uri)


def redact_uri(uri: str) -> str:
    """Drop userinfo and query strings (presigned signatures) from a URI for display."""
    if "://" not in uri:
        return uri
    parts = urllib.parse.urlsplit(uri)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    query = "<redacted>" if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def join_uri(base: str | os.PathLike[str], *names: str) -> str:
    """Join path components onto a path or URI (``s3://b/dir`` + ``model.tensors``)."""
    if isinstance(base, os.PathLike) or "://" not in str(base) or str(base).startswith("file://"):
        return os.path.join(os.fspath(base), *names)
    head, sep, query = str(base).partition("?")
    joined = posixpath.join(head.rstrip("/") + "/", *names)
    return joined + (sep + query if sep else "")
