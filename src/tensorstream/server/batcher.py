"""Continuous batching: one thread owns the ``EngineCore``; HTTP handlers talk to it by queue.

The engine is not thread-safe and its ``step()`` blocks for a forward pass, so
a single background thread (:class:`EngineLoop`) does all engine work. Between
two steps it applies aborts, runs queued commands (adapter loads), and admits
waiting requests up to ``max_num_seqs`` running sequences, so a request that
arrives while a batch runs joins at the next step.

Each request gets a :class:`RequestStream`. The engine thread publishes the
request's *latest* cumulative output to it on the event loop; readers take
what is new when they are ready. A slow streaming client therefore never
blocks the engine and never piles up a backlog: it just sees larger deltas.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tensorstream.engine.outputs import RequestOutput
from tensorstream.engine.sampling import SamplingParams

__all__ = ["EngineLoop", "RequestCancelled", "RequestStream"]

logger = logging.getLogger(__name__)


class RequestCancelled(Exception):
    """The request was aborted (client gone, or the server is shutting down)."""


class RequestStream:
    """The engine's progress on one request, read from the event loop.

    Attributes:
        request_id: the engine's id for the request.
        prompt_token_ids: the tokenized prompt.
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._loop = loop
        self._event = asyncio.Event()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None

    # Called on the event loop (scheduled by the engine thread).
    def _publish(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def updates(self) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output each time it advanced, until it finishes.

        Raises:
            RequestCancelled: the request was aborted.
            Exception: whatever the engine raised for this request.
        """
        while True:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise self._error
            latest = self._latest
            if latest is None:
                continue
            yield latest
            if latest.finished:
                return

    async def result(self) -> RequestOutput:
        """Wait for the finished output."""
        last: RequestOutput | None = None
        async for last in self.updates():  # noqa: B007 - only the final one matters
            pass
        assert last is not None
        return last


@dataclass
class _Pending:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    lora_request: Any
    created: float
    first_token: float | None = None


class EngineLoop:
    """Drives an ``EngineCore`` from one background thread.

    Args:
        engine: the step-able core (``add_request``, ``abort_request``, ``step``).
        max_num_seqs: most sequences (``n`` per request) running at once; others wait.
        metrics: optional :class:`~tensorstream.server.metrics.ServerMetrics` to update.
    """

    def __init__(self, engine: Any, *, max_num_seqs: int = 256, metrics: Any = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.engine = engine
        self.max_num_seqs = max_num_seqs
        self.metrics = metrics
        self._cond = threading.Condition()
        self._inbox: list[_Pending] = []
        self._aborts: list[str] = []
        self._commands: list[tuple[Callable[[Any], Any], concurrent.futures.Future]] = []
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._running: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0

    # -- called from any thread ---------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    @property
    def num_running(self) -> int:
        """Requests admitted to the engine and not finished."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a slot (including ones not yet picked up)."""
        return len(self._waiting) + len(self._inbox)

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        lora_request: Any = None,
    ) -> RequestStream:
        """Queue a request; call from a coroutine on the event loop that will read it.

        Returns:
            The request's stream; read it with ``updates()`` or ``result()``.

        Raises:
            RequestCancelled: the loop is shutting down.
        """
        stream = RequestStream(
            f"req-{next(self._ids)}", list(prompt_token_ids), asyncio.get_running_loop()
        )
        pending = _Pending(
            stream, list(prompt_token_ids), params, prompt, lora_request, time.monotonic()
        )
        with self._cond:
            if self._stopping:
                raise RequestCancelled("the server is shutting down")
            self._inbox.append(pending)
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (waiting or running); unknown or finished ids are ignored."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps.

        Returns:
            A future with ``fn``'s result or exception (``asyncio.wrap_future`` to await it).
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                future.set_exception(RequestCancelled("the server is shutting down"))
                return future
            self._commands.append((fn, future))
            self._cond.notify()
        return future

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still queued or running and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._inbox or self._aborts or self._commands or self._running or self._stopping
                ):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                commands, self._commands = self._commands, []
                stopping = self._stopping
            self._waiting.extend(inbox)
            for fn, future in commands:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        future.set_exception(exc)
            if stopping:
                self._cancel_all("the server is shutting down")
                return
            for request_id in aborts:
                self._abort(request_id)
            self._admit()
            if self._running:
                self._step()

    def _abort(self, request_id: str) -> None:
        for pending in self._waiting:
            if pending.stream.request_id == request_id:
                self._waiting.remove(pending)
                self._finish_metrics(pending, None, "abort")
                return
        pending = self._running.pop(request_id, None)
        if pending is not None:
            self.engine.abort_request(request_id)
            self._finish_metrics(pending, None, "abort")

    def _seats(self) -> int:
        return sum(p.params.n for p in self._running.values())

    def _admit(self) -> None:
        while self._waiting:
            pending = self._waiting[0]
            # A request wider than the whole budget still runs, alone.
            if self._running and self._seats() + pending.params.n > self.max_num_seqs:
                return
            self._waiting.popleft()
            kwargs: dict[str, Any] = {
                "prompt": pending.prompt,
                "request_id": pending.stream.request_id,
            }
            if pending.lora_request is not None:
                kwargs["lora_request"] = pending.lora_request
            try:
                self.engine.add_request(pending.prompt_token_ids, pending.params, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the request fails, the server lives
                if pending.lora_request is not None and self._running:
                    # Every adapter slot may be held by running requests: retry after a step.
                    self._waiting.appendleft(pending)
                    return
                self._deliver(pending.stream._fail, exc)
                continue
            self._running[pending.stream.request_id] = pending
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(pending.prompt_token_ids))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep serving
            logger.exception(
                "engine step failed; failing %d running request(s)", len(self._running)
            )
            for request_id, pending in list(self._running.items()):
                self.engine.abort_request(request_id)
                self._deliver(pending.stream._fail, exc)
                self._finish_metrics(pending, None, "error")
            self._running.clear()
            return
        self.steps += 1
        now = time.monotonic()
        for output in outputs:
            pending = self._running.get(output.request_id)
            if pending is None:
                continue  # aborted since it was stepped
            if pending.first_token is None:
                pending.first_token = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - pending.created)
            self._deliver(pending.stream._publish, output)
            if output.finished:
                del self._running[output.request_id]
                reason = output.outputs[0].finish_reason if output.outputs else "stop"
                self._finish_metrics(pending, output, reason or "stop")

    def _cancel_all(self, why: str) -> None:
        for pending in list(self._waiting) + list(self._running.values()):
            if pending.stream.request_id in self._running:
                self.engine.abort_request(pending.stream.request_id)
            self._deliver(pending.stream._fail, RequestCancelled(why))
        self._waiting.clear()
        self._running.clear()

    def _finish_metrics(self, pending: _Pending, output: RequestOutput | None, reason: str) -> None:
        if self.metrics is None:
            return
        self.metrics.finished.inc(1, reason)
        if output is not None:
            self.metrics.latency.observe(time.monotonic() - pending.created)
            self.metrics.generation_tokens.inc(sum(len(o.token_ids) for o in output.outputs))

    @staticmethod
    def _deliver(callback: Callable[..., None], arg: Any) -> None:
        try:
            callback.__self__._loop.call_soon_threadsafe(callback, arg)  # type: ignore[attr-defined]
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more
