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

The fused ``qkv_proj``/``gate_up_proj`` parameters are filled from several tensors
(q/k/v, gate/up). At tensor-parallel size 1 each part lands in the rows of the fused
parameter where vLLM's own loader would have put it: the part's shard id from the
model's ``hf_to_vllm_mapper`` (or, for a mapper that does not stack, its place in
``packed_modules_mapping``), its rows from the layer's ``output_sizes``. When every part
is a page-cache view starting on a page (our writer page-aligns large tensors), their
pages are mapped side by side and become the parameter's data
(:mod:`tensorstream.deserialize.stitch`); otherwise each part is read into its rows.
Elsewhere (tensor parallelism, quantized classes, other packings) vLLM's loaders still
copy them.

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


#: Fused layers whose weight loader, at tensor-parallel size 1, copies part ``i`` of the
#: packing into rows ``sum(output_sizes[:i])`` onwards of the parameter (vLLM 0.32).
_FUSED_LOADERS = frozenset(
    {
        "QKVParallelLinear.weight_loader",
        "QKVParallelLinear.weight_loader_v2",
        "MergedColumnParallelLinear.weight_loader",
        "MergedColumnParallelLinear.weight_loader_v2",
    }
)

#: The packings filled in place, in the order their parts stack (vLLM's Llama family);
#: another model's packing may stack in another order, so it is left to vLLM.
_PACKINGS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _loader_name(param: nn.Parameter) -> str:
    """``Class.method`` (or a function's own name) of ``param``'s weight loader."""
    loader = getattr(param, "weight_loader", None)
    qualname = getattr(getattr(loader, "__func__", loader), "__qualname__", "")
    return ".".join(qualname.split(".")[-2:])


def _verbatim_loader(param: nn.Parameter, world_size: int) -> bool:
    """Whether ``param``'s weight loader would copy a same-shaped tensor unchanged."""
    if getattr(param, "weight_loader", None) is None:  # vLLM falls back to the default
        return True
    name = _loader_name(param)
    if name == "default_weight_loader" or name.endswith(".default_weight_loader"):
        return True
    return world_size == 1 and name in _VERBATIM


#: A stacked part's shard id (vLLM's ``orig_to_new_stacked``) -> its place in the packing.
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


