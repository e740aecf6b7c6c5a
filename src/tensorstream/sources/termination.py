"""SIGTERM aborts open sinks: no orphaned multipart upload, no temp file left behind.

SIGINT already unwinds through ``with`` blocks as ``KeyboardInterrupt``, which
aborts every sink on the way out. SIGTERM (what Kubernetes, systemd and ``kill``
send) kills the process by default without running any of that, so an S3
multipart upload stays open (and billed) and a local temp file stays on disk.

While at least one sink is open, this module installs a SIGTERM handler in the
main thread (only there: Python runs handlers in the main thread and refuses to
install them elsewhere). The handler puts the previous handler back and starts a
thread that aborts every open sink and sends SIGTERM again, so what the previous
handler would have done still happens: a Python handler runs (signalled before the
aborts), or the default action kills the process once they are done (exit status
143 in a shell). The handler is
uninstalled when the last sink closes, unless someone replaced it meanwhile. A
process that ignores SIGTERM keeps ignoring it: nothing is installed then.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

__all__ = ["track", "untrack"]

_log = logging.getLogger("tensorstream.sources")


class _Abortable(Protocol):
    def abort(self) -> None: ...


_lock = threading.RLock()
_open: weakref.WeakSet[Any] = weakref.WeakSet()
_previous: Any = None
_installed: Callable[[int, FrameType | None], None] | None = None
#: Set once SIGTERM arrived: sinks opened afterwards install nothing (the cleanup
#: thread aborts them as well).
_terminating = False


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Hand the cleanup to a thread, put the previous handler back, return at once.

    The aborts do not run here: the main thread may have been interrupted while
    holding a lock an abort needs (a thread pool's, a queue's), and waiting for it
    inside the handler would hang forever. Once the handler returns, the main thread
    carries on until its next write finds the sink aborted.
    """
    global _terminating
    with _lock:
        _terminating = True
        previous = _previous
        _uninstall()
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # replaced under us: restore
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    threading.Thread(
        target=_abort_and_resignal,
        args=(signum, callable(previous)),
        name="tensorstream-sigterm",
    ).start()  # not a daemon: interpreter shutdown waits for the aborts


def _abort_and_resignal(signum: int, chain_first: bool) -> None:
    """Abort every open sink and deliver SIGTERM again to whatever handles it now.

    A previous Python handler gets the signal first (the main thread runs it at its
    next instruction, before it could see an aborted sink); the default action comes
    last, since it ends the process (exit status 143 in a shell), as it would have
    without us.
    """
    global _terminating
    if chain_first:
        os.kill(os.getpid(), signum)
    tried: set[int] = set()
    while True:
        with _lock:
            sinks = [s for s in list(_open) if id(s) not in tried]
        if not sinks:
            break
        for sink in sinks:
            tried.add(id(sink))
            try:
                sink.abort()
            except Exception as exc:  # noqa: BLE001 - keep aborting the others, then go on
                _log.warning("could not abort %r on SIGTERM: %s", sink, type(exc).__name__)
    if not chain_first:
        os.kill(os.getpid(), signum)
    with _lock:
        _terminating = False  # the previous handler chose to live on: protect new sinks


def _install() -> None:
    global _previous, _installed
    if (
        _terminating
        or _installed is not None
        or threading.current_thread() is not threading.main_thread()
    ):
        return
    current = signal.getsignal(signal.SIGTERM)
    # SIG_IGN: the process chose to survive SIGTERM. None: a handler set from C that
    # Python cannot call or restore. Either way, leave it alone.
    if current is signal.SIG_IGN or current is None:
        return
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main interpreter
        return
    _previous, _installed = current, _on_sigterm


def _uninstall() -> None:
    global _previous, _installed
    if _installed is None:
        return
    if signal.getsignal(signal.SIGTERM) is not _installed:
        _previous, _installed = None, None  # someone replaced it: theirs stays
        return
    if threading.current_thread() is not threading.main_thread():
        return  # cannot restore from here; with no sink open it only chains on
    signal.signal(signal.SIGTERM, _previous)
    _previous, _installed = None, None


def track(sink: _Abortable) -> None:
    """Abort ``sink`` if SIGTERM arrives before ``untrack(sink)``."""
    with _lock:
        _open.add(sink)
        _install()


def untrack(sink: _Abortable) -> None:
    """``sink`` committed or aborted; drop the handler once no sink is open."""
    with _lock:
        _open.discard(sink)
        if not _open:
            _uninstall()
