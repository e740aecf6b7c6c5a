"""Load formats by name: a lazy registry of loaders plus ``auto`` detection.

Formats: ``safetensors`` (``*.safetensors``, sharded or not), ``tensorizer``
(``model.tensors``, tensorizer-compatible) and ``auto``, which picks one by
looking at the model directory. Loader modules are imported on first use, so
choosing one format never imports the other's dependencies.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tensorstream.engine.loaders.base import LoadedWeights, LoadRequest, WeightLoader
from tensorstream.engine.resolve import ModelLocation
from tensorstream.errors import ConfigError

__all__ = [
    "LOAD_FORMATS",
    "LoadRequest",
    "LoadedWeights",
    "WeightLoader",
    "detect_format",
    "get_loader",
]

_LOADERS = {
    "safetensors": "tensorstream.engine.loaders.safetensors:SafetensorsLoader",
    "tensorizer": "tensorstream.engine.loaders.tensorizer:TensorizerLoader",
}
#: Every accepted ``load_format`` value.
LOAD_FORMATS: tuple[str, ...] = ("auto", *sorted(_LOADERS))
LOADERS = MappingProxyType(_LOADERS)
# Keys that only make sense for tensorizer; their presence makes "auto" pick it.
_TENSORIZER_HINTS = ("tensorizer_uri", "tensorizer_dir", "tensorizer_config")


def get_loader(load_format: str) -> WeightLoader:
    """Return the loader for ``load_format`` ("safetensors" or "tensorizer").

    Raises:
        ConfigError: unknown format, listing the valid ones.
    """
    key = str(load_format).strip().lower()
    if key not in _LOADERS:
        raise ConfigError(f"unknown load_format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    module_name, _, class_name = _LOADERS[key].partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


def detect_format(location: ModelLocation, extra: Mapping[str, Any] | None = None) -> str:
    """Pick the load format for ``location``: ``model.tensors`` wins over ``*.safetensors``.

    Raises:
        ConfigError: neither kind of weight file is there.
    """
    if extra and any(key in extra for key in _TENSORIZER_HINTS):
        return "tensorizer"
    weights = location.weights_uri
    if "://" in weights and not weights.startswith("file://"):
        return _detect_remote(weights)
    directory = Path(weights.removeprefix("file://"))
    if (directory / "model.tensors").is_file():
        return "tensorizer"
    if any(p.name != "adapter_model.safetensors" for p in directory.glob("*.safetensors")):
        return "safetensors"
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise ConfigError(
        f"no weights found in {directory}: expected model.tensors (tensorizer) or *.safetensors; "
        f"found {found[:12]}; serialize the model there or pass load_format explicitly"
    )


def _detect_remote(weights: str) -> str:
    """``model.tensors`` if it is there, else safetensors if an entry file is, else tensorizer.

    Remote directories cannot be listed over HTTP, so the names are tried (one small
    request each). Anything but a clear "not found" keeps the tensorizer default, whose
    loader then reports the problem with its own credentials and options.
    """
    from tensorstream.engine.loaders.safetensors import remote_entry
    from tensorstream.errors import SourceNotFoundError, TensorStreamError
    from tensorstream.sources.registry import open_source
    from tensorstream.sources.uri import join_uri

    try:
        with open_source(join_uri(weights, "model.tensors")):
            return "tensorizer"
    except SourceNotFoundError:
        pass
    except TensorStreamError:
        return "tensorizer"
    try:
        return "safetensors" if remote_entry(weights) else "tensorizer"
    except TensorStreamError:
        return "tensorizer"
