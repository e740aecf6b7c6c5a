"""Result types of generation, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "Logprob", "RequestOutput"]


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one candidate token at one step.

    Attributes:
        logprob: natural-log probability under the model's raw distribution.
        rank: 1 = most likely token at that step.
        decoded_token: the token's text.
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: which of the request's ``n`` completions this is.
        text: generated text so far (stop string removed).
        token_ids: generated token ids.
        cumulative_logprob: sum of the chosen tokens' log-probabilities.
        logprobs: per step, token id -> :class:`Logprob` for the top ``logprobs`` tokens and
            the chosen one; None unless asked for.
        finish_reason: "stop" (EOS, stop token or string), "length", or None while running.
        stop_reason: the stop string or stop token id that ended it; None for EOS/length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence has stopped."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All completions of one request, as of the latest engine step.

    Attributes:
        request_id: the id given to (or made by) the engine.
        prompt: the prompt text, when the request came as text.
        prompt_token_ids: the tokenized prompt.
        outputs: one :class:`CompletionOutput` per ``n``.
        finished: True when every completion has stopped.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
