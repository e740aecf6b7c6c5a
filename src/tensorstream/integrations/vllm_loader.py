"""The vLLM model loader behind ``--load-format tensorstream`` (imports vLLM; plugin-only).

Imported only by :func:`tensorstream.integrations.vllm.register`, inside a vLLM
process. vLLM's own ``BaseModelLoader.load_model`` builds the model, calls
:meth:`TensorstreamModelLoader.load_weights`, then runs the post-load processing
(``process_weights_after_loading``: kernel repacking, quantization) — the step
vLLM's tensorizer loader skips (vLLM #55198).

Weights are read by ``TensorDeserializer`` (parallel ranged readers, local /
``http(s)://`` / ``s3://``, hash check, decryption) in vLLM's dtype, onto the
model's device, streamed in batches (:mod:`.vllm_stream`), and handed to the
model's own ``load_weights``, so fused ``qkv_proj``/``gate_up_proj`` and vLLM's
tensor-parallel sharding apply. Two kinds of file are already this rank's part and
are placed without ``load_weights``: one written by vLLM's
``tensorize_vllm_model.py`` (its marker tensor present; vLLM's own names, copied
by name) and a rank file of Hugging Face names with its sidecar
(:mod:`.vllm_shards`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from tensorstream.errors import ConfigError, FormatError, TensorStreamError
from tensorstream.formats.tensorizer import TENSOR_TYPE_BUFFER
from tensorstream.integrations.vllm_adopt import Adopter
from tensorstream.integrations.vllm_options import (
    RANK_FIELD,
    RANK_TEMPLATE,
    VllmLoadOptions,
    first_existing,
    weights_candidates,
)
from tensorstream.integrations.vllm_stream import (
    batch_bytes_for,
    batch_plan,
    prefault,
    stream_batches,
)

__all__ = ["TensorstreamModelLoader"]

# under "vllm." so that vLLM's log handler and format apply
logger = init_logger("vllm.model_executor.model_loader.tensorstream")

#: Written by vLLM's tensorize_vllm_model.py on the root module.
VLLM_MARKER = ".vllm_tensorized_marker"
#: Non-persistent rotary buffers of Hugging Face models (vLLM computes its own).
_ROTARY = ("rotary_emb.", "rotary_pos_emb.")


def _tp_rank_and_size() -> tuple[int, int]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, RuntimeError):  # no parallel groups (a bare loader call)
        return 0, 1


def _is_rank_file(uri: str, options: VllmLoadOptions, rank: int) -> bool:
    """Whether ``uri`` is this rank's own file (a rank template rendered), not one file
    every rank reads whole."""
    if options.tensorizer_uri:
        return RANK_FIELD.search(options.tensorizer_uri) is not None
    return uri.rsplit("/", 1)[-1] == RANK_TEMPLATE % rank


class TensorstreamModelLoader(BaseModelLoader):
    """``--load-format tensorstream``: weights streamed by tensorstream's deserializer."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        # Parsed now, so a bad option stops vLLM before the model is built.
        self.options = VllmLoadOptions.from_extra(load_config.model_loader_extra_config)

    def weights_uri(self, model_config: ModelConfig) -> str:
        """The file this rank reads (the first of :func:`weights_candidates` that exists)."""
        rank, size = _tp_rank_and_size()
        candidates = weights_candidates(self.options, str(model_config.model), rank, size)
        return first_existing(candidates, self.options.storage)

    def download_model(self, model_config: ModelConfig) -> None:
        """Check that the weights are reachable (nothing is downloaded ahead of loading)."""
        self.weights_uri(model_config)

    def _deserializer_kwargs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "device": device,
            "dtype": dtype,
            "num_readers": self.options.num_readers,
            "verify_hash": self.options.verify_hash,
            # Local CPU loads view the page cache: vLLM copies each tensor into its own
            # (prefaulted) parameter, so a private copy would only add page faults.
            "use_mmap": True,
        }
        if self.options.storage is not None:
            kwargs["storage"] = self.options.storage
        if self.options.encryption_keyfile:
            from tensorstream.crypto.keyfile import read_keyfile
            from tensorstream.crypto.params import DecryptionParams

            key = read_keyfile(self.options.encryption_keyfile, self.options.storage)
            kwargs["encryption"] = DecryptionParams.from_key(key)
        kwargs.update(self.options.deserialization_kwargs)
        return kwargs

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        """Stream the weights into ``model`` (vLLM runs post-load processing afterwards).

        Raises:
            SourceNotFoundError: no weights file where the options point.
            CryptoError: the file is encrypted and the key is missing or wrong.
            FormatError: a tensor the model does not have, or of the wrong shape.
            SourceError: the storage failed.
        """
        uri = self.weights_uri(model_config)
        rank, world_size = _tp_rank_and_size()
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        start = time.perf_counter()
        kwargs = self._deserializer_kwargs(device, model_config.dtype)
        reader = _Reader(uri, kwargs, self.options.batch_bytes)
        # a rank file of Hugging Face names holds this rank's slices (its sidecar says
        # for which tensor-parallel size); vLLM's own layout is recognised by its marker
        rank_file = not reader.vllm_tensorized and _is_rank_file(uri, self.options, rank)
        if rank_file:
            from tensorstream.integrations.vllm_shards import check_world_size

            check_world_size(uri, world_size, self.options.storage)
        adopter = None
        if device.type == "cpu" and reader.records and not rank_file and in_place():
            adopter = Adopter(
                model,
                reader.records,
                reader.viewed,
                world_size,
                reader.vllm_tensorized,
                kwargs.get("dtype"),
                reader.viewed_path,
            )
            reader.fill_in_place(adopter.destinations())
        params = list(model.parameters())
        if adopter is not None:  # views are never touched; the readers fault the rest in
            params = adopter.untouched(params)
        prefaulted = prefault(params) if device.type == "cpu" else 0
        fill = time.perf_counter()
        tensors = reader.tensors()
        # vLLM's weight loaders copy one tensor (typically 0.1-4 MB) at a time; each copy
        # as an OpenMP parallel region cost 2-60x a single-threaded copy here (every
        # region waits for all of vLLM's pinned threads), so the copies run on one.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if reader.vllm_tensorized:
                loaded = _copy_vllm_tensorized(model, tensors, uri, adopter)
            elif rank_file:  # this rank's slices already: vLLM must not slice them again
                from tensorstream.integrations.vllm_shards import copy_rank_slices

                loaded = copy_rank_slices(model, tensors, uri)
            else:
                loaded = _feed_load_weights(model, tensors, uri, adopter)
        finally:
            torch.set_num_threads(threads)
            tensors.close()  # stops the background reader when vLLM failed half-way
        end = time.perf_counter()
        # vLLM's default loader logs the same sentence; benchmarks read both alike.
        logger.info(
            "Loading weights took %.2f seconds (tensorstream: %d tensors, %.3f GB from %s "
            "in %d batch(es); in place: %d tensor(s), %.3f GB, of which %.3f GB page-cache "
            "views, the rest read into vLLM's parameters; %.3f GB prefaulted in %.2f s; "
            "read %.2f s, overlapped with filling the model)",
            end - start,
            loaded,
            reader.nbytes / 1e9,
            uri,
            reader.batches,
            adopter.adopted if adopter is not None else 0,
            adopter.nbytes / 1e9 if adopter is not None else 0.0,
            adopter.viewed_bytes / 1e9 if adopter is not None else 0.0,
            prefaulted / 1e9,
            fill - start,
            reader.read_seconds,
        )


