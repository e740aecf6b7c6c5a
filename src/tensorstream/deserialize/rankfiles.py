"""Rank files: one ``.tensors`` file per tensor-parallel rank, plus a JSON sidecar.

Owns the load side of a sharded set (``serialize/sharded.py`` writes it): a URI with
a rank field (``model-rank-%03d.tensors``, ``model-rank-{rank:03d}.tensors``) names
rank ``r``'s file; ``tensor-parallel.json`` beside the files records the world size,
the plan and each file's size. Before a rank reads a byte of tensor data its file is
checked against the sidecar, so a mixed, partial or mismatched set fails with one
message naming the rank and what to do, instead of loading wrong shapes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tensorstream.deserialize.shard import ShardSpec, rank_uri
from tensorstream.errors import FormatError, ShardMismatchError, SourceNotFoundError
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.registry import open_source
from tensorstream.sources.uri import redact_uri

__all__ = ["SIDECAR", "SIDECAR_FORMAT", "open_rank_file", "read_sidecar", "sidecar_uri"]

#: The sidecar's file name, in the rank files' directory.
SIDECAR = "tensor-parallel.json"
SIDECAR_FORMAT = "tensorstream-tensor-parallel/1"


def sidecar_uri(template: str) -> str:
    """Where the sidecar of the rank files ``template`` names lives."""
    head, sep, query = template.partition("?")
    parent = head.rsplit("/", 1)[0] if "/" in head else "."
    return f"{parent}/{SIDECAR}" + (sep + query if sep else "")


def read_sidecar(template: str, storage: StorageOptions | None = None) -> dict[str, Any]:
    """The sidecar of ``template``'s rank files, parsed and shape-checked.

    Raises:
        ShardMismatchError: there is no sidecar (not a rank-file set).
        FormatError: the sidecar is not one this version writes.
    """
    uri = sidecar_uri(template)
    try:
        with open_source(uri, storage) as src:
            raw = src.read(0, src.size)
    except SourceNotFoundError as exc:
        raise ShardMismatchError(
            f"{redact_uri(template)} names rank files, but {redact_uri(uri)} (the sidecar "
            "recording their world size and plan) is missing; write the set with "
            "serialize_sharded / `tensorstream tensorize -tp N`"
        ) from exc
    try:
        data = json.loads(raw)
        ok = data["format"] == SIDECAR_FORMAT and isinstance(data["world_size"], int)
        ok = ok and isinstance(data["plan"], list) and isinstance(data["sizes"], list)
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{redact_uri(uri)} is not a rank-file sidecar: {exc}") from exc
    if not ok or len(data["sizes"]) != data["world_size"]:
        raise FormatError(
            f"{redact_uri(uri)} is not a {SIDECAR_FORMAT} sidecar (format, world_size, plan, "
            "sizes); rewrite the rank files"
        )
    return data


def open_rank_file(
    source: Any, shard: ShardSpec, storage: StorageOptions | None
) -> tuple[Any, ShardSpec | None]:
    """``(what to open, spec still to apply)`` for ``TensorDeserializer(source, shard=...)``.

    A path or URI with a rank field is a rank-file set: this rank's file is checked
    against the sidecar and loaded whole (``None`` is returned for the spec). Anything
    else is one unsharded file that the spec slices.

    Raises:
        ShardMismatchError: world size or plan differ from the sidecar's, the rank file is
            missing, or its size differs from the one recorded.
    """
    if not isinstance(source, (str, os.PathLike)):
        return source, shard
    template = os.fspath(source)
    uri = rank_uri(template, shard.rank)
    if uri is None:
        return source, shard
    data = read_sidecar(template, storage)
    where = redact_uri(template)
    if data["world_size"] != shard.world_size:
        raise ShardMismatchError(
            f"{where} was written for {data['world_size']} ranks, but rank {shard.rank} runs "
            f"with world size {shard.world_size}; use tensor_parallel_size="
            f"{data['world_size']} or re-shard the model"
        )
    if shard.rules and [list(p) for p in shard.plan_json()] != data["plan"]:
        raise ShardMismatchError(
            f"{where} was split with plan {data['plan']}, but rank {shard.rank} expects "
            f"{shard.plan_json()}; re-shard the model with this plan"
        )
    try:
        with open_source(uri, storage) as src:
            size = src.size
    except SourceNotFoundError as exc:
        raise ShardMismatchError(
            f"rank {shard.rank}'s file {redact_uri(uri)} is missing from the set "
            f"{where} ({data['world_size']} ranks); copy or re-write it"
        ) from exc
    if size != data["sizes"][shard.rank]:
        raise ShardMismatchError(
            f"rank {shard.rank}'s file {redact_uri(uri)} holds {size} bytes, but the sidecar "
            f"records {data['sizes'][shard.rank]}: the set is mixed or partly rewritten; "
            "re-write all rank files together"
        )
    return uri, None
