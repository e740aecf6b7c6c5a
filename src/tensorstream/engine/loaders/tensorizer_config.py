"""vLLM's ``TensorizerConfig`` and the mapping of tensorizer's stream options onto ours.

``TensorizerConfig`` has vLLM's field names and is a read-only mapping of the fields
that are set, so it goes wherever vLLM's goes:
``LLM(..., model_loader_extra_config=TensorizerConfig(...))`` and
``LoRARequest(..., tensorizer_config_dict=config.to_serializable())``.

:func:`storage_from_extra` turns the S3 keys and ``stream_kwargs`` (tensorizer's
``open_stream`` keyword arguments, as vLLM passes them through) into one
:class:`~tensorstream.sources.base.StorageOptions`. Keywords with a counterpart are
mapped; those with no meaning for a whole-file parallel load (``buffer_size``,
``force_http``...) are accepted with one INFO line saying so; a value that cannot be
honoured (``begin``/``end`` selecting part of the file, write modes) is refused.
Booleans may be given as vLLM's guide writes them: ``"True"`` / ``"False"``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorstream.engine.vllm_args import parse_bool
from tensorstream.errors import ConfigError

__all__ = ["TensorizerConfig", "storage_from_extra", "tensorizer_keys"]

logger = logging.getLogger(__name__)


@dataclass
class TensorizerConfig(Mapping[str, Any]):
    """Tensorizer load options with vLLM's names (``vllm...tensorizer.TensorizerConfig``).

    Attributes:
        tensorizer_uri: the ``.tensors`` file (local, ``s3://``, ``http(s)://``).
        tensorizer_dir: a directory holding ``model.tensors``.
        vllm_tensorized: vLLM's deprecated marker flag; accepted, not needed.
        verify_hash: check every tensor's hash while loading.
        num_readers: parallel readers (None: chosen from the source).
        encryption_keyfile: the 32-byte key file (local or remote) of an encrypted model.
        s3_access_key_id, s3_secret_access_key, s3_endpoint: S3 credentials/endpoint.
        lora_dir: the directory of the adapter serialized beside the model
            (``adapter_model.tensors`` + ``adapter_config.json``).
        stream_kwargs: tensorizer ``open_stream`` keyword arguments (see module doc).
        serialization_kwargs: ``TensorSerializer`` keyword arguments (serialize only).
        deserialization_kwargs: ``TensorDeserializer`` keyword arguments.

    Example:
        >>> cfg = TensorizerConfig(tensorizer_uri="s3://b/m/model.tensors", num_readers=4)
        >>> dict(cfg)["num_readers"], cfg.tensorizer_dir
        (4, 's3://b/m')
    """

    tensorizer_uri: str | None = None
    tensorizer_dir: str | None = None
    vllm_tensorized: bool | None = None
    verify_hash: bool | None = None
    num_readers: int | None = None
    encryption_keyfile: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = field(default=None, repr=False)
    s3_endpoint: str | None = None
    lora_dir: str | None = None
    stream_kwargs: dict[str, Any] | None = None
    serialization_kwargs: dict[str, Any] | None = None
    deserialization_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("tensorizer_uri", "tensorizer_dir", "lora_dir", "encryption_keyfile"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, os.fspath(value))
        if self.verify_hash is not None:
            self.verify_hash = parse_bool(self.verify_hash, "TensorizerConfig.verify_hash")
        if self.tensorizer_uri and not self.tensorizer_dir:
            # vLLM's rule: the directory of the file holds the config and tokenizer.
            self.tensorizer_dir = self.tensorizer_uri.rstrip("/").rpartition("/")[0] or None

    def _items(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def __getitem__(self, key: str) -> Any:
        items = self._items()
        if key not in items:
            raise KeyError(key)
        return items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def to_serializable(self) -> dict[str, Any]:
        """The set fields as a plain dict (what vLLM hands to ``LoRARequest``)."""
        return self._items()


def tensorizer_keys() -> frozenset[str]:
    """Every ``TensorizerConfig`` field name."""
    return frozenset(f.name for f in dataclasses.fields(TensorizerConfig))


# open_stream keyword -> StorageOptions field.
_RENAMED = {
    "s3_access_key_id": "s3_access_key_id",
    "s3_secret_access_key": "s3_secret_access_key",
    "s3_endpoint": "s3_endpoint",
    "s3_config_path": "s3_config_path",
    "s3_region_name": "s3_region",
}
# open_stream keywords with no meaning for a parallel whole-file load: why.
_NO_MEANING = {
    "buffer_size": "readers size their own buffers",
    "force_http": "the endpoint's scheme decides; give s3_endpoint as http://host to use "
    "plain HTTP",
}


_told: set[str] = set()


def _flat(extra: Mapping[str, Any]) -> dict[str, Any]:
    nested = extra.get("tensorizer_config")
    return {**extra, **(nested if isinstance(nested, Mapping) else {})}


def storage_from_extra(extra: Mapping[str, Any]) -> Any:
    """``StorageOptions`` from the extra config's S3 keys and ``stream_kwargs``; None if none.

    ``stream_kwargs`` may hold tensorizer's ``open_stream`` keywords or
    ``StorageOptions`` field names.

    Raises:
        ConfigError: an unknown keyword, or a value that cannot be honoured.
    """
    from tensorstream.sources.base import StorageOptions

    flat = _flat(extra)
    values: dict[str, Any] = {
        key: flat[key]
        for key in ("s3_access_key_id", "s3_secret_access_key", "s3_endpoint")
        if flat.get(key)
    }
    stream = flat.get("stream_kwargs") or {}
    if not isinstance(stream, Mapping):
        raise ConfigError(
            f"model_loader_extra_config['stream_kwargs'] must be a JSON object, got {stream!r}"
        )
    known = {f.name: f for f in dataclasses.fields(StorageOptions)}
    for key, value in stream.items():
        if value is None:
            continue
        if key in _RENAMED:
            values[_RENAMED[key]] = value
        elif key in _NO_MEANING:
            if key not in _told:  # once per process: the config is read more than once
                _told.add(key)
                logger.info("stream_kwargs[%r] accepted, no effect here: %s", key, _NO_MEANING[key])
        elif key == "mode":
            if str(value) not in ("rb", "r"):
                raise ConfigError(
                    f"stream_kwargs['mode']={value!r}: loading reads the file; use 'rb' or drop it"
                )
        elif key in ("begin", "end"):
            if not (key == "begin" and int(value) == 0):
                raise ConfigError(
                    f"stream_kwargs[{key!r}]={value!r}: a model load reads the whole .tensors "
                    "file; drop begin/end"
                )
        elif key == "s3_signature_version":
            text = str(value).strip().lower()
            if text in ("unsigned",):
                values["s3_unsigned"] = True
            elif text not in ("s3v4", "v4"):
                raise ConfigError(
                    f"stream_kwargs['s3_signature_version']={value!r}: requests are signed "
                    "with SigV4 ('s3v4') or not at all ('UNSIGNED')"
                )
        elif key == "certificate_handling":
            values.update(_certificates(value))
        elif key in known:
            values[key] = value
        else:
            valid = sorted({*_RENAMED, *_NO_MEANING, "begin", "end", "mode", *known})
            raise ConfigError(
                f"stream_kwargs key {key!r} is neither a tensorizer open_stream argument nor a "
                f"storage option; valid: {', '.join(valid)}"
            )
    for key, value in list(values.items()):
        kind = known[key].type if key in known else None
        if isinstance(value, str) and kind is not None and "bool" in str(kind):
            values[key] = parse_bool(value, f"stream_kwargs[{key!r}]")
    if not values:
        return None
    return StorageOptions(**values)


def _certificates(value: Any) -> dict[str, Any]:
    """tensorizer's ``CAInfo`` (or a dict with its fields) as ``ca_bundle`` / ``verify_tls``."""
    get = value.get if isinstance(value, Mapping) else lambda k, d=None: getattr(value, k, d)
    out: dict[str, Any] = {}
    if get("allow_untrusted", False) and parse_bool(get("allow_untrusted"), "allow_untrusted"):
        out["verify_tls"] = False
    bundle = get("cafile", None) or get("capath", None)
    if bundle:
        out["ca_bundle"] = os.fspath(bundle)
    return out
