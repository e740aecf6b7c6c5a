"""Low-level HTTP response handling shared by the ranged engine, and its error net.

Owns: what counts as a transport error (``OSError`` with its socket and ssl
subclasses, ``http.client.HTTPException``, every ``urllib3`` error), reading a
response body straight into caller memory, giving a connection back to the pool
only when its body was read to the end, the ``Cursor`` a resumable read keeps,
and ``map_transport_errors``: the decorator that turns a transport error which
escaped the retry logic into a ``SourceError`` naming the object.
"""

from __future__ import annotations

import functools
import http.client
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3

from tensorstream.errors import SourceError, TensorStreamError
from tensorstream.sources.connection import clean_error

__all__ = ["TRANSPORT_ERRORS", "Cursor", "finish", "map_transport_errors", "readinto"]

#: Exceptions a transfer can raise below tensorstream: retried, resumed, then mapped.
TRANSPORT_ERRORS = (OSError, http.client.HTTPException, urllib3.exceptions.HTTPError)

_F = TypeVar("_F", bound=Callable[..., Any])


def map_transport_errors(method: _F) -> _F:
    """Last line of defence: a transport error that escaped the retry logic (urllib3,
    http.client, socket, ssl) leaves as a ``SourceError`` naming the object."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except TensorStreamError:
            raise
        except TRANSPORT_ERRORS as exc:
            uri = getattr(self, "display_uri", None) or self._http.display_uri
            raise SourceError(
                f"{uri}: the transfer failed ({type(exc).__name__}: {clean_error(exc)}); check "
                "that the server is reachable and serves the whole object, then load again"
            ) from exc

    return wrapper  # type: ignore[return-value]


def readinto(resp: urllib3.BaseHTTPResponse, view: memoryview) -> int:
    # urllib3's own readinto() reads into a new bytes object and copies; the
    # http.client response underneath reads straight from the socket into `view`.
    fp = getattr(resp, "_fp", None)
    if isinstance(fp, http.client.HTTPResponse):
        return fp.readinto(view)
    return resp.readinto(view)  # pragma: no cover - other urllib3 backends


def finish(resp: urllib3.BaseHTTPResponse | None) -> None:
    """Give the connection back: reused only when the body was read to its end.

    A connection with unread body bytes (an abandoned range, a 200 to a Range
    request, an error page read in part) is closed, never pooled dirty.
    """
    if resp is None:
        return
    fp = getattr(resp, "_fp", None)
    # http.client drops its fp once Content-Length bytes were read.
    if not (isinstance(fp, http.client.HTTPResponse) and fp.isclosed()):
        resp.close()
    resp.release_conn()


class Cursor:
    """One response positioned at byte ``pos`` that serves bytes up to ``stop``."""

    __slots__ = ("pos", "resp", "stop")

    def __init__(self, pos: int, stop: int) -> None:
        self.pos = pos
        self.stop = stop
        self.resp: urllib3.BaseHTTPResponse | None = None

    def drop(self) -> None:
        finish(self.resp)
        self.resp = None
