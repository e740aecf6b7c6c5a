"""What ``TensorDeserializer`` settles before it reads any tensor.

Owns opening the input (path, URI, ``Source``, file object or bytes), resolving the
target device, the key checks (a key for an encrypted file, none for a plain one),
loading and verifying the manifest (MAC, then the whole index) and the
``filter_func`` selection. Every function takes its inputs explicitly; the
deserializer keeps what they return.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from tensorstream.deserialize.index import TensorIndex, TensorRecord
from tensorstream.errors import ConfigError, KeyRequiredError, NotEncryptedError
from tensorstream.sources.base import Source, StorageOptions
from tensorstream.sources.fileobj import FileObjectSource
from tensorstream.sources.memory import MemorySource
from tensorstream.sources.registry import open_source

__all__ = [
    "check_encryption",
    "check_manifest",
    "open_input",
    "resolve_device",
    "select_records",
]

log = logging.getLogger("tensorstream")


def open_input(source: Any, storage: StorageOptions | None) -> Source:
    """The ``Source`` behind whatever the caller passed as ``source``."""
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        return open_source(source, storage)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return MemorySource(source)
    if hasattr(source, "readinto") and hasattr(source, "seek"):
        return FileObjectSource(source)
    raise ConfigError(f"cannot read tensors from a {type(source).__name__}; give a path or URI")


def resolve_device(device: str | torch.device | int | None) -> torch.device:
    """``None`` means CUDA when available; a bare ``cuda`` means the current device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_encryption(index: TensorIndex, encryption: Any, where: str) -> Any:
    """The ``RecordDecryptor`` for ``encryption``, or ``None`` for a plain file."""
    if index.encrypted and encryption is None:
        raise KeyRequiredError(
            f"{where} is encrypted; pass encryption=DecryptionParams.from_key(...) "
            "(or --keyfile / --passphrase-env on the command line)"
        )
    if encryption is not None and not index.encrypted:
        raise NotEncryptedError(
            f"a decryption key was given, but {where} is not encrypted; drop the key"
        )
    if encryption is None:
        return None
    from tensorstream.deserialize.decrypt import RecordDecryptor

    return RecordDecryptor(encryption, where)


def check_manifest(
    index: TensorIndex,
    where: str,
    source: Any,
    manifest: Any,
    required: bool,
    storage: Any,
    encryption: Any,
) -> Any:
    """Load and verify the manifest (MAC, then the index) before any tensor is read."""
    if encryption is None and manifest is None and not required:
        return None
    from tensorstream.crypto import manifest as mf

    if manifest is False:
        if required:
            raise ConfigError("require_manifest=True contradicts manifest=False")
        return None
    if encryption is None:
        if required or manifest is not None:
            from tensorstream.errors import ManifestError

            raise ManifestError(
                f"a manifest is authenticated with the decryption key, but {where} is "
                "loaded without one; pass encryption=DecryptionParams..."
            )
        return None
    if isinstance(manifest, (bytes, bytearray, memoryview)):
        data: bytes | None = bytes(manifest)
    elif manifest is not None and manifest is not True:
        data = mf.load_manifest(manifest, storage)
    elif isinstance(source, (str, os.PathLike)):
        data = mf.load_manifest(mf.manifest_uri_for(source), storage, missing_ok=not required)
    elif required or manifest is True:
        raise ConfigError(
            f"cannot find the manifest of {where} (not a path or URI); pass manifest="
        )
    else:
        data = None
    if data is None:
        log.debug("%s has no manifest; tensor names, shapes and order are unauthenticated", where)
        return None
    verified = mf.Manifest.verify(data, encryption, where=where)
    verified.check_index(index)
    log.debug("%s: manifest verified (%d tensors)", where, len(verified.tensors))
    return verified


def select_records(
    index: TensorIndex, filter_func: Callable[[Any], bool] | None, where: str
) -> list[TensorRecord]:
    """The records ``filter_func`` keeps, in file order; refuses an empty selection."""
    records = list(index.records)
    if filter_func is None:
        return records
    chosen = [r for r in records if filter_func(r.key)]
    if records and not chosen:
        raise ConfigError(
            f"filter_func excluded all {len(records)} tensors of {where}; nothing to load"
        )
    return chosen
