"""The tensorize workflow (vLLM's ``tensorize_vllm_model``): serialize a model directory, load it back.

``serialize_model`` builds the model with :class:`~tensorstream.engine.LLM`
(from a local directory, the built-in model, the Hugging Face cache, or an
already serialized directory), and writes, under
``<serialized_directory>/vllm/<model>/<suffix>/``:

* every top-level non-weight file of the model (config, generation config,
  tokenizer files, chat template), first;
* ``adapter_config.json`` + ``adapter_model.tensors`` when a LoRA adapter is given;
* ``model.tensors`` last, so a directory with ``model.tensors`` in it is complete.

With a key file, model and adapter are encrypted (the key file is created with a
random key when it does not exist, else its key is used). ``load_serialized``
is the other half: it turns the deserialize options into an ``LLM`` with every
option honoured. Argument parsing lives in ``tensorstream.cli.tensorize``.
"""

from __future__ import annotations

import inspect
import logging
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorstream.errors import ConfigError, SourceNotFoundError
from tensorstream.sources.base import StorageOptions
from tensorstream.utils.jsonarg import json_object

__all__ = [
    "LoadOptions",
    "SerializeOptions",
    "SerializeResult",
    "check_deserialization_kwargs",
    "check_serialization_kwargs",
    "load_serialized",
    "model_artifacts",
    "output_directory",
    "serialize_model",
    "unique_state",
]

logger = logging.getLogger(__name__)

MODEL_TENSORS = "model.tensors"
# Never copied as "artifacts": weights, caches, docs and VCS files (vLLM's list, plus ours).
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".tensors",
    ".gguf",
    ".h5",
    ".msgpack",
    ".onnx",
    ".ckpt",
    ".cache",
    ".md",
    ".lock",
    ".manifest",
    ".partial",
)
# Indexes of weight shards that are not copied (they would point at files not there).
_SKIPPED_NAMES = {"model.safetensors.index.json", "pytorch_model.bin.index.json", ".gitattributes"}
_TOO_BIG_ARTIFACT = 64 << 20


@dataclass(frozen=True)
class SerializeOptions:
    """What ``tensorize ... serialize`` was asked to do.

    Attributes:
        model: model to serialize (local dir, built-in id/alias, cached Hub id, or a
            serialized directory/URI).
        serialized_directory: root directory or ``s3://`` URI of the output.
        suffix: version component of the output path; random hex when None.
        dtype: dtype of the written weights ("auto": the config's).
        revision: Hub revision for Hub ids.
        trust_remote_code: allow model code from the model directory.
        served_model_name: the name recorded for the model (informational).
        lora_path: a PEFT (or serialized) adapter to write beside the model.
        serialization_kwargs: ``TensorSerializer`` keyword arguments.
        keyfile: where the encryption key is (created with a random key if absent).
        storage: credentials for remote input/output.
        model_loader_extra_config: passed to ``LLM`` when reading the source model.
        progress: draw progress bars.
        overwrite: replace a ``model.tensors`` already at the output path (otherwise
            re-using a ``--suffix`` is refused).
        tensor_parallel_size: >1 writes ``model-rank-%03d.tensors`` (each rank's slices,
            native Llama family) plus ``tensor-parallel.json`` instead of ``model.tensors``.
    """

    model: str
    serialized_directory: str
    suffix: str | None = None
    dtype: str = "auto"
    revision: str | None = None
    trust_remote_code: bool = False
    served_model_name: str | None = None
    lora_path: str | None = None
    serialization_kwargs: Mapping[str, Any] = field(default_factory=dict)
    keyfile: str | None = None
    storage: StorageOptions | None = None
    model_loader_extra_config: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = False
    overwrite: bool = False
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class SerializeResult:
    """What ``serialize_model`` wrote.

    Attributes:
        directory: the output directory (path or URI).
        suffix: the version component used.
        files: names written into ``directory``.
        tensor_bytes: bytes of model tensor data written.
        seconds: time spent writing ``model.tensors``.
        keyfile: where the key is, when encrypted.
        new_key: the key file was created by this call.
    """

    directory: str
    suffix: str
    files: tuple[str, ...]
    tensor_bytes: int
    seconds: float
    keyfile: str | None = None
    new_key: bool = False

    @property
    def gb_per_s(self) -> float:
        return self.tensor_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _accepted(func: Any, blocked: set[str]) -> set[str]:
    params = inspect.signature(func).parameters
    return {name for name, p in params.items() if p.kind == p.KEYWORD_ONLY} - blocked


