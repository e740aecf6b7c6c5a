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
from tensorstream.engine.kvcache import KVCache, padded_length
from tensorstream.engine.models import rowmatmul, rowops
from tensorstream.engine.models.llama import AttentionBatch
from tensorstream.engine.outputs import RequestOutput
from tensorstream.engine.sampler import row_argmax
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

    #: bf16 decode rows attend in one padded call (False: one SDPA call per distinct
    #: length, the form other dtypes take; ``bench.decode_profile --compare-attention``).
    padded_decode = True

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
        """One forward pass: a token for every running sequence, plus up to one chunk of prompts.

        Returns:
            One ``RequestOutput`` per request that advanced this step (``finished`` set on
            its last one). Finished requests are forgotten afterwards.
        """
        touched: dict[str, _Request] = {}
        self._compact()
        decoding = [r for r in self._rows if r.decoding]  # rows 0..n-1 after _compact
        chunks = self._plan_prefill()
        if decoding or chunks:
            self._forward(decoding, chunks, touched)
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

    def _plan_prefill(self) -> list[tuple[_Row, int, int]]:
        """Prompt chunks for this step: (row, start, end), at most ``chunk`` tokens in all.

        Chunks always start at multiples of the chunk size, whatever else runs this step:
        a prompt is then computed in the same pieces (the same rounding) whether it
        arrives alone or behind others. Only the last planned prompt may stay unfinished.
        """
        budget, plan = self.chunk, []
        while budget > 0:
            entry = self._prefilling or self._admit()
            if entry is None:
                break
            prompt_len = len(entry.seq.request.prompt_token_ids)
            start = entry.cached
            take = min(self.chunk, prompt_len - start)
            if take > budget:
                self._prefilling = entry
                break
            plan.append((entry, start, start + take))
            budget -= take
            if start + take < prompt_len:
                self._prefilling = entry
                break
            self._prefilling = None
        return plan

    def _admit(self) -> _Row | None:
        """Give the oldest waiting request rows (one per completion), if they fit."""
        while self._waiting:
            request = self._waiting[0]
            if len(self._rows) + len(request.sequences) > self.max_num_seqs and self._rows:
                return None  # wait for running sequences to finish
            self._waiting.pop(0)
            if request.sequences[0].finish_reason is not None:  # aborted while waiting
                continue
            # The n - 1 other completions get their rows now, right after the prompt's,
            # so rows stay ordered: decoding ones first, the unfinished prompt last.
            first = len(self._rows)
            entries = [_Row(seq, first + i) for i, seq in enumerate(request.sequences)]
            self._rows.extend(entries)
            return entries[0]
        return None

    def _mask(self, queries: torch.Tensor, key_len: int) -> torch.Tensor:
        """Boolean [1, 1, queries, key_len]: key j is visible to a query at position p when
        j <= p and j > p - sliding_window."""
        keys = torch.arange(key_len, device=self.device)
        visible = (keys[None, :] <= queries[:, None]) & (
            keys[None, :] > queries[:, None] - self.window
        )
        return visible[None, None]

    def _decode_plan(self, decoding: list[_Row]) -> list[tuple]:
        """Decode items of rows at equal positions: one SDPA call per distinct length."""
        plan: list[tuple] = []
        for i, entry in enumerate(decoding):
            key_len = entry.cached + 1
            last = plan[-1] if plan else None
            if last is not None and last[5] == key_len and last[4] == entry.row:
                plan[-1] = ("decode", last[1], i + 1, last[3], entry.row + 1, key_len, None)
            else:
                plan.append(("decode", i, i + 1, entry.row, entry.row + 1, key_len, None))
        if self.window is not None:
            for j, item in enumerate(plan):
                if item[5] > self.window:
                    mask = self._mask(torch.tensor([item[5] - 1], device=self.device), item[5])
                    plan[j] = (*item[:6], mask)
        return plan

    def _padded_decode_plan(self, decoding: list[_Row]) -> list[tuple]:
        """One padded decode item per run of consecutive cache rows (the running rows are
        ``0..n-1``, so one item), whatever their lengths; bf16 models only (see
        ``Attention._attend_padded``). The bias is built here once for every layer."""
        plan: list[tuple] = []
        start = 0
        for i in range(1, len(decoding) + 1):
            if i < len(decoding) and decoding[i].row == decoding[i - 1].row + 1:
                continue
            run = decoding[start:i]
            last = max(entry.cached for entry in run)  # the newest token's position
            positions = torch.tensor([entry.cached for entry in run], device=self.device)
            keys = torch.arange(padded_length(last + 1), device=self.device)
            visible = keys[None, :] <= positions[:, None]
            if self.window is not None:
                visible &= keys[None, :] > positions[:, None] - self.window
            bias = torch.zeros(visible.shape, dtype=torch.float32, device=self.device)
            bias.masked_fill_(~visible, float("-inf"))
            plan.append(
                ("decode_padded", start, i, run[0].row, run[-1].row + 1, bias[:, None, None])
            )
            start = i
        return plan

    def _forward(
        self,
        decoding: list[_Row],
        chunks: list[tuple[_Row, int, int]],
        touched: dict[str, _Request],
    ) -> None:
        """Run the step's decode tokens and prompt chunks as one flat batch of token rows."""
        tokens = [r.seq.token_ids[-1] for r in decoding]
        positions = [r.cached for r in decoding]
        owners = [r.seq for r in decoding]
        cache_rows = [r.row for r in decoding]
        length = max([entry.cached + 1 for entry in decoding], default=1)
        # The fused operators attend decode rows from token_slots alone; the plain plan
        # (no padded bias to build) stays right for a layer that takes torch's path.
        fused = self.device.type == "cpu" and rowops.active()
        if self.padded_decode and self.cache.dtype == torch.bfloat16 and not fused:
            plan = self._padded_decode_plan(decoding)
        else:
            plan = self._decode_plan(decoding)
        finishing = []  # (row, index of the prompt's last token row)
        for entry, start, end in chunks:
            prompt = entry.seq.request.prompt_token_ids
            first = len(tokens)
            tokens += prompt[start:end]
            positions += range(start, end)
            owners += [entry.seq] * (end - start)
            cache_rows += [entry.row] * (end - start)
            length = max(length, end)
            mask = None
            if start > 0 or (self.window is not None and end > self.window):
                window = self.window if self.window is not None else end + 1
                keys = torch.arange(end, device=self.device)
                queries = torch.arange(start, end, device=self.device)
                visible = (keys[None, :] <= queries[:, None]) & (
                    keys[None, :] > queries[:, None] - window
                )
                mask = visible[None, None]
            plan.append(("prefill", first, len(tokens), entry.row, start, mask))
            if end == len(prompt):
                finishing.append((entry, len(tokens) - 1))
        self.cache.ensure(len(self._rows), length)
        ids = torch.tensor(tokens, device=self.device)[:, None]
        pos = torch.tensor(positions, device=self.device)[:, None]
        adapters = self._adapters(owners)
        slots = None
        if decoding:
            slots = (
                torch.tensor([r.row for r in decoding], device=self.device),
                torch.tensor([r.cached for r in decoding], device=self.device),
            )
        batch = AttentionBatch(self.cache, plan, None, adapters, slots)
        if fused:
            # The C operators write the cache at these slots unchecked: make sure here.
            if max(cache_rows) >= self.cache.rows or max(positions) >= self.cache.length:
                raise RuntimeError(f"token slots outside the KV cache ({self.cache.rows} rows "
                                   f"of {self.cache.length} tokens)")  # fmt: skip
            batch.token_slots = (torch.tensor(cache_rows, device=self.device), pos.view(-1))
        hidden = self.model.hidden_states(ids, pos, batch)[:, 0]
        picked = list(range(len(decoding))) + [index for _, index in finishing]
        if not picked:
            for entry, _, end in chunks:
                entry.cached = end
            return
        logit_owners = [owners[i] for i in picked]
        index = torch.tensor(picked, device=self.device)
        rows = hidden[index]
        with rowmatmul.engine_pass(rowmatmul.head_layout(rows, self.cache.dtype)):
            logits = self.model.logits(rows, self._adapters(logit_owners))
        for entry in decoding:
            entry.cached += 1
        for entry, _, end in chunks:
            entry.cached = end
        n = len(decoding)
        if n:
            self._sample_sequences([r.seq for r in decoding], logits[:n], touched)
        for k, (entry, _) in enumerate(finishing):
            self._start_decoding(entry, logits[n + k : n + k + 1], touched)

    def _sample_sequences(
        self, sequences: list[_Sequence], logits: torch.Tensor, touched: dict[str, _Request]
    ) -> None:
        """As the base engine's, with one batched argmax when every row is plain greedy.

        Plain greedy (no penalties, no logprobs) needs only each row's argmax and its
        log-probability: one ``argmax`` and one ``logsumexp`` over the batch instead of a
        full-vocabulary ``log_softmax`` plus an ``argmax`` per row; with the fused row
        operators one pass over the logits (``rowops.greedy``: 16 x 49152 bf16 in ~0.3 ms
        against ~2 ms for the float32 copy, argmax and logsumexp).
        """
        if not all(
            seq.finish_reason is None
            and seq.logprobs is None
            and seq.request.params.greedy
            and not seq.request.params.uses_penalties
            for seq in sequences
        ):
            super()._sample_sequences(sequences, logits, touched)
            return
        if rowops.usable(logits) and logits.stride(-1) == 1:
            tokens, logprobs = rowops.greedy(logits)
        else:
            logits = logits.float()
            picked = row_argmax(logits)
            chosen = logits.gather(1, picked[:, None])[:, 0]
            logprobs = (chosen - torch.logsumexp(logits, dim=-1)).tolist()
            tokens = picked.tolist()
        for seq, token, logprob in zip(sequences, tokens, logprobs, strict=True):
            seq.cumulative_logprob += logprob
            self._append(seq, token)
            touched[seq.request.request_id] = seq.request

    def _adapters(self, sequences: list[_Sequence]) -> Any:
        """The rows' LoRA adapters for one forward (None: every row runs the base model)."""
        if self.lora_manager is None:
            return None
        return self.lora_manager.batch([seq.request.adapter for seq in sequences])

    def _start_decoding(
        self, entry: _Row, logits: torch.Tensor, touched: dict[str, _Request]
    ) -> None:
        """After a prompt's last chunk: copy its cache row to the rows of its other ``n - 1``
        completions, and sample every completion's first token from the prompt's logits."""
        request = entry.seq.request
        others = {id(seq) for seq in request.sequences[1:]}
        for sibling in self._rows:
            if id(sibling.seq) in others:
                self.cache.move(entry.row, sibling.row, entry.cached)
                sibling.cached, sibling.decoding = entry.cached, True
        entry.decoding = True
        sequences = request.sequences
        self._sample_sequences(sequences, logits.expand(len(sequences), -1), touched)
