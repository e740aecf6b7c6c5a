"""Options of the vLLM ``tensorstream`` load format, and which file a vLLM worker reads.

Owns the parsing of ``--model-loader-extra-config`` for ``--load-format
tensorstream`` (vLLM's tensorizer keys, flat or nested under
``tensorizer_config``; ``"True"``/``"False"`` and number strings are accepted
wherever a bool or a number is expected, as vLLM's CLI passes them) and the
choice of the weights file for one tensor-parallel rank. Nothing here imports
vLLM, so this module is usable (and testable) without it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorstream.errors import ConfigError, SourceNotFoundError

__all__ = [
    "RANK_FIELD",
    "RANK_TEMPLATE",
    "VllmLoadOptions",
    "checked_deserializer_kwargs",
    "coerce_scalars",
    "first_existing",
    "weights_candidates",
]

#: vLLM's rank-file template, rendered with the tensor-parallel rank.
RANK_TEMPLATE = "model-rank-%03d.tensors"
#: A rank field in a ``tensorizer_uri`` (``%03d``).
RANK_FIELD = re.compile(r"%0\dd")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _as_bool(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(
        f"{what} must be true or false (or the strings 'True'/'False'), got {value!r}"
    )


def _as_number(value: Any, kind: type, what: str) -> Any:
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return kind(value)
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{what} must be a number, got {value!r}")


def coerce_scalars(values: Mapping[str, Any], types: Mapping[str, Any], where: str) -> dict:
    """Convert string values to the bool/int/float that ``types`` (name -> default) expects.

    Raises:
        ConfigError: a value that cannot be converted, naming ``where`` and the key.
    """
    out = dict(values)
    for key, value in values.items():
        default = types.get(key, None)
        if value is None or default is None:
            continue
        what = f"{where}[{key!r}]"
        if isinstance(default, bool):
            out[key] = _as_bool(value, what)
        elif isinstance(default, (int, float)):
            out[key] = _as_number(value, type(default), what)
    return out


def _storage_defaults() -> dict[str, Any]:
    from tensorstream.sources.base import StorageOptions

    defaults = StorageOptions()
    return {f.name: getattr(defaults, f.name) for f in dataclasses.fields(StorageOptions)}


@dataclass(frozen=True)
class VllmLoadOptions:
    """``--model-loader-extra-config`` of ``--load-format tensorstream``, parsed.

    Attributes:
        tensorizer_uri: the weights file (``.tensors``, ``.safetensors`` or a
            ``*.safetensors.index.json``); may hold ``%03d`` for the tensor-parallel rank.
        tensorizer_dir: directory holding the weights (default: vLLM's model directory).
        num_readers: parallel readers (None: the source's preference).
        verify_hash: check every tensor's hash while loading.
        encryption_keyfile: key file (path or URI) of an encrypted file.
        storage: ``StorageOptions`` from the ``s3_*`` keys and ``stream_kwargs``.
        deserialization_kwargs: extra ``TensorDeserializer`` keyword arguments.
        batch_bytes: a remote load is read in batches of about this size while the
            previous batch goes into the model (bounds the extra host memory); None:
            1/16 of the file, 32-128 MiB (``vllm_stream.batch_bytes_for``).
    """

    tensorizer_uri: str | None = None
    tensorizer_dir: str | None = None
    num_readers: int | None = None
    verify_hash: bool = False
    encryption_keyfile: str | None = None
    storage: Any = None
    deserialization_kwargs: Mapping[str, Any] = field(default_factory=dict)
    batch_bytes: int | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> VllmLoadOptions:
        """Parse vLLM's ``model_loader_extra_config`` (a dict; vLLM has decoded the JSON).

        Raises:
            ConfigError: unknown keys, or values of the wrong type.
        """
        from tensorstream.engine.loaders.tensorizer import TensorizerLoadOptions

        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(
                f"--model-loader-extra-config must be a JSON object for --load-format "
                f"tensorstream, got {extra!r}"
            )
        flat = dict(extra)
        nested = flat.pop("tensorizer_config", None)
        if isinstance(nested, Mapping):
            flat.update(nested)
        elif nested is not None:
            raise ConfigError("model_loader_extra_config['tensorizer_config'] must be an object")
        flat = coerce_scalars(
            flat, {"verify_hash": False, "num_readers": 0}, "model_loader_extra_config"
        )
        parsed = TensorizerLoadOptions.from_extra(flat)
        storage_defaults = _storage_defaults()
        stream = coerce_scalars(
            dict(parsed.stream_kwargs),
            storage_defaults,
            "model_loader_extra_config['stream_kwargs']",
        )
        storage_values = {
            "s3_access_key_id": parsed.s3_access_key_id,
            "s3_secret_access_key": parsed.s3_secret_access_key,
            "s3_endpoint": parsed.s3_endpoint,
            **stream,
        }
        storage_values = {k: v for k, v in storage_values.items() if v is not None}
        unknown = sorted(set(storage_values) - set(storage_defaults))
        if unknown:
            raise ConfigError(
                f"model_loader_extra_config['stream_kwargs'] keys {unknown} are not storage "
                f"options; valid: {', '.join(sorted(storage_defaults))}"
            )
        storage = None
        if storage_values:
            from tensorstream.sources.base import StorageOptions

            storage = StorageOptions(**storage_values)
        deser = coerce_scalars(
            dict(parsed.deserialization_kwargs),
            {
                "verify_hash": False,
                "lazy_load": False,
                "use_mmap": True,
                "num_readers": 0,
                "require_manifest": False,
            },
            "model_loader_extra_config['deserialization_kwargs']",
        )
        for reserved in ("device", "dtype", "encryption", "storage", "into"):
            if reserved in deser:
                raise ConfigError(
                    f"model_loader_extra_config['deserialization_kwargs'][{reserved!r}] is set "
                    "by vLLM, by the loader or by the other keys (encryption_keyfile, s3_*); drop it"
                )
        deser = checked_deserializer_kwargs(deser)
        return cls(
            tensorizer_uri=parsed.tensorizer_uri,
            tensorizer_dir=parsed.tensorizer_dir,
            num_readers=parsed.num_readers,
            verify_hash=parsed.verify_hash,
            encryption_keyfile=parsed.encryption_keyfile,
            storage=storage,
            deserialization_kwargs=deser,
        )


#: tensorizer's ``TensorDeserializer`` options that have no meaning here (accepted, dropped).
_TENSORIZER_ONLY = ("plaid_mode", "plaid_mode_buffers")


def checked_deserializer_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``deserialization_kwargs`` checked against ``TensorDeserializer``'s public signature.

    Raises:
        ConfigError: a key that is not one of its keyword arguments.
    """
    import inspect

    from tensorstream import TensorDeserializer

    accepted = {
        name
        for name, p in inspect.signature(TensorDeserializer.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    out = {k: v for k, v in kwargs.items() if k not in _TENSORIZER_ONLY}
    unknown = sorted(set(out) - accepted)
    if unknown:
        raise ConfigError(
            f"model_loader_extra_config['deserialization_kwargs'] keys {unknown} are not "
            f"TensorDeserializer options; accepted: {', '.join(sorted(accepted))}"
        )
    return out


def weights_candidates(
    options: VllmLoadOptions, model_dir: str, rank: int, world_size: int
) -> list[str]:
    """The files to try, in order, for tensor-parallel ``rank`` of ``world_size``.

    An explicit ``tensorizer_uri`` is the only candidate (its ``%0Nd`` rendered with
    the rank). Otherwise, in the weights directory: this rank's file
    ``model-rank-NNN.tensors`` (only when ``world_size > 1``), ``model.tensors``,
    ``model.safetensors.index.json``, ``model.safetensors``. An unsharded file
    (Hugging Face names) also serves several ranks: each rank reads all of it and
    the model's ``load_weights`` keeps that rank's slices.
    """
    from tensorstream.sources.uri import join_uri

    uri = options.tensorizer_uri
    if uri:
        return [uri % rank if RANK_FIELD.search(uri) else uri]
    base = options.tensorizer_dir or model_dir
    names = ["model.tensors", "model.safetensors.index.json", "model.safetensors"]
    if world_size > 1:
        names.insert(0, RANK_TEMPLATE % rank)
    return [join_uri(base, name) for name in names]


def first_existing(candidates: list[str], storage: Any) -> str:
    """The first candidate that exists.

    Raises:
        SourceNotFoundError: none does; the message lists every candidate.
        SourceError: the storage refused a request (credentials, network).
    """
    from tensorstream.sources.registry import open_source

    for uri in candidates:
        try:
            with open_source(uri, storage):
                return uri
        except SourceNotFoundError:
            continue
    tried = ", ".join(candidates)
    raise SourceNotFoundError(
        f"--load-format tensorstream found no weights; tried: {tried}. Serialize the model "
        "there (`tensorstream tensorize`), or point model_loader_extra_config's "
        "'tensorizer_uri' / 'tensorizer_dir' at the weights"
    )