def in_place() -> bool:
    """Whether tensors that fill a parameter whole land there in place (page-cache
    views become its data, other tensors are read into it: :mod:`.vllm_adopt`);
    ``TENSORSTREAM_VLLM_IN_PLACE=0`` copies every tensor into vLLM's own parameters."""
    setting = os.environ.get("TENSORSTREAM_VLLM_IN_PLACE", "").strip().lower()
    return setting not in ("0", "false", "no", "off")


class _Reader:
    """The file's tensors as ``(name, tensor_type, tensor)``, in file order, streamed.

    A local, plain CPU load of a file in the page cache is one deserializer when it
    holds little: page-cache views cost nothing, but tensors at offsets not aligned for
    their dtype (many in files tensorizer wrote) are copied into fresh memory, so when
    those come to more than one batch the file is batched too, each batch holding about
    ``batch_bytes`` of copies (its views hold nothing of their own). Any other load (remote,
    cold, hashed, decrypted, or onto a device) reads batches of about ``batch_bytes`` on
    a background thread, each batch its own ``TensorDeserializer`` over a slice of
    the index, so the model is never held twice.
    """

    def __init__(self, uri: str, kwargs: dict[str, Any], batch_bytes: int | None) -> None:
        from tensorstream import TensorDeserializer

        self.uri, self.kwargs = uri, kwargs
        self.nbytes, self.read_seconds = 0, 0.0
        local = "://" not in uri or uri.startswith("file://")
        with TensorDeserializer(uri, **{**kwargs, "lazy_load": True}) as index_only:
            index = getattr(index_only, "index", None)
            self.records = list(getattr(index, "records", None) or [])
            # hashed or decrypted tensors are copies, not views: those are batched too
            viewed = not kwargs.get("verify_hash") and not getattr(index, "encrypted", False)
        self.vllm_tensorized = any(r.name == VLLM_MARKER for r in self.records)
        self.nbytes = sum(r.data_length for r in self.records)
        mapped = local and viewed and kwargs["device"].type == "cpu" and kwargs.get("use_mmap")
        size = batch_bytes or batch_bytes_for(self.nbytes)
        held = None  # every byte read is held until its batch is consumed
        #: keys of the records handed out as page-cache views (:mod:`.vllm_adopt`), and
        #: the local file they view
        self.viewed: set[Any] = set()
        self.viewed_path: str | None = None
        if mapped:  # a cold file is read, not viewed (issue #12): batches bound what is held
            from tensorstream.deserialize.coldread import loads_by_reading, viewable

            # unaligned tensors are copied even from a cached file (issue #11)
            views = {id(r) for r in viewable(self.records)}
            copied = sum(r.data_length for r in self.records if id(r) not in views)
            path = uri.removeprefix("file://")
            readers = kwargs.get("num_readers") or 2
            if loads_by_reading(path, self.records, readers):
                mapped = False
            else:
                # converted to another dtype, a tensor is a copy, not a view
                dtype = kwargs.get("dtype")
                self.viewed = {
                    r.key
                    for r in self.records
                    if id(r) in views and (dtype is None or r.dtype == dtype)
                }
                self.viewed_path = path if self.viewed else None
                if copied > size:  # cached, but copies to bound: views hold nothing of their own
                    mapped = False
                    held = lambda r: 0 if id(r) in views else r.data_length  # noqa: E731
        whole = (
            not self.records  # a sharded safetensors checkpoint: no single index
            or mapped
            or kwargs.get("lazy_load")
        )
        self.plan = [self.records] if whole else batch_plan(self.records, size, held)
        self.batches = len(self.plan)
        self._size, self._held = size, held
        #: ``TensorDeserializer(into=...)`` by key: parameters read into in place
        self.into: dict[Any, torch.Tensor] = {}

    def fill_in_place(self, into: dict[Any, torch.Tensor]) -> None:
        """Read the tensors of ``into`` straight into those tensors; batches are sized
        by what they still hold of their own (in place, a tensor holds nothing)."""
        self.into = into
        if into and len(self.plan) > 1:
            held = self._held or (lambda r: r.data_length)
            self.plan = batch_plan(
                self.records, self._size, lambda r: 0 if r.key in into else held(r)
            )
            self.batches = len(self.plan)

    def _read(self, batch: list) -> list[tuple[str, int, torch.Tensor]]:
        from tensorstream import TensorDeserializer

        started = time.perf_counter()
        kwargs = dict(self.kwargs)
        if len(self.plan) > 1:
            keys = {r.key for r in batch}
            kwargs["filter_func"] = keys.__contains__
        into = {r.key: self.into[r.key] for r in batch if r.key in self.into}
        if into:
            kwargs["into"] = into
        with TensorDeserializer(self.uri, **kwargs) as deserializer:
            if not batch:  # sharded safetensors: plain names, no types
                out = [(str(n), -1, t.detach()) for n, t in deserializer.items()]
                self.nbytes = int(getattr(deserializer, "total_tensor_bytes", 0) or 0)
            else:
                # plain tensors: vLLM's weight loaders copy out of them, no autograd
                out = [(r.name, r.tensor_type, deserializer[r.key].detach()) for r in batch]
        self.read_seconds += time.perf_counter() - started
        return out

    def tensors(self) -> Generator[tuple[str, int, torch.Tensor], None, None]:
        return stream_batches(self.plan, self._read)


