"""From a request body to token ids and ``SamplingParams``, within the server's bounds.

Everything here runs before a request reaches the engine, and everything a
client controls is bounded: prompts x ``n`` per request, characters of prompt
text, and the time and output size of a chat template. Tokenizing and
rendering run in worker threads, so a large prompt never stalls the event
loop that answers ``/health`` and streams other clients' tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any

from tensorstream.engine.sampling import SamplingParams
from tensorstream.errors import ConfigError
from tensorstream.server.errors import APIError
from tensorstream.server.render import BoundedRunner, WorkTimeout

__all__ = [
    "chat_prompt",
    "check_fanout",
    "completion_prompts",
    "holdback",
    "sampling",
]


def check_fanout(prompts: int, n: int, limit: int) -> None:
    """Refuse a request whose prompts x ``n`` exceed ``limit`` sequences.

    Raises:
        APIError: 400 naming the limit and the server flag that sets it.
    """
    if prompts * n > limit:
        raise APIError(
            400,
            f"this request asks for {prompts} prompt(s) x n={n} = {prompts * n} sequences; "
            f"the server allows at most {limit} per request (--max-seqs-per-request); "
            "split it into several requests",
            param="prompt" if prompts > 1 else "n",
        )


def _check_chars(total: int, limit: int, param: str) -> None:
    if total > limit:
        raise APIError(
            413,
            f"the request carries {total} characters of {param}; the server accepts at most "
            f"{limit} per request; send less text",
            param=param,
        )


async def completion_prompts(
    llm: Any, prompt: Any, *, n: int, max_seqs: int, max_chars: int
) -> list[tuple[str | None, list[int]]]:
    """Token ids (with the text, for string prompts) of a completion request's prompts.

    Raises:
        APIError: 400 for an empty prompt, token ids outside the vocabulary or too many
            prompts x ``n``; 413 for too much text.
    """
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", param="prompt")
    check_fanout(len(items), n, max_seqs)
    _check_chars(sum(len(i) for i in items if isinstance(i, str)), max_chars, "prompt")
    vocab = len(llm.tokenizer)
    for item in items:
        if not isinstance(item, str) and any(t < 0 or t >= vocab for t in item):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")

    def tokenize() -> list[tuple[str | None, list[int]]]:
        return [
            (item, list(llm.tokenizer(item)["input_ids"]))
            if isinstance(item, str)
            else (None, list(item))
            for item in items
        ]

    result = await asyncio.to_thread(tokenize)
    if any(not ids for _, ids in result):
        raise APIError(400, "a prompt is empty; give at least one token", param="prompt")
    return result


async def chat_prompt(
    llm: Any,
    runner: BoundedRunner,
    messages: list[Any],
    template: str | None,
    add_generation_prompt: bool,
    *,
    max_chars: int,
    timeout: float,
) -> tuple[str, list[int]]:
    """Render the chat template in a worker thread under ``timeout``; return text and ids.

    Raises:
        APIError: 400 without a template or when it fails or runs past ``timeout``,
            413 for too much message text or a rendered prompt over ``max_chars``.
    """
    tokenizer = llm.tokenizer
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400, "this model's tokenizer has no chat template; use /v1/completions instead"
        )
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    _check_chars(sum(len(m["content"]) for m in conversation), max_chars, "messages")

    def render() -> tuple[str, list[int]]:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        if len(text) > max_chars:  # checked before tokenizing it
            return text, []
        # The template already carries BOS and friends; the tokenizer must not add more.
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])

    try:
        text, ids = await runner.run(render, timeout=timeout)
    except WorkTimeout as exc:
        raise APIError(
            400,
            f"the chat template took longer than {timeout:g} s to render for these messages "
            "(--chat-template-timeout); send fewer or shorter messages",
            param="messages",
        ) from exc
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    _check_chars(len(text), max_chars, "rendered chat template")
    return text, ids


def sampling(
    body: Any, prompt_len: int, max_model_len: int, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    """``SamplingParams`` for one prompt of ``body``, fitted to the context length.

    Raises:
        APIError: 400 when the prompt (plus ``max_tokens``) does not fit, or a value is bad.
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len}; shorten the prompt",
            param="prompt",
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
            min_p=body.min_p,
            min_tokens=body.min_tokens,
            logit_bias=_token_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )
    except ConfigError as exc:
        raise APIError(400, str(exc)) from exc


def _token_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` keys are token ids written as JSON strings."""
    if bias is None:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError as exc:
        raise APIError(
            400, f"logit_bias keys must be token ids, got {sorted(bias)[:3]!r}", param="logit_bias"
        ) from exc


def holdback(stop: str | list[str] | None) -> int:
    """Characters a stream holds back so a stop string is never half-sent."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return max((len(s) for s in stops), default=1) - 1
