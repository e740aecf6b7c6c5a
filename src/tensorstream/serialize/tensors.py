"""Turn tensors and nested state dicts into the flat records the writer lays out."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tensorstream.errors import SerializationError
from tensorstream.formats.dtypes import encode_dtype
from tensorstream.formats.tensorizer import (
    TENSOR_TYPE_BUFFER,
    TENSOR_TYPE_PARAM,
    TENSOR_TYPE_STATE_DICT,
    encode_name,
)

__all__ = ["PendingTensor", "flatten_state_dict", "host_bytes", "module_tensors"]


@dataclass
class PendingTensor:
    module_idx: int
    tensor_type: int
    raw_name: bytes
    tensor: torch.Tensor

    @property
    def display_name(self) -> str:
        return self.raw_name.decode("utf-8", "replace")


def _iter_items(obj: object) -> Iterator[tuple[str | int, object]]:
    if isinstance(obj, Mapping):
        return iter(obj.items())
    if isinstance(obj, (list, tuple)):
        return iter(enumerate(obj))
    raise SerializationError(
        f"cannot serialize a {type(obj).__name__} inside a state dict; only tensors, "
        "dicts and lists are allowed"
    )


def flatten_state_dict(obj: object) -> Iterator[PendingTensor]:
    """Depth-first walk of nested dicts/lists, naming leaves as tensorizer does."""
    if isinstance(obj, torch.Tensor):
        raise SerializationError("write_state_dict needs a dict or list of tensors, not a tensor")
    stack: list[tuple[tuple[str | int, ...], Iterator[tuple[str | int, object]]]] = [
        ((), _iter_items(obj))
    ]
    while stack:
        prefix, items = stack[-1]
        for key, value in items:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise SerializationError(
                    f"state dict key {key!r} at {list(prefix)} must be a str or an int"
                )
            path = (*prefix, key)
            if isinstance(value, torch.Tensor):
                yield PendingTensor(0, TENSOR_TYPE_STATE_DICT, encode_name(path), value)
            else:
                stack.append((path, _iter_items(value)))
                break
        else:
            stack.pop()


def module_tensors(
    module: torch.nn.Module, include_non_persistent_buffers: bool = True
) -> Iterator[tuple[PendingTensor, torch.nn.Module, str]]:
    """Parameters then buffers of each module, in ``named_modules()`` order.

    Names are ``f"{module_name}.{name}"`` (so root tensors get a leading dot), which is
    what tensorizer writes and what ``load_into_module`` expects.
    """
    for idx, (module_name, sub) in enumerate(module.named_modules()):
        skip = set() if include_non_persistent_buffers else sub._non_persistent_buffers_set
        for name, param in sub.named_parameters(recurse=False):
            yield (
                PendingTensor(idx, TENSOR_TYPE_PARAM, f"{module_name}.{name}".encode(), param),
                sub,
                name,
            )
        for name, buf in sub.named_buffers(recurse=False):
            if name in skip:
                continue
            yield (
                PendingTensor(idx, TENSOR_TYPE_BUFFER, f"{module_name}.{name}".encode(), buf),
                sub,
                name,
            )


def host_bytes(tensor: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A C-contiguous CPU byte view of ``tensor`` (copying only when it must).

    Returns the view and the tensor that owns its memory (keep it alive while writing).
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b""), t
    flat = t.reshape(-1)
    try:
        raw = flat.view(torch.uint8)
    except RuntimeError:
        raw = torch.frombuffer(flat.untyped_storage(), dtype=torch.uint8)[
            flat.storage_offset() * t.element_size() :
        ][:nbytes]
    return memoryview(raw.numpy().view(np.uint8)).cast("B"), t


def dtype_code(tensor: torch.Tensor, name: str) -> str:
    try:
        return encode_dtype(tensor.dtype)
    except SerializationError as exc:
        raise SerializationError(f"tensor {name!r}: {exc}") from None


def shape_of(tensor: torch.Tensor) -> Sequence[int]:
    return tuple(int(d) for d in tensor.shape)
