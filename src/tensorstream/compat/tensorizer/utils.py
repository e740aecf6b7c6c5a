"""tensorizer's ``utils``: memory reports, device helpers and ``no_init_or_tensor``.

``no_init_or_tensor`` builds a model without allocating or initialising its
weights: construction runs under ``torch.device("meta")``, so every tensor the
model creates is a shape-only placeholder until ``load_into_module`` replaces it.
(tensorizer patches ``torch.empty`` and ``reset_parameters`` for the same effect.)
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import torch

from tensorstream.utils.meminfo import available_bytes

__all__ = [
    "CPUMemoryUsage",
    "GlobalGPUMemoryUsage",
    "MemoryUsage",
    "TorchGPUMemoryUsage",
    "convert_bytes",
    "get_device",
    "get_gpu_name",
    "get_mem_usage",
    "no_init_or_tensor",
]

Model = TypeVar("Model")


def convert_bytes(num: float, decimal: bool = True) -> str:
    """``num`` bytes as ``"123.4 MB"`` (``decimal``) or ``"117.7 MiB"`` (binary units)."""
    step = 1000.0 if decimal else 1024.0
    units = (
        ("bytes", "KB", "MB", "GB", "TB", "PB")
        if decimal
        else ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")
    )
    for unit in units[:-1]:
        if num < step:
            return f"{num:3.1f} {unit}"
        num /= step
    return f"{num:3.1f} {units[-1]}"


def get_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def get_gpu_name() -> str:
    """Name of the current CUDA device, or ``"N/A"``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "N/A"


class GlobalGPUMemoryUsage(NamedTuple):
    """Memory of one GPU across all processes, in bytes."""

    total: int
    free: int
    used: int

    @classmethod
    def now(cls, device: Any = None) -> GlobalGPUMemoryUsage | None:
        """A snapshot, or ``None`` without CUDA."""
        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, total - free)

    def __str__(self) -> str:
        return (
            f"GPU: (U: {self.used >> 20:,}MiB F: {self.free >> 20:,}MiB T: {self.total >> 20:,}MiB)"
        )


class TorchGPUMemoryUsage(NamedTuple):
    """PyTorch's own allocations on one GPU, in bytes."""

    reserved: int
    reserved_max: int
    used: int
    used_max: int

    @classmethod
    def now(cls, device: Any = None) -> TorchGPUMemoryUsage | None:
        """A snapshot, or ``None`` without CUDA."""
        if not torch.cuda.is_available():
            return None
        stats = torch.cuda.memory_stats(device)
        return cls(
            stats.get("reserved_bytes.all.current", 0),
            stats.get("reserved_bytes.all.peak", 0),
            stats.get("allocated_bytes.all.current", 0),
            stats.get("allocated_bytes.all.peak", 0),
        )

    def __str__(self) -> str:
        return (
            f"TORCH: (R: {self.reserved >> 20:,}MiB/{self.reserved_max >> 20:,}MiB, "
            f"A: {self.used >> 20:,}MiB/{self.used_max >> 20:,}MiB)"
        )


class CPUMemoryUsage(NamedTuple):
    """Peak resident memory of this process (and its children), and free RAM, in bytes."""

    maxrss: int
    free: int

    @classmethod
    def now(cls) -> CPUMemoryUsage:
        """A snapshot."""
        maxrss = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        ) << 10
        return cls(maxrss, available_bytes())

    def __str__(self) -> str:
        return f"CPU: (maxrss: {self.maxrss >> 20:,}MiB F: {self.free >> 20:,}MiB)"


class MemoryUsage(NamedTuple):
    """CPU, whole-GPU and PyTorch-GPU memory together (GPU parts ``None`` without CUDA)."""

    cpu: CPUMemoryUsage
    gpu: GlobalGPUMemoryUsage | None
    torch: TorchGPUMemoryUsage | None

    @classmethod
    def now(cls, device: Any = None) -> MemoryUsage:
        """A snapshot."""
        return cls(
            CPUMemoryUsage.now(), GlobalGPUMemoryUsage.now(device), TorchGPUMemoryUsage.now(device)
        )

    def __str__(self) -> str:
        return " ".join(str(part) for part in self if part)


def get_mem_usage() -> str:
    """``str(MemoryUsage.now())``: a one-line memory report."""
    return str(MemoryUsage.now())


@contextlib.contextmanager
def _meta_construction() -> Iterator[None]:
    with torch.device("meta"):
        yield


def no_init_or_tensor(loading_code: Callable[[], Model] | None = None) -> Any:
    """Build a model without allocating or initialising its weights.

    Args:
        loading_code: a callable to run that way, or ``None`` for a context manager.

    Returns:
        ``loading_code()``'s result, or a context manager.

    Raises:
        TypeError: ``loading_code`` is neither callable nor ``None``.

    Example:
        >>> with no_init_or_tensor():
        ...     layer = torch.nn.Linear(4, 4)
        >>> layer.weight.is_meta
        True
    """
    if loading_code is None:
        return _meta_construction()
    if not callable(loading_code):
        raise TypeError(
            "no_init_or_tensor() takes a callable or None (for a with-statement), "
            f"got {type(loading_code).__name__}"
        )
    with _meta_construction():
        return loading_code()
