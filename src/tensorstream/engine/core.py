"""The step-able generation engine: requests join between steps, each step adds one token.

``EngineCore`` owns the model's KV caches and the running requests. Callers
``add_request`` at any time; each ``step()`` first prefills the requests that
arrived since the last step (as one left-padded batch, a *cohort* with its own
KV cache), then decodes one token for every running sequence, and returns a
``RequestOutput`` for each request that advanced. Finished sequences leave
their cohort's batch at once, so a long request never keeps short ones' rows
alive. ``LLM.generate`` drives ``step()`` until nothing is left; a server can
interleave ``add_request`` and ``step()`` for continuous batching.

Before each step, running cohorts are merged into one batch where their caches
allow it (``engine/cohorts.py``: left-padded, within a padding bound), so many
clients arriving at different steps still cost one forward pass per step.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorstream.engine.cohorts import can_merge, merge_caches, trim_left_padding
from tensorstream.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tensorstream.engine.sampler import apply_penalties, pick_token, top_logprobs
from tensorstream.engine.sampling import SamplingParams
from tensorstream.errors import ConfigError

__all__ = ["EngineCore"]


@dataclass
class _Sequence:
    request: _Request
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    prompt_tensor: torch.Tensor
    sequences: list[_Sequence] = field(default_factory=list)
    adapter: str | None = None  # LoRA adapter name inside the model; None = base model

    def output(self) -> RequestOutput:
        outputs = [s.output() for s in self.sequences]
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_token_ids),
            outputs,
            all(o.finish_reason is not None for o in outputs),
        )


@dataclass
class _Cohort:
    """Sequences that were prefilled together and share one KV cache (one row each)."""

    sequences: list[_Sequence]
    cache: Any
    mask: torch.Tensor  # [rows, cached length]; 0 marks left padding


class EngineCore:
    """Step-wise batched generation over a transformers causal LM.

    Args:
        model: the causal LM (eval mode).
        tokenizer: its tokenizer (used to detokenize and for EOS/pad ids).
        max_model_len: most tokens (prompt + output) per sequence.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        seed: seeds the generator of requests that bring no seed of their own.
        lora_manager: a :class:`~tensorstream.engine.lora.LoRAManager` over ``model``;
            without one, requests with a ``lora_request`` are refused.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: int,
        eos_token_ids: set[int],
        seed: int | None = None,
        lora_manager: Any = None,
    ) -> None:
        self.model = model
        self.lora_manager = lora_manager
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = next(model.parameters()).device
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (min(eos_token_ids) if eos_token_ids else 0)
        self._seeder = torch.Generator().manual_seed(seed) if seed is not None else None
        self._ids = itertools.count()
        self._waiting: list[_Request] = []
        self._cohorts: list[_Cohort] = []
        self._requests: dict[str, _Request] = {}
        forward = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"
        self._pass_positions = "position_ids" in forward
        self._keep_last = "logits_to_keep" in forward
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None:
            head.register_forward_pre_hook(_standard_strides)

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        lora_request: Any = None,
    ) -> str:
        """Queue a request; it is prefilled at the next :meth:`step`.

        Args:
            prompt_token_ids: the prompt's tokens.
            params: how to sample.
            prompt: the prompt's text, echoed in outputs.
            request_id: an id of the caller's choosing; default a counter.
            lora_request: a ``LoRARequest`` whose adapter this request uses (loaded on
                first use, kept loaded while the request runs).

        Returns:
            The request id.

        Raises:
            ConfigError: empty prompt, a prompt that fills the context, a duplicate id,
                or a ``lora_request`` without LoRA support (or an unusable adapter).
        """
        if params.truncate_prompt_tokens is not None:
            prompt_token_ids = list(prompt_token_ids)[-params.truncate_prompt_tokens :]
        params = params.for_engine(sorted(self.eos_token_ids))
        if not prompt_token_ids:
            raise ConfigError("the prompt is empty; give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}; shorten it or raise max_model_len"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise ConfigError(f"request id {request_id!r} is already running")
        adapter = None
        if lora_request is not None:
            if self.lora_manager is None:
                raise ConfigError(
                    "a lora_request was given but LoRA is not enabled; build the LLM with "
                    "enable_lora=True (vllm serve: --enable-lora)"
                )
            adapter = self.lora_manager.acquire(lora_request)
        request = _Request(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            self._generator_for(params),
            torch.tensor(prompt_token_ids, dtype=torch.long, device=self.device),
            adapter=adapter,
        )
        request.sequences = [
            _Sequence(request, i, logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)
        ]
        self._requests[request_id] = request
        self._waiting.append(request)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its rows leave the batch at the next step. Unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._release(request)
        if request in self._waiting:
            self._waiting.remove(request)
        for seq in request.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def _generator_for(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        if params.seed is not None:
            seed = params.seed
        elif self._seeder is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeder))
        else:
            return None  # torch's global RNG
        return torch.Generator(device=self.device).manual_seed(seed)

    # -- stepping -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Prefill newly added requests, decode one token for every running sequence.

        Returns:
            One ``RequestOutput`` per request that advanced this step (``finished`` set on
            its last one). Finished requests are forgotten afterwards.
        """
        touched: dict[str, _Request] = {}
        self._merge_cohorts()
        # Cohorts running before this step decode; new arrivals get their first token
        # from the prefill, so each sequence advances exactly one token per step.
        for cohort in list(self._cohorts):
            self._decode(cohort, touched)
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            self._prefill(waiting, touched)
        outputs = [request.output() for request in touched.values()]
        for out in outputs:
            if out.finished:
                request = self._requests.pop(out.request_id, None)
                if request is not None:
                    self._release(request)
        return outputs

    def _merge_cohorts(self) -> None:
        """Fold running cohorts into as few batches as the padding bound allows."""
        if len(self._cohorts) < 2:
            return
        merged: list[_Cohort] = []
        for cohort in sorted(self._cohorts, key=lambda c: -c.mask.shape[1]):
            for group in merged:
                caches, masks = [group.cache, cohort.cache], [group.mask, cohort.mask]
                if can_merge(caches, masks):
                    group.cache, group.mask = merge_caches(caches, masks)
                    group.sequences = group.sequences + cohort.sequences
                    break
            else:
                merged.append(cohort)
        self._cohorts = merged

    def _release(self, request: _Request) -> None:
        if request.adapter is not None and self.lora_manager is not None:
            self.lora_manager.release(request.adapter)
            request.adapter = None

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
        adapters: list[str | None],
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            self._cache_kw: cache,
            "use_cache": True,
        }
        if self._pass_positions:
            # Left padding: a row's positions count its real tokens only, as in HF generate.
            positions = mask.long().cumsum(-1) - 1
            positions.masked_fill_(mask == 0, 0)
            kwargs["position_ids"] = positions[:, -input_ids.shape[1] :]
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        if self.lora_manager is None:
            return self.model(**kwargs).logits[:, -1, :]
        with self.lora_manager.activate(adapters):  # row i uses adapters[i]
            return self.model(**kwargs).logits[:, -1, :]

    def _prefill(self, requests: list[_Request], touched: dict[str, _Request]) -> None:
        from transformers import DynamicCache

        width = max(len(r.prompt_token_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):
            n = len(request.prompt_token_ids)
            input_ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
            mask[row, width - n :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, mask, cache, [r.adapter for r in requests])
        # n > 1: every completion of a prompt starts from that prompt's cache row.
        rows = [row for row, request in enumerate(requests) for _ in request.sequences]
        sequences = [seq for request in requests for seq in request.sequences]
        if rows != list(range(len(requests))):
            index = torch.tensor(rows, device=self.device)
            cache.batch_select_indices(index)
            logits, mask = logits[index], mask[index]
        cohort = _Cohort(sequences, cache, mask)
        self._cohorts.append(cohort)
        self._sample(cohort, logits, touched)

    def _decode(self, cohort: _Cohort, touched: dict[str, _Request]) -> None:
        last = torch.tensor([[seq.token_ids[-1]] for seq in cohort.sequences], device=self.device)
        cohort.mask = torch.cat(
            [cohort.mask, cohort.mask.new_ones((cohort.mask.shape[0], 1))], dim=1
        )
        adapters = [seq.request.adapter for seq in cohort.sequences]
        logits = self._forward(last, cohort.mask, cohort.cache, adapters)
        self._sample(cohort, logits, touched)

    def _sample(self, cohort: _Cohort, logits: torch.Tensor, touched: dict[str, _Request]) -> None:
        self._sample_sequences(cohort.sequences, logits, touched)
        keep = [row for row, seq in enumerate(cohort.sequences) if seq.finish_reason is None]
        if len(keep) == len(cohort.sequences):
            return
        if not keep:
            self._cohorts.remove(cohort)
            return
        index = torch.tensor(keep, device=self.device)
        cohort.cache.batch_select_indices(index)
        cohort.mask = trim_left_padding(cohort.cache, cohort.mask[index])
        cohort.sequences = [cohort.sequences[row] for row in keep]

    def _sample_sequences(
        self, sequences: list[_Sequence], logits: torch.Tensor, touched: dict[str, _Request]
    ) -> None:
        """Pick each row's token with the sampler functions and record it (row i = sequences[i])."""
        logits = logits.float()
        # Raw-model log-probs (before penalties/temperature), as vLLM reports them.
        logprobs = torch.log_softmax(logits, dim=-1)
        for row, seq in enumerate(sequences):
            if seq.finish_reason is not None:  # aborted since the last step
                continue
            params = seq.request.params
            row_logits = logits[row]
            if params.uses_penalties:
                output_ids = torch.tensor(seq.token_ids, dtype=torch.long, device=self.device)
                row_logits = apply_penalties(
                    row_logits, params, seq.request.prompt_tensor, output_ids
                )
            token = pick_token(row_logits, params, seq.request.generator)
            row_logprobs = logprobs[row]
            seq.cumulative_logprob += float(row_logprobs[token])
            if seq.logprobs is not None:
                seq.logprobs.append(
                    top_logprobs(row_logprobs, token, params.logprobs, self._decode_one)
                )
            self._append(seq, token)
            touched[seq.request.request_id] = seq.request

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _stops(self, seq: _Sequence, token: int, previous: int) -> bool:
        """End ``seq`` on EOS, a stop token or a stop string; True when it ended."""
        params = seq.request.params
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
            return True
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return True
        if params.stop_strings:
            longest = max(len(s) for s in params.stop_strings)
            start = max(0, previous - longest + 1)
            hits = [(seq.text.find(s, start), s) for s in params.stop_strings]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, stop = min(hits)
                end = at + len(stop) if params.include_stop_str_in_output else at
                seq.text = seq.text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        return False

    def _append(self, seq: _Sequence, token: int) -> None:
        """Record ``token``, update the text, and decide whether the sequence stops."""
        params = seq.request.params
        seq.token_ids.append(token)
        previous = len(seq.text)
        if params.detokenize:
            seq.text = self.tokenizer.decode(
                seq.token_ids, skip_special_tokens=params.skip_special_tokens
            )
        # Until min_tokens are out only the length may end it (the sampler masks EOS/stop ids).
        if len(seq.token_ids) >= params.min_tokens and self._stops(seq, token, previous):
            return
        total = len(seq.request.prompt_token_ids) + len(seq.token_ids)
        if (params.max_tokens is not None and len(seq.token_ids) >= params.max_tokens) or (
            total >= self.max_model_len
        ):
            seq.finish_reason = "length"


def _standard_strides(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Give the LM head's input textbook strides (and a contiguous layout).

    ``logits_to_keep=1`` hands the head a slice whose size-1 dims keep the parent's
    strides. Torch's CPU bf16 matmul then takes a slow path: 0.66 s instead of 0.01 s
    per prefill for a 2048 x 49152 head (measured with torch 2.13). For a contiguous
    tensor only size-1 dims can differ, so re-striding is free and reads the same memory.
    """
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return None
    if not x.is_contiguous():
        # A batched prefill keeps the last position of each row: [rows, 1, hidden] with
        # the parent's row stride. matmul then broadcasts the head's weight to a batched
        # bmm and copies it per row (0.96 s per 16-row prefill of a 49152-token head,
        # measured). The slice is tiny; a contiguous copy costs microseconds.
        return (x.contiguous(), *args[1:])
    expected = []
    step = 1
    for size in reversed(x.shape):
        expected.append(step)
        step *= size
    expected.reverse()
    if list(x.stride()) == expected:
        return None
    return (x.as_strided(x.shape, expected), *args[1:])
