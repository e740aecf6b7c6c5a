"""Prepacked oneDNN matmuls for the native models' linear layers.

Owns: whether a weight is packed (:func:`pack_enabled`), the packed joint matmul of one
or more layers over the same input (:class:`FusedLinear`), and the per-forward budget
that spreads packing over the first steps (:class:`PackQuota`, :func:`packed`). The
layers' parameters are never touched: the packed copies live beside them.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tensorstream.engine.cpu_dtype import cpu_matmul_supported
from tensorstream.engine.models import rowmatmul

__all__ = [
    "FAST_LINEARS",
    "PACK_STEP_BYTES",
    "FusedLinear",
    "PackQuota",
    "pack_enabled",
    "packed",
    "packed_dtype",
]

#: Prepacked (and fused) matmuls on the inference path; False runs every layer as a plain
#: ``nn.Linear`` (``bench/decode_profile.py --compare`` alternates the two per step).
FAST_LINEARS = True
_PACK_ENV = "TENSORSTREAM_PACK_WEIGHTS"
_PACK_AUTO_BYTES = 4 << 30  # auto mode packs models up to this many linear-weight bytes
#: Weight bytes packed per forward pass at most (one layer group beyond it may finish).
#: Packing writes fresh memory (slow on first touch: seconds for a GiB model), so it is
#: spread over the first steps instead of stalling the first token; unpacked layers run
#: the plain matmul meanwhile, which gives the very same bits.
PACK_STEP_BYTES = 64 << 20


def packed_dtype(dtype: torch.dtype) -> bool:
    """Whether linear weights in ``dtype`` are prepacked on this CPU (before the size and
    switch checks of :func:`pack_enabled`).

    bfloat16 where oneDNN has fast bf16 kernels (AVX-512/AMX). float32 where it has not
    (AVX2 hosts, where ``dtype="auto"`` runs bf16 checkpoints in float32): measured on a
    2-core AVX2 AMD EPYC, one thread, oneDNN's packed float32 matmul against torch's (MKL)
    ``linear``: 16 rows x 576 -> 49152 (an LM head) 17.6 ms vs 31.5, 576 -> 1536 0.44 ms vs
    0.49; 4 rows 0.19 vs 0.25. And its rows get the same bits at every batch size (MKL's
    differ below 4 rows), so small batches need no padding.
    """
    fast_bf16 = cpu_matmul_supported(torch.bfloat16)
    return (dtype == torch.bfloat16 and fast_bf16) or (dtype == torch.float32 and not fast_bf16)


def pack_enabled(weight: torch.Tensor, model_bytes: int = 0) -> bool:
    """Whether ``weight`` gets a prepacked oneDNN copy for inference matmuls.

    Why: torch's plain bf16 ``linear`` on CPU reaches oneDNN too, but re-derives the
    kernel and reads the weight in its checkpoint layout on every call; a weight reordered
    once into oneDNN's blocked layout runs measurably faster (``bench/decode_profile.py``)
    with bit-identical results. float32 too on CPUs without fast bf16 (:func:`packed_dtype`).
    The price is a second copy of the linear weights (the checkpoint's stay as loaded, e.g.
    mapped from the page cache), so the automatic choice packs only models up to 4 GiB of
    them; ``TENSORSTREAM_PACK_WEIGHTS=1`` forces packing, ``=0`` turns it off.
    """
    setting = os.environ.get(_PACK_ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if weight.device.type != "cpu" or weight.dim() != 2 or not packed_dtype(weight.dtype):
        return False
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return setting in ("1", "true", "yes", "on") or model_bytes <= _PACK_AUTO_BYTES


class PackQuota:
    """Weight bytes that may still be packed during the current forward pass."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = 0

    def take(self, nbytes: int) -> bool:
        """Spend ``nbytes`` if anything is left (the last group may overdraw)."""
        if self.left <= 0:
            return False
        self.left -= nbytes
        return True


