"""Vocab-parallel ``embed_tokens`` and ``lm_head``: each rank holds ``vocab/N`` rows.

Owns the two modules that replace the native model's embedding and head on a rank
whose plan splits the vocab (``plan.py`` decides), and :func:`split_vocab`, which
swaps them in on the meta-built model before its weights are filled, so the model
code itself (``engine/models/llama.py``) knows nothing of ranks.

* Embedding: a rank looks up the ids inside its row range and writes zeros for the
  others; one all-reduce sums the ranks' results. Each position gets exactly one
  non-zero term, so the sum is the unsharded lookup bit for bit.
* Head: a rank computes the logits of its vocab rows; a gather brings the slices to
  rank 0, which samples (the other ranks' logits are never used, so a gather, not an
  all-gather, moves ``(N-1)/N`` of the logits once instead of to every rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VocabParallelEmbedding", "VocabParallelHead", "split_vocab"]


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the embedding table; the full lookup after an all-reduce."""

    def __init__(self, rows: int, hidden: int, start: int, group: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden, device="meta"), requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """Logits of vocab rows ``[start, start + rows)``; rank 0 returns all of them.

    Ranks other than 0 return their own slice (``[..., rows]``), which nothing reads.
    """

    def __init__(
        self, rows: int, hidden: int, rank: int, world_size: int, group: Any = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden, device="meta"), requires_grad=False)
        self.bias = None  # the Llama family's head has none; fill_model checks attributes
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        local = F.linear(hidden, self.weight).contiguous()
        parts = (
            [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        dist.gather(local, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else local


def split_vocab(
    model: nn.Module,
    rank: int,
    world_size: int,
    *,
    embed: bool,
    head: bool,
    group: Any = None,
) -> None:
    """Replace ``model``'s embedding and/or head with their vocab-parallel versions.

    Call on the meta-built model, before its weights are filled. A tied head follows the
    embedding (``tie_weights`` shares the one split table), whatever ``head`` says.
    """
    config = model.config
    vocab, hidden = config.vocab_size, config.hidden_size
    rows = vocab // world_size
    if config.tie_word_embeddings:
        head = embed
    if embed:
        model.model.embed_tokens = VocabParallelEmbedding(rows, hidden, rank * rows, group)
    if head:
        model.lm_head = VocabParallelHead(rows, hidden, rank, world_size, group)
