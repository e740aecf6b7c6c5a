"""The native engine's KV cache: one preallocated slab per layer, one row per running sequence.

Layout per layer: keys and values of shape ``[rows, kv_heads, length, head_dim]``.
A sequence owns one row for its whole life; its cached tokens are
``[:, :, :n]`` of that row. The engine keeps running sequences in rows
``0..n-1`` (compacting when one finishes), so a decode step reads a run of rows
with the same length as a *view* ``[r0:r1, :, :length]`` — no gather, no copy.
The model's attention writes and reads the slabs in place
(``engine/models/kvattention.py``, ``CacheAttention``). Rows and length grow
by doubling, so memory follows the actual load instead of
``max_num_seqs * max_model_len``.

Row lengths are whole :data:`KEY_BLOCK`-token blocks, so a bf16 decode step can attend
every running row in one call over a block-padded key length (``Attention._attend_padded``):
padding to whole blocks, alone or beside longer rows, is what keeps a request's arithmetic
independent of the batch.

Why a slab and not pages: on CPU a paged layout must gather each step's keys
into a contiguous tensor for SDPA, which copies the whole live cache every
step; the slab view copies nothing. ``python -m bench.cold_start --kv-layout`` measures
both: 360 ms (slab view) vs 1036 ms (gathered) of attention per decode step at 16 rows
x 512 tokens x 30 layers (SmolLM2's shape, bf16, on the shared 2-core CPU machine).
"""

from __future__ import annotations

import torch

__all__ = ["KEY_BLOCK", "KVCache", "padded_length"]

#: Key lengths a padded decode attends over are multiples of this (and so are the slabs').
#: 64 keeps every vector and matrix-tile loop of the CPU kernels free of tails.
KEY_BLOCK = 64


def padded_length(tokens: int) -> int:
    """``tokens`` rounded up to whole :data:`KEY_BLOCK` blocks."""
    return -(-tokens // KEY_BLOCK) * KEY_BLOCK


class KVCache:
    """Per-layer key/value slabs that the native models read and write in place.

    Args:
        layers: decoder layers.
        kv_heads: key/value heads per layer.
        head_dim: dimensions per head.
        dtype: cache dtype (the model's).
        device: where the slabs live.
        max_length: most tokens one row ever holds (the engine's ``max_model_len``; the slab
            holds it rounded up to whole :data:`KEY_BLOCK` blocks).
        rows: initial rows; length: initial tokens per row (both grow on demand, lengths
            in whole blocks).
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_length: int,
        rows: int = 4,
        length: int = 64,
    ) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_length = padded_length(max_length)
        self.rows = 0
        self.length = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._arange = torch.arange(0, device=device)
        self.ensure(rows, min(length, self.max_length))

    @property
    def nbytes(self) -> int:
        """Bytes held by the slabs."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def ensure(self, rows: int, length: int) -> None:
        """Grow (by doubling) until there are ``rows`` rows of ``length`` tokens."""
        if rows <= self.rows and length <= self.length:
            return
        new_rows = max(self.rows, 1)
        while new_rows < rows:
            new_rows *= 2
        new_length = max(self.length, KEY_BLOCK)
        while new_length < length:
            new_length *= 2
        new_length = padded_length(min(new_length, max(self.max_length, length)))
        shape = (new_rows, self.kv_heads, new_length, self.head_dim)
        for slabs in (self.keys, self.values):
            for layer in range(self.layers):
                # Zeros, not empty: masked keys get weight 0, but 0 * NaN garbage in a
                # value slot would still be NaN.
                fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if layer < len(slabs):
                    old = slabs[layer]
                    fresh[: old.shape[0], :, : old.shape[2]] = old
                    slabs[layer] = fresh
                else:
                    slabs.append(fresh)
        self.rows, self.length = new_rows, new_length
        self._arange = torch.arange(new_rows, device=self.device)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src``'s first ``length`` tokens into row ``dst`` (compaction, n > 1)."""
        for slabs in (self.keys, self.values):
            for slab in slabs:
                slab[dst, :, :length] = slab[src, :, :length]
