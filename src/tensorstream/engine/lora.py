"""LoRA adapters: requests, and several adapters applied at once, chosen per row.

Adapter files (serialized or PEFT directories at any URI) are read and written by
:mod:`tensorstream.engine.adapter_files`, re-exported here.

:class:`LoRAManager` owns the adapters loaded into one model: it injects them
with ``peft`` (the model is changed in place, so ``LLM.model`` stays the same
object), loads their weights, and registers one forward pre-hook per LoRA layer
that hands PEFT the adapter of every batch row (PEFT's ``adapter_names``
mixed-batch inference). Rows without an adapter run the base model, so one
batch can mix the base model and several adapters.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tensorstream.engine.adapter_files import (
    ADAPTER_CONFIG,
    ADAPTER_TENSORS,
    AdapterOptions,
    LoadedAdapter,
    read_adapter,
    write_adapter,
)
from tensorstream.errors import ConfigError, FormatError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_TENSORS",
    "AdapterOptions",
    "LoRAManager",
    "LoRARequest",
    "LoadedAdapter",
    "check_adapter_fits",
    "read_adapter",
    "write_adapter",
]

_BASE = "__base__"  # PEFT's row label for "no adapter"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """One adapter, as vLLM names it: ``LoRARequest(lora_name, lora_int_id, lora_path)``.

    Args:
        lora_name: a name for the adapter (served as a model name by the server).
        lora_int_id: a positive id; requests with the same id share one loaded adapter.
        lora_path: the adapter directory (local, ``s3://``, ``http(s)://``), serialized
            or PEFT, or a Hugging Face id in the local cache.
        base_model_name: the model the adapter belongs to (informational).
        tensorizer_config_dict: vLLM's per-adapter tensorizer options; the keys used are
            ``encryption_keyfile``, ``s3_access_key_id``, ``s3_secret_access_key``,
            ``s3_endpoint``, ``num_readers``, ``verify_hash`` and ``lora_dir``
            (which overrides ``lora_path``).

    Raises:
        ConfigError: an empty name, a non-positive id, or an unknown config key.

    Example:
        >>> LoRARequest("sql", 1, "s3://bucket/vllm/model/v1").lora_int_id
        1
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    tensorizer_config_dict: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ConfigError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ConfigError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ConfigError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        AdapterOptions.from_config(self.tensorizer_config_dict or {})  # validate early
        if not self.path:
            raise ConfigError(f"LoRA adapter {self.lora_name!r} has no lora_path")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of ``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """Where the adapter is read from (``tensorizer_config_dict['lora_dir']`` wins)."""
        lora_dir = (self.tensorizer_config_dict or {}).get("lora_dir")
        return str(lora_dir) if lora_dir else self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_int_id == other.lora_int_id

    def __hash__(self) -> int:
        return hash(self.lora_int_id)


class LoRAManager:
    """The adapters loaded into one model, applied per batch row.

    Args:
        model: the transformers model (changed in place: LoRA layers are injected).
        max_loras: adapters resident at once; the least recently used idle one is
            evicted to make room.
        max_lora_rank: highest rank accepted.
        defaults: read options used when a request brings none of its own.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        defaults: AdapterOptions | None = None,
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.defaults = defaults or AdapterOptions()
        self._loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        self._in_use: dict[int, int] = {}
        self._hooked: set[int] = set()
        self._rows: list[str] | None = None

    @staticmethod
    def adapter_name(lora_int_id: int) -> str:
        """The name an adapter has inside PEFT's layers."""
        return f"lora{lora_int_id}"

    def list(self) -> set[int]:
        """Ids of the loaded adapters."""
        return set(self._loaded)

    def requests(self) -> list[LoRARequest]:
        """The loaded adapters' requests, least recently used first."""
        return list(self._loaded.values())

    def add(self, request: LoRARequest) -> str:
        """Load ``request``'s adapter unless it is loaded already; return its PEFT name.

        Raises:
            ConfigError: rank above ``max_lora_rank``, an adapter for another base model,
                every slot busy, or the id already used for another path.
            SourceNotFoundError, FormatError, CryptoError: the adapter cannot be read.
        """
        if not isinstance(request, LoRARequest):
            raise ConfigError(
                f"lora_request must be a LoRARequest, got {type(request).__name__}; "
                "build one with LoRARequest(name, id, path)"
            )
        name = self.adapter_name(request.lora_int_id)
        known = self._loaded.get(request.lora_int_id)
        if known is not None:
            if known.path != request.path:
                raise ConfigError(
                    f"LoRA id {request.lora_int_id} is loaded from {known.path}, not "
                    f"{request.path}; use a new lora_int_id for another adapter"
                )
            self._loaded.move_to_end(request.lora_int_id)
            return name
        options = AdapterOptions.from_config(request.tensorizer_config_dict or {}, self.defaults)
        return self.install(read_adapter(request.path, options), request)

    def install(self, adapter: LoadedAdapter, request: LoRARequest) -> str:
        """Load an adapter already read into memory under ``request``'s id; return its name.

        Raises:
            ConfigError: as :meth:`add`.
        """
        name = self.adapter_name(request.lora_int_id)
        self._check(adapter, request)
        self._make_room(request)
        self._inject(adapter, name, request)
        self._loaded[request.lora_int_id] = request
        return name

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter; False when it is not loaded.

        Raises:
            ConfigError: running requests still use it.
        """
        if lora_int_id not in self._loaded:
            return False
        if self._in_use.get(lora_int_id):
            raise ConfigError(
                f"LoRA adapter {lora_int_id} is used by {self._in_use[lora_int_id]} running "
                "requests; remove it when they finish"
            )
        self._delete(self.adapter_name(lora_int_id))
        del self._loaded[lora_int_id]
        return True

    def acquire(self, request: LoRARequest) -> str:
        """:meth:`add`, and keep the adapter loaded until :meth:`release`."""
        name = self.add(request)
        self._in_use[request.lora_int_id] = self._in_use.get(request.lora_int_id, 0) + 1
        return name

    def release(self, name: str) -> None:
        """Undo one :meth:`acquire` of the adapter called ``name``."""
        lora_int_id = int(name.removeprefix("lora"))
        count = self._in_use.get(lora_int_id, 0) - 1
        if count > 0:
            self._in_use[lora_int_id] = count
        else:
            self._in_use.pop(lora_int_id, None)

    @contextmanager
    def activate(self, rows: Sequence[str | None]) -> Iterator[None]:
        """Within the block, row ``i`` of every forward uses adapter ``rows[i]`` (None: base)."""
        previous = self._rows
        self._rows = [_BASE if name is None else name for name in rows]
        try:
            yield
        finally:
            self._rows = previous

    # -- internals --------------------------------------------------------------------

    def _check(self, adapter: LoadedAdapter, request: LoRARequest) -> None:
        config = adapter.config
        kind = str(config.get("peft_type", "LORA")).upper()
        if kind != "LORA":
            raise ConfigError(
                f"adapter {request.lora_name!r} at {adapter.uri} is a {kind} adapter; only LoRA is supported"
            )
        if adapter.rank > self.max_lora_rank:
            raise ConfigError(
                f"adapter {request.lora_name!r} at {adapter.uri} has rank {adapter.rank}, above "
                f"max_lora_rank={self.max_lora_rank}; build the LLM with max_lora_rank>={adapter.rank}"
            )
        if config.get("use_dora"):
            raise ConfigError(
                f"adapter {request.lora_name!r} uses DoRA, which cannot be mixed per request; "
                "merge it into the model instead"
            )
        if config.get("modules_to_save"):
            raise ConfigError(
                f"adapter {request.lora_name!r} replaces whole modules ({config['modules_to_save']}); "
                "only LoRA matrices can be applied per request"
            )

    def _make_room(self, request: LoRARequest) -> None:
        while len(self._loaded) >= self.max_loras:
            idle = [i for i in self._loaded if not self._in_use.get(i)]
            if not idle:
                raise ConfigError(
                    f"cannot load LoRA adapter {request.lora_name!r}: all max_loras="
                    f"{self.max_loras} slots are used by running requests; raise max_loras"
                )
            self.remove(idle[0])

    def _inject(self, adapter: LoadedAdapter, name: str, request: LoRARequest) -> None:
        try:
            import peft
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError as exc:
            raise ConfigError(
                "LoRA adapters need peft; run: pip install 'tensorstream[engine]'"
            ) from exc
        fields = {k: v for k, v in adapter.config.items() if not k.startswith("_")}
        try:
            config = peft.LoraConfig(**_known_fields(peft.LoraConfig, fields))
        except (TypeError, ValueError) as exc:
            raise FormatError(
                f"{adapter.uri}/{ADAPTER_CONFIG} is not a LoRA config: {exc}"
            ) from exc
        config.inference_mode = True
        other = _other_base(adapter, request)
        try:
            with warnings.catch_warnings():
                # PEFT warns about several adapters in one model; that is the point here.
                warnings.simplefilter("ignore", UserWarning)
                peft.inject_adapter_in_model(config, self.model, adapter_name=name)
        except ValueError as exc:
            self._delete(name)
            raise ConfigError(
                f"adapter {request.lora_name!r} at {adapter.uri} does not fit this model{other}: "
                f"{exc}"
            ) from exc
        state = {k.removeprefix(_PEFT_PREFIX): v for k, v in adapter.tensors.items()}
        try:
            result = peft.set_peft_model_state_dict(self.model, state, adapter_name=name)
        except RuntimeError as exc:  # load_state_dict's size mismatch
            self._delete(name)
            raise ConfigError(
                f"adapter {request.lora_name!r} at {adapter.uri} has tensors whose shapes do not "
                f"match this model{other}: {str(exc)[:600]}"
            ) from exc
        missing = [k for k in result.missing_keys if f".{name}." in k]
        if result.unexpected_keys or missing:
            self._delete(name)
            raise ConfigError(
                f"adapter {request.lora_name!r} at {adapter.uri} does not match this model{other}: "
                f"unexpected tensors {sorted(result.unexpected_keys)[:5]}, missing {missing[:5]}"
            )
        for module in self.model.modules():
            if isinstance(module, BaseTunerLayer) and id(module) not in self._hooked:
                module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
                self._hooked.add(id(module))

    def _pre_forward(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        rows = self._rows
        if rows is None:
            # Outside activate(): the base model, never PEFT's "active adapter" default.
            x = args[0] if args else next(iter(kwargs.values()))
            rows = [_BASE] * len(x)
        kwargs["adapter_names"] = rows
        return args, kwargs

    def _delete(self, name: str) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.model.modules():
            if isinstance(module, BaseTunerLayer) and name in getattr(module, "lora_A", {}):
                module.delete_adapter(name)
        getattr(self.model, "peft_config", {}).pop(name, None)


def check_adapter_fits(model_config: Any, adapter: LoadedAdapter, name: str = "adapter") -> None:
    """Apply ``adapter`` to a weightless (meta) copy of the model: checks modules and shapes.

    Args:
        model_config: the base model's transformers config.
        adapter: what :func:`read_adapter` returned.
        name: names the adapter in errors.

    Raises:
        ConfigError: the adapter was made for another model (missing target modules,
            shape mismatch), or it is not a plain LoRA adapter.
    """
    from tensorstream.engine.models import NativeConfig

    if isinstance(model_config, NativeConfig):  # the native model code: no peft involved
        from tensorstream.engine.models.lora import check_native_adapter_fits

        return check_native_adapter_fits(model_config, adapter, name)
    import transformers

    with torch.device("meta"):
        probe = transformers.AutoModelForCausalLM.from_config(model_config)
    manager = LoRAManager(probe, max_loras=1, max_lora_rank=max(1, adapter.rank))
    with warnings.catch_warnings():
        # Copies into meta parameters are no-ops by design here: only shapes are checked.
        warnings.simplefilter("ignore", UserWarning)
        manager.install(adapter, LoRARequest(name, 1, adapter.uri))


def _known_fields(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """Drop keys a newer PEFT wrote that this PEFT's config class does not know."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def _other_base(adapter: LoadedAdapter, request: LoRARequest) -> str:
    base = adapter.config.get("base_model_name_or_path") or request.base_model_name
    return f" (it was made for {base!r})" if base else ""
