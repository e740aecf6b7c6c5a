"""``SamplingParams``: how one request picks its tokens, validated up front (vLLM-shaped).

Fields mirror vLLM's names and meanings; values are checked when the object is
made, so a bad request fails before it reaches the engine. vLLM fields this engine
cannot honour (``bad_words``, ``prompt_logprobs``, structured outputs, beam search)
are accepted only at their "off" value; anything else is a ``ConfigError`` naming
the field, never a silently ignored setting.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
        min_tokens: generate at least this many tokens before EOS, stop tokens or stop
            strings may end the output.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely
            token's (after temperature); 0 turns it off.
        include_stop_str_in_output: keep the stop string that ended the output.
        logit_bias: token id -> value added to its logit before sampling (-100..100).
        allowed_token_ids: only these tokens may be generated.
        truncate_prompt_tokens: keep only the last k prompt tokens.
        detokenize: produce ``text``; False returns token ids only (no stop strings).
        spaces_between_special_tokens, bad_words, prompt_logprobs, best_of,
        use_beam_search, structured_outputs, guided_decoding, logits_processors,
        extra_args: vLLM fields accepted at their default; other values are refused.

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
    min_tokens: int = 0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: Sequence[str] | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    structured_outputs: Any = None
    guided_decoding: Any = None
    logits_processors: Any = None
    extra_args: Mapping[str, Any] | None = None
    # Normalised forms, filled in __post_init__.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    #: Token ids masked until ``min_tokens`` are out (EOS + stop ids; set by the engine).
    min_tokens_blocked: tuple[int, ...] = field(init=False, repr=False, default=())

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
        self._check_vllm_fields(bad)

    def _check_vllm_fields(self, bad: Any) -> None:
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise bad(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                ) from None
            if any(k < 0 or not -100 <= v <= 100 for k, v in bias.items()):
                raise bad("logit_bias needs token ids >= 0 and values in [-100, 100]")
            object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            if not allowed or any(not _is_int(i) or i < 0 for i in allowed):
                raise bad(
                    "allowed_token_ids must be a non-empty list of token ids, "
                    f"got {self.allowed_token_ids!r}"
                )
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise bad(
                "truncate_prompt_tokens must be a positive integer or None, "
                f"got {self.truncate_prompt_tokens!r}"
            )
        if not self.detokenize and self.stop_strings:
            raise bad("stop strings need detokenize=True (the text is what they match)")
        if self.best_of is not None and self.best_of != self.n:
            raise bad(f"best_of={self.best_of} is not supported; use n (got n={self.n})")
        refused = {
            "spaces_between_special_tokens": self.spaces_between_special_tokens is False,
            "bad_words": bool(self.bad_words),
            "prompt_logprobs": self.prompt_logprobs is not None,
            "use_beam_search": bool(self.use_beam_search),
            "structured_outputs": self.structured_outputs is not None,
            "guided_decoding": self.guided_decoding is not None,
            "logits_processors": bool(self.logits_processors),
        }
        for name, given in refused.items():
            if given:
                raise bad(
                    f"{name}={getattr(self, name)!r} is not supported by this engine; "
                    "leave it at its default"
                )

    def for_engine(self, eos_token_ids: Sequence[int]) -> SamplingParams:
        """A copy that knows which ids ``min_tokens`` must hold back (EOS + stop ids)."""
        if not self.min_tokens:
            return self
        blocked = set(self.stop_token_ids)
        if not self.ignore_eos:
            blocked.update(eos_token_ids)
        params = copy.copy(self)
        object.__setattr__(params, "min_tokens_blocked", tuple(sorted(blocked)))
        return params

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature ~ 0)."""
        return self.temperature < _EPS

    @property
    def uses_penalties(self) -> bool:
        """True when the logits need processing before sampling (``apply_penalties``):
        any of the three penalties, ``logit_bias``, ``allowed_token_ids`` or ``min_tokens``."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.min_tokens_blocked)
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