def _check_kwargs(
    kind: str, kwargs: Mapping[str, Any] | str | None, accepted: set[str], hints: Mapping[str, str]
) -> dict[str, Any]:
    kwargs = json_object(kwargs, f"--{kind}")
    for key in kwargs:
        if key in hints:
            raise ConfigError(f"--{kind} key {key!r} is not accepted here: {hints[key]}")
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ConfigError(
            f"--{kind} keys {unknown} are not understood; accepted keys: {', '.join(sorted(accepted))}"
        )
    return dict(kwargs)


def check_serialization_kwargs(kwargs: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Validate ``--serialization-kwargs`` against ``TensorSerializer``'s keyword arguments.

    Returns:
        The kwargs as a dict.

    Raises:
        ConfigError: not a JSON object, or a key ``TensorSerializer`` does not take (the
            message lists the accepted ones).
    """
    from tensorstream import TensorSerializer

    hints = {
        "encryption": "use --keyfile",
        "storage": "use --s3-access-key-id/--s3-secret-access-key/--s3-endpoint",
    }
    accepted = _accepted(TensorSerializer.__init__, set(hints))
    return _check_kwargs("serialization-kwargs", kwargs, accepted, hints)


def check_deserialization_kwargs(kwargs: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Validate ``--deserialization-kwargs`` against ``TensorDeserializer``'s keyword arguments.

    Raises:
        ConfigError: not a JSON object, or an unknown key (the accepted ones are listed).
    """
    from tensorstream import TensorDeserializer

    hints = {
        "encryption": "use --keyfile",
        "storage": "use --s3-access-key-id/--s3-secret-access-key/--s3-endpoint",
        "dtype": "use --dtype",
        "device": "use --device",
        "filter_func": "a function cannot be given as JSON",
    }
    accepted = _accepted(TensorDeserializer.__init__, set(hints))
    return _check_kwargs("deserialization-kwargs", kwargs, accepted, hints)


def output_directory(root: str, model: str, suffix: str) -> str:
    """``<root>/vllm/<model>/<suffix>``; a local-path model contributes its directory name.

    Raises:
        ConfigError: an empty root, or a model/suffix that would escape the root (``..``).
    """
    from tensorstream.sources.uri import join_uri

    if not root:
        raise ConfigError("--serialized-directory is empty; give a local directory or s3:// URI")
    ref = model.rstrip("/")
    if ref.startswith(("/", ".", "~")) or os.path.isdir(os.path.expanduser(ref)) or "://" in ref:
        ref = ref.rsplit("/", 1)[-1] or "model"
    parts = [p for p in ref.split("/") if p] + [suffix]
    if any(p in (".", "..") for p in parts) or "/" in suffix or not suffix:
        raise ConfigError(f"model {model!r} / suffix {suffix!r} cannot form an output path")
    return join_uri(root.rstrip("/") or "/", "vllm", *parts)


def model_artifacts(files_dir: Path) -> list[Path]:
    """Top-level non-weight files of a model directory, sorted (config, tokenizer, template...).

    Hidden files, subdirectories, weights (``*.safetensors``, ``*.bin``, ``*.tensors``...),
    their indexes, docs (``*.md``) and LoRA adapter files are left out.
    """
    found = []
    for path in sorted(files_dir.iterdir()):
        name = path.name
        if not path.is_file() or name.startswith(".") or name in _SKIPPED_NAMES:
            continue
        if name.endswith(_WEIGHT_SUFFIXES) or name.startswith("adapter_"):
            continue
        if path.stat().st_size > _TOO_BIG_ARTIFACT:
            logger.warning(
                "not copying %s: %d bytes is too big for a config file", path, path.stat().st_size
            )
            continue
        found.append(path)
    return found


def unique_state(model: Any) -> dict[str, Any]:
    """The model's persistent state by name, each tensor once (tied weights under the first name).

    Non-persistent buffers (rotary ``inv_freq``...) are left out: loaders recompute them.
    The result is what ``from_pretrained`` and vLLM's ``load_weights`` expect.
    """
    state: dict[str, Any] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():  # duplicates (tied weights) dropped
        if id(param) not in seen:
            seen.add(id(param))
            state[name] = param.detach()
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            state[f"{module_name}.{name}" if module_name else name] = buffer
    return state


def _encryption_for(keyfile: str, storage: StorageOptions | None) -> tuple[Any, bool]:
    """The key at ``keyfile``, or a new random one written there. Returns (params, created)."""
    from tensorstream.crypto.keyfile import read_keyfile, write_keyfile
    from tensorstream.crypto.params import EncryptionParams

    if _exists(keyfile, storage):
        return EncryptionParams(read_keyfile(keyfile, storage)), False
    params = EncryptionParams.random()
    # The key is stored before any data is encrypted with it, so a crash never leaves
    # ciphertext without its key.
    write_keyfile(keyfile, params.key, storage)
    return params, True


def config_with_dtype(data: bytes, dtype: Any) -> bytes:
    """``config.json`` bytes whose ``torch_dtype`` / ``dtype`` say ``dtype`` (the weights')."""
    import json

    try:
        config = json.loads(data)
    except ValueError:
        return data  # copied as it is; loading reports the broken file
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    if all(config.get(k) == name for k in keys):
        return data
    for key in keys:
        config[key] = name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _exists(uri: str, storage: StorageOptions | None) -> bool:
    """True when ``uri`` names an existing object/file."""
    from tensorstream.sources.registry import open_source

    try:
        with open_source(uri, storage):
            return True
    except SourceNotFoundError:
        return False


def _write_bytes(uri: str, data: bytes, storage: StorageOptions | None) -> None:
    from tensorstream.sources.registry import open_sink

    with open_sink(uri, storage) as sink:
        sink.write(data)


def serialize_model(options: SerializeOptions) -> SerializeResult:
    """Write the model (and adapter) in the tensorize layout; see the module docstring.

    Args:
        options: what to write and where.

    Returns:
        What was written.

    Raises:
        ConfigError: bad kwargs, dtype, or an adapter that does not fit.
        SourceNotFoundError: the model or adapter is not there.
        SourceError: the output cannot be written.
    """
    from tensorstream import TensorSerializer
    from tensorstream.engine.cpu_dtype import keep_checkpoint_dtype
    from tensorstream.engine.llm import LLM
    from tensorstream.engine.lora import (
        AdapterOptions,
        check_adapter_fits,
        read_adapter,
        write_adapter,
    )
    from tensorstream.sources.uri import join_uri

    kwargs = check_serialization_kwargs(options.serialization_kwargs)
    kwargs.setdefault("progress", options.progress)
    suffix = options.suffix or secrets.token_hex(16)
    directory = output_directory(options.serialized_directory, options.model, suffix)
    target = join_uri(directory, MODEL_TENSORS)
    if not options.overwrite and _exists(target, options.storage):
        raise ConfigError(
            f"{target} already exists (suffix {suffix!r}); pass --overwrite to replace it, "
            "or choose another --suffix"
        )
    adapter = None
    if options.lora_path:
        # Read (and check) the adapter before anything is written.
        adapter = read_adapter(options.lora_path, AdapterOptions(storage=options.storage))
    # A file is written once and served on any CPU: "auto" is the checkpoint's dtype here,
    # never the float32 this CPU would compute in (engine/cpu_dtype.py).
    with keep_checkpoint_dtype():
        llm = LLM(
            options.model,
            dtype=options.dtype,
            revision=options.revision,
            trust_remote_code=options.trust_remote_code,
            model_loader_extra_config=dict(options.model_loader_extra_config) or None,
            device="cpu",
        )
    if adapter is not None:
        # Refuse an adapter made for another model before anything is written.
        check_adapter_fits(llm.config, adapter, options.lora_path)
    encryption, new_key = None, False
    if options.keyfile:
        encryption, new_key = _encryption_for(options.keyfile, options.storage)
    files = []
    for path in model_artifacts(llm.location.files_dir):
        data = path.read_bytes()
        if path.name == "config.json":
            data = config_with_dtype(data, llm.dtype)
        _write_bytes(join_uri(directory, path.name), data, options.storage)
        files.append(path.name)
    if "config.json" not in files:
        raise SourceNotFoundError(f"{llm.location.files_dir} has no config.json to copy")
    if adapter is not None:
        write_adapter(
            adapter,
            directory,
            encryption=encryption,
            storage=options.storage,
            serialization_kwargs={k: v for k, v in kwargs.items() if k != "progress"},
        )
        files += ["adapter_config.json", "adapter_model.tensors"]
    started = time.perf_counter()
    if options.tensor_parallel_size != 1:  # rank files (engine/parallel, docs/parallel.md)
        from tensorstream.engine.parallel.files import write_rank_files

        names, nbytes = write_rank_files(
            llm, directory, options.tensor_parallel_size, encryption, options.storage, kwargs
        )
        seconds = time.perf_counter() - started
        return SerializeResult(
            directory, suffix, (*files, *names), nbytes, seconds, options.keyfile, new_key
        )
    with TensorSerializer(
        target, encryption=encryption, storage=options.storage, **kwargs
    ) as serializer:
        serializer.write_state_dict(unique_state(llm.model))
    seconds = time.perf_counter() - started
    files.append(MODEL_TENSORS)
    return SerializeResult(
        directory,
        suffix,
        tuple(files),
        serializer.total_tensor_bytes,
        seconds,
        options.keyfile,
        new_key,
    )


@dataclass(frozen=True)
class LoadOptions:
    """What ``tensorize ... deserialize`` was asked to do.

    Attributes:
        path_to_tensors: URI of the ``.tensors`` file (config files beside it, or from ``model``).
        serialized_directory: directory holding ``model.tensors`` and the config files.
        model: where config/tokenizer come from when the tensors' directory has none.
        keyfile: decryption key file.
        deserialization_kwargs: ``TensorDeserializer`` keyword arguments.
        num_readers: parallel readers.
        verify_hash: check every tensor's hash.
        storage: credentials for remote sources.
        dtype, revision, trust_remote_code, device, max_model_len: engine options.
        model_loader_extra_config: base extra config; the options above override it.
        lora: load the adapter serialized beside the model.
    """

    path_to_tensors: str | None = None
    serialized_directory: str | None = None
    model: str | None = None
    keyfile: str | None = None
    deserialization_kwargs: Mapping[str, Any] = field(default_factory=dict)
    num_readers: int | None = None
    verify_hash: bool = False
    storage: StorageOptions | None = None
    dtype: str = "auto"
    revision: str | None = None
    trust_remote_code: bool = False
    device: str | None = None
    max_model_len: int | None = None
    model_loader_extra_config: Mapping[str, Any] = field(default_factory=dict)
    lora: bool = False


def _parent(uri: str) -> str:
    if "://" in uri and not uri.startswith("file://"):
        return uri.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(uri.removeprefix("file://")))


