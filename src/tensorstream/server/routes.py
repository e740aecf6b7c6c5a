"""HTTP routes: models, completions, chat (SSE streaming), adapters, tokenize, health, metrics.

Handlers turn a request into token ids and ``SamplingParams``, submit one
engine request per prompt to the :class:`~tensorstream.server.batcher.EngineLoop`,
and format what comes back. A client that disconnects has its requests
aborted: streamed ones when the response generator is cancelled, whole ones by
a watcher that polls the connection while waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tensorstream.engine.outputs import RequestOutput
from tensorstream.engine.sampling import SamplingParams
from tensorstream.errors import ConfigError
from tensorstream.server import responses as fmt
from tensorstream.server.batcher import RequestStream
from tensorstream.server.errors import APIError, error_body
from tensorstream.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
)

__all__ = ["router"]

router = APIRouter()

_DISCONNECT_POLL_S = 0.25


def _state(request: Request) -> Any:
    return request.app.state.ts


# -- utility routes ---------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded (the gate answers 503 before)."""
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text."""
    return PlainTextResponse(
        _state(request).metrics.render(), media_type="text/plain; version=0.0.4"
    )


@router.get("/version")
async def version(request: Request) -> dict[str, str]:
    return {"version": request.app.version}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The base model and every loaded adapter (``parent`` = the base model)."""
    state = _state(request)
    llm, _ = state.require_ready()
    created = int(state.started)
    base = {
        "id": state.options.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "tensorstream",
        "root": str(llm.model_name),
        "parent": None,
        "max_model_len": llm.max_model_len,
    }
    return {"object": "list", "data": [base, *state.adapters.cards(created)]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    llm, _ = state.require_ready()
    _check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' or 'messages'")
    if body.messages is not None:
        _, ids = _chat_prompt(llm, body.messages, None, body.add_generation_prompt)
    else:
        ids = list(
            llm.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        )
    return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    llm, _ = state.require_ready()
    _check_model(state, body.model)
    vocab = len(llm.tokenizer)
    bad = [t for t in body.tokens if t < 0 or t >= vocab]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return {"prompt": llm.tokenizer.decode(body.tokens)}


# -- adapters ---------------------------------------------------------------------------


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> PlainTextResponse:
    """Load a LoRA adapter (tensorized dir on local/S3/HTTP, optionally encrypted, or PEFT dir)."""
    state = _state(request)
    state.require_ready()
    await state.adapters.load(body.lora_name, body.lora_path, body.encryption_keyfile)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> PlainTextResponse:
    state = _state(request)
    state.require_ready()
    await state.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


# -- generation -------------------------------------------------------------------------


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    llm, loop = state.require_ready()
    lora = state.adapters.resolve(body.model)
    if body.echo:
        raise APIError(400, "echo=true is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    prompts = _completion_prompts(llm, body.prompt)
    k = body.logprobs
    params = [
        _sampling(body, len(ids), llm.max_model_len, body.max_tokens, k) for _, ids in prompts
    ]
    streams = [
        loop.submit(ids, p, prompt=text, lora_request=lora)
        for (text, ids), p in zip(prompts, params, strict=True)
    ]
    model = body.model or state.options.served_model_name
    rid, created = fmt.new_id("cmpl"), fmt.now()

    def choice(prompt_index: int, n: int, c: Any, text: str, tokens: tuple[int, int]) -> dict:
        lp = None
        if k is not None and c.logprobs is not None:
            start, end = tokens
            lp = fmt.completion_logprobs(
                llm.tokenizer, c.token_ids[start:end], c.logprobs[start:end], k
            )
        return {
            "index": prompt_index * n + c.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": fmt.finish_reason(c) if c.finish_reason else None,
        }

    if body.stream:
        holdback = _holdback(body.stop)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(prompt_index: int, c: Any, delta: str, tokens: tuple[int, int]) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice(prompt_index, body.n, c, delta, tokens)],
            }

        def usage_chunk(outs: list[RequestOutput]) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(outs),
            }

        return _sse_response(
            loop, streams, body.n, holdback, chunk, usage_chunk if include_usage else None
        )

    outs = await _gather(request, loop, streams)
    choices = [
        choice(i, body.n, c, c.text, (0, len(c.token_ids)))
        for i, out in enumerate(outs)
        for c in out.outputs
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(outs),
    }


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    state = _state(request)
    llm, loop = state.require_ready()
    lora = state.adapters.resolve(body.model)
    text, ids = _chat_prompt(llm, body.messages, body.chat_template, body.add_generation_prompt)
    k = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = _sampling(body, len(ids), llm.max_model_len, max_tokens, k)
    streams = [loop.submit(ids, params, prompt=text, lora_request=lora)]
    model = body.model or state.options.served_model_name
    rid, created = fmt.new_id("chatcmpl"), fmt.now()

    def logprobs_for(c: Any, start: int, end: int) -> dict | None:
        if k is None or c.logprobs is None:
            return None
        return fmt.chat_logprobs(llm.tokenizer, c.token_ids[start:end], c.logprobs[start:end], k)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        opened: set[int] = set()

        def chunk(_prompt_index: int, c: Any, delta: str, tokens: tuple[int, int]) -> dict:
            message: dict[str, Any] = {"content": delta}
            if c.index not in opened:  # the first chunk of a choice names the role
                opened.add(c.index)
                message["role"] = "assistant"
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": c.index,
                        "delta": message,
                        "logprobs": logprobs_for(c, *tokens),
                        "finish_reason": fmt.finish_reason(c) if c.finish_reason else None,
                    }
                ],
            }

        def usage_chunk(outs: list[RequestOutput]) -> dict:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(outs),
            }

        return _sse_response(
            loop,
            streams,
            body.n,
            _holdback(body.stop),
            chunk,
            usage_chunk if include_usage else None,
        )

    outs = await _gather(request, loop, streams)
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs_for(c, 0, len(c.token_ids)),
            "finish_reason": fmt.finish_reason(c),
        }
        for c in outs[0].outputs
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(outs),
    }


