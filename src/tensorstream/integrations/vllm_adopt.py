"""Weights that land in vLLM's parameters in place instead of being copied into them.

No vLLM import here. A plain CPU load hands vLLM tensors of its own (page-cache views
of a cached local file, or fresh memory the readers filled), and vLLM's weight loaders
copy each one into a freshly allocated parameter. The first touch of that fresh memory
is most of a local load (issue #11, 1.64 GB Llama: prefault 0.45-0.5 s of 0.65-0.76 s).
Where a tensor fills a parameter whole and unchanged (same name, shape and dtype, a
plain parameter on the CPU: torch's, or vLLM's unquantized linear weight; a weight
loader that copies verbatim at this tensor-parallel size), it lands there directly:

- a page-cache view becomes the parameter's data (``param.data = view``): no page
  fault and no copy, and vLLM's own allocation, never touched, is freed unread;
- any other tensor (remote, cold, unaligned, hashed or decrypted) is read straight
  into the parameter's memory (``TensorDeserializer(into=...)``), where it would have
  gone to fresh memory first and been copied from there.

The fused ``qkv_proj``/``gate_up_proj`` parameters are filled from several tensors, so
they are still copied by vLLM's loaders.

A view is a private, writable mapping of the file (copy-on-write): vLLM may repack or
modify the weight, and the file is never written. Its storage is exactly the tensor's
bytes (issue #14), so vLLM dropping a repacked weight drops its part of the mapping.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Adopter"]

#: Weight loaders that, at tensor-parallel size 1 and equal shapes, copy the whole
#: tensor into the whole parameter (vLLM 0.32; qualified names, so a subclass that
#: overrides the loader is not taken for one of these).
_VERBATIM = frozenset(
    {
        "default_weight_loader",
        "ColumnParallelLinear.weight_loader",
        "ColumnParallelLinear.weight_loader_v2",
        "RowParallelLinear.weight_loader",
        "RowParallelLinear.weight_loader_v2",
        "ReplicatedLinear.weight_loader",
        "VocabParallelEmbedding.weight_loader",
    }
)


#: Parameter classes whose data a weight loader replaces whole: torch's own, and vLLM's
#: unquantized linear weight (its loaders narrow by tensor-parallel rank, then copy).
_PLAIN_PARAMETERS = frozenset({"Parameter", "ModelWeightParameter"})


def _verbatim_loader(param: nn.Parameter, world_size: int) -> bool:
    """Whether ``param``'s weight loader would copy a same-shaped tensor unchanged."""
    loader = getattr(param, "weight_loader", None)
    if loader is None:  # vLLM's loaders fall back to default_weight_loader
        return True
    qualname = getattr(getattr(loader, "__func__", loader), "__qualname__", "")
    name = ".".join(qualname.split(".")[-2:])  # Class.method, or a function's own name
    if name == "default_weight_loader" or name.endswith(".default_weight_loader"):
        return True
    return world_size == 1 and name in _VERBATIM


def _same_name_in_vllm(model: nn.Module, name: str) -> bool:
    """Whether the model's checkpoint-name mapper (``hf_to_vllm_mapper``) leaves ``name``
    as it is: a renamed or stacked tensor goes elsewhere, so it is vLLM's to load."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    map_name = getattr(mapper, "map_name", None)
    if map_name is None:
        return True
    try:
        return map_name(name) == name
    except Exception:  # a mapper of another vLLM version: let vLLM load it
        return False


class Adopter:
    """Which parameters take their tensor's page-cache view or are read into in place,
    and the adopting itself.

    Args:
        model: the vLLM model, built, weights not loaded.
        records: the file's index records (``name``, ``shape``, ``dtype``, ``key``).
        viewed: keys of the records the load hands out as page-cache views; the others
            planned are read into the parameter (:meth:`destinations`).
        world_size: tensor-parallel size; above 1 only vLLM-tensorized files (this
            rank's shards already) adopt (``any_loader``).
        any_loader: adopt whatever the parameter's weight loader (the caller copies by
            name itself, as for a vLLM-tensorized file).
        dtype: the dtype the load casts floating tensors to, if any.
    """

    def __init__(
        self,
        model: nn.Module,
        records: Iterable[Any],
        viewed: set[Any],
        world_size: int = 1,
        any_loader: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        # a tied parameter is loaded under its first name in module order, as vLLM's
        # AutoWeightsLoader does (the others are skipped aliases)
        first: dict[int, str] = {}
        for name, param in params.items():
            first.setdefault(id(param), name)
        self.targets: dict[str, nn.Parameter] = {}
        #: records read straight into their parameter (not handed out as views), by key
        self._fill: dict[Any, nn.Parameter] = {}
        taken: set[int] = set()
        for record in records:
            param = params.get(record.name)
            if (
                not _same_name_in_vllm(model, record.name)
                or param is None
                or type(param).__name__ not in _PLAIN_PARAMETERS  # quantized: vLLM's to load
                or param.is_meta
                or param.device.type != "cpu"
                or param.dtype != record.dtype
                # the load casts to ``dtype``: a cast tensor is new memory, not in place
                or (dtype is not None and record.dtype.is_floating_point and record.dtype != dtype)
                or tuple(param.shape) != tuple(record.shape)
                or first[id(param)] != record.name  # an alias of a tied parameter
                or not (any_loader or _verbatim_loader(param, world_size))
            ):
                continue
            taken.add(id(param))
            self.targets[record.name] = param
            if record.key not in viewed:
                self._fill[record.key] = param
        self._ids = taken
        #: other names of a planned parameter (``lm_head.weight`` tied to the embedding):
        #: vLLM skips them, and it refuses a skipped alias whose canonical name it did not
        #: load itself, so they are not handed on either
        self.aliases = {n for n, p in params.items() if id(p) in taken and n not in self.targets}
        self.adopted = 0
        self.nbytes = 0
        self.viewed_bytes = 0

    def destinations(self) -> dict[Any, torch.Tensor]:
        """``TensorDeserializer(into=...)`` for the tensors that are not views: each
        planned parameter's own memory, by record key."""
        return {key: param.data for key, param in self._fill.items()}

    def untouched(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` less those planned to land in place: a view needs no prefault, and
        the readers fault in what they read into."""
        return [p for p in params if id(p) not in self._ids]

    def adopt(self, name: str, tensor: torch.Tensor) -> bool:
        """Make ``tensor`` the data of the parameter named ``name`` if planned and still
        fitting (same shape, dtype and device), or if ``name`` is another name of such a
        parameter (nothing to load); False: the caller loads it as before."""
        if name in self.aliases:
            return True
        param = self.targets.pop(name, None)
        if param is None:
            return False
        if (
            tensor.shape != param.shape
            or tensor.dtype != param.dtype
            or tensor.device != param.device
        ):
            return False
        if tensor.data_ptr() != param.data_ptr():  # a view: it becomes the data
            with torch.no_grad():
                param.data = tensor.detach()
            self.viewed_bytes += tensor.nbytes
        # else the readers wrote it into the parameter already (destinations())
        self.adopted += 1
        self.nbytes += tensor.nbytes
        return True
