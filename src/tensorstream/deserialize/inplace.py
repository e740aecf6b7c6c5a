"""``TensorDeserializer(into=...)``: read tensors straight into memory the caller owns.

A caller that already allocated its destinations (vLLM's parameters, a model built on
the CPU) would otherwise get fresh tensors from the load and copy them over: the bytes
are touched twice, and both sets of pages are faulted in. With ``into``, the readers
(or the decryptor) write each named tensor's bytes into the caller's tensor, hashes
are checked on those bytes, and the deserializer hands out that same memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tensorstream.deserialize.index import TensorRecord
from tensorstream.errors import ConfigError

__all__ = ["check_into"]


def check_into(
    records: Sequence[TensorRecord],
    into: Mapping[Any, torch.Tensor] | None,
    device: torch.device,
    dtype: torch.dtype | None,
    shard: Any,
    where: str,
) -> dict[Any, torch.Tensor]:
    """``into`` checked against the selected records: each a contiguous CPU tensor of
    the record's shape and dtype, no two sharing memory.

    Raises:
        ConfigError: a key the load does not select, a tensor that does not fit, a load
            onto a device or of shard slices, or a ``dtype`` cast of a named tensor.
    """
    if not into:
        return {}
    if device.type != "cpu":
        raise ConfigError(
            f"{where}: into= fills CPU tensors, but this load goes to {device}; "
            "load onto the CPU, or drop into="
        )
    if shard is not None:
        raise ConfigError(f"{where}: into= cannot be combined with shard=; drop one of them")
    by_key = {r.key: r for r in records}
    starts: dict[int, Any] = {}
    for key, tensor in into.items():
        record = by_key.get(key)
        if record is None:
            raise ConfigError(
                f"{where}: into names {key!r}, which this load does not select (not in the "
                "file, or left out by filter_func); name only tensors the load reads"
            )
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"{where}: into[{key!r}] must be a torch.Tensor, got {tensor!r}")
        fits = (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and tuple(tensor.shape) == tuple(record.shape)
            and tensor.dtype == record.dtype
        )
        if not fits:
            raise ConfigError(
                f"{where}: into[{key!r}] must be a contiguous CPU tensor of shape "
                f"{list(record.shape)} and dtype {record.dtype} (the file's), got shape "
                f"{list(tensor.shape)}, dtype {tensor.dtype} on {tensor.device}"
            )
        if dtype is not None and record.dtype.is_floating_point and record.dtype != dtype:
            raise ConfigError(
                f"{where}: tensor {key!r} is {record.dtype} in the file and dtype={dtype} "
                "would cast it into new memory, not into into[...]; drop dtype= or the key"
            )
        if tensor.numel():
            other = starts.setdefault(tensor.data_ptr(), key)
            if other != key:
                raise ConfigError(
                    f"{where}: into[{key!r}] and into[{other!r}] share memory; "
                    "give each tensor its own"
                )
    return dict(into)
