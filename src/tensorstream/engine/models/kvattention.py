"""Attention over the engine's KV cache: what one engine pass asks of it, and how it attends.

Owns :class:`AttentionBatch` (the step's plan: which token rows decode, which are prompt
chunks, where each sits in the cache) and :class:`CacheAttention`, the half of the native
models' attention layer that writes the step's keys and values into the cache slabs
(``engine/kvcache.py``) and attends over them: through the fused row operators
(``rowops.py``, :meth:`CacheAttention.attend_rows`) where they run, else through torch's
(:meth:`CacheAttention._attend_planned`). ``llama.Attention`` adds the projections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from tensorstream.engine.models import rowops

__all__ = ["AttentionBatch", "CacheAttention", "fused_pass"]


@dataclass
class AttentionBatch:
    """How one forward pass uses the engine's KV cache.

    The engine flattens a step into token rows (input ``[tokens, 1]``): the decode
    tokens of the running sequences first, then prompt chunks. ``plan`` says what each
    stretch of rows is:

    * ``("decode_padded", first, stop, row0, row1, bias)``: rows ``first..stop`` are one
      new token each of cache rows ``row0..row1``, at their own positions; ``bias`` is
      float32 [rows, 1, 1, padded keys], 0 where a row sees a key and -inf elsewhere. One
      call attends all of them (bf16 only: :meth:`Attention._attend_padded`).
    * ``("decode", first, stop, row0, row1, key_len, mask)``: the same for rows that all
      sit at position ``key_len - 1``, over exactly their own keys (float32: batched
      matmuls, :meth:`Attention._attend_rows`; other dtypes: SDPA). Other dtypes than bf16
      take this form, one item per distinct length, so a request's arithmetic never
      depends on the other rows (attending over extra, masked keys rounds differently).
    * ``("prefill", first, stop, row, start, mask)``: rows ``first..stop`` are one prompt
      chunk of cache row ``row``, positions ``start..``; causal (``mask`` None) or masked.

    Attributes:
        cache: the :class:`~tensorstream.engine.kvcache.KVCache` (None: no cache).
        plan: the items above, or None for a plain causal pass over ``[batch, tokens]``.
        mask: boolean [batch, 1, tokens, tokens] for a plain pass (sliding windows).
        adapters: per-row LoRA state (``engine/models/lora.py``), or None.
        decode_slots: (cache rows, positions) of the decode tokens (the first rows), so
            their keys/values are written with one indexed copy per layer, not one per item.
        token_slots: (cache row, position) of every token row, int64: what the fused row
            operators (``rowops.py``) need; without it a pass runs torch's operators.
    """

    cache: Any = None
    plan: list[tuple[Any, ...]] | None = None
    mask: torch.Tensor | None = None
    adapters: Any = None
    decode_slots: tuple[torch.Tensor, torch.Tensor] | None = None
    token_slots: tuple[torch.Tensor, torch.Tensor] | None = None
    #: per-step values every layer shares (the padded decode's bias per kv head)
    shared: dict[Any, torch.Tensor] = field(default_factory=dict)


def fused_pass(x: torch.Tensor, batch: AttentionBatch | None) -> bool:
    """Whether a pass runs the fused row operators (``rowops.py``): engine passes over the
    KV cache (``token_slots`` set), on CPU, in bfloat16/float32, without autograd. A plain
    ``model(input_ids)`` keeps torch's operators, so its logits stay transformers' bits."""
    return batch is not None and batch.token_slots is not None and rowops.usable(x)


class CacheAttention:
    """The cache half of an attention layer (mixed into ``llama.Attention``).

    Expects on the instance: ``layer``, ``heads``, ``kv_heads``, ``head_dim``, ``groups``,
    ``window``, ``fusable``, ``qk_norm`` (and ``q_norm``/``k_norm`` modules with it).
    """

    layer: int
    heads: int
    kv_heads: int
    head_dim: int
    groups: int
    window: int | None
    fusable: bool
    qk_norm: bool

    def fused_rows(self, x: torch.Tensor, batch: AttentionBatch | None) -> bool:
        """Whether this engine pass attends through the fused row operators (``rowops``)."""
        return (
            self.fusable and fused_pass(x, batch) and batch.cache.keys[self.layer].dtype == x.dtype  # type: ignore[union-attr]
        )

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the queries, keys and values in a joint [rows, width] projection."""
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return qkv[:, :q_width], qkv[:, q_width : q_width + kv_width], qkv[:, q_width + kv_width :]

    def attend_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One engine pass's attention through the fused row operators.

        Every token row's queries and keys are normed (q/k norms) and rotated in place, its
        key and value written into the cache at its slot; the decode rows (the first
        ``len(batch.decode_slots[0])``) attend their cache row, all in one C call; then each
        prompt chunk of the plan attends through SDPA over its row, as the torch path does.

        Args:
            q, k, v: [token rows, heads * head_dim] (kv heads for k/v), unit element stride;
                q and k are overwritten.
            cos, sin: [token rows, head_dim], the rows' rotary tables.
            batch: the step (``token_slots`` set).
            out: where the result goes ([token rows or more, heads * head_dim]; rows past
                the token rows get copies of row 0, as a padded o-projection takes them),
                or None for a new tensor.

        Returns:
            ``out`` (or the new [token rows, heads * head_dim]).
        """
        keys, values = batch.cache.keys[self.layer], batch.cache.values[self.layer]
        rows = q.shape[0]
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        scratch = batch.shared.get(("scratch",))
        if scratch is None:  # once per step
            scratch = batch.shared[("scratch",)] = torch.empty(self.groups * keys.shape[2])
        decoding = 0 if batch.decode_slots is None else len(batch.decode_slots[0])
        chunks = [item for item in batch.plan if item[0] == "prefill"]
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        rowops.rope_attend(
            q, k, v, cos, sin, keys, values, batch.token_slots, decoding,
            out if decoding and not chunks else out[:rows], head_dim=self.head_dim,
            window=self.window, scratch=scratch, q_norm=norms[0], k_norm=norms[1],
            eps=self.q_norm.variance_epsilon if self.qk_norm else 0.0,
        )  # fmt: skip
        d = self.head_dim
        for _, first, stop, row, start, mask in chunks:
            end = start + stop - first
            chunk = F.scaled_dot_product_attention(
                q[first:stop].view(stop - first, self.heads, d).transpose(0, 1)[None],
                keys[row : row + 1, :, :end], values[row : row + 1, :, :end],
                attn_mask=mask, is_causal=mask is None and stop - first > 1,
                enable_gqa=self.groups > 1,
            )  # fmt: skip
            out[first:stop] = chunk[0].transpose(0, 1).reshape(stop - first, -1)
        if out.shape[0] > rows and (chunks or not decoding):
            out[rows:] = out[0]
        return out

    def _attend_planned(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """Write the step's keys/values into the cache and attend, item by item of the plan.

        ``q``/``k``/``v`` are [token rows, heads, 1, head_dim]; returns [token rows, heads, 1, head_dim].
        """
        keys, values = batch.cache.keys[self.layer], batch.cache.values[self.layer]
        if batch.decode_slots is not None:
            # One indexed copy per slab into its flat [slots, head_dim] view: at 16 rows a
            # fifth of the time of ``slab[rows, :, positions] = ...`` (an index_put).
            flat = batch.shared.get(("slots",))
            if flat is None:  # once per step: every layer's slabs have the same shape
                flat = batch.shared[("slots",)] = self._cache_slots(keys, *batch.decode_slots)
            n, d = len(batch.decode_slots[0]), self.head_dim
            keys.view(-1, d).index_copy_(0, flat, k[:n, :, 0].reshape(-1, d))
            values.view(-1, d).index_copy_(0, flat, v[:n, :, 0].reshape(-1, d))
        parts = []
        for item in batch.plan:
            if item[0] == "decode_padded":
                _, first, stop, row0, row1, bias = item
                key = ("bias", first, self.kv_heads)
                if key not in batch.shared:  # once per step, not per layer
                    batch.shared[key] = self.head_bias(bias)
                out = self._attend_padded(
                    q[first:stop], keys, values, row0, row1, batch.shared[key]
                )
                parts.append(out)
            elif item[0] == "decode" and keys.dtype == torch.float32:
                _, first, stop, row0, row1, key_len, mask = item
                parts.append(self._attend_rows(q[first:stop], keys, values, row0, row1,
                                               key_len, mask))  # fmt: skip
            elif item[0] == "decode":
                _, first, stop, row0, row1, key_len, mask = item
                # Fold each kv head's query group into the query axis: no repeated keys.
                n = stop - first
                packed = q[first:stop].reshape(n, self.kv_heads, self.groups, self.head_dim)
                out = F.scaled_dot_product_attention(
                    packed, keys[row0:row1, :, :key_len], values[row0:row1, :, :key_len],
                    attn_mask=mask,
                )  # fmt: skip
                parts.append(out.reshape(n, self.heads, 1, self.head_dim))
            else:
                _, first, stop, row, start, mask = item
                end = start + stop - first
                keys[row, :, start:end] = k[first:stop, :, 0].transpose(0, 1)
                values[row, :, start:end] = v[first:stop, :, 0].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q[first:stop, :, 0].transpose(0, 1)[None],
                    keys[row : row + 1, :, :end], values[row : row + 1, :, :end],
                    attn_mask=mask, is_causal=mask is None and stop - first > 1,
                    enable_gqa=self.groups > 1,
                )  # fmt: skip
                parts.append(out[0].transpose(0, 1)[:, :, None])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _cache_slots(
        self, slab: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Flat indices into ``slab.view(-1, head_dim)`` of each (row, kv head, position):
        [len(rows) * kv heads], row-major like ``k[rows, heads]``."""
        heads = torch.arange(self.kv_heads, device=slab.device)
        starts = (rows[:, None] * self.kv_heads + heads) * slab.shape[2]
        return (starts + positions[:, None]).view(-1)

    def _attend_rows(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        row0: int,
        row1: int,
        key_len: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """float32 decode tokens of cache rows ``row0..row1``, all at ``key_len`` keys, as two
        batched matmuls over strided views of the slabs (no copy).

        Why not SDPA: its CPU kernel costs ~11 us per row for one query (2-core AVX2 EPYC,
        SmolLM2 decoding, torch profiler: ~160 us per layer at 16 rows against ~110 us here,
        ~42 against ~35 us at one row). Each row's product is its own small matrix, so a
        row gets the same bits alone or in any batch (checked for 1-39 rows, 1-513 keys,
        1 and 2 threads; ``tests/native/test_lean_stack.py`` decodes staggered arrivals). Not for
        bf16/fp16: the matmuls would round the scores to the cache dtype, SDPA keeps them
        in float32.

        Args:
            q: [rows, heads, 1, head_dim] queries.
            keys, values: this layer's cache slabs ([cache rows, kv heads, length, head_dim]).
            mask: boolean [1, 1, 1, key_len] (a sliding window), or None.

        Returns:
            [rows, heads, 1, head_dim].
        """
        n, kv, d = row1 - row0, self.kv_heads, self.head_dim
        length = keys.shape[2]
        k = keys[row0:row1].view(n * kv, length, d)[:, :key_len]
        v = values[row0:row1].view(n * kv, length, d)[:, :key_len]
        # Each kv head's query group is the query axis of one product: no repeated keys.
        scores = torch.bmm(q.reshape(n * kv, self.groups, d), k.transpose(1, 2)).mul_(d**-0.5)
        if mask is not None:
            scores.masked_fill_(~mask.view(1, 1, key_len), float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), v).view(n, self.heads, 1, d)

    def head_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """A padded decode's bias ([rows, 1, 1, keys]) repeated for each kv head:
        [rows * kv heads, 1, keys], the form :meth:`_attend_padded` takes."""
        return bias.flatten(1).repeat_interleave(self.kv_heads, dim=0)[:, None]

    def _attend_padded(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        row0: int,
        row1: int,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """One decode token per cache row ``row0..row1``, each over its own keys, in one call.

        Keys are padded to whole :data:`~tensorstream.engine.kvcache.KEY_BLOCK` blocks and
        ``bias`` hides what a row does not see. Scores and softmax run in float32, the
        weighted sum of values in bf16 with float32 accumulation (as SDPA's CPU kernel).
        Why the result is a row's own: a masked key adds exact zeros, and with lengths in
        whole blocks the kernels' vector and tile loops group a row's real keys the same way
        for every padded length, so a row gets the same bits alone or beside longer rows
        (tested: ``tests/native/test_native_batching.py``). float32 matmuls do not keep
        that (their blocking depends on the shapes), hence bf16 only.

        Args:
            q: [rows, heads, 1, head_dim] queries.
            keys, values: this layer's cache slabs.
            bias: float32 [rows * kv heads, 1, padded keys] (:meth:`head_bias`).

        Returns:
            [rows, heads, 1, head_dim].
        """
        n, length = row1 - row0, bias.shape[-1]
        kv, groups, d = self.kv_heads, self.groups, self.head_dim
        # Each kv head's query group is the query axis of one matrix product: no repeated keys.
        packed = q.float().reshape(n * kv, groups, d)
        k = keys[row0:row1, :, :length].float().reshape(n * kv, length, d)
        v = values[row0:row1, :, :length].reshape(n * kv, length, d)
        scores = torch.baddbmm(bias, packed, k.transpose(1, 2), alpha=d**-0.5)
        weights = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.bmm(weights, v).view(n, self.heads, 1, d)
