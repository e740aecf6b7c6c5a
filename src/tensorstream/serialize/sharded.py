"""Write a tensor-parallel set: one ``.tensors`` file per rank plus a JSON sidecar.

Owns ``serialize_sharded``: each rank's file holds that rank's slice of every split
tensor (``torch.chunk`` of the dim the plan names) and every replicated tensor
whole, all under the unsharded names, so a rank loads its file with the plain
``TensorDeserializer`` path (mapped, hashed, encrypted alike). The sidecar
(``deserialize/rankfiles.py`` reads and checks it) records the world size, the plan
and each file's size; it is written last, so a set cut short has no sidecar.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from tensorstream.deserialize.rankfiles import SIDECAR_FORMAT, sidecar_uri
from tensorstream.deserialize.shard import ShardSpec, chunk_bounds, rank_uri
from tensorstream.errors import ConfigError
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.registry import open_sink

__all__ = ["rank_slice", "serialize_sharded"]

DEFAULT_TEMPLATE = "model-rank-%03d.tensors"


def rank_slice(name: str, tensor: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``spec.rank``'s part of ``tensor`` (the whole tensor when replicated), contiguous."""
    dim = spec.action(name)
    if dim is None or spec.world_size == 1:
        return tensor
    if dim >= tensor.dim():
        raise ConfigError(f"plan splits {name} (shape {list(tensor.shape)}) along dim {dim}")
    size = tensor.shape[dim]
    if spec.even and size % spec.world_size:
        raise ConfigError(
            f"{name}: dim {dim} of size {size} does not divide into {spec.world_size} shards"
        )
    start, stop = chunk_bounds(size, spec.world_size, spec.rank)
    return tensor.narrow(dim, start, stop - start).contiguous()


def serialize_sharded(
    tensors: Mapping[str, torch.Tensor] | torch.nn.Module,
    template: str | os.PathLike[str],
    *,
    world_size: int,
    plan: Any,
    even: bool = True,
    storage: StorageOptions | None = None,
    encryption: Any = None,
    **serializer_kwargs: Any,
) -> list[str]:
    """Write ``world_size`` rank files and their sidecar.

    Args:
        tensors: a state dict (dotted names) or a module (its ``state_dict()``).
        template: path or URI with a rank field, e.g. ``dir/model-rank-%03d.tensors``; a
            directory (no rank field) gets ``model-rank-%03d.tensors`` inside it.
        world_size: ranks.
        plan: ``{pattern: "replicate" | 0 | 1}``, as for :class:`ShardSpec`.
        even: refuse splits that do not divide evenly (what models need).
        storage: credentials for remote targets.
        encryption: ``EncryptionParams``; each rank file is encrypted on its own.
        serializer_kwargs: more ``TensorSerializer`` keywords (``align``, ``progress``...).

    Returns:
        The rank files' URIs, rank order.

    Raises:
        ConfigError: a planned split does not fit a tensor.
    """
    from tensorstream.serialize.writer import TensorSerializer
    from tensorstream.sources.uri import join_uri

    text = os.fspath(template)
    if rank_uri(text, 0) is None:
        text = join_uri(text, DEFAULT_TEMPLATE)
    state = tensors.state_dict() if isinstance(tensors, torch.nn.Module) else dict(tensors)
    written, sizes = [], []
    specs = [ShardSpec(r, world_size, plan, even=even) for r in range(world_size)]
    for name, tensor in state.items():  # every split must fit before a file is written
        rank_slice(name, torch.empty(tensor.shape, device="meta"), specs[0])
    for spec in specs:
        uri = rank_uri(text, spec.rank)
        assert uri is not None
        with TensorSerializer(
            uri, storage=storage, encryption=encryption, **serializer_kwargs
        ) as out:
            out.write_state_dict(
                {n: rank_slice(n, t.detach().cpu(), spec) for n, t in state.items()}
            )
        sizes.append(_size(uri, storage))
        written.append(uri)
    sidecar = {
        "format": SIDECAR_FORMAT,
        "world_size": world_size,
        "plan": specs[0].plan_json(),
        "template": os.path.basename(text.split("?", 1)[0]),
        "sizes": sizes,
    }
    with open_sink(sidecar_uri(text), storage) as sink:
        sink.write(json.dumps(sidecar, indent=1).encode())
    return written


def _size(uri: str, storage: StorageOptions | None) -> int:
    from tensorstream.sources.registry import open_source

    with open_source(uri, storage) as src:
        return src.size
