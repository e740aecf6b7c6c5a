"""The ``tensorizer`` load format: ``model.tensors`` read by ``tensorstream.TensorDeserializer``.

``model_loader_extra_config`` follows vLLM's tensorizer keys, flat or nested
under ``"tensorizer_config"``: ``tensorizer_uri`` (file to read; may hold a
``%0Nd`` rank templates are refused: no sharding yet), ``tensorizer_dir`` (directory
holding ``model.tensors``), ``num_readers``, ``verify_hash``,
``encryption_keyfile``, ``deserialization_kwargs`` (passed to the
deserializer), and the S3 options ``s3_access_key_id``,
``s3_secret_access_key``, ``s3_endpoint`` and ``stream_kwargs`` (tensorizer's
``open_stream`` keywords, mapped in ``tensorizer_config.storage_from_extra``).
``lora_dir`` (the adapter beside the model) is used by ``LLM``'s LoRA support and
``serialization_kwargs`` only by serialization; both are accepted here. Booleans and
counts may be strings, as vLLM's guide writes them (``"True"``, ``"8"``).
"""

from __future__ import annotations

import logging
import os
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
from tensorstream.engine.loaders.tensorizer_config import storage_from_extra
from tensorstream.engine.vllm_args import parse_bool
from tensorstream.errors import ConfigError, KeyRequiredError

__all__ = ["TensorizerLoadOptions", "TensorizerLoader", "start_prefetch"]

