"""One rank's weights: its rank file, or its slices of one unsharded checkpoint.

Owns the choice of what a rank opens: ``tensorizer_uri`` with a rank field
(``model-rank-%03d.tensors``, vLLM's convention) loads rank ``r``'s file whole;
otherwise the ``.tensors`` file or safetensors checkpoint of the model is opened with
``shard=ShardSpec(rank, world, LLAMA_TP_PLAN)``, so the rank reads only its slices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorstream.deserialize.shard import ShardSpec, rank_uri
from tensorstream.engine.parallel.plan import LLAMA_TP_PLAN
from tensorstream.errors import ConfigError, SourceNotFoundError

__all__ = ["RankWeights", "load_rank_weights"]


@dataclass
class RankWeights:
    """What one rank loaded."""

    tensors: dict[str, torch.Tensor]
    uri: str
    bytes_read: int
    seconds: float


def _entry(location: Any, load_format: str, extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The URI to open and the deserializer options the model's loader would use."""
    from tensorstream.engine.loaders.tensorizer_config import storage_from_extra

    kwargs: dict[str, Any] = {}
    storage = storage_from_extra(extra)
    if storage is not None:
        kwargs["storage"] = storage
    weights = location.weights_uri
    if load_format == "tensorizer":
        from tensorstream.engine.loaders.tensorizer import TensorizerLoadOptions
        from tensorstream.sources.uri import join_uri

        options = TensorizerLoadOptions.from_extra(extra)
        uri = options.tensorizer_uri or join_uri(options.tensorizer_dir or weights, "model.tensors")
        kwargs.update(num_readers=options.num_readers, verify_hash=options.verify_hash)
        if options.encryption_keyfile:
            from tensorstream.crypto.keyfile import read_keyfile
            from tensorstream.crypto.params import DecryptionParams

            key = read_keyfile(options.encryption_keyfile, storage)
            kwargs["encryption"] = DecryptionParams.from_key(key)
        return uri, kwargs
    if load_format != "safetensors":
        raise ConfigError(
            f"tensor_parallel_size > 1 reads tensorizer or safetensors weights, not "
            f"load_format={load_format!r}"
        )
    if "://" in weights and not weights.startswith("file://"):
        from tensorstream.engine.loaders.safetensors import remote_entry

        entry = remote_entry(weights, storage)
        if entry is None:
            raise SourceNotFoundError(f"no model.safetensors (or index) at {weights}")
        return entry, kwargs
    directory = Path(weights.removeprefix("file://"))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return str(index), kwargs
    from tensorstream.engine.loaders.safetensors import safetensors_files

    files = safetensors_files(directory)
    if len(files) != 1:
        raise ConfigError(f"{directory} holds {len(files)} safetensors files and no index")
    return str(files[0]), kwargs


def load_rank_weights(
    location: Any,
    load_format: str,
    extra: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> RankWeights:
    """Load rank ``rank``'s part of the model (its rank file, or its slices).

    Raises:
        ShardMismatchError: rank files written for another world size or plan, or missing.
        ConfigError, SourceError, FormatError: as ``TensorDeserializer``.
    """
    from tensorstream import TensorDeserializer

    uri, kwargs = _entry(location, load_format, extra)
    spec = ShardSpec(rank, world_size, LLAMA_TP_PLAN, even=True)
    started = time.perf_counter()
    with TensorDeserializer(uri, device=device, dtype=dtype, shard=spec, **kwargs) as d:
        tensors = dict(d.items())
        shards = getattr(d, "shards", None)
        parts = shards.values() if shards is not None else [d]
        nbytes = sum(p.total_bytes_read for p in parts)
    shown = rank_uri(uri, rank) or uri  # this rank's own file, when it has one
    return RankWeights(tensors, shown, nbytes, time.perf_counter() - started)
