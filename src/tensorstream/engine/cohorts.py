"""Merging and trimming left-padded KV caches, so running cohorts share one forward pass.

Requests that arrive at different steps are prefilled as separate cohorts, each with
its own cache. Decoding them separately costs one forward pass per cohort per step,
and on a CPU a forward pass of a small batch costs nearly as much as one of a large
batch (measured: 16 clients gained 4.7x over one client with cohorts kept apart,
where vLLM's single batch gained 8.7x). Caches are merged by left-padding the
shorter ones along the sequence axis, with the padding masked out, which is how the
prefill already batches prompts of different lengths.

Only plain ``DynamicLayer`` caches are merged: sliding-window, static and indexed
layers keep extra state (offsets, cumulative lengths) that padding would break, so
models using them keep separate cohorts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["can_merge", "merge_caches", "trim_left_padding"]

#: Padding allowed per row on average whatever the real lengths: short prompts cost
#: little to pad, and a forward pass saved is worth far more on a CPU.
PADDING_PER_ROW = 256


def _plain_layers(cache: Any) -> list[Any] | None:
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    if any(not layer.is_initialized or layer.keys is None for layer in layers):
        return None
    return list(layers)


def can_merge(caches: Sequence[Any], masks: Sequence[torch.Tensor]) -> bool:
    """Whether these caches can become one without too much padding (see ``PADDING_PER_ROW``)."""
    if len(caches) < 2 or any(_plain_layers(c) is None for c in caches):
        return False
    if len({len(c.layers) for c in caches}) != 1:
        return False
    width = max(m.shape[1] for m in masks)
    rows = sum(m.shape[0] for m in masks)
    real = sum(int(m.sum()) for m in masks)
    # Padding costs attention work and memory in every row it lands in: allow as much
    # as the real tokens, or a few hundred per row, not a long prompt's worth in each.
    return rows * width - real <= max(real, PADDING_PER_ROW * rows)


def _left_pad(t: torch.Tensor, width: int, axis_from_end: int) -> torch.Tensor:
    missing = width - t.shape[-axis_from_end]
    if missing <= 0:
        return t
    pad = [0, 0] * (axis_from_end - 1) + [missing, 0]
    return F.pad(t, pad)


def merge_caches(caches: Sequence[Any], masks: Sequence[torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """Concatenate caches (and their masks) along the batch axis, left-padding to one width.

    The first cache object is reused and returned; the others must not be used after.
    Call only when :func:`can_merge` said yes.
    """
    width = max(m.shape[1] for m in masks)
    target = caches[0]
    per_cache = [_plain_layers(c) for c in caches]
    for i, layer in enumerate(per_cache[0] or []):
        parts = [layers[i] for layers in per_cache if layers is not None]
        layer.keys = torch.cat([_left_pad(p.keys, width, 2) for p in parts], dim=0)
        layer.values = torch.cat([_left_pad(p.values, width, 2) for p in parts], dim=0)
    mask = torch.cat([_left_pad(m, width, 1) for m in masks], dim=0)
    return target, mask


def trim_left_padding(cache: Any, mask: torch.Tensor) -> torch.Tensor:
    """Drop leading columns that are padding in every row (e.g. after a long row finished).

    Returns the trimmed mask; the cache is trimmed in place. No-op for caches that
    cannot be merged (their layers keep offsets of their own).
    """
    used = mask.any(dim=0).nonzero()
    if not len(used) or int(used[0]) == 0:
        return mask
    layers = _plain_layers(cache)
    if layers is None:
        return mask
    start = int(used[0])
    for layer in layers:
        layer.keys = layer.keys[..., start:, :]
        layer.values = layer.values[..., start:, :]
    return mask[:, start:]
