"""The native models' fused row operators (``csrc/rowops.c``): built once per machine, bound with ctypes.

Owns: compiling the C source with the system's C compiler into the cache directory
(``$TENSORSTREAM_CACHE`` or ``~/.cache/tensorstream``, under ``kernels/``, keyed by the
source, the compiler and this CPU), loading it, and the torch-facing calls: the residual
add with its RMS norm (:func:`add_norm`), SiLU gating (:func:`silu_mul`), the rotary
rotation with the KV-cache write (:func:`rope_store`) and decode attention over the cache
(:func:`decode_attention`).

Why: between its four matmuls a decoder layer ran ~25 torch operators on tensors of a few
KiB, each paying a few microseconds of dispatch; at 16 rows a SmolLM2 decode step spent
~20 ms there against ~28 ms of matmuls (``bench.decode_profile --compare-rowops``
alternates the two). One C call per stretch between matmuls does the same arithmetic in
a fraction of that. Every operator is row-wise with a fixed summation order, so a
request gets the same bits alone or in any batch (``tests/native/test_rowops.py``).

The build starts in the background when a native model is built (:func:`start_build`)
and the first forward pass waits for it (:func:`library`): a process never mixes the
two arithmetics. Without a C compiler, or with ``TENSORSTREAM_ROWOPS=0``, the models run
their torch operators; ``TENSORSTREAM_ROWOPS=1`` makes a failed build an error.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

from tensorstream.errors import ConfigError

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
    "rope_store",
    "silu_mul",
    "start_build",
    "usable",
]

logger = logging.getLogger("tensorstream.engine")

ENV = "TENSORSTREAM_ROWOPS"
#: The C attention's per-kv-head buffers (``MAX_GROUP_VALUES``, ``MAX_HEAD_VECTORS`` in
#: rowops.c): query heads per kv head times head_dim, and head_dim, at most these.
MAX_GROUP_VALUES = 4096
MAX_HEAD_DIM = 512
_ABI = 2
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno")
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "float"}

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_norm": [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _F],
    "add_rows": [_P, _I, _P, _I, _I, _I],
    "silu_mul": [_P, _I, _P, _I, _P, _I, _I, _I, _I],
    "rope_store": [_P, _I, _P, _I, _P, _I, _P, _P, _I, _P, _P, _F, _P, _P, _P, _P] + [_I] * 5,
    "decode_attention": [_P, _I, _P, _P, _P, _P, _P, _I] + [_I] * 6 + [_P],
    "greedy_rows": [_P, _I, _I, _I, _P, _P],
}

#: False: the models run torch's operators even where the library is loaded (benchmarks
#: alternate the two per step; tests run both).
ENABLED = True

_lock = threading.Lock()
_thread: threading.Thread | None = None
_lib: _Library | None = None
_error = ""
_resolved = False  # _lib/_error are final


class _Library:
    """The loaded shared object: one bound function per operator and dtype."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cdll = ctypes.CDLL(str(path))
        self.cdll.rowops_abi.restype = ctypes.c_int
        if self.cdll.rowops_abi() != _ABI:
            raise OSError(f"{path} has another ABI than this tensorstream")
        self.ops: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _DTYPES.items():
                fn = getattr(self.cdll, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, None
                self.ops[name, dtype] = fn


def _mode() -> str:
    return os.environ.get(ENV, "").strip().lower()


def _disabled() -> bool:
    return _mode() in ("0", "false", "no", "off")


def _required() -> bool:
    return _mode() in ("1", "true", "yes", "on")


def _cache_root() -> Path:
    root = os.environ.get("TENSORSTREAM_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "tensorstream"
    return base / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _sources() -> dict[str, bytes]:
    """The C sources shipped in the package: name -> bytes."""
    folder = resources.files("tensorstream.engine.models").joinpath("csrc")
    return {
        item.name: item.read_bytes()
        for item in folder.iterdir()
        if item.name.endswith((".c", ".h"))
    }


def _build(sources: dict[str, bytes]) -> Path:
    """The compiled library of ``sources`` on this machine (built now unless cached)."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH; set CC to one")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    digest = hashlib.sha256()
    for part in (compiler, version, " ".join(_FLAGS), _cpu_identity()):
        digest.update(part.encode() + b"\0")
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name] + b"\0")
    root = _cache_root()
    target = root / f"rowops-{digest.hexdigest()[:24]}.so"
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(dir=root) as work:
        for name, data in sources.items():
            (Path(work) / name).write_bytes(data)
        out = Path(work) / "rowops.so"
        done = subprocess.run(
            [compiler, *_FLAGS, "-o", str(out), str(Path(work) / "rowops.c"), "-lm"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise OSError(f"{Path(compiler).name} failed: {' '.join(tail)}")
        os.replace(out, target)  # atomic: a concurrent build leaves one whole file
    return target


def _run_build() -> None:
    global _lib, _error
    try:
        _lib = _Library(_build(_sources()))
    except (OSError, subprocess.SubprocessError) as exc:
        _error = str(exc)


def start_build() -> None:
    """Start building (or loading the cached) library in the background; idempotent."""
    global _thread
    with _lock:
        if _thread is None and not _resolved and not _disabled():
            _thread = threading.Thread(target=_run_build, name="tensorstream-rowops", daemon=True)
            _thread.start()


def library() -> _Library | None:
    """The loaded library (waits for a build in progress), or None: torch operators run.

    Raises:
        ConfigError: ``TENSORSTREAM_ROWOPS=1`` and the library could not be built.
    """
    global _resolved, _error
    if _resolved:
        return _lib
    if _disabled():
        _error = f"{ENV}={os.environ.get(ENV)}"
    else:
        start_build()
        assert _thread is not None
        _thread.join()
    with _lock:
        _resolved = True
    if _lib is None:
        message = f"fused row operators unavailable ({_error})"
        if _required():
            raise ConfigError(f"{message}; unset {ENV} to run torch's operators instead")
        logger.info("%s: the native models run torch's operators", message)
    else:
        logger.debug("fused row operators: %s", _lib.path)
    return _lib


def active() -> bool:
    """Whether the fused operators run in this process (builds or waits once)."""
    return ENABLED and (_lib if _resolved else library()) is not None


def usable(x: torch.Tensor) -> bool:
    """Whether ``x``'s operators may run fused: CPU, bfloat16/float32, no autograd."""
    return (
        x.dtype in _DTYPES and x.device.type == "cpu" and not torch.is_grad_enabled() and active()
    )


def _op(name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
    assert _lib is not None, "rowops called before library() found it"
    return _lib.ops[name, dtype]


def _rows(t: torch.Tensor) -> int:
    """Row stride of a [rows, n] view whose elements are contiguous within a row."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"expected [rows, n] with unit element stride, got {tuple(t.stride())}")
    return t.stride(0)


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
    gate: torch.Tensor, up: torch.Tensor, rows: int | None = None, out_rows: int | None = None
) -> torch.Tensor:
    """``silu(gate) * up`` (rounded as torch's two operators are), [out_rows, n]: the first
    ``rows`` rows computed (default all), the rest repeating row 0."""
    rows = gate.shape[0] if rows is None else rows
    out_rows = rows if out_rows is None else out_rows
    n = gate.shape[1]
    out = torch.empty(out_rows, n, dtype=gate.dtype)
    _op("silu_mul", gate.dtype)(
        gate.data_ptr(), _rows(gate), up.data_ptr(), _rows(up),
        out.data_ptr(), n, rows, out_rows, n,
    )  # fmt: skip
    return out


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
        slots: int64 (cache row, position) of each row.
    """
    rows, kv_heads, length = q.shape[0], keys.shape[1], keys.shape[2]
    cache_rows, positions = slots
    _op("rope_store", q.dtype)(
        q.data_ptr(), _rows(q), k.data_ptr(), _rows(k), v.data_ptr(), _rows(v),
        cos.data_ptr(), sin.data_ptr(), _rows(cos),
        None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(), eps,
        keys.data_ptr(), values.data_ptr(), cache_rows.data_ptr(), positions.data_ptr(),
        rows, q.shape[1] // head_dim, kv_heads, head_dim, length,
    )  # fmt: skip


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
    kv_heads, length = keys.shape[1], keys.shape[2]
    heads = q.shape[1] // head_dim
    if scratch.numel() < heads // kv_heads * length or scratch.dtype != torch.float32:
        raise ValueError(f"scratch needs {heads // kv_heads * length} float32 values")
    _op("decode_attention", q.dtype)(
        q.data_ptr(), _rows(q), keys.data_ptr(), values.data_ptr(),
        cache_rows.data_ptr(), positions.data_ptr(), out.data_ptr(), _rows(out),
        len(cache_rows), heads, kv_heads, head_dim, length, window or 0, scratch.data_ptr(),
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
