"""One rank's weights: its rank file, or its slices of one unsharded checkpoint.

Owns the choice of what a rank opens: ``tensorizer_uri`` with a rank field
(``model-rank-%03d.tensors``, vLLM's convention) loads rank ``r``'s file whole;
otherwise the ``.tensors`` file or safetensors checkpoint of the model is opened with
``shard=ShardSpec(rank, world, plan)``, so the rank reads only its slices.

Which plan: for one unsharded file, ``llama_tp_plan`` (vocab-split when the vocab
divides). For rank files, the plan their sidecar records, when it is one this engine
runs (the current plan, or the replicated-vocab plan of sets written before the vocab
split); any other plan is checked against the current one and refused with
``ShardMismatchError`` naming both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorstream.deserialize.shard import ShardSpec, rank_uri
from tensorstream.engine.parallel.plan import LLAMA_LAYER_PLAN, LLAMA_TP_PLAN, llama_tp_plan
from tensorstream.errors import ConfigError, ShardMismatchError, SourceNotFoundError

__all__ = ["RankWeights", "choose_plan", "load_rank_weights"]


@dataclass
class RankWeights:
    """What one rank loaded."""

    tensors: dict[str, torch.Tensor]
    uri: str
    bytes_read: int
    seconds: float
    plan: dict[str, int | str]


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


def choose_plan(
    uri: str, config: Any, world_size: int, storage: Any = None
) -> dict[str, int | str]:
    """The plan rank ``r`` loads ``uri`` with (see the module docstring).

    Raises:
        ShardMismatchError: rank files that split a vocab which does not divide evenly.
        FormatError: a malformed sidecar.
    """
    if rank_uri(uri, 0) is None:
        return llama_tp_plan(config, world_size)
    from tensorstream.deserialize.rankfiles import read_sidecar
    from tensorstream.sources.uri import redact_uri

    recorded = read_sidecar(uri, storage)["plan"]
    for plan in (LLAMA_TP_PLAN, LLAMA_LAYER_PLAN):
        if recorded == ShardSpec(0, 1, plan).plan_json():
            break
    else:
        return LLAMA_TP_PLAN  # open_rank_file refuses it, naming both plans
    if plan is LLAMA_TP_PLAN and config.vocab_size % world_size:
        raise ShardMismatchError(
            f"{redact_uri(uri)} splits the vocab ({config.vocab_size}) into {world_size} uneven parts; "
            "re-write the rank files with `tensorstream tensorize -tp N` (it replicates a "
            "vocab that does not divide)"
        )
    return plan


def load_rank_weights(
    location: Any,
    load_format: str,
    extra: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    dtype: torch.dtype,
    device: torch.device,
    config: Any,
) -> RankWeights:
    """Load rank ``rank``'s part of the model (its rank file, or its slices).

    Raises:
        ShardMismatchError: rank files written for another world size or plan, or missing.
        ConfigError, SourceError, FormatError: as ``TensorDeserializer``.
    """
    from tensorstream import TensorDeserializer

    uri, kwargs = _entry(location, load_format, extra)
    plan = choose_plan(uri, config, world_size, kwargs.get("storage"))
    spec = ShardSpec(rank, world_size, plan, even=True)
    started = time.perf_counter()
    with TensorDeserializer(uri, device=device, dtype=dtype, shard=spec, **kwargs) as d:
        tensors = dict(d.items())
        shards = getattr(d, "shards", None)
        parts = shards.values() if shards is not None else [d]
        nbytes = sum(p.total_bytes_read for p in parts)
    shown = rank_uri(uri, rank) or uri  # this rank's own file, when it has one
    return RankWeights(tensors, shown, nbytes, time.perf_counter() - started, plan)
