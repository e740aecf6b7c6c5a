"""tensorizer's ``torch_compat``: ``torch.save`` / ``torch.load`` with tensors in a ``.tensors`` file.

Inside ``tensorizer_saving()``, ``torch.save(obj, "x.pt")`` writes the pickled
structure to ``x.pt`` as usual but every tensor storage with data to a sidecar
``x.pt.tensors`` (through this package's ``TensorSerializer``); inside
``tensorizer_loading()``, ``torch.load("x.pt")`` reads them back from it. The
pickle stream references storages as ``("TensorizerPickler", 0, "storage", index,
dtype)``, the same persistent ids tensorizer 2.12.1 writes, so files made by
either library load with the other.

The contexts are thread- and task-local (``contextvars``): ``torch.save`` and
``torch.load`` are replaced by wrappers while any context is open, and the
wrappers behave exactly like the originals wherever no context is active.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import pickle
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import IO, Any, Union

import torch

from tensorstream.compat.tensorizer.serialization import TensorDeserializer, TensorSerializer

__all__ = ("tensorizer_loading", "tensorizer_saving")

log = logging.getLogger(__name__)

_FileLike = Union[str, "os.PathLike[str]", IO[bytes]]
_PID_TAG = "TensorizerPickler"
_PID_VERSION = 0
#: torch.load's default ``pickle_module`` (``None`` since torch 1.13).
_LOAD_WRAPPER_DEFAULT_MODULE: Any = None

_ORIG_TORCH_SAVE = torch.save
_ORIG_TORCH_LOAD = torch.load


class _Settings:
    """What one open context asked for: sidecar location, constructor kwargs, hook."""

    __slots__ = ("file_obj", "kwargs", "func", "suppress_weights_only")

    def __init__(
        self, file_obj: Any, kwargs: dict[str, Any], func: Any, suppress: bool = False
    ) -> None:
        self.file_obj = file_obj
        self.kwargs = kwargs
        self.func = func
        self.suppress_weights_only = suppress


_saving: ContextVar[_Settings | None] = ContextVar("tensorstream_tz_saving", default=None)
_loading: ContextVar[_Settings | None] = ContextVar("tensorstream_tz_loading", default=None)
#: The sidecar of the torch.save / torch.load call in progress (None: no sidecar).
_sidecar: ContextVar[Any] = ContextVar("tensorstream_tz_sidecar", default=None)

_patch_lock = threading.Lock()
_patch_count = {"save": 0, "load": 0}


def _untyped(storage: Any) -> torch.UntypedStorage:
    if isinstance(storage, torch.UntypedStorage):
        return storage
    # TypedStorage.untyped() warns that TypedStorage is deprecated; the attribute does not.
    inner = getattr(storage, "_untyped_storage", None)
    return inner if inner is not None else storage.untyped()


def _storage_tensor(storage: Any) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``'s bytes (no copy)."""
    untyped = _untyped(storage)
    t = torch.empty((0,), dtype=torch.uint8, device=untyped.device)
    t.set_(untyped)
    return t


def _has_data(storage: Any) -> bool:
    untyped = _untyped(storage)
    return untyped.device.type != "meta" and untyped.data_ptr() != 0


