"""The ``safetensors`` load format: ``model.safetensors`` or an indexed set of shards.

Local directories: tensors are read one at a time with the ``safetensors`` library
straight onto the target device and converted to the target dtype right away, so
peak memory stays at the model's final size plus one tensor.

``s3://`` and ``http(s)://`` directories: ``model.safetensors.index.json`` (or, without
one, ``model.safetensors``) is streamed with tensorstream's own parallel ranged readers
(``TensorDeserializer``), the same path as the tensorizer format; vLLM needs a
separate streamer package for this.

On CPU, ``safetensors`` hands out tensors backed by a private mmap of the
file: no copy, page-cache pages shared. Its pages would be read lazily during
the first forward pass, which would make the load look instant and the first
request slow; the loader touches one byte per page instead, so the read
happens (and is timed) during the load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def remote_entry(weights: str, storage: Any = None) -> str | None:
    """The URI to stream a remote safetensors checkpoint from, or None if there is none.

    Remote directories cannot be listed over HTTP, so the two names Hugging Face uses
    are tried: the shard index first, then the single file.

    Raises:
        SourceError: the storage refused the request (credentials, network).
    """
    from tensorstream.sources.registry import open_source
    from tensorstream.sources.uri import join_uri

    for name in (_INDEX, "model.safetensors"):
        uri = join_uri(weights, name)
        try:
            with open_source(uri, storage):
                return uri
        except SourceNotFoundError:
            continue
    return None


class SafetensorsLoader(WeightLoader):
    """Reads ``*.safetensors`` from a local directory, ``s3://`` or ``http(s)://``."""

    name = "safetensors"
    extra_keys = frozenset()

    def load(self, request: LoadRequest) -> LoadedWeights:
        """Read all shards onto ``request.device`` in ``request.dtype``.

        Raises:
            ConfigError: extra options given, or safetensors missing.
            SourceNotFoundError: no shards.
            FormatError: a shard is not a valid safetensors file.
        """
        check_extra_keys(self.name, request.extra, self.extra_keys)
        weights = request.location.weights_uri
        if "://" in weights and not weights.startswith("file://"):
            return _load_remote(request, weights)
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


def _load_remote(request: LoadRequest, weights: str) -> LoadedWeights:
    """Stream a remote checkpoint with ``TensorDeserializer`` (credentials from the environment)."""
    from tensorstream import TensorDeserializer

    entry = remote_entry(weights)
    if entry is None:
        raise SourceNotFoundError(
            f"no {_INDEX} or model.safetensors at {weights}; upload the checkpoint's "
            "safetensors files there, or serialize it and use load_format='tensorizer'"
        )
    deserializer = TensorDeserializer(entry, device=request.device, dtype=request.dtype)
    try:
        tensors = dict(deserializer.items())
    except BaseException:
        deserializer.close()
        raise
    nbytes = sum(t.nbytes for t in tensors.values())
    return LoadedWeights(tensors, uri=entry, nbytes=nbytes, closer=deserializer)
