"""The native models' fused row operators (``engine/csrc/rowops.c``), called on torch tensors.

Owns the calls: the residual add with its RMS norm (:func:`add_norm`), SiLU gating
(:func:`silu_mul`), the rotary rotation with the KV-cache write and decode attention over
the cache in one call per layer (:func:`rope_attend`; its two halves, :func:`rope_store`
and :func:`decode_attention`, are callable alone for tests and tools), and greedy picks
(:func:`greedy`); and whether they run (:func:`active`, :func:`usable`). Building and
loading the library is ``engine/rowops_build.py``'s.

Why: between its four matmuls a decoder layer ran ~25 torch operators on tensors of a few
KiB, each paying a few microseconds of dispatch; at 16 rows a SmolLM2 decode step spent
~20 ms there against ~28 ms of matmuls (``bench.decode_profile --compare-rowops``
alternates the two). One C call per stretch between matmuls does the same arithmetic in
a fraction of that. Every operator is row-wise with a fixed summation order, so a
request gets the same bits alone or in any batch (``tests/native/test_rowops.py``).

Without a C compiler, or with ``TENSORSTREAM_ROWOPS=0``, the models run their torch
operators; ``TENSORSTREAM_ROWOPS=1`` makes a failed build an error.
"""

from __future__ import annotations

import ctypes

import torch

from tensorstream.engine.rowops_build import ENV, library, start_build

__all__ = [
    "ENABLED",
    "ENV",
    "MAX_GROUP_VALUES",
    "MAX_HEAD_DIM",
    "active",
    "add_norm",
    "add_rows",
    "check_shapes",
    "decode_attention",
    "greedy",
    "library",
    "rope_attend",
    "rope_store",
    "silu_mul",
    "start_build",
    "usable",
]

#: Shapes the fused attention takes: head_dim at most ``MAX_HEAD_DIM`` (its per-head
#: arrays, ``MAX_HEAD_VECTORS`` in rowops.c), and query heads per kv head times head_dim
#: at most ``MAX_GROUP_VALUES`` (the bound of its first version, kept: wider groups run
#: torch's operators).
MAX_GROUP_VALUES = 4096
MAX_HEAD_DIM = 512
#: False: the models run torch's operators even where the library is loaded (benchmarks
#: alternate the two per step; tests run both).
ENABLED = True
_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def active() -> bool:
    """Whether the fused operators run in this process (builds or waits once)."""
    return ENABLED and library() is not None


def usable(x: torch.Tensor) -> bool:
    """Whether ``x``'s operators may run fused: CPU, bfloat16/float32, no autograd."""
    return x.dtype in _NAMES and x.device.type == "cpu" and not torch.is_grad_enabled() and active()


_OPS: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}


