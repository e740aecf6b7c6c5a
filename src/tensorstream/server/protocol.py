"""uvicorn's HTTP/1.1 protocol with a deadline for request headers (slow-loris defence).

uvicorn's ``timeout_keep_alive`` only runs between two requests and is
cancelled by the first byte of the next one, and h11 has no header timeout
of its own: a client that opens a socket and sends a request line one byte
at a time (or nothing at all) holds the socket, and a file descriptor, for
as long as it likes. Many such sockets exhaust the open-file limit.

:func:`header_timeout_protocol` returns an ``H11Protocol`` subclass that arms
a timer whenever the connection waits for a request's headers (a new
connection, or an idle keep-alive one that starts sending) and closes the
socket when the headers are not complete by then. The deadline counts from
the first moment of waiting, so trickling bytes does not extend it. Bodies
and responses are not affected.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["header_timeout_protocol"]

logger = logging.getLogger(__name__)


def header_timeout_protocol(seconds: float) -> type:
    """An ``H11Protocol`` subclass that closes connections whose headers take over ``seconds``.

    Pass it as ``uvicorn.Config(http=...)``.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        """h11 with a request-header deadline of ``seconds``."""

        header_timeout = seconds

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._waiting_for_headers():
                self._arm()  # an idle keep-alive connection starts a new request
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

        def _disarm(self) -> None:
            timer = getattr(self, "_header_timer", None)
            if timer is not None:
                timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self._busy():
                logger.info(
                    "%s: closing a connection that sent no complete headers in %.0f s",
                    self.client,
                    self.header_timeout,
                )
                self.transport.close()

        def _busy(self) -> bool:
            # A response still being written (pipelining) keeps the connection.
            cycle: Any = self.cycle
            return cycle is not None and not cycle.response_complete

    return HeaderTimeoutH11Protocol