def _model_names(model: nn.Module) -> set[str]:
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    return names


def _skippable(name: str, tensor_type: int, known: set[str]) -> bool:
    """A Hugging Face buffer the vLLM model computes itself (``rotary_emb.inv_freq``...)."""
    if name in known:
        return False
    return tensor_type == TENSOR_TYPE_BUFFER or any(part in name for part in _ROTARY)


def _feed_load_weights(
    model: nn.Module, named: Iterator, uri: str, adopter: Adopter | None = None
) -> int:
    """Hand the tensors to ``model.load_weights`` (vLLM's name mapping, fusing and sharding)
    as they arrive; those ``adopter`` places as parameters' data skip it."""
    known = _model_names(model)
    skipped: list[str] = []
    current: dict[str, Any] = {"count": 0}

    def weights() -> Any:
        for name, tensor_type, tensor in named:
            if _skippable(name, tensor_type, known):
                skipped.append(name)
                continue
            current["name"], current["shape"] = name, tuple(tensor.shape)
            current["count"] += 1
            if adopter is not None and adopter.adopt(name, tensor):
                continue
            yield name, tensor

    try:
        model.load_weights(weights())
    except TensorStreamError:
        raise
    except (ValueError, KeyError, AssertionError, RuntimeError, IndexError) as exc:
        name = current.get("name", "?")
        raise FormatError(
            f"{uri}: tensor {name!r} (shape {list(current.get('shape', ()))}) does not fit "
            f"the vLLM model {type(model).__name__}: {_short(exc)}. The file was written "
            "for a different model or configuration; serialize this model again "
            "(`tensorstream tensorize`) or point --model at the matching config"
        ) from exc
    if skipped:
        logger.info(
            "tensorstream: skipped %d buffer(s) the vLLM model computes itself: %s",
            len(skipped),
            ", ".join(skipped[:4]) + (" ..." if len(skipped) > 4 else ""),
        )
    return current["count"]


