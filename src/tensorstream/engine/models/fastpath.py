"""The decoder stack's lean engine pass: the same arithmetic, a fraction of the Python.

Owns: :class:`LeanStack`, built once the native model's linear layers are packed
(``packing.py``), which runs the decoder layers of an engine step (an
:class:`~tensorstream.engine.models.llama.AttentionBatch` with a plan) as straight
calls on the packed weights, and the checks that say when it may run.

Why: at 16 rows a float32 decode step of SmolLM2-135M spent ~52 ms in its 121 packed
matmuls and another ~32 ms around them, a third of which was Python: module calls,
per-layer pack lookups and validity checks, padding decisions and 2-op slices made
once per layer instead of once per step (``bench.decode_profile --compare-lean``
measures the two paths step by step in one process). The lean pass does those
once per forward and gives every row the very bits of the module path (tested:
``tests/native/test_lean_stack.py``): same ops in the same order, the rotation's
``rotate_half`` folded into a sign-flipped sine (``rope.rotate_rolled``).

It runs only where skipping the modules changes nothing observable: no autograd, no
LoRA rows, no hooks on any module it bypasses (tensor parallelism's all-reduce is a
hook), and every packed weight still the one in its parameter. Anything else takes
the module path, which also (re)packs; the stack is then rebuilt.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks

from tensorstream.engine.models import packing, rowmatmul, rowops
from tensorstream.engine.models.packing import FusedLinear
from tensorstream.engine.models.rope import rotate_rolled, signed_sin

__all__ = ["ENABLED", "LeanStack"]

#: False sends every engine pass through the modules (``bench.decode_profile
#: --compare-lean`` alternates the two per step).
ENABLED = True

_linear = torch.ops.mkldnn._linear_pointwise if hasattr(torch.ops, "mkldnn") else None


class _Layer:
    """One decoder layer's tensors, as the lean pass reads them."""

    __slots__ = ("attn", "down", "gate_up", "inorm", "kv_norm", "o", "postnorm", "q_norm", "qkv")

    def __init__(self, layer: nn.Module, fused: tuple[FusedLinear, ...]) -> None:
        self.attn = layer.self_attn
        self.qkv, self.o, self.gate_up, self.down = fused
        self.inorm = layer.input_layernorm.weight
        self.postnorm = layer.post_attention_layernorm.weight
        self.q_norm = self.attn.q_norm.weight if self.attn.qk_norm else None
        self.kv_norm = self.attn.k_norm.weight if self.attn.qk_norm else None