logger = logging.getLogger(__name__)

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
        flat.pop("lora_dir", None)  # the adapter beside the model: LLM's LoRA manager reads it
        flat.pop("serialization_kwargs", None)  # only used when serializing
        check_extra_keys("tensorizer", flat, frozenset(cls.__dataclass_fields__))
        for key in ("deserialization_kwargs", "stream_kwargs"):
            if flat.get(key) is None:
                flat.pop(key, None)
            elif not isinstance(flat[key], Mapping):
                raise ConfigError(
                    f"model_loader_extra_config[{key!r}] must be a JSON object, got {flat[key]!r}"
                )
        if flat.get("num_readers") is not None:
            flat["num_readers"] = _readers(flat["num_readers"], "num_readers")
        if flat.get("verify_hash") is not None:
            flat["verify_hash"] = parse_bool(flat["verify_hash"], "verify_hash")
        else:
            flat.pop("verify_hash", None)
        return cls(**flat)

    def uri_for(self, weights_dir: str) -> str:
        """The ``.tensors`` URI to read: explicit URI, else ``<dir>/model.tensors``."""
        from tensorstream.sources.uri import join_uri

        if self.tensorizer_uri:
            if _RANK_TEMPLATE.search(self.tensorizer_uri):
                raise ConfigError(
                    f"tensorizer_uri {self.tensorizer_uri!r} names tensor-parallel shards "
                    "(one file per rank), which one process does not load: pass "
                    "tensor_parallel_size=N (serve -tp N) to run the ranks, or give an "
                    "unsharded model.tensors"
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
        storage = storage_from_extra(request.extra)
        if storage is not None:
            kwargs["storage"] = storage
        if options.encryption_keyfile:
            from tensorstream.crypto.keyfile import read_keyfile
            from tensorstream.crypto.params import DecryptionParams

            # the key file may sit in the same bucket, behind the same credentials
            key = read_keyfile(options.encryption_keyfile, storage)
            kwargs["encryption"] = DecryptionParams.from_key(key)
        kwargs.update(_checked_kwargs(options.deserialization_kwargs))
        prefetch = request.prefetch
        fetched = prefetch.take() if prefetch is not None and prefetch.uri == uri else None
        try:
            deserializer = TensorDeserializer(fetched or uri, **kwargs)
        except KeyRequiredError as exc:
            _close(fetched)
            # The entry point (LLM or serve) adds how to give the key its own way.
            raise KeyRequiredError(f"{uri} is encrypted and no key was given") from exc
        except BaseException:
            _close(fetched)
            raise
        closer = _Closers(deserializer, fetched)
        try:
            tensors = dict(deserializer.items())
        except BaseException:
            closer.close()
            raise
        nbytes = sum(t.nbytes for t in tensors.values())
        if fetched is not None:
            # Views of the fetched copy in memory: every byte was read from storage (by the
            # fetch), none is left in a page cache for first use.
            return LoadedWeights(
                tensors, uri=uri, nbytes=nbytes, closer=closer, fetch_seconds=prefetch.fetch_seconds
            )
        mapped = _mapped_bytes(deserializer, tensors)
        if mapped:
            from tensorstream.engine.prefetch import populate

            populate(*_map_region(deserializer))
        return LoadedWeights(tensors, uri=uri, nbytes=nbytes, closer=closer, mapped_bytes=mapped)


#: ``deserialization_kwargs`` that read the file the same way whatever holds its bytes.
_PREFETCH_SAFE = frozenset(
    {"verify_hash", "num_readers", "encryption", "dtype", "plaid_mode", "plaid_mode_buffers"}
)


def start_prefetch(request_extra: Mapping[str, Any], weights_uri: str, device: Any) -> Any:
    """Start fetching the ``.tensors`` file a plain CPU load will read; None when not.

    Needs neither torch nor the deserializer, so ``LLM`` calls it before importing them.
    Options that read the file differently (manifests, lazy loads, filters, shards) and
    device loads (which stream through small staging buffers, not a whole host copy)
    load as before, as does everything with ``TENSORSTREAM_PREFETCH=0`` (for comparisons,
    or where CPU is too scarce for the fetch to run beside the import). Bad options are
    left for :meth:`TensorizerLoader.load` to report.
    """
    if not _host_target(device) or os.environ.get("TENSORSTREAM_PREFETCH", "1") == "0":
        return None
    try:
        options = TensorizerLoadOptions.from_extra(request_extra)
        uri = options.uri_for(weights_uri)
        storage = storage_from_extra(request_extra)
    except Exception:  # noqa: BLE001 - the loader raises the real error later
        return None
    if not set(options.deserialization_kwargs) <= _PREFETCH_SAFE:
        return None
    from tensorstream.engine.prefetch import Prefetch

    return Prefetch(uri, storage, options.num_readers)


def _host_target(device: Any) -> bool:
    """Whether the tensors will live in host memory, decided without importing torch."""
    if device is None:  # CUDA when there is one
        return not os.path.exists("/dev/nvidiactl")
    return str(getattr(device, "type", device)).split(":")[0] == "cpu"


class _Closers:
    """Closes the deserializer, then the prefetched source under it."""

    def __init__(self, deserializer: Any, source: Any) -> None:
        self._items = (deserializer, source)

    def close(self) -> None:
        for item in self._items:
            _close(item)


def _close(item: Any) -> None:
    if item is not None:
        item.close()


def _checked_kwargs(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``deserialization_kwargs`` must name ``TensorDeserializer`` keyword arguments."""
    import inspect

    from tensorstream import TensorDeserializer

    accepted = {
        name
        for name, p in inspect.signature(TensorDeserializer.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY or name == "device"
    }
    out = dict(extra)
    for key in sorted(set(_TENSORIZER_ONLY) & set(out)):
        logger.info(
            "deserialization_kwargs[%r] accepted, no effect here: %s", key, _TENSORIZER_ONLY[key]
        )
        del out[key]
    unknown = sorted(set(out) - accepted)
    if unknown:
        raise ConfigError(
            f"unknown deserialization_kwargs key(s) {unknown}; accepted: {sorted(accepted)}"
        )
    if out.get("verify_hash") is not None:
        out["verify_hash"] = parse_bool(out["verify_hash"], "deserialization_kwargs['verify_hash']")
    if out.get("num_readers") is not None:
        out["num_readers"] = _readers(out["num_readers"], "deserialization_kwargs['num_readers']")
    for key in ("lazy_load", "use_mmap", "require_manifest"):
        if isinstance(out.get(key), str):
            out[key] = parse_bool(out[key], f"deserialization_kwargs[{key!r}]")
    return out


# tensorizer TensorDeserializer keywords that tensorstream's deserializer does not need.
_TENSORIZER_ONLY = {
    "plaid_mode": "readers always stream into the destination memory",
    "plaid_mode_buffers": "readers size their own buffers",
}


def _readers(value: Any, what: str) -> int:
    """A positive reader count from an int or a numeric string (``"8"``)."""
    try:
        count = int(value) if not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        count = 0
    if count < 1 or (isinstance(value, float) and value != count):
        raise ConfigError(f"{what} must be a positive integer or null, got {value!r}")
    return count


def _map_region(deserializer: Any) -> tuple[int, int]:
    """Address and length of the deserializer's file mapping; (0, 0) when it has none."""
    import ctypes

    region = getattr(getattr(deserializer, "_file_map", None), "_map", None)
    if region is None:
        return 0, 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(region)), len(region)
    except (TypeError, ValueError):
        return 0, 0


def _mapped_bytes(deserializer: Any, tensors: Mapping[str, Any]) -> int:
    """Bytes of ``tensors`` that are views of the deserializer's file mapping.

    Local CPU loads map the ``.tensors`` file and hand out views of the page cache;
    nothing is read until the model touches them. Tensors that were converted,
    decrypted or copied live elsewhere and count as read.
    """
    start, length = _map_region(deserializer)
    if not length:
        return 0
    end = start + length
    return sum(
        t.nbytes for t in tensors.values() if t.device.type == "cpu" and start <= t.data_ptr() < end
    )