class _Pickler(pickle.Pickler):
    """Pickles storages as references into the sidecar; torch's pickler subclasses this."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ts_target = _sidecar.get()
        self._ts_tensors: list[torch.Tensor] = []
        self._ts_ids: dict[tuple[Any, ...], int] = {}

    def _ts_persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if self._ts_target is None or not torch.is_storage(obj) or not _has_data(obj):
            return None
        tensor = _storage_tensor(obj)
        key = (tensor.device, tensor.data_ptr(), tensor.numel())
        idx = self._ts_ids.setdefault(key, len(self._ts_tensors))
        if idx == len(self._ts_tensors):
            self._ts_tensors.append(tensor)
        return (_PID_TAG, _PID_VERSION, "storage", idx, getattr(obj, "dtype", None))

    def persistent_id(self, obj: Any) -> Any:
        return self._ts_persistent_id(obj)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # torch.save subclasses the pickler and defines its own persistent_id; ours
        # must see storages first, so the subclass's method is wrapped.
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("persistent_id")
        if own is not None:

            @functools.wraps(own)
            def persistent_id(self: _Pickler, obj: Any) -> Any:
                pid = self._ts_persistent_id(obj)
                return pid if pid is not None else own(self, obj)

            cls.persistent_id = persistent_id  # type: ignore[method-assign]

    def dump(self, obj: Any) -> None:
        super().dump(obj)
        tensors, self._ts_tensors, self._ts_ids = self._ts_tensors, [], {}
        if not tensors or self._ts_target is None:
            return
        settings = _saving.get()
        kwargs = dict(settings.kwargs) if settings else {}
        if settings is not None and settings.func is not None:
            settings.func(self._ts_target, tensors, kwargs)
            return
        serializer = TensorSerializer(self._ts_target, **kwargs)
        try:
            serializer.write_state_dict(tensors)
        except BaseException:
            serializer.abort()
            raise
        serializer.close()


class _Unpickler(pickle.Unpickler):
    """Resolves the sidecar's storage references; torch sets its own handler for the rest."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ts_source = _sidecar.get()
        self._ts_tensors: list[torch.Tensor] | None = None

    def _ts_storage(self, pid: tuple[Any, ...]) -> Any:
        if pid[1] != _PID_VERSION or pid[2] != "storage":
            raise pickle.UnpicklingError(f"unsupported tensorizer persistent id {pid[:3]!r}")
        if self._ts_source is None:
            raise pickle.UnpicklingError(
                "this file keeps its tensors in a .tensors sidecar; load it inside "
                "tensorizer_loading(...)"
            )
        if self._ts_tensors is None:
            self._ts_tensors = _load_sidecar(self._ts_source)
        tensor = self._ts_tensors[pid[3]]
        dtype = pid[4] if pid[4] is not None else torch.uint8
        return torch.TypedStorage(
            wrap_storage=tensor.untyped_storage(), dtype=dtype, _internal=True
        )

    def load(self) -> Any:
        try:
            return super().load()
        finally:
            self._ts_tensors = None

    def __setattr__(self, name: str, value: Any) -> None:
        # torch.load assigns its own persistent_load; ours answers the sidecar's ids first.
        if name == "persistent_load" and not getattr(value, "_ts_wrapped", False):
            theirs = value

            def persistent_load(pid: Any) -> Any:
                if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == _PID_TAG:
                    return self._ts_storage(pid)
                return theirs(pid)

            persistent_load._ts_wrapped = True  # type: ignore[attr-defined]
            value = persistent_load
        super().__setattr__(name, value)


def _load_sidecar(source: Any) -> list[torch.Tensor]:
    settings = _loading.get()
    kwargs = dict(settings.kwargs) if settings else {}
    if settings is not None and settings.func is not None:
        tensors = list(settings.func(source, kwargs))
    else:
        with TensorDeserializer(source, **kwargs) as deserializer:
            tensors = list(deserializer.tree())
    # A storage must span exactly its tensor's bytes; copy any that does not.
    return [
        t if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() else t.clone()
        for t in tensors
    ]


_pickle_module = types.ModuleType("tensorstream_tensorizer_pickle")
_pickle_module.__getattr__ = lambda name: getattr(pickle, name)  # type: ignore[attr-defined]
_pickle_module.Pickler = _Pickler  # type: ignore[attr-defined]
_pickle_module.Unpickler = _Unpickler  # type: ignore[attr-defined]


def _sidecar_for(f: Any, settings: _Settings) -> Any:
    """The sidecar for a torch.save/load of ``f``: given, computed, or ``f`` + ``.tensors``."""
    if settings.file_obj is not None:
        return settings.file_obj(f) if callable(settings.file_obj) else settings.file_obj
    if isinstance(f, io.BytesIO):
        log.warning(
            "cannot place a .tensors sidecar beside an io.BytesIO; tensors stay in the "
            "pickle (pass file_obj= to choose a location)"
        )
        return None
    name = f if isinstance(f, (str, bytes, os.PathLike)) else getattr(f, "name", None)
    if name is None:
        raise ValueError(f"cannot name a .tensors sidecar for {type(f).__name__}; pass file_obj=")
    return os.fsdecode(name) + ".tensors"


def _check_pickle_module(pickle_module: Any) -> None:
    if pickle_module is not None and pickle_module is not pickle:
        raise ValueError(
            "tensorizer-backed torch.save/torch.load cannot use a custom pickle_module"
        )


