"""LoRA adapter files at any URI: read and write serialized or PEFT adapter directories.

An adapter lives in a directory (local, ``s3://``, ``http(s)://``) as either

* a *serialized* adapter: ``adapter_config.json`` + ``adapter_model.tensors``
  (what ``tensorstream tensorize --lora-path`` writes; optionally encrypted), or
* a *PEFT* adapter: ``adapter_config.json`` + ``adapter_model.safetensors``
  (``adapter_model.bin`` too, for local directories).

:func:`read_adapter` / :func:`write_adapter` are the symmetric pair.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
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
    "LoadedAdapter",
    "read_adapter",
    "write_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_TENSORS = "adapter_model.tensors"
_PEFT_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


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
        from tensorstream.engine.vllm_args import parse_bool

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
            num_readers=int(config.get("num_readers") or 0) or base.num_readers,
            # "False" from a vLLM-style JSON config must not count as true
            verify_hash=parse_bool(config.get("verify_hash", base.verify_hash), "verify_hash"),
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

        return _from_hub(path, None, kind="adapter")
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
