"""SIGTERM aborts open sinks: no orphaned multipart upload, no temp file left behind.

SIGINT already unwinds through ``with`` blocks as ``KeyboardInterrupt``, which
aborts every sink on the way out. SIGTERM (what Kubernetes, systemd and ``kill``
send) kills the process by default without running any of that, so an S3
multipart upload stays open (and billed) and a local temp file stays on disk.

While at least one sink is open, this module installs a SIGTERM handler in the
main thread (only there: Python runs handlers in the main thread and refuses to
install them elsewhere). The handler aborts every open sink, then does what the
previous handler would have done: calls it when it was a Python function, or
restores the default action and sends SIGTERM again so the process still dies
of SIGTERM (exit status 143 in a shell). It is uninstalled when the last sink
closes, unless someone replaced it meanwhile. A process that ignores SIGTERM
keeps ignoring it: nothing is installed then.
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


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    previous = _previous  # before the aborts: the last one uninstalls and forgets it
    for sink in list(_open):
        try:
            sink.abort()
        except Exception as exc:  # noqa: BLE001 - keep aborting the others, then die
            _log.warning("could not abort %r on SIGTERM: %s", sink, type(exc).__name__)
    _uninstall()
    if callable(previous):
        previous(signum, frame)
        return
    # The default action: die of SIGTERM, as the process would have without us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install() -> None:
    global _previous, _installed
    if _installed is not None or threading.current_thread() is not threading.main_thread():
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
