"""Continuous batching: one thread owns the ``EngineCore``; HTTP handlers talk to it by queue.

The engine is not thread-safe and its ``step()`` blocks for a forward pass, so
a single background thread (:class:`EngineLoop`) does all engine work. Between
two steps it applies aborts, runs queued commands (adapter loads), and admits
waiting requests up to ``max_num_seqs`` running sequences, so a request that
arrives while a batch runs joins at the next step.

Admission is fair between HTTP requests, not first-come by prompt: one HTTP
request may carry many prompts, and each becomes an engine request tagged
with its HTTP request's *group*. Free seats go round-robin over the groups
that have something waiting, so a client sending a thousand prompts gets one
seat in turn with everyone else instead of holding the queue.

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
        # Set by result(): only the finished output wakes the reader, not every step's.
        self._final_only = False

    # Called on the event loop (scheduled by the engine thread).
    def _publish(self, output: RequestOutput) -> None:
        self._latest = output
        if output.finished or not self._final_only:
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
        """Wait for the finished output (woken once, not at every step)."""
        self._final_only = True
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
    group: object
    first_token: float | None = None
    last_output: float | None = None


class _FairQueue:
    """Waiting requests, one FIFO per group, served round-robin over the groups."""

    def __init__(self) -> None:
        self._groups: collections.OrderedDict[object, collections.deque[_Pending]] = (
            collections.OrderedDict()
        )
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Any:
        for queue in self._groups.values():
            yield from queue

    def push(self, pending: _Pending) -> None:
        self._groups.setdefault(pending.group, collections.deque()).append(pending)
        self._size += 1

    def peek(self) -> _Pending:
        """The next request to admit: the head of the group whose turn it is."""
        return next(iter(self._groups.values()))[0]

    def pop(self) -> _Pending:
        """Take :meth:`peek`'s request; its group goes to the back of the line."""
        group, queue = next(iter(self._groups.items()))
        pending = queue.popleft()
        del self._groups[group]
        if queue:
            self._groups[group] = queue  # re-inserted last: the next group's turn
        self._size -= 1
        return pending

    def push_front(self, pending: _Pending) -> None:
        """Put back a request :meth:`pop` took; its group is first again."""
        queue = self._groups.pop(pending.group, collections.deque())
        queue.appendleft(pending)
        self._groups[pending.group] = queue
        self._groups.move_to_end(pending.group, last=False)
        self._size += 1

    def remove(self, request_id: str) -> _Pending | None:
        for group, queue in self._groups.items():
            for pending in queue:
                if pending.stream.request_id == request_id:
                    queue.remove(pending)
                    if not queue:
                        del self._groups[group]
                    self._size -= 1
                    return pending
        return None

    def clear(self) -> None:
        self._groups.clear()
        self._size = 0


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
        self._waiting = _FairQueue()
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
        group: object = None,
    ) -> RequestStream:
        """Queue a request; call from a coroutine on the event loop that will read it.

        Args:
            group: the HTTP request this engine request belongs to; requests of one
                group share a turn in the round-robin admission (None: its own group).

        Returns:
            The request's stream; read it with ``updates()`` or ``result()``.

        Raises:
            RequestCancelled: the loop is shutting down.
        """
        stream = RequestStream(
            f"req-{next(self._ids)}", list(prompt_token_ids), asyncio.get_running_loop()
        )
        pending = _Pending(
            stream,
            list(prompt_token_ids),
            params,
            prompt,
            lora_request,
            time.monotonic(),
            stream.request_id if group is None else group,
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
                # Waiting requests count too: when a step finishes every running request,
                # the queue must be admitted now, not when the next HTTP request arrives.
                while not (
                    self._inbox
                    or self._aborts
                    or self._commands
                    or self._running
                    or self._waiting
                    or self._stopping
                ):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for pending in inbox:
                self._waiting.push(pending)
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
        pending = self._waiting.remove(request_id)
        if pending is not None:
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
            pending = self._waiting.peek()
            # A request wider than the whole budget still runs, alone.
            if self._running and self._seats() + pending.params.n > self.max_num_seqs:
                return
            self._waiting.pop()
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
                    self._waiting.push_front(pending)
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
        published = []
        for output in outputs:
            pending = self._running.get(output.request_id)
            if pending is None:
                continue  # aborted since it was stepped
            if self.metrics is not None:
                if pending.first_token is None:
                    self.metrics.ttft.observe(now - pending.created)
                elif pending.last_output is not None:
                    self.metrics.inter_token.observe(now - pending.last_output)
            if pending.first_token is None:
                pending.first_token = now
            pending.last_output = now
            published.append((pending.stream._publish, output))
            if output.finished:
                del self._running[output.request_id]
                reason = output.outputs[0].finish_reason if output.outputs else "stop"
                self._finish_metrics(pending, output, reason or "stop")
        self._deliver_all(published)

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
        self.metrics.finished(reason)
        if output is not None:
            now = time.monotonic()
            self.metrics.latency.observe(now - pending.created)
            generated = sum(len(o.token_ids) for o in output.outputs)
            self.metrics.generation_tokens.inc(generated)
            steps = max((len(o.token_ids) for o in output.outputs), default=0)
            if pending.first_token is not None and steps > 1:
                self.metrics.per_output_token.observe((now - pending.first_token) / (steps - 1))

    @staticmethod
    def _deliver_all(calls: list[tuple[Callable[..., None], Any]]) -> None:
        """A step's outputs handed to their event loops in one wake-up per loop, not one
        per request (each wake-up is a write to the loop's pipe and a GIL hand-over)."""
        by_loop: dict[Any, list[tuple[Callable[..., None], Any]]] = {}
        for callback, arg in calls:
            by_loop.setdefault(callback.__self__._loop, []).append((callback, arg))  # type: ignore[attr-defined]
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_run_calls, batch)
            except RuntimeError:
                pass  # the event loop is closed: nobody is listening any more

    @staticmethod
    def _deliver(callback: Callable[..., None], arg: Any) -> None:
        try:
            callback.__self__._loop.call_soon_threadsafe(callback, arg)  # type: ignore[attr-defined]
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


def _run_calls(calls: list[tuple[Callable[..., None], Any]]) -> None:
    for callback, arg in calls:
        callback(arg)