def load_serialized(options: LoadOptions) -> Any:
    """Build the ``LLM`` for a serialized model, honouring every option.

    Returns:
        The ``LLM`` (``enable_lora`` set when ``options.lora``).

    Raises:
        ConfigError: both or neither of path/directory, bad kwargs.
        SourceNotFoundError: the tensors or the config are not there.
    """
    from tensorstream.engine.llm import LLM
    from tensorstream.sources.uri import join_uri

    extra = dict(options.model_loader_extra_config)
    uri = options.path_to_tensors or extra.pop("tensorizer_uri", None)
    directory = options.serialized_directory or extra.pop("tensorizer_dir", None)
    if uri and directory:
        raise ConfigError(
            "give either --path-to-tensors (a .tensors URI) or --serialized-directory, not both"
        )
    if not uri and not directory:
        raise ConfigError(
            "deserialize needs --path-to-tensors URI or --serialized-directory DIR "
            "(or tensorizer_uri / tensorizer_dir in --model-loader-extra-config)"
        )
    directory = directory or _parent(str(uri))
    if uri:
        extra["tensorizer_uri"] = uri
    deser = {**extra.pop("deserialization_kwargs", {})}
    deser.update(check_deserialization_kwargs(options.deserialization_kwargs))
    if deser:
        extra["deserialization_kwargs"] = deser
    if options.num_readers is not None:
        extra["num_readers"] = options.num_readers
    if options.verify_hash:
        extra["verify_hash"] = True
    storage = options.storage
    if storage is not None:
        for key in ("s3_access_key_id", "s3_secret_access_key", "s3_endpoint"):
            if getattr(storage, key):
                extra[key] = getattr(storage, key)
    if options.keyfile:
        from tensorstream.crypto.keyfile import read_keyfile
        from tensorstream.crypto.params import DecryptionParams

        # Read here, with the storage options: the loader's keyfile path would read an
        # s3:// key file with environment credentials only.
        key = read_keyfile(options.keyfile, storage)
        extra.pop("encryption_keyfile", None)
        extra.setdefault("deserialization_kwargs", {})["encryption"] = DecryptionParams.from_key(
            key
        )
    model = directory
    if not _exists(join_uri(directory, "config.json"), storage):
        if not options.model:
            raise SourceNotFoundError(
                f"no config.json in {directory}; serialize with `tensorstream tensorize` (it "
                "copies the config), or pass --model with the original model for its config"
            )
        model = options.model
        extra.setdefault("tensorizer_uri", join_uri(directory, MODEL_TENSORS))
    return LLM(
        model,
        load_format="tensorizer",
        dtype=options.dtype,
        revision=options.revision,
        trust_remote_code=options.trust_remote_code,
        device=options.device,
        max_model_len=options.max_model_len,
        model_loader_extra_config=extra,
        enable_lora=options.lora,
        max_lora_rank=512,
    )


def adapter_directory(options: LoadOptions) -> str:
    """Where the adapter serialized beside the model is (the tensors' directory)."""
    return options.serialized_directory or _parent(str(options.path_to_tensors))