class FusedLinear:
    """Several ``nn.Linear`` layers over the same input as one prepacked oneDNN matmul.

    The layers' weights are concatenated along the output dim into a temporary and
    reordered once into oneDNN's blocked layout; only that packed copy (and the joined
    bias) is kept. The layers' parameters are not touched: names, ``state_dict``, LoRA and
    tensor parallelism see the checkpoint's tensors. :meth:`valid` notices a parameter
    replaced or written since (pointer and version counter), and callers then build a
    fresh one. Build with :meth:`build`, which answers None where packing does not apply.
    """

    def __init__(self, layers: list[nn.Linear], packed: torch.Tensor) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.packed = packed
        self.bias = None
        if any(layer.bias is not None for layer in layers):
            # A layer without bias adds zeros (not a new parameter: names stay the checkpoint's).
            self.bias = torch.cat(
                [
                    layer.bias.detach() if layer.bias is not None else layer.weight.new_zeros(n)
                    for layer, n in zip(layers, self.sizes, strict=True)
                ]
            )
        self.key = self._key()

    @classmethod
    def build(cls, layers: list[nn.Linear], model_bytes: int = 0) -> FusedLinear | None:
        """The packed matmul of ``layers``, or None where :func:`pack_enabled` says no or
        oneDNN refuses the shape (the plain per-layer matmuls then serve)."""
        weight = layers[0].weight
        if not pack_enabled(weight, model_bytes or weight.numel() * weight.element_size()):
            return None
        with torch.no_grad():
            weights = [layer.weight.detach() for layer in layers]
            joined = weights[0] if len(weights) == 1 else torch.cat(weights)
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(joined, 2)
            except RuntimeError:  # an unsupported shape or build
                return None
            return cls(layers, packed)

    def _key(self) -> tuple:
        key = []
        for layer in self.layers:
            for param in (layer.weight, layer.bias):
                if param is not None:
                    # Inference tensors (made under inference_mode, e.g. cast while
                    # loading) keep no version counter: only replacement is seen there.
                    version = None if param.is_inference() else param._version
                    key.append((param.data_ptr(), version, tuple(param.shape)))
        return tuple(key)

    def valid(self) -> bool:
        """False when a layer's weight or bias was replaced or written since packing."""
        return self._key() == self.key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        layout = rowmatmul.current()
        if layout is not None and flat.dtype == layout.dtype:  # no row's bits depend on its step
            out = rowmatmul.segmented(flat, layout, self._small_rows, self._onednn)
        else:
            out = rowmatmul.matmul(flat, self)  # a few rows: faster (AMX, AVX-512 bf16)
            if out is None:
                out = self._onednn(flat)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _small_rows(self, x: torch.Tensor) -> torch.Tensor:
        out = rowmatmul.matmul(x, self, any_rows=True)
        return rowmatmul.pieces(x, self._onednn) if out is None else out


def packed(
    owner: nn.Module, slot: str, layers: tuple[nn.Linear, ...], *, inside_forward: bool = False
) -> FusedLinear | None:
    """``owner``'s cached :class:`FusedLinear` of ``layers`` in ``slot`` (built or rebuilt
    within the forward's :class:`PackQuota`), or None where the plain path runs: autograd,
    hooks on a layer whose forward would be bypassed (they must fire), no packing, or not
    packed yet. ``inside_forward``: called from the layer's own forward (hooks fired)."""
    hooked = not inside_forward and any(
        layer._forward_hooks or layer._forward_pre_hooks for layer in layers
    )
    if not FAST_LINEARS or torch.is_grad_enabled() or hooked:
        return None
    state = owner.__dict__
    fused = state.get(slot)
    if fused is False:  # packing does not apply to these weights
        return None
    if fused is not None and fused.valid():
        return fused
    quota = state.get("_quota")
    nbytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    # bf16 packing is spread over the first passes: unpacked layers give the same bits.
    # float32 is packed at once: MKL's unpacked matmul does not (oneDNN's rows differ).
    spread = layers[0].weight.dtype == torch.bfloat16
    if spread and quota is not None and not quota.take(nbytes):
        return None
    fused = FusedLinear.build(list(layers), state.get("_budget", 0))
    state[slot] = False if fused is None else fused
    return fused
