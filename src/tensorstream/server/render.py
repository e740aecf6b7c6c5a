"""Run CPU-bound request work (chat templates) off the event loop, with a deadline that stops it.

A chat template is a Jinja program (transformers renders it in Jinja's
immutable sandbox, so it cannot reach the host), and the messages it loops
over come from the client: a template plus a big enough conversation can run
for minutes. Run on the event loop, that froze ``/health`` for the whole time.

:class:`BoundedRunner` runs such work in its own daemon thread, at most a few
at once, and waits for it without blocking the loop. When the deadline passes
the waiting request fails at once and the thread is stopped: an exception is
raised inside it at its next Python bytecode (``PyThreadState_SetAsyncExc``),
which interrupts a template loop because compiled Jinja templates are Python
code. Work that sits inside one long C call finishes that call first.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["BoundedRunner", "WorkTimeout"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkTimeout(Exception):
    """The work did not finish within its deadline (it has been told to stop)."""


class _Stop(BaseException):
    """Raised inside a worker thread to end work past its deadline."""


class _Worker(threading.Thread):
    def __init__(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name="bounded-work", daemon=True)
        self._fn = fn
        self._loop = loop
        self.future: asyncio.Future = loop.create_future()
        self._lock = threading.Lock()
        self._finished = False

    def run(self) -> None:
        try:
            try:
                result, error = self._fn(), None
            except _Stop:
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
                result, error = None, exc
            with self._lock:
                self._finished = True
            try:
                self._loop.call_soon_threadsafe(_settle, self.future, result, error)
            except RuntimeError:
                pass  # the loop is gone: nobody waits any more
        except _Stop:
            pass  # arrived just as the work ended

    def stop(self) -> None:
        """Raise :class:`_Stop` in the thread unless its work already ended."""
        with self._lock:
            if self._finished or self.ident is None or not self.is_alive():
                return
            hits = ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.ident), ctypes.py_object(_Stop)
            )
            if hits > 1:  # never expected; undo rather than hit other threads
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), None)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class BoundedRunner:
    """Runs callables in worker threads, ``concurrency`` at a time, each under a deadline.

    Args:
        concurrency: most callables running at once; more wait (without blocking the loop).

    Example:
        >>> import asyncio
        >>> asyncio.run(BoundedRunner().run(lambda: 6 * 7, timeout=5))
        42
    """

    def __init__(self, concurrency: int = 4) -> None:
        self._concurrency = concurrency
        self._slots: asyncio.Semaphore | None = None

    async def run(self, fn: Callable[[], T], *, timeout: float) -> T:
        """Return ``fn()``, run in a worker thread.

        Raises:
            WorkTimeout: ``fn`` ran past ``timeout`` seconds; it is being stopped.
            Exception: whatever ``fn`` raised.
        """
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._concurrency)
        async with self._slots:
            worker = _Worker(fn, asyncio.get_running_loop())
            worker.start()
            try:
                return await asyncio.wait_for(asyncio.shield(worker.future), timeout)
            except asyncio.TimeoutError:
                worker.stop()
                logger.info("stopped work that ran past its %.1f s deadline", timeout)
                raise WorkTimeout(f"did not finish within {timeout:g} s") from None
            except asyncio.CancelledError:
                worker.stop()  # the client went away; the work is useless now
                raise
