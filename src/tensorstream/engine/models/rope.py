"""Rotary position embeddings for the native models: inverse frequencies and cos/sin tables.

The inverse frequencies follow the ``rope_type`` of the config (default, linear,
dynamic NTK, llama3) with the same float32 arithmetic, op for op, as
transformers computes them, so the native models' logits equal the reference's
bit for bit in float32. ``inv_freq`` is a non-persistent buffer: computed at
build time, never read from a checkpoint (files that hold one still load; the
loader skips it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = [
    "RotaryEmbedding",
    "apply_rotary",
    "inverse_frequencies",
    "rotate",
    "rotate_rolled",
    "signed_sin",
]


def inverse_frequencies(
    rope: dict[str, Any], head_dim: int, max_positions: int, seq_len: int | None = None
) -> torch.Tensor:
    """float32 inverse frequencies for ``rope`` (a normalised rotary parameter dict).

    Args:
        rope: ``rope_type``, ``rope_theta`` and the type's own keys (``factor``...).
        head_dim: rotated dimensions per head.
        max_positions: the config's ``max_position_embeddings``.
        seq_len: dynamic NTK only: the sequence length to scale for.
    """
    base = rope["rope_theta"]
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float)
    factor = rope["factor"]
    if kind == "linear":
        inv_freq = 1.0 / (base ** (steps / head_dim))
        inv_freq /= factor
        return inv_freq
    if kind == "dynamic":
        seq_len = max(seq_len or max_positions, max_positions)
        base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        return 1.0 / (base ** (steps / head_dim))
    if kind == "llama3":
        inv_freq = 1.0 / (base ** (steps / head_dim))
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not implemented natively")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; dynamic NTK re-scales past the trained length."""

    def __init__(self, rope: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.dynamic = rope.get("rope_type") == "dynamic"
        self.max_seq_len_cached = max_positions
        # Filled by ``reset_parameters`` once the model leaves the meta device.
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.original_inv_freq: torch.Tensor | None = None

    def reset_parameters(self, device: torch.device | str = "cpu") -> None:
        """Compute ``inv_freq`` on ``device`` (real storage, replacing a meta placeholder)."""
        inv_freq = inverse_frequencies(self.rope, self.head_dim, self.max_positions).to(device)
        self.inv_freq = inv_freq
        self.original_inv_freq = inv_freq.clone()
        self.max_seq_len_cached = self.max_positions

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``positions.shape + (head_dim,)`` in ``dtype``."""
        if self.dynamic:
            self._dynamic_update(int(positions.max()) + 1)
        freqs = positions[..., None].float() * self.inv_freq.to(dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _dynamic_update(self, seq_len: int) -> None:
        # Same policy as transformers: grow the base past the trained length, and go
        # back to the original frequencies once sequences are short again.
        if seq_len > self.max_seq_len_cached:
            self.inv_freq = inverse_frequencies(
                self.rope, self.head_dim, self.max_positions, seq_len
            ).to(self.inv_freq.device)
            self.max_seq_len_cached = seq_len
        if seq_len < self.max_positions and self.max_seq_len_cached > self.max_positions:
            self.inv_freq = self.original_inv_freq
            self.max_seq_len_cached = self.max_positions


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` ([batch, heads, tokens, head_dim]) by cos/sin ([batch, tokens, dim])."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate one tensor ([batch, heads, tokens, head_dim]): queries and keys side by side
    take one pass instead of two, with the same element-wise arithmetic."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated, for :func:`rotate_rolled` (once per step)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """:func:`rotate`'s bits in fewer operators: ``rotate_half(x) * sin`` is
    ``roll(x, half) * signed_sin(sin)``, since ``(-a) * b == a * (-b)`` exactly."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, -1) * signed)
