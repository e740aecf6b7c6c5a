"""Judging the ranged engine's HTTP responses: same object, right range, known status.

Owns ``ObjectInfo`` (what the open-time probe learned: size, Range support, ETag,
Last-Modified), checking every later response against it (``SourceChangedError``
when the object changed under a read; ``SourceError`` when a server or proxy sent
another range than asked for) and turning a final HTTP status into the
``tensorstream.errors`` tree. Messages show only the redacted ``display_uri``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import urllib3

from tensorstream.errors import (
    AccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)
from tensorstream.sources.transport import finish

__all__ = ["CONTENT_RANGE", "ObjectInfo", "check_same", "status_error"]

CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class ObjectInfo:
    """What the open-time probe learned about the object."""

    size: int
    supports_ranges: bool
    etag: str | None
    last_modified: str | None


def check_same(
    info: ObjectInfo,
    resp: urllib3.BaseHTTPResponse,
    start: int | None,
    stop: int | None,
    display_uri: str,
) -> None:
    """Refuse a response from a different version of the object, or a different range.

    ``start``/``stop`` is the range asked for; ``None`` for a whole-object GET.
    """
    headers = resp.headers
    problem = None
    etag = headers.get("ETag")
    modified = headers.get("Last-Modified")
    if info.etag and etag and etag != info.etag:
        problem = f"ETag {info.etag} at open, now {etag}"
    elif info.last_modified and modified and modified != info.last_modified:
        problem = f"Last-Modified {info.last_modified} at open, now {modified}"
    elif start is not None and stop is not None:
        match = CONTENT_RANGE.fullmatch(headers.get("Content-Range", "").strip())
        if not match:
            finish(resp)
            raise SourceError(
                f"{display_uri} answered a Range request with Content-Range "
                f"{headers.get('Content-Range')!r}; expected bytes {start}-{stop - 1}"
            )
        if match.group(3) != "*" and int(match.group(3)) != info.size:
            problem = f"size {info.size} at open, now {match.group(3)}"
        elif (int(match.group(1)), int(match.group(2))) != (start, stop - 1):
            finish(resp)
            raise SourceError(
                f"{display_uri} sent bytes {match.group(1)}-{match.group(2)} when asked "
                f"for {start}-{stop - 1}; a caching proxy may be misbehaving"
            )
    else:
        length = headers.get("Content-Length")
        if length is not None and int(length) != info.size:
            problem = f"size {info.size} at open, now {length}"
    if problem:
        finish(resp)
        raise SourceChangedError(
            f"{display_uri} changed while it was being read ({problem}); the bytes "
            "already loaded may come from the old version. Load again once the upload "
            "finished, and do not overwrite objects that are being served"
        )


def status_error(uri: str, status: int, offset: int, probing: bool) -> SourceError:
    """The error for a final (not retried) HTTP ``status`` at byte ``offset``."""
    if status in (401, 403):
        return AccessDeniedError(
            f"{uri}: access denied (HTTP {status}); check the URL, its signature or expiry, "
            "and any authorization header passed in StorageOptions.headers"
        )
    if status in (404, 410) and probing:
        return SourceNotFoundError(f"{uri} not found (HTTP {status}); check the URL")
    if status in (404, 410, 412, 416):
        return SourceChangedError(
            f"{uri} changed or disappeared while it was being read (HTTP {status} at byte "
            f"offset {offset}); load again once the object is stable"
        )
    return SourceError(f"{uri}: unexpected HTTP {status} at byte offset {offset}")
