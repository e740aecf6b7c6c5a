"""Request bodies of the HTTP API (OpenAI's shapes), validated with pydantic.

The models are strict about types (a string where a number belongs is a 400,
not a silent conversion). Fields they do not know are ignored, as OpenAI's own
API does, so newer clients keep working, except the OpenAI and vLLM fields
this server knows it does not implement (tools, response formats, guided
decoding...): :func:`check_body` answers 400 naming the field
unless its value means "not used", so a request never gets a 200 that
silently ignored what it asked for. Text must be valid Unicode (JSON can
carry lone UTF-16 surrogates, which no tokenizer accepts). Value checks that
need the model (context length, adapter names) happen in the routes;
sampling values are checked again by ``SamplingParams``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "LoadLoRARequest",
    "StreamOptions",
    "TokenizeRequest",
    "UnloadLoRARequest",
    "check_body",
]

_STRICT = ConfigDict(strict=True, extra="ignore")
# Request bodies keep unknown fields so check_body can refuse the unimplemented ones.
_REQUEST = ConfigDict(strict=True, extra="allow")

# Fields of OpenAI's or vLLM's API that are not implemented here, with the values that
# mean "not used" (client libraries send some of them by default).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # meaningless without tools
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "structured_outputs": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,),
    "logits_processors": (None, []),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "continue_final_message": (None, False),
    "documents": (None,),
    "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None,),
    "priority": (None, 0),
    "echo": (None, False),  # chat's echo (completions implement their own check)
}


def check_body(body: BaseModel) -> None:
    """Refuse lone surrogates anywhere in ``body`` and unimplemented fields that are used.

    Raises:
        APIError: 400 naming the field.
    """
    from tensorstream.server.errors import APIError

    where = _lone_surrogate(body.model_dump(), "")
    if where is not None:
        raise APIError(
            400,
            f"{where} contains a lone UTF-16 surrogate, which is not valid Unicode text; "
            "send surrogates only as pairs",
            param=where.split("[")[0].split(".")[0] or None,
        )
    for name, value in (body.model_extra or {}).items():
        accepted = _UNSUPPORTED.get(name)
        if accepted is not None and not any(
            value == ok and type(value) is type(ok) for ok in accepted
        ):
            raise APIError(
                400,
                f"{name!r} is not supported by this server; remove it (or send null)",
                param=name,
            )


def _lone_surrogate(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the request"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _REQUEST

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # torch seeds are 64-bit signed, as vLLM bounds them.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    # vLLM's sampling extensions, honoured by SamplingParams.
    min_p: float = Field(default=0.0, ge=0, le=1)
    min_tokens: int = Field(default=0, ge=0)
    # OpenAI sends token ids as JSON object keys, so strings.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``.

    ``prompt`` is a string, a list of strings, a list of token ids or a list of
    such lists; each prompt gets ``n`` choices. ``logprobs`` (0-20) asks for the
    top tokens' log-probabilities at each step.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One message of a conversation; ``content`` may be text or OpenAI's text parts."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text: parts of type ``text`` joined, other parts refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                from tensorstream.server.errors import APIError

                raise APIError(
                    400,
                    f"only text content parts are supported, got a part of type {part.get('type')!r}",
                    param="messages",
                )
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``; ``logprobs``/``top_logprobs`` as in OpenAI's chat API."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None


class LoadLoRARequest(BaseModel):
    """``POST /v1/load_lora_adapter``: a name and where the adapter lives.

    ``lora_path`` is a tensorized adapter directory (local, ``s3://``, ``http(s)://``)
    or a PEFT directory; ``encryption_keyfile`` decrypts an encrypted one.
    """

    model_config = _STRICT
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    encryption_keyfile: str | None = None


class UnloadLoRARequest(BaseModel):
    """``POST /v1/unload_lora_adapter``."""

    model_config = _STRICT
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``."""

    model_config = _STRICT
    model: str | None = None
    tokens: list[int]