def _op(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    # Called a few hundred times per engine step: the bound function is looked up once.
    fn = _OPS.get((name, dtype))
    if fn is None:
        lib = library()
        assert lib is not None, "rowops called where library() found none"
        fn = _OPS[name, dtype] = lib.ops[name, _NAMES[dtype]]
    return fn


def _rows(t: torch.Tensor) -> int:
    """Row stride of a [rows, n] view whose elements are contiguous within a row."""
    strides = t.stride()
    if len(strides) != 2 or strides[1] != 1:
        raise ValueError(f"expected [rows, n] with unit element stride, got {strides}")
    return strides[0]


def add_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``norm(x + delta) * weight`` row by row; with ``delta``, ``x`` is updated in place
    (the residual stream). ``out`` may have more rows than ``x``: they repeat row 0.

    Args:
        x: [rows, n]. weight: [n]. delta: [rows or more, n] (its first rows are added).
        out: [out_rows >= rows, n], or None for a new [rows, n].
    """
    rows, n = x.shape
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _op("add_norm", x.dtype)(
        x.data_ptr(), _rows(x),
        None if delta is None else delta.data_ptr(), 0 if delta is None else _rows(delta),
        weight.data_ptr(), out.data_ptr(), _rows(out), rows, out.shape[0], n, eps,
    )  # fmt: skip
    return out


def add_rows(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``x += delta[:rows]`` in place, rounded to ``x``'s dtype; returns ``x``."""
    rows, n = x.shape
    _op("add_rows", x.dtype)(x.data_ptr(), _rows(x), delta.data_ptr(), _rows(delta), rows, n)
    return x


def silu_mul(
    gate: torch.Tensor,
    up: torch.Tensor | None = None,
    rows: int | None = None,
    out_rows: int | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` (rounded as torch's two operators are), [out_rows, n]: the first
    ``rows`` rows computed (default all), the rest repeating row 0. ``up`` None: ``gate``
    is the joint gate/up projection ([rows, 2n], gate first), split without a view."""
    rows = gate.shape[0] if rows is None else rows
    out_rows = rows if out_rows is None else out_rows
    stride = _rows(gate)
    if up is None:
        n = gate.shape[1] // 2
        up_ptr, up_stride = gate.data_ptr() + n * gate.element_size(), stride
    else:
        n = gate.shape[1]
        up_ptr, up_stride = up.data_ptr(), _rows(up)
    out = torch.empty(out_rows, n, dtype=gate.dtype)
    _op("silu_mul", gate.dtype)(
        gate.data_ptr(), stride, up_ptr, up_stride, out.data_ptr(), n, rows, out_rows, n
    )
    return out


def _rope_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    head_dim: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
) -> tuple:
    """The C arguments :func:`rope_store` and :func:`rope_attend` share, in their order."""
    cache_rows, positions = slots
    return (
        q.data_ptr(), _rows(q), k.data_ptr(), _rows(k), v.data_ptr(), _rows(v),
        cos.data_ptr(), sin.data_ptr(), _rows(cos),
        None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(), eps,
        keys.data_ptr(), values.data_ptr(), cache_rows.data_ptr(), positions.data_ptr(),
        q.shape[0], q.shape[1] // head_dim, keys.shape[1], head_dim, keys.shape[2],
    )  # fmt: skip


def _check_scratch(scratch: torch.Tensor, heads: int, keys: torch.Tensor) -> None:
    need = heads // keys.shape[1] * keys.shape[2]
    if scratch.numel() < need or scratch.dtype != torch.float32:
        raise ValueError(f"scratch needs {need} float32 values")


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    *,
    head_dim: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """Rotate the rows' queries and keys in place (after their per-head norms, if given)
    and write keys and values into this layer's cache slabs at ``slots``.

    Args:
        q, k, v: [rows, heads * head_dim] / [rows, kv_heads * head_dim] views.
        cos, sin: [rows, head_dim] contiguous, in the activations' dtype.
        keys, values: contiguous [cache rows, kv heads, length, head_dim] slabs.
        slots: int64 (cache row, position) of each row, inside the slabs (the engine's
            ``KVCache.ensure`` made them so; they are not checked here).
    """
    args = _rope_args(q, k, v, cos, sin, keys, values, slots, head_dim, q_norm, k_norm, eps)
    _op("rope_store", q.dtype)(*args)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    *,
    head_dim: int,
    window: int | None,
    scratch: torch.Tensor,
) -> None:
    """Rows ``0..len(slots[0])`` of ``q`` (rotated) attend their cache row's keys up to
    their position (within ``window``); results go to the same rows of ``out``.

    ``scratch``: float32, at least (query heads per kv head) x the slabs' length.
    """
    cache_rows, positions = slots
    heads = q.shape[1] // head_dim
    _check_scratch(scratch, heads, keys)
    _op("decode_attention", q.dtype)(
        q.data_ptr(), _rows(q), keys.data_ptr(), values.data_ptr(),
        cache_rows.data_ptr(), positions.data_ptr(), out.data_ptr(), _rows(out),
        len(cache_rows), heads, keys.shape[1], head_dim, keys.shape[2], window or 0,
        scratch.data_ptr(),
    )  # fmt: skip


def rope_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor],
    decode_rows: int,
    out: torch.Tensor,
    *,
    head_dim: int,
    window: int | None,
    scratch: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> None:
    """:func:`rope_store` for every row, then :func:`decode_attention` for the first
    ``decode_rows`` (whose slots come first in ``slots``) into ``out``, in one call. Rows
    of ``out`` past ``q``'s repeat row 0 (write them only when row 0 is a decode row)."""
    rows = q.shape[0]
    _check_scratch(scratch, q.shape[1] // head_dim, keys)
    if decode_rows > rows or out.shape[0] < rows or (out.shape[0] > rows and decode_rows < 1):
        raise ValueError(f"{decode_rows} decode rows of {rows} into {out.shape[0]} out rows")
    args = _rope_args(q, k, v, cos, sin, keys, values, slots, head_dim, q_norm, k_norm, eps)
    _op("rope_attend", q.dtype)(
        *args, decode_rows, out.data_ptr(), _rows(out), out.shape[0], window or 0,
        scratch.data_ptr(),
    )  # fmt: skip


def greedy(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """Each row's argmax (torch's: the first maximal entry, or the first NaN) and its
    log-softmax value, from [rows, vocab] logits in one pass, without a float32 copy."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    _op("greedy_rows", logits.dtype)(
        logits.data_ptr(), _rows(logits), rows, vocab, tokens.data_ptr(), logprobs.data_ptr()
    )
    return tokens.tolist(), logprobs.tolist()


def check_shapes(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the kernels take a model of these attention shapes."""
    if not 0 < head_dim <= MAX_HEAD_DIM or head_dim % 2 or kv_heads <= 0 or heads % kv_heads:
        return False
    return heads // kv_heads * head_dim <= MAX_GROUP_VALUES
