"""The ``safetensors`` load format: ``model.safetensors`` or an indexed set of shards.

Tensors are read one at a time with the ``safetensors`` library straight onto
the target device and converted to the target dtype right away, so peak memory
stays at the model's final size plus one tensor.

On CPU, ``safetensors`` hands out tensors backed by a private mmap of the
file: no copy, page-cache pages shared. Its pages would be read lazily during
the first forward pass, which would make the load look instant and the first
request slow; the loader touches one byte per page instead, so the read
happens (and is timed) during the load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tensorstream.engine.loaders.base import (
    LoadedWeights,
    LoadRequest,
    WeightLoader,
    check_extra_keys,
)
from tensorstream.errors import ConfigError, FormatError, SourceNotFoundError

__all__ = ["SafetensorsLoader", "safetensors_files"]

_INDEX = "model.safetensors.index.json"


def safetensors_files(directory: Path) -> list[Path]:
    """Return the checkpoint's shard files: those named by the index, else every ``*.safetensors``.

    Adapter files (``adapter_model*.safetensors``) are never part of the base model.

    Raises:
        SourceNotFoundError: no shard is there, or the index names a missing one.
        FormatError: the index is not valid JSON.
    """
    index = directory / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise FormatError(
                f"{index} is not a safetensors index (no 'weight_map'): {exc}"
            ) from exc
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SourceNotFoundError(
                f"{index} names shards that are not in {directory}: {missing}"
            )
        return files
    files = sorted(
        p for p in directory.glob("*.safetensors") if not p.name.startswith("adapter_model")
    )
    if not files:
        raise SourceNotFoundError(
            f"no *.safetensors files in {directory}; pass load_format='tensorizer' for model.tensors"
        )
    return files


_PAGE = 4096


def _fault_in(tensor: torch.Tensor) -> None:
    """Read one byte of every page of a (possibly mmap-backed) CPU tensor."""
    if tensor.numel() and tensor.is_contiguous():
        tensor.reshape(-1).view(torch.uint8)[::_PAGE].sum()


class SafetensorsLoader(WeightLoader):
    """Reads ``*.safetensors`` from a local directory."""

    name = "safetensors"
    extra_keys = frozenset()

    def load(self, request: LoadRequest) -> LoadedWeights:
        """Read all shards onto ``request.device`` in ``request.dtype``.

        Raises:
            ConfigError: extra options given, a remote location, or safetensors missing.
            SourceNotFoundError: no shards.
            FormatError: a shard is not a valid safetensors file.
        """
        check_extra_keys(self.name, request.extra, self.extra_keys)
        weights = request.location.weights_uri
        if "://" in weights and not weights.startswith("file://"):
            raise ConfigError(
                f"the safetensors loader reads local directories only, not {weights}; "
                "use load_format='tensorizer' for remote models"
            )
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError as exc:
            raise ConfigError(
                "load_format='safetensors' needs safetensors; run: pip install safetensors"
            ) from exc
        directory = Path(weights.removeprefix("file://"))
        device = request.device
        tensors: dict[str, torch.Tensor] = {}
        nbytes = 0
        for path in safetensors_files(directory):
            try:
                with safe_open(str(path), framework="pt", device=str(device)) as handle:
                    for name in handle.keys():
                        tensor = handle.get_tensor(name)
                        nbytes += tensor.nbytes
                        if device.type == "cpu":
                            _fault_in(tensor)
                        if tensor.is_floating_point() and tensor.dtype != request.dtype:
                            tensor = tensor.to(request.dtype)
                        tensors[name] = tensor
            except SafetensorError as exc:
                raise FormatError(f"{path} is not a valid safetensors file: {exc}") from exc
        return LoadedWeights(tensors, uri=str(directory), nbytes=nbytes)