# -- helpers ----------------------------------------------------------------------------


def _check_model(state: Any, model: str | None) -> None:
    state.adapters.resolve(model)  # raises 404 for unknown names


def _usage(outs: list[RequestOutput]) -> dict[str, int]:
    return fmt.usage(sum(len(o.prompt_token_ids) for o in outs), fmt.completion_tokens(outs))


def _holdback(stop: str | list[str] | None) -> int:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return max((len(s) for s in stops), default=1) - 1


def _completion_prompts(llm: Any, prompt: Any) -> list[tuple[str | None, list[int]]]:
    vocab = len(llm.tokenizer)
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", param="prompt")
    result = []
    for item in items:
        if isinstance(item, str):
            ids = list(llm.tokenizer(item)["input_ids"])
            result.append((item, ids))
        else:
            if any(t < 0 or t >= vocab for t in item):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            result.append((None, list(item)))
        if not result[-1][1]:
            raise APIError(400, "a prompt is empty; give at least one token", param="prompt")
    return result


def _chat_prompt(
    llm: Any, messages: list[Any], template: str | None, add_generation_prompt: bool
) -> tuple[str, list[int]]:
    tokenizer = llm.tokenizer
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400, "this model's tokenizer has no chat template; use /v1/completions instead"
        )
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    # The template already carries BOS and friends; the tokenizer must not add more.
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sampling(
    body: Any, prompt_len: int, max_model_len: int, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    room = max_model_len - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len}; shorten the prompt",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, but you asked for "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the "
            "completion); lower max_tokens or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k is None else body.top_k,
            max_tokens=max_tokens,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            seed=body.seed,
            n=body.n,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logprobs=logprobs,
        )
    except ConfigError as exc:
        raise APIError(400, str(exc)) from exc


async def _gather(request: Request, loop: Any, streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream to finish; abort them all if the client goes away."""
    work = asyncio.ensure_future(asyncio.gather(*(s.result() for s in streams)))

    async def watch() -> None:
        while not work.done():
            if await request.is_disconnected():
                work.cancel()
                return
            await asyncio.sleep(_DISCONNECT_POLL_S)

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except ConfigError as exc:
        raise APIError(400, str(exc)) from exc
    finally:
        watcher.cancel()
        for s in streams:
            loop.abort(s.request_id)  # no-op for finished requests


def _sse_response(
    loop: Any,
    streams: list[RequestStream],
    n: int,
    holdback: int,
    chunk: Any,
    usage_chunk: Any,
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        cursors = {
            (i, j): fmt.ChoiceCursor(holdback) for i in range(len(streams)) for j in range(n)
        }
        finals: dict[int, RequestOutput] = {}
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
        except ConfigError as exc:
            yield fmt.sse(error_body(400, str(exc)))
        except Exception as exc:  # noqa: BLE001 - the stream reports it; the server lives
            yield fmt.sse(error_body(500, f"generation failed: {type(exc).__name__}: {exc}"))
        finally:
            # Runs on normal end, on error, and when the client disconnects (cancelled).
            for s in streams:
                loop.abort(s.request_id)
        yield fmt.sse("[DONE]")

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


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
