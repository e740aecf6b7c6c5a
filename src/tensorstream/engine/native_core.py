"""``NativeEngineCore``: step-level continuous batching over a native model and its KV cache.

Same surface as :class:`~tensorstream.engine.core.EngineCore` (``add_request``,
``abort_request``, ``has_unfinished_requests``, ``step``) and the same request,
sampling and stop semantics (it inherits them), but it owns the forward pass:

* every running sequence joins every step: one decode forward over all of them,
  each at its own position, reading the KV slab rows ``0..n-1`` as a view with a
  length mask (no left padding, nothing recomputed);
* prompts are prefilled in chunks of at most ``max_num_batched_tokens`` tokens per
  step, one request at a time in arrival order, so a long prompt delays running
  decodes by one chunk per step instead of its whole length;
* a request's ``n`` completions copy the prompt's cache row once, after prefill;
* finished rows are compacted away (the last rows move down), so the running
  batch always stays a contiguous prefix of the slab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tensorstream.engine.core import EngineCore, _Request, _Sequence
from tensorstream.engine.kvcache import KVCache
from tensorstream.engine.models.llama import AttentionBatch
from tensorstream.engine.outputs import RequestOutput
from tensorstream.engine.sampler import apply_penalties, pick_token, top_logprobs
from tensorstream.errors import ConfigError

__all__ = ["NativeEngineCore"]


@dataclass
class _Row:
    """A sequence's place in the KV slab."""

    seq: _Sequence
    row: int
    cached: int = 0  # tokens in the cache (the last sampled token is not, until decoded)
    decoding: bool = False


