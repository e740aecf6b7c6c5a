"""A fault-injecting TCP proxy for HTTP tests: cut, stall or fail requests on purpose.

Owns: a threaded loopback proxy in front of one upstream ``host:port`` that
passes bytes through untouched (so SigV4 signatures and keep-alive still work)
unless told to misbehave. Faults are chosen per request and can be changed
while connections are open:

- ``pass``: forward everything.
- ``cut``: after ``after_bytes`` response bytes (status line and headers
  included, counted from the start of the faulted request's response), close
  both sides with a FIN, so the client sees a short body or a dropped
  connection.
- ``stall``: after ``after_bytes`` response bytes, stop forwarding for
  ``seconds`` (``None``: until the proxy closes), then carry on.
- ``status``: answer the request itself with ``HTTP/1.1 <status>``,
  ``Content-Length`` and ``Connection: close``, then close; the upstream never
  sees it.

``times=K`` limits a fault to the first K requests after :meth:`FaultProxy.set_mode`
(the proxy behaves afterwards); ``times=None`` faults every request.

The proxy splits the client's stream into requests (head, then a
``Content-Length`` body) only to count them; a chunked request body makes the
rest of that connection opaque (still forwarded, no longer counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http
import select
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

from . import LOOPBACK

__all__ = ["MODES", "Fault", "FaultProxy", "ProxyStats"]

MODES = ("pass", "cut", "stall", "status")
_MAX_HEAD = 64 * 1024
_RECV = 64 * 1024
_POLL = 0.1  # seconds between checks of the stop flag in every loop
_SEND_TIMEOUT = 30.0  # a client that stops reading cannot wedge a thread forever


@dataclass(frozen=True)
class Fault:
    """What the proxy does to the next requests; see the module docstring.

    Attributes:
        mode: one of ``pass``, ``cut``, ``stall``, ``status``.
        after_bytes: response bytes forwarded before a cut or stall.
        times: how many requests get the fault; ``None`` for all.
        seconds: stall length; ``None`` stalls until the proxy closes.
        status: HTTP status code for ``status`` mode.
    """

    mode: str = "pass"
    after_bytes: int = 0
    times: int | None = None
    seconds: float | None = None
    status: int = 503

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"fault mode {self.mode!r} is not one of {MODES}")
        if self.after_bytes < 0 or (self.times is not None and self.times < 0):
            raise ValueError(f"after_bytes and times must be >= 0, got {self}")
        if not 100 <= self.status <= 599:
            raise ValueError(f"status must be an HTTP status code, got {self.status}")


@dataclass(frozen=True)
class ProxyStats:
    """Counters since the proxy started (or :meth:`FaultProxy.reset_stats`).

    Attributes:
        connections: client connections accepted.
        requests: request heads seen (faulted ones included).
        faults: requests that got a fault.
        bytes_up: bytes forwarded client -> upstream.
        bytes_down: bytes forwarded upstream -> client (canned replies excluded).
    """

    connections: int = 0
    requests: int = 0
    faults: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class FaultProxy:
    """Loopback TCP proxy in front of an HTTP upstream, with injectable faults.

    Args:
        upstream_url: ``http://host:port[/path]`` of the real server.
        fault: initial behaviour (default: pass through).

    Example:
        >>> with FaultProxy(http_server.base_url) as proxy:  # doctest: +SKIP
        ...     proxy.set_mode("status", status=503, times=1)
        ...     urllib3.request("GET", proxy.url + "/a.bin", retries=Retry(status_forcelist=[503]))
    """

    def __init__(self, upstream_url: str, fault: Fault | None = None) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(
                f"fault proxy needs an http://host:port upstream, got {upstream_url!r}"
            )
        self.upstream = (parts.hostname, parts.port or 80)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fault = fault or Fault()
        self._claimed = 0
        self._stats = ProxyStats()
        self._socks: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(_POLL)
        self.port: int = self._listener.getsockname()[1]
        #: Base URL to use instead of the upstream's (same path).
        self.url = f"http://{LOOPBACK}:{self.port}{parts.path.rstrip('/')}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept")
        self._acceptor.daemon = True
        self._acceptor.start()

    def set_mode(
        self,
        mode: str = "pass",
        *,
        after_bytes: int = 0,
        times: int | None = None,
        seconds: float | None = None,
        status: int = 503,
    ) -> None:
        """Change the fault for requests from now on; resets the ``times`` budget.

        Args:
            mode: ``pass``, ``cut``, ``stall`` or ``status``.
            after_bytes: response bytes let through before a cut or stall.
            times: fault only the next ``times`` requests; ``None`` for all.
            seconds: stall length; ``None`` stalls until :meth:`close`.
            status: status code answered in ``status`` mode.

        Raises:
            ValueError: an unknown mode or out-of-range number.
        """
        fault = Fault(mode, after_bytes, times, seconds, status)
        with self._lock:
            self._fault = fault
            self._claimed = 0

    @property
    def stats(self) -> ProxyStats:
        """A snapshot of the counters."""
        with self._lock:
            return self._stats

    def reset_stats(self) -> None:
        """Zero the counters."""
        with self._lock:
            self._stats = ProxyStats()

    def close(self) -> None:
        """Stop accepting, drop every open connection and join the threads."""
        self._stop.set()
        self._acceptor.join(timeout=5)
        _close(self._listener)
        with self._lock:
            socks = list(self._socks)
        # Shutdown (not close) wakes threads blocked in select/recv/sendall; each
        # thread then closes its own sockets, so no thread sees a dead descriptor.
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in list(self._threads):
            t.join(timeout=5)
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _close(s)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            values = {k: getattr(self._stats, k) + v for k, v in deltas.items()}
            self._stats = dataclasses.replace(self._stats, **values)

    def _claim(self) -> Fault | None:
        """Decide whether the request just seen gets a fault (and spend budget)."""
        with self._lock:
            fault = self._fault
            if fault.mode == "pass":
                return None
            if fault.times is not None and self._claimed >= fault.times:
                return None
            self._claimed += 1
            return fault

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._stop.is_set():
                return False
            self._socks.add(sock)
            return True

    def _untrack(self, *socks: socket.socket | None) -> None:
        for s in socks:
            if s is not None:
                with self._lock:
                    self._socks.discard(s)
                _close(s)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            if not self._track(client):
                _close(client)
                return
            self._count(connections=1)
            t = threading.Thread(target=self._serve, args=(client,), name="faultproxy-conn")
            t.daemon = True
            # Drop finished threads so a long session does not accumulate them.
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            upstream = _Connection(self, client).run()
        except (OSError, ValueError):
            pass  # either side went away; that is the client's error to see
        finally:
            self._untrack(client, upstream)


class _Connection:
    """One client connection: forwards both ways, applies faults, counts."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.splitter = _RequestSplitter()
        self.armed: Fault | None = None  # cut/stall fault in force on this connection
        self.sent_since_armed = 0
        self.replying: int | None = None  # status code we answer this request with
        self.client.settimeout(_SEND_TIMEOUT)

    def run(self) -> socket.socket | None:
        """Pump bytes until either side closes or the proxy stops; returns upstream."""
        client_open = True
        while not self.proxy._stop.is_set():
            watch = [self.client] if client_open else []
            if self.upstream is not None:
                watch.append(self.upstream)
            if not watch:
                break
            readable, _, _ = select.select(watch, [], [], _POLL)
            if self.client in readable:
                data = self.client.recv(_RECV)
                if not data:
                    client_open = False
                    if self.upstream is None:
                        break
                    # Half-close: the upstream may still owe a response.
                    self.upstream.shutdown(socket.SHUT_WR)
                elif not self._from_client(data):
                    break
            if self.upstream is not None and self.upstream in readable:
                data = self.upstream.recv(_RECV)
                if not data or not self._from_upstream(data):
                    break
        return self.upstream

    def _from_client(self, data: bytes) -> bool:
        """Handle client bytes; False ends the connection."""
        for kind, chunk in self.splitter.feed(data):
            if self.replying is not None:
                continue  # the body of a request we answer ourselves goes nowhere
            if kind == "head":
                self.proxy._count(requests=1)
                fault = self.armed or self._claim()
                if fault is not None and fault.mode == "status":
                    self.replying = fault.status
                    continue
                self.armed = fault
            self._to_upstream(chunk)
        if self.replying is None:
            return True
        split = self.splitter
        # Reply once the client has sent its whole body (unless it waits for
        # 100-continue), so it reads our answer instead of a reset mid-upload.
        if split.body_left and not split.expects_continue and not split.opaque:
            return True
        self._reply_status(self.replying)
        return False

    def _claim(self) -> Fault | None:
        fault = self.proxy._claim()
        if fault is not None:
            self.proxy._count(faults=1)
            self.sent_since_armed = 0
        return fault

    def _to_upstream(self, chunk: bytes) -> None:
        if self.upstream is None:
            host, port = self.proxy.upstream
            self.upstream = socket.create_connection((host, port), timeout=_SEND_TIMEOUT)
            if not self.proxy._track(self.upstream):
                raise ConnectionAbortedError("fault proxy is closing")
        self.upstream.sendall(chunk)
        self.proxy._count(bytes_up=len(chunk))

    def _from_upstream(self, data: bytes) -> bool:
        """Handle upstream bytes, cutting or stalling when armed; False ends it."""
        fault = self.armed
        if fault is None:
            self._to_client(data)
            return True
        allowed = max(0, fault.after_bytes - self.sent_since_armed)
        head, rest = data[:allowed], data[allowed:]
        self._to_client(head)
        self.sent_since_armed += len(head)
        if not rest:
            return not (fault.mode == "cut" and self.sent_since_armed >= fault.after_bytes)
        if fault.mode == "cut":
            return False
        # Stall: hold the remaining bytes (and stop reading either side) until
        # the stall ends or the proxy closes; then behave on this connection.
        if self.proxy._stop.wait(fault.seconds):
            return False
        self.armed = None
        self._to_client(rest)
        return True

    def _to_client(self, chunk: bytes) -> None:
        if chunk:
            self.client.sendall(chunk)
            self.proxy._count(bytes_down=len(chunk))

    def _reply_status(self, status: int) -> None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = "Injected"
        body = f"{status} {phrase} (injected by fault proxy)\n".encode()
        head = (
            f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.client.sendall(head.encode("latin-1") + body)
        with contextlib.suppress(OSError):
            self.client.shutdown(socket.SHUT_WR)


class _RequestSplitter:
    """Cuts a client's byte stream into request heads and bodies, to count requests."""

    def __init__(self) -> None:
        self._head = bytearray()
        self.body_left = 0
        self.expects_continue = False
        self.opaque = False  # stream no longer understood: forward without counting

    def feed(self, data: bytes) -> Iterator[tuple[str, bytes]]:
        """Yield ``("head", bytes)``, ``("body", bytes)`` or ``("raw", bytes)`` pieces."""
        while data:
            if self.opaque:
                yield "raw", data
                return
            if self.body_left:
                n = min(len(data), self.body_left)
                self.body_left -= n
                yield "body", data[:n]
                data = data[n:]
                continue
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > _MAX_HEAD:
                    self.opaque = True
                    yield "raw", bytes(self._head)
                    self._head.clear()
                return
            head, data = bytes(self._head[: end + 4]), bytes(self._head[end + 4 :])
            self._head.clear()
            self._parse(head)
            yield "head", head

    def _parse(self, head: bytes) -> None:
        self.body_left = 0
        self.expects_continue = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length" and value.isdigit():
                self.body_left = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                self.opaque = True
            elif name == b"expect" and value == b"100-continue":
                self.expects_continue = True


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
