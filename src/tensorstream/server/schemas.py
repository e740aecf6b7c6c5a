"""Request bodies of the HTTP API (OpenAI's shapes), validated with pydantic.

The models are strict about types (a string where a number belongs is a 400,
not a silent conversion) and ignore fields they do not know, as OpenAI's own
API does, so newer clients keep working. Value checks that need the model
(context length, adapter names) happen in the routes; sampling values are
checked again by ``SamplingParams``.
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
]

_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""

    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
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
