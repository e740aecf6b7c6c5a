"""``SamplingParams``: how one request picks its tokens, validated up front (vLLM-shaped).

Fields mirror vLLM's names and meanings; values are checked when the object is
made, so a bad request fails before it reaches the engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tensorstream.errors import ConfigError

__all__ = ["SamplingParams"]

_EPS = 1e-5  # below this temperature sampling is treated as greedy, as in vLLM


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request.

    Attributes:
        temperature: 0 means greedy (argmax); higher is more random.
        top_p: keep the smallest set of tokens whose probability mass reaches this (0, 1].
        top_k: keep the k most likely tokens; -1 or 0 turns it off.
        max_tokens: most tokens to generate; None = until the model's context is full.
        stop: string(s) that end the output; the stop string itself is not returned.
        stop_token_ids: token ids that end the output (besides EOS).
        ignore_eos: keep generating past the EOS token.
        seed: per-request random seed; same seed, same output.
        n: how many completions to return for the prompt.
        repetition_penalty: > 1 discourages tokens already in prompt or output (HF style).
        presence_penalty: subtracted once from tokens that appear in the output [-2, 2].
        frequency_penalty: subtracted per occurrence in the output [-2, 2].
        logprobs: also return the log-probabilities of this many top tokens per step.
        skip_special_tokens: drop special tokens from the returned text.

    Example:
        >>> SamplingParams(temperature=0, max_tokens=8).greedy
        True
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Normalised forms, filled in __post_init__.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        def bad(message: str) -> ConfigError:
            return ConfigError(f"invalid SamplingParams: {message}")

        if (
            not _is_number(self.temperature)
            or self.temperature < 0
            or not math.isfinite(self.temperature)
        ):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not _is_int(self.n) or self.n < 1:
            raise bad(f"n must be a positive integer, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(f"{name} must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad(f"logprobs must be a non-negative integer or None, got {self.logprobs!r}")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop_strings", stops)
        ids = tuple(self.stop_token_ids or ())
        if any(not _is_int(i) or i < 0 for i in ids):
            raise bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature ~ 0)."""
        return self.temperature < _EPS

    @property
    def uses_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
