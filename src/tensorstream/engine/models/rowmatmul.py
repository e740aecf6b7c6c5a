"""Small-batch matmuls over oneDNN's own packed weights (``csrc/rowmatmul.h``), on AMX
tiles or on AVX-512 bf16 dot products.

Owns: whether a packed matmul (:class:`~tensorstream.engine.models.packing.FusedLinear`)
runs through the C kernel (:func:`matmul`), the checked view of the packed weights it
reads (:class:`Plan`), the same sums from weights not packed yet (:func:`plain`), how an
engine pass's rows split between it and oneDNN so that no row's bits depend on its step
(:class:`Layout`, :func:`engine_pass`, :func:`segmented`; where the kernel does not run,
:func:`splits_rows` probes whether the CPU's own matmuls need that split), and a decode
step's layers as one C call (:class:`DecodeStack`).

Why: a decode step multiplies a few rows by every weight of the model once. On one core
of an AMX Xeon, oneDNN's packed bf16 matmul streamed SmolLM2's weights at 8.3-9.7 GB/s for
1-48 rows, and paid ~17 us of set-up per call; the AMX kernel here reads the very same
packed bytes at 10-12.6 GB/s (a bare read loop: 14.5) with ~1 us of set-up. On one core of
a Zen 4 (AVX-512 bf16, no AMX), oneDNN's 1-4-row products ran at 17-156 GFLOP/s and 16
rows at 160-207 against ~218 for large ones; the AVX-512 kernel ran the same shapes at
34-205 and 182-201 (1.3-2.3x at 1-4 rows), and whole decode steps 1.74x faster at one row
(11.9 against 20.7 ms) and 1.26x at 16 (30.3 against 38.3 ms), the one-call steps of
:class:`DecodeStack` included (``bench.decode_profile --compare-rowmatmul`` alternates the
two per step). No second copy of the weights.

Bits: every output of either kernel depends on its own row only, in a call of any size.
On AMX, for 3 to :data:`MAX_ROWS` rows oneDNN's kernel and this one add the same products
in the same order (measured equal bit for bit on every shape of the supported models,
``tests/native/test_rowmatmul.py``); one or two rows get the bits oneDNN gives them padded
to four (``llama.padded_rows``). With AVX-512 bf16 alone the kernel's sums are its own
(each output the input pairs in order, one VDPBF16PS each: oneDNN's products, added in
another order, equally accurate; tested against a float32 definition of them), so layers
not packed yet run :func:`plain` for the same bits. Above :data:`MAX_ROWS` rows oneDNN
rounds differently, so within an engine pass (:class:`Layout`) rows are multiplied by role
and a request's bits never depend on what shares its step; outside one (a plain
``model(input_ids)``) calls above :data:`MAX_ROWS` rows stay oneDNN's, as transformers' are.

Where it runs: bfloat16 on a CPU with AMX or AVX-512 bf16 (the C library built,
``rowops``), one or two compute threads (with two, the second thread of torch's OpenMP
team takes half of each call's outputs, or a helper thread of the C library's in a
process without OpenMP or in a forked child; with more, oneDNN's matmul spreads over all
of them), inputs multiples of 32, outputs multiples of 32 (AMX) or 16 (AVX-512), the
packed weights in the layout checked by :class:`Plan`. ``ENABLED = False`` (or
``TENSORSTREAM_ROWOPS=0``) keeps oneDNN.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from tensorstream.engine.models import rowops

if TYPE_CHECKING:
    from tensorstream.engine.models.packing import FusedLinear

__all__ = [
    "ENABLED",
    "Layout",
    "MAX_ROWS",
    "MAX_THREADS",
    "STACK",
    "DecodeStack",
    "Plan",
    "active",
    "current",
    "engine_pass",
    "head_layout",
    "matmul",
    "pieces",
    "plain",
    "plan",
    "segmented",
    "splits_rows",
    "threads",
]

#: False keeps oneDNN's matmuls (benchmarks alternate the two; tests run both).
ENABLED = True
#: False runs decode steps through the Python lean pass even where :class:`DecodeStack`
#: could (benchmarks alternate the two; tests compare them).
STACK = True
#: The most rows this kernel takes (on AMX, up to here its bits are oneDNN's: measured).
MAX_ROWS = 32
#: The most compute threads it runs on (the caller and one more); with more,
#: oneDNN's matmul spreads over all of them instead.
MAX_THREADS = 2
#: Inputs per block of oneDNN's packed layouts the kernel reads (outputs per block: the
#: library's ``matmul_block``, 32 on AMX and 64 on AVX-512 bf16).
_BLOCK = 32


_state = threading.local()


class Layout:
    """How the rows of one engine pass split for the matmuls, so that no row's bits depend
    on the rest of its step.

    oneDNN's packed bf16 matmul rounds a row one way in calls of 3-32 rows and another in
    calls of more (measured: rows differ from 33 on, and agree among larger calls whatever
    sits before them), so a request decoding beside 40 others got other logprobs, and
    sometimes other greedy tokens, than alone. Within an engine pass, rows are therefore
    multiplied as: each prompt chunk of more than :data:`MAX_ROWS` rows in a call of its
    own (its length depends on the request alone: chunks start at fixed multiples), every
    other row (decode rows, short chunks, the LM head's rows) through this kernel, whose
    every row gets its bits whatever their number; layers not yet packed use torch's
    matmul on pieces of at most :data:`MAX_ROWS` rows (on AMX the same bits) or
    :func:`plain` (AVX-512 bf16: the kernel's sums from the row-major weights).

    Where the kernel does not run (other CPUs, other dtypes, more threads), the same split
    applies with the CPU's matmul over pieces of at most :data:`MAX_ROWS` rows for the
    short rows, but only where :func:`splits_rows` finds that this CPU's matmuls round
    rows of larger calls otherwise; elsewhere the pass runs unsplit (no cost).

    Attributes:
        rows: rows in the pass (the row space of ``big``).
        big: (first, stop) of the long prompt chunks, in the pass's row order.
        dtype: the pass's compute dtype; matmuls in another one run unsplit.
    """

    def __init__(
        self, rows: int, big: tuple[tuple[int, int], ...] = (), dtype: torch.dtype = torch.bfloat16
    ) -> None:
        self.rows = rows
        self.big = big
        self.dtype = dtype
        self._small: torch.Tensor | None = None

    def small_rows(self) -> torch.Tensor:
        """Indices of the rows outside the long chunks (made once per pass)."""
        if self._small is None:
            keep = torch.ones(self.rows, dtype=torch.bool)
            for first, stop in self.big:
                keep[first:stop] = False
            self._small = keep.nonzero().view(-1)
        return self._small


@contextlib.contextmanager
def engine_pass(layout: Layout | None) -> Iterator[None]:
    """Within this block (on this thread), the native models' matmuls follow ``layout``
    where this kernel runs (:func:`active`, bf16) or where this CPU's matmuls need the
    split (:func:`splits_rows`); elsewhere, or with None, nothing changes."""
    before = getattr(_state, "layout", None)
    if layout is not None and not (layout.dtype == torch.bfloat16 and active()):
        # no call of a pass of at most MAX_ROWS rows is larger: nothing to split, no probe
        if layout.rows <= MAX_ROWS or not splits_rows(layout.dtype, torch.get_num_threads()):
            layout = None
    _state.layout = layout
    try:
        yield
    finally:
        _state.layout = before


def current() -> Layout | None:
    """The running engine pass's layout, or None (a plain forward, or no kernel here)."""
    return getattr(_state, "layout", None)


def segmented(
    x: torch.Tensor,
    layout: Layout,
    small: Callable[[torch.Tensor], torch.Tensor],
    big: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``x`` ([rows, inputs]) multiplied by :class:`Layout`: ``big`` once per long chunk,
    ``small`` once for all other rows. ``x`` may have more rows than the pass (padding
    after them) only when the pass has no long chunk."""
    if not layout.big:
        return small(x)
    if x.shape[0] != layout.rows:
        raise ValueError(f"{x.shape[0]} rows in a pass of {layout.rows} with long chunks")
    index = layout.small_rows()
    parts = [(first, stop, big(x[first:stop])) for first, stop in layout.big]
    out = torch.empty(x.shape[0], parts[0][2].shape[1], dtype=parts[0][2].dtype, device=x.device)
    for first, stop, part in parts:
        out[first:stop] = part
    if index.numel():
        out.index_copy_(0, index, small(x.index_select(0, index)))
    return out


def head_layout(rows: torch.Tensor, dtype: torch.dtype) -> Layout | None:
    """The LM head's :class:`Layout` for ``rows`` (one row per sequence, no long chunk), or
    None off the CPU (the split is about the CPU's matmuls); rank 0's engine and the
    tensor-parallel followers pass the same one."""
    return Layout(rows.shape[0], dtype=dtype) if rows.device.type == "cpu" else None


def pieces(
    x: torch.Tensor, matmul: Callable[[torch.Tensor], torch.Tensor], packed: bool = True
) -> torch.Tensor:
    """``matmul`` over ``x`` in calls of at most :data:`MAX_ROWS` rows, each padded as the
    engine pads small batches (``llama.padded_rows``; ``packed``: ``matmul`` is oneDNN's
    packed one, else torch's): every row gets the bits of the 32-row calls (for bf16 on
    AMX, those of the kernel)."""
    from tensorstream.engine.models.llama import _pad_rows, padded_rows

    if not x.shape[0]:
        return matmul(x)
    outs = []
    for start in range(0, x.shape[0], MAX_ROWS):
        piece = x[start : start + MAX_ROWS]
        count = piece.shape[0]
        padded = padded_rows(count, x.dtype, packed=packed)
        if padded > count:
            piece = _pad_rows(piece, count, padded)
        outs.append(matmul(piece)[:count])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


#: Row counts above :data:`MAX_ROWS` that :func:`splits_rows` multiplies.
_LARGE_ROWS = (33, 40, 64, 100)


@functools.cache
def splits_rows(dtype: torch.dtype, threads: int) -> bool:
    """Whether this CPU's matmuls in ``dtype`` on ``threads`` threads round some row of a
    call above :data:`MAX_ROWS` rows otherwise than :func:`pieces` of at most that many
    (then engine passes split their rows, :class:`Layout`). Probed once per dtype and
    thread count on the shapes ``llama.padded_rows`` probes, with torch's ``linear`` and
    oneDNN's packed matmul where the engine packs ``dtype``; where the kernel runs, bf16
    passes split whatever this says.

    Measured: oneDNN's packed bf16 on AMX Xeons rounds rows from 33 on otherwise (the
    reason for :class:`Layout`); on a 2-core AVX-512 AMD EPYC (Zen 4), bf16 and float32 on
    one or two threads, also with oneDNN and MKL held to AVX2, every count from 16 rows
    gives every row the same bits, so passes there run unsplit.
    """
    from tensorstream.engine.models import packing
    from tensorstream.engine.models.llama import _PROBE_SHAPES

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(1)
        for features, outputs in _PROBE_SHAPES:
            weight = torch.randn(outputs, features, generator=generator).to(dtype)
            x = torch.randn(_LARGE_ROWS[-1], features, generator=generator).to(dtype)
            matmuls = [(lambda rows, w=weight: torch.nn.functional.linear(rows, w), False)]
            if packing.packed_dtype(dtype):
                layer = torch.nn.Linear(features, outputs, bias=False, dtype=dtype)
                layer.weight = torch.nn.Parameter(weight, requires_grad=False)
                fused = packing.FusedLinear.build([layer])
                if fused is not None:
                    matmuls.append((fused._onednn, True))
            with torch.no_grad():
                for matmul, packed in matmuls:
                    split = pieces(x, matmul, packed)
                    for rows in _LARGE_ROWS:
                        if not torch.equal(matmul(x[:rows]), split[:rows]):
                            return True
        return False
    finally:
        torch.set_num_threads(before)


def threads() -> int:
    """Threads the kernel runs on now: torch's intra-op count, 1 or 2 (0: not at all)."""
    count = torch.get_num_threads()
    return count if count <= MAX_THREADS else 0


def active() -> bool:
    """Whether the kernel may run in this process now (library, AMX or AVX-512 bf16, one
    or two threads)."""
    if not ENABLED or not threads() or not rowops.active():
        return False
    lib = rowops.library()
    return lib is not None and lib.matmul_ready()


class Plan:
    """A :class:`FusedLinear`'s packed weights as the kernel reads them, checked.

    oneDNN chooses its packed layout per CPU and shape; the kernel reads one per build:
    per B outputs, the input pairs in order, B outputs x 2 each (B = the library's
    ``matmul_block``: ``AB16b32a2b`` on AMX, ``AB16b64a2b`` with AVX-512 bf16 alone).
    :meth:`build` confirms it on three blocks against the layers' own weights (and that
    nothing is padded) before any call, and answers None for anything else.
    """

    def __init__(self, pointer: int, outputs: int, inputs: int, bias: torch.Tensor | None):
        self.pointer = pointer
        self.outputs = outputs
        self.inputs = inputs
        self.bias = bias  # kept alive with the plan
        self.bias_pointer = None if bias is None else bias.data_ptr()

    @classmethod
    def build(cls, fused: FusedLinear) -> Plan | None:
        lib = rowops.library()
        width = lib.matmul_block if lib is not None else 0
        weights = [layer.weight for layer in fused.layers]
        outputs, inputs = sum(fused.sizes), weights[0].shape[1]
        # AVX-512 bf16: oneDNN pads the last block to 64 outputs; the kernel skips the pad
        granule = 16 if width == 64 else width
        if not width or outputs % granule or inputs % _BLOCK:
            return None
        if any(w.dtype != torch.bfloat16 or w.device.type != "cpu" for w in weights):
            return None
        bias = fused.bias
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return None
        packed = fused.packed
        try:
            pointer = torch.ops.mkldnn.data_ptr(packed)
            nbytes = torch.ops.mkldnn._nbytes(packed)
        except (AttributeError, RuntimeError):
            return None
        row_blocks, column_blocks = -(-outputs // width), inputs // _BLOCK
        if not pointer or nbytes != row_blocks * width * inputs * 2:
            return None
        raw = (ctypes.c_uint16 * (nbytes // 2)).from_address(pointer)
        stored = torch.frombuffer(raw, dtype=torch.bfloat16)
        size = width * _BLOCK  # elements of one block: width outputs x 32 inputs
        for o, i in {(0, 0), (row_blocks // 2, column_blocks // 2),
                     (row_blocks - 1, column_blocks - 1)}:  # fmt: skip
            rows = _rows(weights, o * width, width)  # fewer in a padded last block
            block = rows[:, i * _BLOCK : (i + 1) * _BLOCK].reshape(-1, _BLOCK // 2, 2)
            start = (o * column_blocks + i) * size
            held = stored[start : start + size].view(_BLOCK // 2, width, 2)[:, : rows.shape[0]]
            if not torch.equal(held, block.permute(1, 0, 2)):
                return None
        return cls(pointer, outputs, inputs, bias)


def _rows(weights: list[torch.Tensor], first: int, count: int) -> torch.Tensor:
    """Rows ``first .. first + count`` of the layers' weights stacked (what oneDNN packed)."""
    parts, start = [], 0
    for weight in weights:
        stop = start + weight.shape[0]
        if stop > first and start < first + count:
            parts.append(weight[max(first - start, 0) : first + count - start])
        start = stop
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def plan(fused: FusedLinear) -> Plan | None:
    """``fused``'s :class:`Plan`, built once per packed matmul (None: not this kernel's)."""
    state = fused.__dict__
    found = state.get("_rowmatmul")
    if found is None:
        found = state["_rowmatmul"] = Plan.build(fused) or False
    return found or None


def matmul(x: torch.Tensor, fused: FusedLinear, any_rows: bool = False) -> torch.Tensor | None:
    """``fused``'s outputs for rows ``x`` ([rows, inputs]) through the kernel, or None where
    it does not apply (the caller runs oneDNN's). ``any_rows``: also above
    :data:`MAX_ROWS` (where the bits are this kernel's 3-32-row ones, not oneDNN's)."""
    rows = x.shape[0]
    if rows <= 0 or (rows > MAX_ROWS and not any_rows):
        return None
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return None
    if not active():
        return None
    layers = plan(fused)
    if layers is None:
        return None
    out = torch.empty(rows, layers.outputs, dtype=x.dtype)
    lib = rowops.library()
    assert lib is not None  # active() said so
    lib.matmul(
        x.data_ptr(), rows, x.stride(0), layers.inputs, layers.outputs,
        layers.pointer, layers.bias_pointer, out.data_ptr(), layers.outputs, threads(),
    )  # fmt: skip
    return out


def plain(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor | None:
    """``layer``'s outputs for rows ``x`` from its row-major weight, with the bits the
    kernel gives once the layer is packed, or None where that takes nothing of its own (on
    AMX torch's matmul already gives them) or does not apply: layers are packed over the
    first passes, and a request must not get other bits in them than later."""
    weight, bias = layer.weight, layer.bias
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not active():
        return None
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.shape[0] % 16:
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    lib = rowops.library()
    assert lib is not None  # active() said so
    rows, (outputs, inputs) = x.shape[0], weight.shape
    out = torch.empty(rows, outputs, dtype=x.dtype)
    failed = lib.plain_matmul(
        x.data_ptr(), rows, x.stride(0), inputs, outputs, weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), out.data_ptr(), outputs,
    )  # fmt: skip
    return None if failed else out


_POINTERS = ("inorm", "postnorm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias",
             "gate_up", "gate_up_bias", "down", "down_bias", "keys", "values")  # fmt: skip


class _StackLayer(ctypes.Structure):
    """``stack_layer`` in csrc/rowmatmul.h."""

    _fields_ = [(name, ctypes.c_void_p) for name in _POINTERS] + [("window", ctypes.c_int64)]


class DecodeStack:
    """A lean pass's decoder layers as one C call per decode step (``decode_stack_bf16``).

    The same operators in the same order as ``fastpath.LeanStack._run_fused`` with this
    module's matmul (so the same bits: tested), without the ~8 Python calls per layer
    between them: at 16 rows a SmolLM2 step spent ~4 ms of its ~32 there. It takes steps
    of decode rows only (any number: every row gets its own bits, :class:`Layout`);
    anything else runs the Python pass.
    Build with :meth:`build` from a lean stack (None where a layer does not qualify).
    """

    def __init__(self, lean: object, layers: ctypes.Array, groups: int, qk_eps: float) -> None:
        self.lean = lean
        self.layers = layers
        self.groups = groups
        self.qk_eps = qk_eps
        self.attention = [layer.attn for layer in lean.layers]  # type: ignore[attr-defined]
        self._cache: tuple[int, ...] = ()

    @classmethod
    def build(cls, lean: object) -> DecodeStack | None:
        layers = lean.layers  # type: ignore[attr-defined]
        if lean.dtype != torch.bfloat16 or not lean.fusable:  # type: ignore[attr-defined]
            return None
        array = (_StackLayer * len(layers))()
        epsilons = set()
        for entry, layer in zip(array, layers, strict=True):
            plans = [plan(f) for f in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in plans):
                return None
            for name, p in zip(("qkv", "o", "gate_up", "down"), plans, strict=True):
                setattr(entry, name, p.pointer)
                setattr(entry, name + "_bias", p.bias_pointer)
            norms = {"inorm": layer.inorm, "postnorm": layer.postnorm,
                     "q_norm": layer.q_norm, "k_norm": layer.kv_norm}  # fmt: skip
            for name, tensor in norms.items():
                if tensor is not None and (
                    tensor.dtype != torch.bfloat16 or not tensor.is_contiguous()
                ):
                    return None
                setattr(entry, name, None if tensor is None else tensor.data_ptr())
            attn = layer.attn
            entry.window = attn.window or 0
            epsilons.add(attn.q_norm.variance_epsilon if attn.qk_norm else 0.0)
        if len(epsilons) != 1:
            return None
        return cls(lean, array, layers[0].attn.groups, epsilons.pop())

    def takes(self, rows: int, batch: object) -> bool:
        """Whether this step is one for :meth:`run`: decode rows only, the kernel active."""
        slots = batch.decode_slots  # type: ignore[attr-defined]
        return (
            rows > 0
            and slots is not None
            and len(slots[0]) == rows
            and batch.token_slots is not None  # type: ignore[attr-defined]
            and active()
        )

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: object
    ) -> torch.Tensor:
        """The decoder layers over decode rows ``x`` ([rows, 1, hidden]); same shape back."""
        lean = self.lean
        rows, hidden = x.shape[0], x.shape[-1]
        heads, kv_heads, d = lean.heads, lean.kv_heads, lean.head_dim  # type: ignore[attr-defined]
        intermediate = lean.intermediate  # type: ignore[attr-defined]
        cache = batch.cache  # type: ignore[attr-defined]
        keys, values = cache.keys, cache.values
        pointers = tuple(keys[a.layer].data_ptr() for a in self.attention)
        if pointers != self._cache:  # the cache grew into new slabs
            for entry, a, pointer in zip(self.layers, self.attention, pointers, strict=True):
                entry.keys, entry.values = pointer, values[a.layer].data_ptr()
            self._cache = pointers
        x = x.view(rows, hidden)
        cos, sin = cos.reshape(rows, d).contiguous(), sin.reshape(rows, d).contiguous()
        length = keys[self.attention[0].layer].shape[2]
        cache_rows, positions = batch.token_slots  # type: ignore[attr-defined]
        empty, bf16 = torch.empty, torch.bfloat16
        normed, delta = empty(rows, hidden, dtype=bf16), empty(rows, hidden, dtype=bf16)
        qkv = empty(rows, (heads + 2 * kv_heads) * d, dtype=bf16)
        attended = empty(rows, heads * d, dtype=bf16)
        up, gated = empty(rows, 2 * intermediate, dtype=bf16), empty(rows, intermediate, dtype=bf16)
        scratch = empty(self.groups * length)
        lib = rowops.library()
        assert lib is not None
        lib.decode_stack(
            x.data_ptr(), rows, hidden, len(self.layers), self.layers, heads, kv_heads, d,
            intermediate, length, lean.eps, self.qk_eps,  # type: ignore[attr-defined]
            cos.data_ptr(), sin.data_ptr(), cache_rows.data_ptr(), positions.data_ptr(),
            normed.data_ptr(), qkv.data_ptr(), attended.data_ptr(), delta.data_ptr(),
            up.data_ptr(), gated.data_ptr(), scratch.data_ptr(), threads(),
        )  # fmt: skip
        return x.view(rows, 1, hidden)
