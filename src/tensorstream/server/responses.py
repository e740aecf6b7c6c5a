"""Engine outputs -> OpenAI response JSON: whole responses, stream chunks, logprobs, usage.

Pure functions plus :class:`ChoiceCursor`, which remembers how much of one
choice has been streamed so each chunk carries only what is new. Text that may
still change is held back: a trailing partial UTF-8 character (decoded as
U+FFFD) and, when stop strings are set, the last characters that could be the
start of one, so a streamed reply never shows text the final answer drops.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from tensorstream.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = [
    "ChoiceCursor",
    "chat_logprobs",
    "completion_logprobs",
    "new_id",
    "sse",
    "usage",
]


def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Seconds since the epoch, for ``created``."""
    return int(time.time())


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_text(tokenizer: Any, token: int, entry: Logprob | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token])


def completion_logprobs(
    tokenizer: Any,
    token_ids: list[int],
    steps: list[dict[int, Logprob]],
    k: int,
    text_start: int = 0,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``token_ids``.

    Args:
        tokenizer: decodes token ids.
        token_ids: chosen tokens, one per step.
        steps: per step, token id -> ``Logprob`` (top ``k`` plus the chosen one).
        k: how many top alternatives were asked for.
        text_start: character offset of the first token in the choice's text.
    """
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_start
    for token, step in zip(token_ids, steps, strict=False):
        entry = step.get(token)
        text = _token_text(tokenizer, token, entry)
        tokens.append(text)
        token_logprobs.append(entry.logprob if entry is not None else None)
        ranked = sorted(step.items(), key=lambda item: item[1].rank)[:k] if k else []
        tops.append({_token_text(tokenizer, t, e): e.logprob for t, e in ranked} if k else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], steps: list[dict[int, Logprob]], k: int
) -> dict[str, Any]:
    """The chat ``logprobs`` object (``{"content": [...]}``) for ``token_ids``."""
    content = []
    for token, step in zip(token_ids, steps, strict=False):
        entry = step.get(token)
        text = _token_text(tokenizer, token, entry)
        ranked = sorted(step.items(), key=lambda item: item[1].rank)[:k]
        content.append(
            {
                "token": text,
                "logprob": entry.logprob if entry is not None else None,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (alt := _token_text(tokenizer, t, e)),
                        "logprob": e.logprob,
                        "bytes": list(alt.encode("utf-8")),
                    }
                    for t, e in ranked
                ],
            }
        )
    return {"content": content}


class ChoiceCursor:
    """How much of one streamed choice the client has already received.

    Args:
        holdback: characters to keep back until the choice finishes (longest stop string - 1).
    """

    def __init__(self, holdback: int = 0) -> None:
        self.holdback = holdback
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False

    def advance(self, output: CompletionOutput) -> tuple[str, int, int] | None:
        """Take what is new in ``output``.

        Returns:
            ``(text_delta, first_new_token, end_token)`` or None when nothing is new
            (or the choice was already finished).
        """
        if self.done:
            return None
        finished = output.finish_reason is not None
        text = output.text
        safe = len(text)
        if not finished:
            safe = max(self.sent_chars, safe - self.holdback)
            while safe > self.sent_chars and text[safe - 1] == "\ufffd":
                safe -= 1  # an incomplete multi-byte character; its next token completes it
        delta = text[self.sent_chars : safe] if safe > self.sent_chars else ""
        start, end = self.sent_tokens, len(output.token_ids)
        self.sent_chars = max(self.sent_chars, safe)
        self.sent_tokens = end
        self.done = finished
        if not delta and start == end and not finished:
            return None
        return delta, start, end


def finish_reason(output: CompletionOutput) -> str | None:
    """OpenAI's finish reason ("stop", "length"); aborted choices report None."""
    reason = output.finish_reason
    return reason if reason in ("stop", "length") else None


def completion_tokens(outputs: list[RequestOutput]) -> int:
    """Generated tokens over every choice of every request."""
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)
