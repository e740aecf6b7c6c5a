"""LoRA adapters: read/write them at any URI, and apply several at once, chosen per row.

An adapter lives in a directory (local, ``s3://``, ``http(s)://``) as either

* a *serialized* adapter: ``adapter_config.json`` + ``adapter_model.tensors``
  (what ``tensorstream tensorize --lora-path`` writes; optionally encrypted), or
* a *PEFT* adapter: ``adapter_config.json`` + ``adapter_model.safetensors``
  (``adapter_model.bin`` too, for local directories).

:func:`read_adapter` / :func:`write_adapter` are the symmetric pair for files.
:class:`LoRAManager` owns the adapters loaded into one model: it injects them
with ``peft`` (the model is changed in place, so ``LLM.model`` stays the same
object), loads their weights, and registers one forward pre-hook per LoRA layer
that hands PEFT the adapter of every batch row (PEFT's ``adapter_names``
mixed-batch inference). Rows without an adapter run the base model, so one
batch can mix the base model and several adapters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tensorstream.errors import ConfigError, FormatError, SourceNotFoundError
from tensorstream.sources.base import StorageOptions

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

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_TENSORS = "adapter_model.tensors"
_PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
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


@dataclass(frozen=True)
class AdapterOptions:
    """How adapters are read: storage, key file, readers, hash check."""

    storage: StorageOptions | None = None
    encryption_keyfile: str | None = None
    num_readers: int | None = None
    verify_hash: bool = False

    _KEYS = frozenset(
        {
            "encryption_keyfile",
            "s3_access_key_id",
            "s3_secret_access_key",
            "s3_endpoint",
            "num_readers",
            "verify_hash",
            "lora_dir",
            # vLLM's TensorizerConfig.to_serializable() carries these; they do not apply here.
            "tensorizer_uri",
            "tensorizer_dir",
            "serialization_kwargs",
            "deserialization_kwargs",
            "stream_kwargs",
            "vllm_tensorized",
        }
    )

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], base: AdapterOptions | None = None
    ) -> AdapterOptions:
        """Options from a tensorizer-style mapping; unset keys fall back to ``base``.

        Raises:
            ConfigError: unknown keys.
        """
        unknown = sorted(set(config) - cls._KEYS)
        if unknown:
            raise ConfigError(
                f"LoRA tensorizer_config_dict keys {unknown} are not understood; "
                f"valid keys: {', '.join(sorted(cls._KEYS))}"
            )
        base = base or cls()
        creds = {
            k: config[k]
            for k in ("s3_access_key_id", "s3_secret_access_key", "s3_endpoint")
            if config.get(k)
        }
        storage = base.storage
        if creds:
            storage = dataclasses.replace(storage or StorageOptions(), **creds)
        return cls(
            storage=storage,
            encryption_keyfile=config.get("encryption_keyfile") or base.encryption_keyfile,
            num_readers=config.get("num_readers") or base.num_readers,
            verify_hash=bool(config.get("verify_hash", base.verify_hash)),
        )


@dataclass
class LoadedAdapter:
    """An adapter read into memory.

    Attributes:
        uri: the directory it came from.
        config: the parsed ``adapter_config.json``.
        tensors: PEFT state-dict names (``base_model.model.<module>.lora_A.weight``) -> tensors.
    """

    uri: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """The largest LoRA rank the adapter uses (``r`` and any ``rank_pattern`` entry)."""
        ranks = [int(self.config.get("r", 8))]
        ranks += [int(v) for v in (self.config.get("rank_pattern") or {}).values()]
        return max(ranks)


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _local_dir(path: str) -> Path | None:
    """The local directory ``path`` names; a cached Hub snapshot for Hub ids; None if remote."""
    if _is_remote(path):
        return None
    local = Path(os.path.expanduser(path.removeprefix("file://")))
    if local.is_dir():
        return local
    if not path.startswith(("/", ".", "~", "file://")) and path.count("/") == 1:
        from tensorstream.engine.resolve import _from_hub

        return _from_hub(path, None)
    raise SourceNotFoundError(
        f"LoRA adapter directory {path} does not exist; give a directory holding "
        f"{ADAPTER_CONFIG} and {ADAPTER_TENSORS} (or a PEFT adapter_model.safetensors)"
    )


def _read_bytes(uri: str, storage: StorageOptions | None) -> bytes:
    from tensorstream.sources.registry import open_source

    with open_source(uri, storage) as source:
        return source.read(0, source.size) if source.size else b""


def read_adapter(
    path: str | os.PathLike[str],
    options: AdapterOptions | None = None,
    *,
    device: str | torch.device = "cpu",
) -> LoadedAdapter:
    """Read an adapter directory: serialized (``adapter_model.tensors``) or PEFT.

    Args:
        path: local directory, ``s3://`` or ``http(s)://`` directory URI, or a cached Hub id.
        options: storage, key file (for encrypted adapters), readers, hash check.
        device: where the tensors go.

    Returns:
        The config and tensors.

    Raises:
        SourceNotFoundError: no ``adapter_config.json`` or no weights file there.
        FormatError: the config is not JSON, or a weights file is unreadable.
        CryptoError: the adapter is encrypted and the key is missing or wrong.
    """
    from tensorstream.sources.uri import join_uri

    options = options or AdapterOptions()
    raw = os.fspath(path)
    local = _local_dir(raw)
    where = str(local) if local is not None else raw
    try:
        config_bytes = _read_bytes(join_uri(where, ADAPTER_CONFIG), options.storage)
    except SourceNotFoundError:
        raise SourceNotFoundError(
            f"no {ADAPTER_CONFIG} in LoRA adapter directory {where}; give the directory "
            "written by `tensorstream tensorize --lora-path` or a PEFT adapter directory"
        ) from None
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise FormatError(f"{join_uri(where, ADAPTER_CONFIG)} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise FormatError(f"{join_uri(where, ADAPTER_CONFIG)} is not a JSON object")
    if local is not None:
        tensors = _read_local_weights(local, options, device)
    else:
        tensors = _read_remote_weights(raw, options, device)
    return LoadedAdapter(where, config, tensors)


def _deserialize(uri: str, options: AdapterOptions, device: Any, encrypted_ok: bool) -> dict:
    from tensorstream import TensorDeserializer

    kwargs: dict[str, Any] = {
        "device": device,
        "num_readers": options.num_readers,
        "verify_hash": options.verify_hash,
        "storage": options.storage,
    }
    if options.encryption_keyfile and encrypted_ok:
        from tensorstream.crypto.keyfile import read_keyfile
        from tensorstream.crypto.params import DecryptionParams

        key = read_keyfile(options.encryption_keyfile, options.storage)
        kwargs["encryption"] = DecryptionParams.from_key(key)
    with TensorDeserializer(uri, **kwargs) as deserializer:
        return {str(k): v.detach() for k, v in deserializer.items()}


def _read_local_weights(directory: Path, options: AdapterOptions, device: Any) -> dict:
    tensors_file = directory / ADAPTER_TENSORS
    if tensors_file.is_file():
        return _deserialize(str(tensors_file), options, device, True)
    if (directory / _PEFT_WEIGHTS[0]).is_file():
        return _deserialize(str(directory / _PEFT_WEIGHTS[0]), options, device, False)
    if (directory / _PEFT_WEIGHTS[1]).is_file():
        state = torch.load(directory / _PEFT_WEIGHTS[1], map_location=device, weights_only=True)
        return {str(k): v for k, v in state.items()}
    raise SourceNotFoundError(
        f"LoRA adapter directory {directory} has {ADAPTER_CONFIG} but no weights: expected "
        f"{ADAPTER_TENSORS} or {_PEFT_WEIGHTS[0]}"
    )


def _read_remote_weights(uri: str, options: AdapterOptions, device: Any) -> dict:
    from tensorstream.sources.uri import join_uri

    try:
        return _deserialize(join_uri(uri, ADAPTER_TENSORS), options, device, True)
    except SourceNotFoundError:
        pass
    try:
        return _deserialize(join_uri(uri, _PEFT_WEIGHTS[0]), options, device, False)
    except SourceNotFoundError:
        raise SourceNotFoundError(
            f"LoRA adapter at {uri} has {ADAPTER_CONFIG} but no weights: expected "
            f"{ADAPTER_TENSORS} or {_PEFT_WEIGHTS[0]}"
        ) from None


def write_adapter(
    adapter: LoadedAdapter,
    directory: str | os.PathLike[str],
    *,
    encryption: Any = None,
    storage: StorageOptions | None = None,
    serialization_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Write ``adapter_config.json`` and ``adapter_model.tensors`` into ``directory``.

    Args:
        adapter: what :func:`read_adapter` returned.
        directory: local directory or ``s3://`` URI.
        encryption: ``EncryptionParams`` to encrypt the tensors (the config stays plain).
        storage: credentials and endpoints for remote targets.
        serialization_kwargs: extra ``TensorSerializer`` keyword arguments.

    Returns:
        Bytes of tensor data written.

    Raises:
        SourceError: the target cannot be written.
    """
    from tensorstream import TensorSerializer
    from tensorstream.sources.registry import open_sink
    from tensorstream.sources.uri import join_uri

    target = os.fspath(directory)
    with open_sink(join_uri(target, ADAPTER_CONFIG), storage) as sink:
        sink.write(json.dumps(adapter.config, indent=2, sort_keys=True).encode() + b"\n")
    kwargs = dict(serialization_kwargs or {})
    with TensorSerializer(
        join_uri(target, ADAPTER_TENSORS), encryption=encryption, storage=storage, **kwargs
    ) as serializer:
        serializer.write_state_dict(adapter.tensors)
        return serializer.total_tensor_bytes


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