def _copy_vllm_tensorized(
    model: nn.Module, named: Iterable, uri: str, adopter: Adopter | None = None
) -> int:
    """Copy a vLLM-tensorized file (vLLM's names, this rank's shards) into the parameters,
    or make them the parameters' data where ``adopter`` planned it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    count = 0
    for name, _, tensor in named:
        if name == VLLM_MARKER:
            continue
        target = params.get(name)
        if target is None:
            if any(part in name for part in _ROTARY):
                continue
            raise FormatError(
                f"{uri}: tensor {name!r} is not a parameter of the vLLM model "
                f"{type(model).__name__}; the file was tensorized from another model or vLLM "
                "version. Serialize this model again (`tensorstream tensorize`)"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            hint = (
                " It is empty: vLLM-CPU serializes weights after repacking them for its "
                "kernels, which leaves the layers' weight tensors empty (vLLM #55198); "
                "serialize with `tensorstream tensorize` instead"
                if tensor.numel() == 0
                else " Was it written with another --tensor-parallel-size?"
            )
            raise FormatError(
                f"{uri}: tensor {name!r} has shape {list(tensor.shape)}, the vLLM model's "
                f"parameter has {list(target.shape)}.{hint}"
            )
        count += 1
        if adopter is not None and adopter.adopt(name, tensor):
            continue
        with torch.no_grad():
            target.data.copy_(tensor)
    if count == 0:
        raise ConfigError(f"{uri}: the vLLM-tensorized file holds no tensors of the model")
    return count


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
