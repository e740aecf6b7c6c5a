"""What ``dtype="auto"`` computes in on a CPU that has no fast half-precision matmuls.

Owns the one decision: a checkpoint stored in bfloat16 (or float16) runs in float32 on a
CPU whose oneDNN build has no kernels for it, when float32 weights fit in memory.

Why: torch's CPU ``linear`` in bfloat16 reaches oneDNN's fast kernels only where the CPU
has AVX-512 (or AMX); elsewhere (AVX2 hosts: many AMD EPYC and older Xeon VMs) it falls
back to a reference loop. Measured on a 2-core AMD EPYC (AVX2) VM, SmolLM2-135M, one
thread: a 16-row decode step took 495 ms in bfloat16 and 156 ms in float32 (3.2x); a
576x1536 matmul ran at 10 GFLOP/s in bfloat16 against 63 in float32 at 16 rows. The
price is twice the weights' memory (four times where the float32 weights also get
oneDNN-packed copies), so the switch is made only when all of that takes at most half of
the memory available now; otherwise the checkpoint's dtype stays, with a warning. An
explicit ``dtype`` is always honoured.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from tensorstream.utils.meminfo import available_bytes

__all__ = [
    "auto_compute_dtype",
    "cpu_matmul_supported",
    "estimated_parameters",
    "keep_checkpoint_dtype",
]

logger = logging.getLogger("tensorstream.engine")

#: Share of the currently available memory float32 weights may take for the switch.
_FIT_SHARE = 0.5
_KEEP = contextvars.ContextVar("tensorstream_keep_checkpoint_dtype", default=False)
_CHECKS = {
    torch.bfloat16: "_is_mkldnn_bf16_supported",
    torch.float16: "_is_mkldnn_fp16_supported",
}


@contextlib.contextmanager
def keep_checkpoint_dtype() -> Iterator[None]:
    """Within: ``auto`` is the checkpoint's dtype whatever the CPU (for writing files)."""
    token = _KEEP.set(True)
    try:
        yield
    finally:
        _KEEP.reset(token)


@functools.cache
def cpu_matmul_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype`` matmuls on oneDNN's fast kernels.

    float32 (and any dtype torch cannot tell about) counts as supported: only a known
    "no" changes what ``auto`` picks. Cached: the model code asks on every matmul.
    """
    check = _CHECKS.get(dtype)
    if check is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch build without the probe
        return True


def estimated_parameters(config: Any) -> int | None:
    """Parameter count of a decoder-only transformer from its config, or None when the
    config lacks the usual Llama/GPT-style sizes (then no estimate is made)."""

    def get(*names: str) -> int | None:  # the spellings differ by family
        values = (getattr(config, name, None) for name in names)
        return next((v for v in values if isinstance(v, int) and v > 0), None)

    hidden = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    vocab = get("vocab_size")
    if not (hidden and layers and vocab):
        return None
    inner = get("intermediate_size", "ffn_dim", "n_inner") or 4 * hidden
    heads = get("num_attention_heads", "n_head") or 1
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = (3 if get("intermediate_size") else 2) * hidden * inner
    tied = getattr(config, "tie_word_embeddings", True)
    return layers * (attention + mlp) + vocab * hidden * (1 if tied is not False else 2)


def _copies(float32_bytes: int) -> int:
    """Copies of the float32 weights a CPU load holds: 2 where they get oneDNN-packed
    copies beside them (``engine/models/packing.py``: models up to its automatic budget)."""
    from tensorstream.engine.models.packing import _PACK_AUTO_BYTES

    return 2 if float32_bytes <= _PACK_AUTO_BYTES else 1


def _available_bytes() -> int | None:
    try:
        return available_bytes()
    except OSError:  # not Linux: no size to judge by
        return None


def auto_compute_dtype(declared: torch.dtype, device: Any, config: Any) -> torch.dtype:
    """The dtype ``auto`` computes in: ``declared``, or float32 on a CPU without fast
    ``declared`` matmuls when float32 weights fit (see the module docstring).

    Args:
        declared: the checkpoint's dtype (config.json's ``dtype``/``torch_dtype``).
        device: where the model runs (None: CPU).
        config: the model config, for the size estimate.
    """
    if declared not in _CHECKS or (device is not None and torch.device(device).type != "cpu"):
        return declared
    if _KEEP.get():
        return declared
    if cpu_matmul_supported(declared):
        return declared
    name = str(declared).removeprefix("torch.")
    params = estimated_parameters(config)
    available = _available_bytes()
    need = None if params is None else params * 4 * _copies(params * 4)
    if need is None or available is None or need > _FIT_SHARE * available:
        logger.warning(
            "this CPU has no fast %s matmuls (torch sees %s); float32 would be ~3x faster but "
            "its weights (%s) may not fit, so the model stays in %s; pass dtype='float32' "
            "to choose it anyway",
            name, torch.backends.cpu.get_cpu_capability(),
            "size unknown" if params is None else f"~{params * 4 / 1e9:.1f} GB", name,
        )  # fmt: skip
        return declared
    logger.info(
        "this CPU has no fast %s matmuls (torch sees %s): computing in float32 "
        "(~%.2f GB of weights, ~3x faster here); pass dtype='%s' to keep the checkpoint's",
        name, torch.backends.cpu.get_cpu_capability(), params * 4 / 1e9, name,
    )  # fmt: skip
    return torch.float32