@functools.wraps(_ORIG_TORCH_SAVE)
def _save_wrapper(
    obj: object, f: Any, pickle_module: Any = pickle, *args: Any, **kwargs: Any
) -> Any:
    settings = _saving.get()
    if settings is None:
        return _ORIG_TORCH_SAVE(obj, f, pickle_module, *args, **kwargs)
    _check_pickle_module(pickle_module)
    token = _sidecar.set(_sidecar_for(f, settings))
    try:
        return _ORIG_TORCH_SAVE(obj, f, *args, pickle_module=_pickle_module, **kwargs)
    finally:
        _sidecar.reset(token)


@functools.wraps(_ORIG_TORCH_LOAD)
def _load_wrapper(
    f: Any,
    map_location: Any = None,
    pickle_module: Any = _LOAD_WRAPPER_DEFAULT_MODULE,
    *args: Any,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    settings = _loading.get()
    if settings is None:
        return _ORIG_TORCH_LOAD(
            f, map_location, pickle_module, *args, weights_only=weights_only, **kwargs
        )
    _check_pickle_module(pickle_module)
    if settings.suppress_weights_only:
        weights_only = False
    token = _sidecar.set(_sidecar_for(f, settings))
    try:
        return _ORIG_TORCH_LOAD(
            f,
            map_location,
            *args,
            pickle_module=_pickle_module,
            weights_only=weights_only,
            **kwargs,
        )
    finally:
        _sidecar.reset(token)


@contextlib.contextmanager
def _patched(which: str, var: ContextVar[_Settings | None], settings: _Settings) -> Iterator[None]:
    token = var.set(settings)
    with _patch_lock:
        _patch_count[which] += 1
        if _patch_count[which] == 1:
            if which == "save":
                torch.save = _save_wrapper
            else:
                torch.load = _load_wrapper
    try:
        yield
    finally:
        with _patch_lock:
            _patch_count[which] -= 1
            if _patch_count[which] == 0:
                if which == "save":
                    torch.save = _ORIG_TORCH_SAVE
                else:
                    torch.load = _ORIG_TORCH_LOAD
        var.reset(token)


def tensorizer_saving(
    file_obj: Any = None,
    *,
    save_func: Callable[[Any, Iterable[torch.Tensor], dict[str, Any]], Any] | None = None,
    **kwargs: Any,
) -> contextlib.AbstractContextManager[None]:
    """Within this context, ``torch.save`` keeps tensor data in a ``.tensors`` sidecar.

    Args:
        file_obj: where the sidecar goes: anything ``TensorSerializer`` accepts, or
            ``f(torch_save_target) -> that``. Default: the ``torch.save`` path plus
            ``".tensors"``.
        save_func: ``save_func(file_obj, tensors, kwargs)`` replacing the default
            ``TensorSerializer(file_obj, **kwargs).write_state_dict(tensors)``.
        **kwargs: passed to ``TensorSerializer`` (e.g. ``encryption=``).

    Example:
        >>> with tensorizer_saving():  # doctest: +SKIP
        ...     torch.save(model, "model.pt")   # also writes model.pt.tensors
    """
    return _patched("save", _saving, _Settings(file_obj, kwargs, save_func))


def tensorizer_loading(
    file_obj: Any = None,
    *,
    load_func: Callable[[Any, dict[str, Any]], Iterable[torch.Tensor]] | None = None,
    suppress_weights_only: bool = False,
    **kwargs: Any,
) -> contextlib.AbstractContextManager[None]:
    """Within this context, ``torch.load`` reads tensor data from the ``.tensors`` sidecar.

    Args:
        file_obj: the sidecar: anything ``TensorDeserializer`` accepts, or
            ``f(torch_load_source) -> that``. Default: the path plus ``".tensors"``.
        load_func: ``load_func(file_obj, kwargs) -> tensors`` replacing the default
            ``TensorDeserializer(file_obj, **kwargs).tree()``.
        suppress_weights_only: turn ``weights_only=True`` into ``False`` (torch refuses
            ``weights_only`` with a custom unpickler, which this context uses).
        **kwargs: passed to ``TensorDeserializer`` (e.g. ``device=``, ``encryption=``).
    """
    return _patched("load", _loading, _Settings(file_obj, kwargs, load_func, suppress_weights_only))