class LeanStack:
    """The packed decoder layers of one model, and what must hold for them to stand in.

    Build with :meth:`build` (None until every layer is packed); :meth:`applies` is the
    per-forward check (:meth:`fresh` its parameter half); :meth:`run` is the pass itself.
    """

    def __init__(self, model: nn.Module, layers: list[_Layer]) -> None:
        self.layers = layers
        config = model.config
        first = layers[0].attn
        self.heads, self.kv_heads, self.head_dim = first.heads, first.kv_heads, first.head_dim
        self.intermediate = config.intermediate_size
        self.eps = model.model.layers[0].input_layernorm.variance_epsilon
        self.dtype = layers[0].inorm.dtype
        self.fusable = all(layer.attn.fusable for layer in layers)
        # Every module the pass bypasses (their hooks would not fire) and every parameter
        # it reads through a packed copy or by reference (a replaced one must be seen).
        self._modules = [m for layer in model.model.layers for m in layer.modules()]
        self._params = []
        for layer in model.model.layers:
            for owner in layer.modules():
                for name, param in owner._parameters.items():
                    if param is not None:
                        self._params.append((owner._parameters, name, param, *_stamp(param)))

    @classmethod
    def build(cls, model: nn.Module) -> LeanStack | None:
        """The stack over ``model``'s packed layers, or None while any is not packed."""
        if _linear is None or not model.model.layers:
            return None
        layers = []
        for layer in model.model.layers:
            fused = (
                layer.self_attn.__dict__.get("_qkv"),
                layer.self_attn.o_proj.__dict__.get("_fast"),
                layer.mlp.__dict__.get("_gate_up"),
                layer.mlp.down_proj.__dict__.get("_fast"),
            )
            if not all(isinstance(f, FusedLinear) and f.valid() for f in fused):
                return None
            layers.append(_Layer(layer, fused))
        dtypes = {t.dtype for layer in layers for t in (layer.inorm, layer.postnorm)}
        dtypes |= {f.layers[0].weight.dtype for layer in layers
                   for f in (layer.qkv, layer.o, layer.gate_up, layer.down)}  # fmt: skip
        if len(dtypes) != 1:
            return None
        return cls(model, layers)

    def applies(self, x: torch.Tensor, batch: Any) -> bool:
        """Whether this forward may take the lean pass (else the modules run)."""
        if not ENABLED or not packing.FAST_LINEARS or torch.is_grad_enabled():
            return False
        if batch is None or batch.plan is None or batch.adapters is not None:
            return False
        if x.dtype != self.dtype or x.dim() != 3 or x.shape[1] != 1:
            return False
        if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
            return False
        for owner in self._modules:
            if owner._forward_hooks or owner._forward_pre_hooks:
                return False
        return self.fresh()

    def fresh(self) -> bool:
        """False once a parameter was replaced or written since the stack was built."""
        # Inlined, not _stamp(): this runs every step over every parameter (~270 for SmolLM2).
        for params, name, param, pointer, version in self._params:
            if params.get(name) is not param or param.data_ptr() != pointer:
                return False
            if version is not None and param._version != version:
                return False
        return True

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Any
    ) -> torch.Tensor:
        """The decoder layers over token rows ``x`` ([rows, 1, hidden]); returns the same shape.

        ``cos``/``sin`` are the rows' rotary tables ([rows, 1, head_dim]).
        """
        from tensorstream.engine.models.llama import padded_rows

        rows = x.shape[0]
        padded = padded_rows(rows, x.dtype, packed=True)
        if self.fusable and batch.token_slots is not None and rowops.usable(x):
            stack = self._decode_stack()
            if stack is not None and stack.takes(rows, batch):
                return stack.run(x, cos, sin, batch)
            return self._run_fused(x, cos, sin, batch, padded)
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qk_width = (heads + kv_heads) * d
        linear = _packed_linear if padded == rows else _padded_linear(rows, padded)
        norm = _norm_fp32 if x.dtype == torch.float32 else _norm_cast
        eps, split = self.eps, self.intermediate
        cos, sin = cos.view(rows, 1, d), signed_sin(sin).view(rows, 1, d)
        x = x.view(rows, -1)
        for layer in self.layers:
            qkv = linear(norm(x, layer.inorm, eps), layer.qkv)
            if layer.q_norm is None:
                # queries and keys are adjacent: one rotation for both
                qk = rotate_rolled(qkv[:, :qk_width].view(rows, heads + kv_heads, d), cos, sin)
                q, k = qk[:, :, None].split([heads, kv_heads], dim=1)
            else:
                q = norm(qkv[:, : heads * d].view(rows, heads, d), layer.q_norm, eps)
                k = norm(qkv[:, heads * d : qk_width].view(rows, kv_heads, d), layer.kv_norm, eps)
                q = rotate_rolled(q, cos, sin)[:, :, None]
                k = rotate_rolled(k, cos, sin)[:, :, None]
            v = qkv[:, qk_width:].view(rows, kv_heads, 1, d)
            out = layer.attn._attend_planned(q, k, v, batch).reshape(rows, heads * d)
            x = x + linear(out, layer.o)
            up = linear(norm(x, layer.postnorm, eps), layer.gate_up)
            x = x + linear(F.silu(up[:, :split]) * up[:, split:], layer.down)
        return x.view(rows, 1, -1)

    def _decode_stack(self) -> rowmatmul.DecodeStack | None:
        """The layers as one C call per decode step (built once; None: not this model)."""
        if not rowmatmul.STACK:
            return None
        stack = self.__dict__.get("_stack")
        if stack is None:
            stack = self.__dict__["_stack"] = rowmatmul.DecodeStack.build(self) or False
        return stack or None

    def _run_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Any, padded: int
    ) -> torch.Tensor:
        """:meth:`run` through the fused row operators (``rowops.py``): one C call per
        stretch between two matmuls, the module path's bits (the residual adds and norms
        fused, padded rows written by the norm and gate operators themselves)."""
        rows, d, eps = x.shape[0], self.head_dim, self.eps
        cos, sin = cos.reshape(rows, d), sin.reshape(rows, d)
        x = x.view(rows, -1)
        normed = torch.empty(padded, x.shape[1], dtype=x.dtype)
        # The o-projection's input, padded rows filled by the attention call itself.
        attended = torch.empty(padded, self.heads * d, dtype=x.dtype)
        delta = None
        for layer in self.layers:
            rowops.add_norm(x, layer.inorm, eps, delta=delta, out=normed)
            q, k, v = layer.attn.split_qkv(_packed_linear(normed, layer.qkv)[:rows])
            layer.attn.attend_rows(q, k, v, cos, sin, batch, out=attended)
            rowops.add_norm(x, layer.postnorm, eps, delta=_packed_linear(attended, layer.o),
                            out=normed)  # fmt: skip
            gated = rowops.silu_mul(_packed_linear(normed, layer.gate_up), None, rows, padded)
            delta = _packed_linear(gated, layer.down)
        rowops.add_rows(x, delta)
        return x.view(rows, 1, -1)


def _stamp(param: torch.Tensor) -> tuple[int, int | None]:
    # Inference tensors keep no version counter: only replacement is seen there.
    return param.data_ptr(), None if param.is_inference() else param._version


def _norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # The weight inside torch's norm: the bits of ``weight * rms_norm(x)`` (tested).
    return torch.rms_norm(x, x.shape[-1:], weight, eps)


def _norm_cast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As the module: normalized in float32, scaled in the input's dtype.
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _packed_linear(x: torch.Tensor, fused: FusedLinear) -> torch.Tensor:
    # ``x`` is [rows, features]; the engine pass's row layout applies (rowmatmul.Layout).
    return fused(x)


def _padded_linear(rows: int, padded: int) -> Any:
    """The packed matmul over ``padded`` rows (the first repeated), as the module path
    runs small batches (``llama.padded_rows``); returns the ``rows`` real ones."""

    from tensorstream.engine.models.llama import _pad_rows  # llama imports this module

    def linear(x: torch.Tensor, fused: FusedLinear) -> torch.Tensor:
        return _packed_linear(_pad_rows(x, rows, padded), fused)[:rows]

    return linear
