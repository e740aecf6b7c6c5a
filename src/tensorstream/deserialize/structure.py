"""Tensors as nested structures (state-dict paths) and as module parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from tensorstream.deserialize.index import TensorRecord
from tensorstream.formats.tensorizer import TENSOR_TYPE_BUFFER, TENSOR_TYPE_PARAM

__all__ = ["freeze", "nest", "place_into_module", "tied_aliases"]


def tied_aliases(module: torch.nn.Module) -> list[list[str]]:
    """Groups of file names (``write_module`` style, root names dot-prefixed) that name
    one parameter object, first occurrence first."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        prefixed = name if "." in name else f".{name}"
        groups.setdefault(id(p), []).append(prefixed)
    return [g for g in groups.values() if len(g) > 1]


def _owner(module: torch.nn.Module, file_name: str) -> tuple[torch.nn.Module, str]:
    owner_name, _, attr = file_name.lstrip(".").rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), attr


def place_into_module(
    module: torch.nn.Module,
    records: Sequence[TensorRecord],
    tensors: Mapping[Any, torch.nn.Parameter],
    aliases: Sequence[Sequence[str]],
) -> int:
    """Register each tensor on its owner module, then re-tie aliased parameters.

    Returns:
        Bytes of tensor data placed.
    """
    placed = 0
    for r in records:
        owner, attr = _owner(module, r.key)  # type: ignore[arg-type]
        tensor = tensors[r.key]
        if r.tensor_type == TENSOR_TYPE_PARAM:
            owner.register_parameter(attr, tensor)
        elif r.tensor_type == TENSOR_TYPE_BUFFER:
            persistent = attr not in owner._non_persistent_buffers_set
            owner.register_buffer(attr, tensor.data, persistent=persistent)
        placed += r.data_length
    loaded = {r.key for r in records}
    for group in aliases:
        if group[0] not in loaded:
            continue
        first_owner, first_attr = _owner(module, group[0])
        shared = getattr(first_owner, first_attr)
        for alias in group[1:]:
            owner, attr = _owner(module, alias)
            owner.register_parameter(attr, shared)
    return placed


def nest(flat: Mapping[tuple[Any, ...], Any], lists: bool = False) -> Any:
    """``{("a", 0, "w"): t}`` -> ``{"a": {0: {"w": t}}}`` (or ``{"a": [{"w": t}]}``)."""
    root: dict[Any, Any] = {}
    for path, value in flat.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _listify(root) if lists else root


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _listify(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def freeze(node: Any) -> Any:
    """Nested dicts as read-only ``MappingProxyType`` views (tensorizer's mapping surface)."""
    if isinstance(node, dict):
        return MappingProxyType({k: freeze(v) for k, v in node.items()})
    return node
