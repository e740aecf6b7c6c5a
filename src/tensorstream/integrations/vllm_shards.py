"""Rank files of Hugging Face names (``serialize_sharded`` / ``tensorize -tp N``) into vLLM.

A rank file already holds this rank's slices, so the model's ``load_weights``
(which slices full tensors for the rank itself) must not see them. Each slice is
copied straight into the vLLM parameter of the same name; the pieces of a
parameter vLLM fuses (its model's public ``packed_modules_mapping``, e.g.
``qkv_proj`` <- ``q_proj``, ``k_proj``, ``v_proj``) are concatenated along the
output dimension in the mapping's order, which is how vLLM lays out one rank's
part of a fused column-parallel layer. No vLLM import here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tensorstream.errors import ConfigError, FormatError

__all__ = ["check_world_size", "copy_rank_slices"]

_ROTARY = ("rotary_emb.", "rotary_pos_emb.")


def check_world_size(template: str, world_size: int, storage: Any) -> None:
    """Refuse rank files written for another tensor-parallel size (their sidecar says).

    Raises:
        ConfigError: the sidecar's world size differs from vLLM's.
        ShardMismatchError, FormatError: no sidecar, or not one tensorstream wrote.
    """
    from tensorstream.deserialize.rankfiles import read_sidecar

    written = read_sidecar(template, storage)["world_size"]
    if written != world_size:
        raise ConfigError(
            f"{template}: the rank files were written for tensor_parallel_size={written}, "
            f"vLLM runs {world_size}; start vLLM with --tensor-parallel-size {written} or "
            f"serialize again with `tensorstream tensorize -tp {world_size}`"
        )


def _fused_target(name: str, packed: Mapping[str, list[str]]) -> tuple[str, int, int] | None:
    """``(vLLM name, position, pieces)`` when ``name`` is one piece of a fused parameter."""
    parts = name.split(".")
    for fused, pieces in packed.items():
        for position, piece in enumerate(pieces):
            if piece in parts:
                i = parts.index(piece)
                target = ".".join([*parts[:i], fused, *parts[i + 1 :]])
                return target, position, len(pieces)
    return None


def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str, uri: str) -> None:
    if tuple(target.shape) != tuple(tensor.shape):
        raise FormatError(
            f"{uri}: the rank slice {name!r} has shape {list(tensor.shape)}, this rank's vLLM "
            f"parameter has {list(target.shape)}. Write the rank files for this model and "
            "--tensor-parallel-size (`tensorstream tensorize -tp N`); a vocabulary vLLM pads "
            "per rank needs an unsharded model.tensors instead"
        )
    with torch.no_grad():
        target.copy_(tensor)


def copy_rank_slices(model: nn.Module, named: Iterable[Any], uri: str) -> int:
    """Copy ``(name, tensor_type, tensor)`` rank slices into ``model``'s parameters.

    Returns:
        Tensors placed (each piece of a fused parameter counts).

    Raises:
        FormatError: a tensor the model does not have, a slice of the wrong shape, or
            a fused parameter missing some of its pieces.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    packed: Mapping[str, list[str]] = getattr(model, "packed_modules_mapping", None) or {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    count = 0
    for name, _, tensor in named:
        if name in params:
            _copy(params[name], tensor, name, uri)
            count += 1
            continue
        fused = _fused_target(name, packed)
        if fused is not None and fused[0] in params:
            target, position, pieces = fused
            # a layer's pieces are adjacent in the file: few are held at once
            got = pending.setdefault(target, {})
            got[position] = tensor
            if len(got) == pieces:
                del pending[target]
                _copy(params[target], torch.cat([got[i] for i in range(pieces)]), target, uri)
            count += 1
            continue
        if any(part in name for part in _ROTARY) or name == "lm_head.weight":
            continue  # computed by vLLM, or tied to the embedding there
        raise FormatError(
            f"{uri}: tensor {name!r} is not a parameter of the vLLM model "
            f"{type(model).__name__}; the rank files were written for another model"
        )
    if pending:
        raise FormatError(
            f"{uri}: fused parameter(s) {sorted(pending)[:3]} got only some of their pieces; "
            "the rank file is incomplete; write it again"
        )
    if count == 0:
        raise ConfigError(f"{uri}: the rank file holds no tensors of the model")
    return count
