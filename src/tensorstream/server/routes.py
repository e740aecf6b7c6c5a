"""HTTP routes: models, completions, chat (SSE streaming), adapters, tokenize, health, metrics.

Handlers turn a request into token ids and ``SamplingParams``
(:mod:`~tensorstream.server.prompts`), submit one engine request per prompt to
the :class:`~tensorstream.server.batcher.EngineLoop` (all prompts of one HTTP
request share one turn in its round-robin admission), and format what comes
back (:mod:`~tensorstream.server.streaming`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tensorstream.engine.outputs import RequestOutput
from tensorstream.server import responses as fmt
from tensorstream.server.errors import APIError
from tensorstream.server.metrics import CONTENT_TYPE
from tensorstream.server.prompts import (
    chat_prompt,
    check_fanout,
    completion_prompts,
    holdback,
    sampling,
)
from tensorstream.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
    check_body,
)
from tensorstream.server.streaming import gather, sse_response

__all__ = ["router"]

router = APIRouter()


def _state(request: Request) -> Any:
    return request.app.state.ts


# -- utility routes ---------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the model is loaded (the gate answers 503 before)."""
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text (``vllm:*`` and ``tensorstream_*`` metrics)."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


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
    check_body(body)
    _check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' or 'messages'")
    if body.messages is not None:
        _, ids = await _chat(state, llm, body.messages, None, body.add_generation_prompt)
    else:
        if len(body.prompt) > state.options.max_prompt_chars:
            raise APIError(
                413,
                f"prompt has {len(body.prompt)} characters; the server accepts at most "
                f"{state.options.max_prompt_chars}",
                param="prompt",
            )
        ids = await asyncio.to_thread(
            lambda: list(
                llm.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
            )
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


@router.get("/v1/load_stats")
async def load_stats(request: Request) -> dict[str, Any]:
    """This process's start-up timeline and adapter loads (answered while loading too)."""
    state = _state(request)
    body = state.timeline.as_json(state.status, state.load_error)
    adapters = state.adapters
    body["server"] = {
        "served_model_name": state.options.served_model_name,
        "lora_enabled": adapters.enabled,
        "runtime_lora_updating": adapters.runtime_updates,
        "lora_allowed_roots": list(adapters.allowed_roots.display),
    }
    return body


# -- adapters ---------------------------------------------------------------------------


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRARequest, request: Request) -> PlainTextResponse:
    """Load a LoRA adapter (tensorized dir on local/S3/HTTP, optionally encrypted, or PEFT dir)."""
    state = _state(request)
    state.require_ready()
    check_body(body)
    started = state.timeline.now()
    try:
        await state.adapters.load_runtime(body.lora_name, body.lora_path, body.encryption_keyfile)
    except APIError as exc:
        state.metrics.adapter_loads.labels(
            result="refused" if exc.status == 403 else "failed"
        ).inc()
        raise
    state.metrics.adapter_loads.labels(result="ok").inc()
    state.timeline.adapter_loaded(
        body.lora_name, body.lora_path, "runtime", started, state.timeline.now()
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request) -> PlainTextResponse:
    state = _state(request)
    state.require_ready()
    state.adapters.check_runtime_updates()
    await state.adapters.unload(body.lora_name)
    state.timeline.adapter_unloaded(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


# -- generation -------------------------------------------------------------------------


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    state = _state(request)
    llm, loop = state.require_ready()
    check_body(body)
    lora = state.adapters.resolve(body.model)
    if body.echo:
        raise APIError(400, "echo=true is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    options = state.options
    prompts = await completion_prompts(
        llm,
        body.prompt,
        n=body.n,
        max_seqs=options.max_seqs_per_request,
        max_chars=options.max_prompt_chars,
    )
    k = body.logprobs
    params = [sampling(body, len(ids), llm.max_model_len, body.max_tokens, k) for _, ids in prompts]
    group = object()  # this HTTP request's turn in the fair admission
    streams = [
        loop.submit(ids, p, prompt=text, lora_request=lora, group=group)
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

        return sse_response(
            request,
            loop,
            streams,
            body.n,
            holdback(body.stop),
            chunk,
            usage_chunk if include_usage else None,
        )

    outs = await gather(request, loop, streams)
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
    check_body(body)
    lora = state.adapters.resolve(body.model)
    if body.chat_template is not None and not state.options.trust_request_chat_template:
        raise APIError(
            400,
            "chat_template in a request is refused; the operator allows it with "
            "--trust-request-chat-template",
            param="chat_template",
        )
    check_fanout(1, body.n, state.options.max_seqs_per_request)
    text, ids = await _chat(
        state, llm, body.messages, body.chat_template, body.add_generation_prompt
    )
    k = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling(body, len(ids), llm.max_model_len, max_tokens, k)
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

        return sse_response(
            request,
            loop,
            streams,
            body.n,
            holdback(body.stop),
            chunk,
            usage_chunk if include_usage else None,
        )

    outs = await gather(request, loop, streams)
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


async def _chat(
    state: Any, llm: Any, messages: list[Any], template: str | None, add_generation_prompt: bool
) -> tuple[str, list[int]]:
    return await chat_prompt(
        llm,
        state.renderer,
        messages,
        template,
        add_generation_prompt,
        max_chars=state.options.max_prompt_chars,
        timeout=state.options.chat_template_timeout,
    )
