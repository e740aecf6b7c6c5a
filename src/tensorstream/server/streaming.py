"""Waiting for engine requests on behalf of an HTTP request: whole answers and SSE streams.

A client that goes away has its engine requests aborted: streamed ones when
the response generator is cancelled, whole ones by a watcher that polls the
connection while waiting. Either way the server logs one INFO line, not a
``CancelledError`` traceback: a client hanging up is not a server error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tensorstream.engine.outputs import RequestOutput
from tensorstream.errors import ConfigError
from tensorstream.server import responses as fmt
from tensorstream.server.batcher import RequestCancelled, RequestStream
from tensorstream.server.errors import APIError, error_body

__all__ = ["ClientDisconnected", "gather", "sse_response"]

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.25


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def gather(request: Request, loop: Any, streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream to finish; abort them all if the client goes away.

    Raises:
        ClientDisconnected: the client went away (its requests are aborted).
        APIError: 400 for a request the engine refused, 503 when the server shuts down.
    """
    work = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))
    gone = False

    async def watch() -> None:
        nonlocal gone
        while not work.done():
            if await request.is_disconnected():
                gone = True
                work.cancel()
                return
            await asyncio.sleep(_DISCONNECT_POLL_S)

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # the server itself cancelled this handler
        logger.info("client %s disconnected; aborted %d request(s)", _peer(request), len(streams))
        raise ClientDisconnected() from None
    except ConfigError as exc:
        raise APIError(400, str(exc)) from exc
    except RequestCancelled as exc:
        raise APIError(503, f"the request was cancelled: {exc}") from exc
    finally:
        watcher.cancel()
        for s in streams:
            loop.abort(s.request_id)  # no-op for finished requests


def sse_response(
    request: Request,
    loop: Any,
    streams: list[RequestStream],
    n: int,
    holdback: int,
    chunk: Any,
    usage_chunk: Any,
) -> StreamingResponse:
    """An SSE response of ``chunk(...)`` events, an optional usage event, then ``[DONE]``."""

    async def events() -> AsyncIterator[str]:
        cursors = {
            (i, j): fmt.ChoiceCursor(holdback) for i in range(len(streams)) for j in range(n)
        }
        finals: dict[int, RequestOutput] = {}
        complete = False
        try:
            async for index, out in _merge(streams):
                for c in out.outputs:
                    step = cursors[(index, c.index)].advance(c)
                    if step is not None:
                        delta, start, end = step
                        yield fmt.sse(chunk(index, c, delta, (start, end)))
                if out.finished:
                    finals[index] = out
            if usage_chunk is not None:
                yield fmt.sse(usage_chunk([finals[i] for i in sorted(finals)]))
            complete = True
        except ConfigError as exc:
            complete = True
            yield fmt.sse(error_body(400, str(exc)))
        except RequestCancelled as exc:
            complete = True
            yield fmt.sse(error_body(503, f"the request was cancelled: {exc}"))
        except Exception as exc:  # noqa: BLE001 - the stream reports it; the server lives
            complete = True
            logger.exception("generation failed")
            yield fmt.sse(error_body(500, f"generation failed ({type(exc).__name__})"))
        finally:
            # Runs on normal end, on error, and when the client disconnects (cancelled).
            if not complete:
                logger.info(
                    "client %s disconnected from a stream; aborted %d request(s)",
                    _peer(request),
                    len(streams),
                )
            for s in streams:
                loop.abort(s.request_id)
        yield fmt.sse("[DONE]")

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _peer(request: Request) -> str:
    client = request.client
    return f"{client.host}:{client.port}" if client else "?"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams' updates as ``(stream_index, output)``."""
    if len(streams) == 1:
        async for out in streams[0].updates():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream.updates():
                await queue.put((index, out))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the reader
            await queue.put((index, exc))
            return
        await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