class NativeEngineCore(EngineCore):
    """Continuous batching over a :class:`~tensorstream.engine.models.NativeCausalLM`.

    Args:
        model: the native model (eval mode).
        tokenizer: its tokenizer (detokenizes; EOS/pad ids).
        max_model_len: most tokens (prompt + output) per sequence.
        eos_token_ids: ids that end a sequence unless ``ignore_eos``.
        seed: seeds the generator of requests that bring no seed of their own.
        max_num_seqs: most sequences running at once; later requests wait.
        max_num_batched_tokens: prompt tokens prefilled per step (the chunk size).
        lora_manager: a :class:`~tensorstream.engine.models.lora.NativeLoRAManager` over
            ``model``; without one, requests with a ``lora_request`` are refused.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_model_len: int,
        eos_token_ids: set[int],
        seed: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 512,
        lora_manager: Any = None,
    ) -> None:
        super().__init__(
            model,
            tokenizer,
            max_model_len=max_model_len,
            eos_token_ids=eos_token_ids,
            seed=seed,
            lora_manager=lora_manager,
        )
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.max_num_seqs = max_num_seqs
        self.chunk = max_num_batched_tokens
        config = model.config
        self.window = config.sliding_window
        self.cache = KVCache(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            dtype=model.dtype,
            device=self.device,
            max_length=max_model_len,
        )
        self._rows: list[_Row] = []
        self._prefilling: _Row | None = None

    # -- stepping -----------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Decode one token for every running sequence, then prefill up to one chunk.

        Returns:
            One ``RequestOutput`` per request that advanced this step (``finished`` set on
            its last one). Finished requests are forgotten afterwards.
        """
        touched: dict[str, _Request] = {}
        decoding = [r for r in self._rows if r.decoding and r.seq.finish_reason is None]
        if decoding:
            self._compact()
            self._decode([r for r in self._rows if r.decoding], touched)
        self._prefill(touched)
        self._compact()
        outputs = [request.output() for request in touched.values()]
        for out in outputs:
            if out.finished:
                request = self._requests.pop(out.request_id, None)
                if request is not None:
                    self._release(request)
        return outputs

    def _compact(self) -> None:
        """Drop finished rows and move the rest down, keeping rows ``0..n-1`` in use."""
        live = [r for r in self._rows if r.seq.finish_reason is None]
        if self._prefilling is not None and self._prefilling.seq.finish_reason is not None:
            self._prefilling = None  # aborted mid-prefill
        for new, entry in enumerate(live):  # rows only move down, so targets are free
            if entry.row != new:
                self.cache.move(entry.row, new, entry.cached)
                entry.row = new
        self._rows = live

    def _mask(self, queries: torch.Tensor, key_len: int) -> torch.Tensor:
        """Boolean [rows, 1, tokens, key_len]: key j is visible to a query at position p
        when j <= p (and within the sliding window, if any)."""
        keys = torch.arange(key_len, device=self.device)
        visible = keys[None, None, :] <= queries[:, :, None]
        if self.window is not None:
            visible &= keys[None, None, :] > queries[:, :, None] - self.window
        return visible[:, None]

    def _decode(self, rows: list[_Row], touched: dict[str, _Request]) -> None:
        n = len(rows)  # rows 0..n-1 of the slab, after _compact
        positions = [r.cached for r in rows]
        key_len = max(positions) + 1
        self.cache.ensure(len(self._rows), key_len)
        pos = torch.tensor(positions, device=self.device)
        ids = torch.tensor([[r.seq.token_ids[-1]] for r in rows], device=self.device)
        adapters = self._adapters([r.seq for r in rows])
        if self.window is None or key_len <= self.window:
            # Runs of equal length attend over exactly their own keys: a request's tokens
            # are then the same whether it runs alone or beside others (bit for bit).
            runs: list[tuple[int, int, int]] = []
            for i, length in enumerate(positions):
                if runs and runs[-1][2] == length + 1:
                    runs[-1] = (runs[-1][0], i + 1, length + 1)
                else:
                    runs.append((i, i + 1, length + 1))
            batch = AttentionBatch(
                self.cache, slice(0, n), None, pos, key_len, None, adapters, runs
            )
        else:  # sliding window: one masked pass
            mask = self._mask(pos[:, None], key_len)
            batch = AttentionBatch(self.cache, slice(0, n), None, pos, key_len, mask, adapters)
        hidden = self.model.hidden_states(ids, pos[:, None], batch)
        logits = self.model.logits(hidden[:, -1], adapters)
        for r in rows:
            r.cached += 1
        self._sample_rows([r.seq for r in rows], logits, touched)

    def _prefill(self, touched: dict[str, _Request]) -> None:
        budget = self.chunk
        while budget > 0:
            entry = self._prefilling or self._admit()
            if entry is None:
                return
            prompt = entry.seq.request.prompt_token_ids
            start = entry.cached
            # Chunks always start at multiples of the chunk size, whatever else ran this
            # step: the same prompt is then computed in the same pieces (the same rounding)
            # whether it arrives alone or behind others.
            take = min(self.chunk, len(prompt) - start)
            if take > budget:
                self._prefilling = entry
                return
            end = start + take
            budget -= take
            self.cache.ensure(len(self._rows), end)
            ids = torch.tensor([prompt[start:end]], device=self.device)
            positions = torch.arange(start, end, device=self.device)[None]
            plain = start == 0 and (self.window is None or end <= self.window)
            mask = None if plain else self._mask(positions, end)
            adapters = self._adapters([entry.seq])
            batch = AttentionBatch(self.cache, entry.row, start, None, end, mask, adapters)
            hidden = self.model.hidden_states(ids, positions, batch)
            entry.cached = end
            if end < len(prompt):
                self._prefilling = entry
                continue
            self._prefilling = None
            logits = self.model.logits(hidden[:, -1], adapters)
            self._start_decoding(entry, logits, touched)

    def _adapters(self, sequences: list[_Sequence]) -> Any:
        """The rows' LoRA adapters for one forward (None: every row runs the base model)."""
        if self.lora_manager is None:
            return None
        return self.lora_manager.batch([seq.request.adapter for seq in sequences])

    def _admit(self) -> _Row | None:
        """Give the oldest waiting request a row, if one fits."""
        while self._waiting:
            request = self._waiting[0]
            if len(self._rows) + len(request.sequences) > self.max_num_seqs and self._rows:
                return None  # wait for running sequences to finish
            self._waiting.pop(0)
            if request.sequences[0].finish_reason is not None:  # aborted while waiting
                continue
            entry = _Row(request.sequences[0], len(self._rows))
            self._rows.append(entry)
            return entry
        return None

    def _start_decoding(
        self, entry: _Row, logits: torch.Tensor, touched: dict[str, _Request]
    ) -> None:
        """After a prompt's last chunk: copy its cache row to its other ``n - 1``
        completions, and sample every completion's first token from the prompt's logits."""
        request = entry.seq.request
        entry.decoding = True
        for seq in request.sequences[1:]:
            row = len(self._rows)
            self.cache.ensure(row + 1, entry.cached)
            self.cache.move(entry.row, row, entry.cached)
            self._rows.append(_Row(seq, row, entry.cached, decoding=True))
        sequences = request.sequences
        self._sample_rows(sequences, logits.expand(len(sequences), -1), touched)

    def _sample_rows(
        self, sequences: list[_Sequence], logits: torch.Tensor, touched: dict[str, _Request]
    ) -> None:
        """Pick each row's token with the shared sampler functions and record it."""
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
