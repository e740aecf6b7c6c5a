"""The ``tensorizer`` load format: ``model.tensors`` read by ``tensorstream.TensorDeserializer``.

``model_loader_extra_config`` follows vLLM's tensorizer keys, flat or nested
under ``"tensorizer_config"``: ``tensorizer_uri`` (file to read; may hold a
``%0Nd`` rank templates are refused: no sharding yet), ``tensorizer_dir`` (directory
holding ``model.tensors``), ``num_readers``, ``verify_hash``,
``encryption_keyfile``, ``deserialization_kwargs`` (passed to the
deserializer), and the S3 options ``s3_access_key_id``,
``s3_secret_access_key``, ``s3_endpoint`` and ``stream_kwargs``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorstream.engine.loaders.base import (
    LoadedWeights,
    LoadRequest,
    WeightLoader,
    check_extra_keys,
)
from tensorstream.errors import ConfigError

__all__ = ["TensorizerLoadOptions", "TensorizerLoader"]

_RANK_TEMPLATE = re.compile(r"%0\dd")


@dataclass(frozen=True)
class TensorizerLoadOptions:
    """Parsed tensorizer keys of ``model_loader_extra_config``."""

    tensorizer_uri: str | None = None
    tensorizer_dir: str | None = None
    num_readers: int | None = None
    verify_hash: bool = False
    encryption_keyfile: str | None = None
    deserialization_kwargs: Mapping[str, Any] = field(default_factory=dict)
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_endpoint: str | None = None
    stream_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> TensorizerLoadOptions:
        """Parse ``model_loader_extra_config`` (flat, or vLLM's nested ``tensorizer_config``).

        Raises:
            ConfigError: unknown keys or wrongly typed values.
        """
        flat = dict(extra)
        nested = flat.pop("tensorizer_config", None)
        if nested is not None:
            if not isinstance(nested, Mapping):
                raise ConfigError(
                    "model_loader_extra_config['tensorizer_config'] must be a JSON object"
                )
            flat = {**flat, **nested}
        flat.pop("vllm_tensorized", None)  # vLLM's deprecated flag; detection is not needed here
        check_extra_keys("tensorizer", flat, frozenset(cls.__dataclass_fields__))
        for key in ("deserialization_kwargs", "stream_kwargs"):
            if flat.get(key) is None:
                flat.pop(key, None)
            elif not isinstance(flat[key], Mapping):
                raise ConfigError(
                    f"model_loader_extra_config[{key!r}] must be a JSON object, got {flat[key]!r}"
                )
        if flat.get("num_readers") is not None and (
            not isinstance(flat["num_readers"], int) or flat["num_readers"] < 1
        ):
            raise ConfigError(
                f"num_readers must be a positive integer or null, got {flat['num_readers']!r}"
            )
        if "verify_hash" in flat:
            flat["verify_hash"] = bool(flat["verify_hash"])
        return cls(**flat)

    def uri_for(self, weights_dir: str) -> str:
        """The ``.tensors`` URI to read: explicit URI, else ``<dir>/model.tensors``."""
        from tensorstream.sources.uri import join_uri

        if self.tensorizer_uri:
            if _RANK_TEMPLATE.search(self.tensorizer_uri):
                raise ConfigError(
                    f"tensorizer_uri {self.tensorizer_uri!r} names tensor-parallel shards "
                    "(one file per rank); sharded loading is not supported yet. Serialize "
                    "with tensor_parallel_size=1 and give that model.tensors"
                )
            return self.tensorizer_uri
        return join_uri(self.tensorizer_dir or weights_dir, "model.tensors")


class TensorizerLoader(WeightLoader):
    """Reads a tensorizer ``.tensors`` file from a local path or URI."""

    name = "tensorizer"
    extra_keys = frozenset(TensorizerLoadOptions.__dataclass_fields__) | {
        "tensorizer_config",
        "vllm_tensorized",
    }

    def load(self, request: LoadRequest) -> LoadedWeights:
        """Deserialize every tensor onto ``request.device`` in ``request.dtype``.

        Raises:
            ConfigError: bad options, or the deserializer is unavailable.
            SourceNotFoundError: the ``.tensors`` file is not there.
        """
        options = TensorizerLoadOptions.from_extra(request.extra)
        uri = options.uri_for(request.location.weights_uri)
        try:
            from tensorstream import TensorDeserializer
        except ImportError as exc:
            raise ConfigError(
                f"load_format='tensorizer' needs tensorstream's deserializer ({exc})"
            ) from exc
        kwargs: dict[str, Any] = {
            "device": request.device,
            "dtype": request.dtype,
            "num_readers": options.num_readers,
            "verify_hash": options.verify_hash,
        }
        storage = _storage_options(options)
        if storage is not None:
            kwargs["storage"] = storage
        if options.encryption_keyfile:
            from tensorstream.crypto.keyfile import read_keyfile
            from tensorstream.crypto.params import DecryptionParams

            # the key file may sit in the same bucket, behind the same credentials
            key = read_keyfile(options.encryption_keyfile, storage)
            kwargs["encryption"] = DecryptionParams.from_key(key)
        kwargs.update(_checked_kwargs(options.deserialization_kwargs))
        deserializer = TensorDeserializer(uri, **kwargs)
        try:
            tensors = dict(deserializer.items())
        except BaseException:
            deserializer.close()
            raise
        nbytes = getattr(deserializer, "total_bytes_read", 0) or sum(
            t.nbytes for t in tensors.values()
        )
        return LoadedWeights(tensors, uri=uri, nbytes=nbytes, closer=deserializer)


def _storage_options(options: TensorizerLoadOptions) -> Any:
    """``StorageOptions`` from the S3 keys and ``stream_kwargs``; None when none were given.

    Raises:
        ConfigError: a ``stream_kwargs`` key that ``StorageOptions`` does not have.
    """
    from dataclasses import fields

    from tensorstream.sources.base import StorageOptions

    values = {
        "s3_access_key_id": options.s3_access_key_id,
        "s3_secret_access_key": options.s3_secret_access_key,
        "s3_endpoint": options.s3_endpoint,
        **options.stream_kwargs,
    }
    values = {key: value for key, value in values.items() if value is not None}
    if not values:
        return None
    known = {f.name for f in fields(StorageOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(
            f"stream_kwargs keys {unknown} are not storage options; valid: {', '.join(sorted(known))}"
        )
    return StorageOptions(**values)


def _checked_kwargs(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``deserialization_kwargs`` must name ``TensorDeserializer`` keyword arguments."""
    import inspect

    from tensorstream import TensorDeserializer

    accepted = {
        name
        for name, p in inspect.signature(TensorDeserializer.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY or name == "device"
    }
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise ConfigError(
            f"unknown deserialization_kwargs key(s) {unknown}; accepted: {sorted(accepted)}"
        )
    return dict(extra)