def _vllm_name(model: nn.Module, name: str) -> tuple[str, int | None] | None:
    """Where the model's checkpoint-name mapper (``hf_to_vllm_mapper``) sends ``name``:
    (vLLM's name, the part's place in its fused parameter, or None for a whole one);
    None when vLLM drops it or the mapper is one this does not know."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return name, None
    try:
        with_shard = getattr(mapper, "_map_name_with_shard", None)  # vLLM >= 0.32
        if with_shard is None:
            mapped = mapper.map_name(name)
            return None if mapped is None else (mapped, None)
        result = with_shard(name)
    except Exception:  # a mapper of another vLLM version: let vLLM load it
        return None
    if result is None:
        return None
    mapped, shard = result
    if shard is None:
        return mapped, None
    index = _QKV_SHARDS.get(shard) if isinstance(shard, str) else shard
    if not isinstance(index, int) or isinstance(index, bool):
        return None  # one tensor into several shards, or an unknown id
    return mapped, index


def _packed_part(model: nn.Module, name: str) -> tuple[str, int] | None:
    """(fused name, place) for a part named as in the model's ``packed_modules_mapping``
    (vLLM versions whose mapper does not stack: the model's ``load_weights`` does)."""
    prefix, _, leaf = name.rpartition(".")  # "....q_proj", "weight"
    prefix, _, part = prefix.rpartition(".")
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    for fused, names in mapping.items():
        if _PACKINGS.get(fused) == tuple(names) and part in names and prefix:
            return f"{prefix}.{fused}.{leaf}", list(names).index(part)
    return None


def _fused_rows(
    model: nn.Module, param: nn.Parameter, name: str, index: int, shape: tuple[int, ...]
) -> int | None:
    """The first row of part ``index`` (shape ``shape``) in the fused parameter
    ``param`` named ``name``, if vLLM's loader at tensor-parallel size 1 would copy it
    there unchanged: a known fused loader, rows along dim 0, the layer's
    ``output_sizes`` adding up to the parameter."""
    if _loader_name(param) not in _FUSED_LOADERS or getattr(param, "output_dim", None) != 0:
        return None
    try:
        layer = model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return None
    sizes = list(getattr(layer, "output_sizes", None) or ())
    if (
        not 0 <= index < len(sizes)
        or sum(sizes) != param.shape[0]
        or shape != (sizes[index], *param.shape[1:])
    ):
        return None
    return sum(sizes[:index])


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
        path: the local file, when the load views it (``viewed``): a fused parameter
            whose parts are all views and page-aligned becomes one mapping of their
            pages side by side (:mod:`tensorstream.deserialize.stitch`), not a copy.
    """

    def __init__(
        self,
        model: nn.Module,
        records: Iterable[Any],
        viewed: set[Any],
        world_size: int = 1,
        any_loader: bool = False,
        dtype: torch.dtype | None = None,
        path: str | None = None,
    ) -> None:
        params = dict(model.named_parameters(remove_duplicate=False))
        # a tied parameter is loaded under its first name in module order, as vLLM's
        # AutoWeightsLoader does (the others are skipped aliases)
        first: dict[int, str] = {}
        for name, param in params.items():
            first.setdefault(id(param), name)
        # fused parameters are vLLM's loaders' business at other tensor-parallel sizes,
        # and a vLLM-tensorized file holds them fused already
        fuse = world_size == 1 and not any_loader
        self.targets: dict[str, nn.Parameter] = {}
        #: part name -> its rows of the fused parameter, read into in place
        self._rows: dict[str, torch.Tensor] = {}
        #: tensors read straight into their parameter's memory (not handed out as
        #: views), by record key
        self._fill: dict[Any, torch.Tensor] = {}
        taken: set[int] = set()
        #: fused parameter -> (its name, [(first row, record)]) for the parts planned
        fused: dict[int, tuple[str, list[tuple[int, Any]]]] = {}
        for record in records:
            mapped = _vllm_name(model, record.name)
            if mapped is None:
                continue
            name, index = mapped
            if index is None and name not in params and fuse:
                mapped = _packed_part(model, record.name)
                if mapped is not None:
                    name, index = mapped
            param = params.get(name)
            if param is None or not _fits(param, record, dtype) or first[id(param)] != name:
                continue  # not the model's, quantized, cast, or a tied alias
            if index is not None:  # a part of a fused parameter
                shape = tuple(record.shape)
                row = _fused_rows(model, param, name, index, shape) if fuse else None
                if row is not None:
                    fused.setdefault(id(param), (name, []))[1].append((row, record))
                continue
            if (
                name != record.name  # renamed: vLLM's to load
                or tuple(param.shape) != tuple(record.shape)
                or not (any_loader or _verbatim_loader(param, world_size))
            ):
                continue
            taken.add(id(param))
            self.targets[record.name] = param
            if record.key not in viewed:
                self._fill[record.key] = param.data
        #: part names whose pages were mapped into their fused parameter, with their sizes
        self._stitched: dict[str, int] = {}
        for name, planned in fused.values():
            param = params[name]
            layer = model.get_submodule(name.rpartition(".")[0])
            places = {row for row, _ in planned}  # one part per place, every place
            if len(places) == len(planned) == len(layer.output_sizes):
                taken.add(id(param))  # every part lands in it: nothing left to copy
                if path is not None and all(r.key in viewed for _, r in planned):
                    if self._stitch(param, planned, path):
                        continue
            for row, record in planned:  # read into its rows
                rows = param.data.narrow(0, row, record.shape[0])
                self._rows[record.name] = self._fill[record.key] = rows
        self._ids = taken
        #: other names of a planned parameter (``lm_head.weight`` tied to the embedding):
        #: vLLM skips them, and it refuses a skipped alias whose canonical name it did not
        #: load itself, so they are not handed on either
        self.aliases = {n for n, p in params.items() if id(p) in taken and n not in self.targets}
        self.aliases -= {name for name, _ in fused.values()}
        self.adopted = 0
        self.nbytes = 0
        self.viewed_bytes = 0

    def _stitch(self, param: nn.Parameter, planned: list[tuple[int, Any]], path: str) -> bool:
        """Make ``param``'s data its parts' pages mapped side by side, if they allow it."""
        import os

        from tensorstream.deserialize.stitch import stitch, stitchable

        planned = sorted(planned, key=lambda part: part[0])
        ranges = [(r.data_offset, r.data_length) for _, r in planned]
        if not stitchable(ranges) or sum(n for _, n in ranges) != param.nbytes:
            return False
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = stitch(fd, ranges)
        finally:
            os.close(fd)  # the mapping holds the file
        if raw is None:
            return False
        with torch.no_grad():
            param.data = raw.view(param.dtype).reshape(param.shape)
        for _, record in planned:
            self._stitched[record.name] = record.data_length
        return True

    def destinations(self) -> dict[Any, torch.Tensor]:
        """``TensorDeserializer(into=...)`` for the tensors that are not views: each
        planned parameter's own memory (a fused parameter's rows for a part), by
        record key."""
        return dict(self._fill)

    def untouched(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` less those planned to land in place (fused ones: every part): a
        view needs no prefault, and the readers fault in what they read into."""
        return [p for p in params if id(p) not in self._ids]

    def adopt(self, name: str, tensor: torch.Tensor) -> bool:
        """Make ``tensor`` the data of the parameter named ``name`` if planned and still
        fitting (same shape, dtype and device), or if ``name`` is another name of such a
        parameter (nothing to load), or if the readers wrote ``tensor`` into its place
        already (a whole parameter or a fused part); False: the caller loads it as before."""
        if name in self.aliases:
            return True
        stitched = self._stitched.pop(name, None)
        if stitched is not None:  # its pages are mapped into the fused parameter already
            self.adopted += 1
            self.nbytes += stitched
            self.viewed_bytes += stitched
            return True
        rows = self._rows.pop(name, None)
        if rows is not None:
            if tensor.data_ptr() != rows.data_ptr() or tensor.shape != rows.shape:
                return False  # not read into its rows after all: vLLM copies it there
            self.adopted += 1
            self.nbytes += tensor.nbytes
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


def _fits(param: nn.Parameter, record: Any, dtype: torch.dtype | None) -> bool:
    """Whether ``record``'s bytes can be ``param``'s (or its rows') unchanged: a plain
    (unquantized) CPU parameter of the record's dtype, and no cast on the way."""
    return (
        type(param).__name__ in _PLAIN_PARAMETERS  # quantized: vLLM's to load
        and not param.is_meta
        and param.device.type == "cpu"
        and param.dtype == record.dtype
        # the load casts to ``dtype``: a cast tensor is new memory, not in place
        and not (dtype is not None and record.dtype.is_floating_point and record.dtype != dtype)
    )
