"""tensorizer's ``serialization`` module: its classes and arguments over tensorstream's.

``TensorSerializer`` and ``TensorDeserializer`` here are tensorstream's classes
with tensorizer 2.12.1's constructor signatures (positional order, keyword names)
and the few methods tensorizer has beyond ours (``verify_module``,
``read_numpy_arrays``, ``cache_status``...). Loading and writing are done by
tensorstream; nothing here reads or writes tensor bytes itself.

Differences a tensorizer user may meet:

* ``compress_tensors=True`` raises ``NotImplementedError`` (tensorizer ignores it).
* ``to_redis`` and ``redis://`` sources raise ``NotImplementedError``.
* ``plaid_mode`` / ``plaid_mode_buffers`` are accepted and ignored, as in tensorizer.
* Writing with encryption to a path also writes tensorstream's authenticated
  manifest beside the file (``<file>.manifest``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum, IntFlag
from typing import Any, NamedTuple

import torch

from tensorstream import StorageOptions
from tensorstream import TensorDeserializer as _Deserializer
from tensorstream import TensorSerializer as _Serializer
from tensorstream.compat.tensorizer import stream_io
from tensorstream.crypto.params import DecryptionParams as _DecryptionParams
from tensorstream.crypto.params import EncryptionParams as _EncryptionParams
from tensorstream.errors import CryptoError as CryptographyError
from tensorstream.errors import HashMismatchError

__all__ = [
    "CryptographyError",
    "DecryptionParams",
    "EncryptionParams",
    "FilterFuncType",
    "HashMismatchError",
    "HashType",
    "TensorDeserializer",
    "TensorHash",
    "TensorSerializer",
    "TensorType",
]

logger = logging.getLogger(__name__)

FilterFuncType = Callable[[str | Sequence[str | int]], bool]

# tensorizer's data versions (the format is the same; these name its milestones).
TENSORIZER_VERSION = 5
LONG_TENSOR_TENSORIZER_VERSION = 5
META_TENSOR_TENSORIZER_VERSION = 4
ENCRYPTION_TENSORIZER_VERSION = 3
OPAQUE_TENSORIZER_VERSION = 2
NON_OPAQUE_TENSORIZER_VERSION = 1
TENSORIZER_MAGIC = b"|TZR|"


class TensorType(IntEnum):
    """What a stored tensor was: a module parameter, a buffer, or a state-dict entry."""

    PARAM = 0
    BUFFER = 1
    STATE_DICT = 2


class HashType(IntEnum):
    """Hash algorithms a tensor header can carry."""

    CRC32 = 0
    SHA256 = 1


@dataclasses.dataclass(order=True)
class TensorHash:
    """One stored hash of a tensor: its algorithm and digest."""

    type: HashType
    hash: bytes


class _FileFeatureFlags(IntFlag):
    encrypted = 1
    versioned_headers = 2


class _FileHeader(NamedTuple):
    version_number: int
    tensor_size: int
    tensor_count: int


class EncryptionParams(_EncryptionParams):
    """tensorstream's ``EncryptionParams`` with tensorizer's ``from_string(source=...)``."""

    __slots__ = ()

    @classmethod
    def from_string(  # type: ignore[override]
        cls,
        source: str | bytes,
        opslimit: int | None = None,
        memlimit: int | None = None,
        salt: str | bytes | None = None,
        *,
        encoding: str = "utf-8",
    ) -> EncryptionParams:
        """Derive the key from the passphrase ``source`` with Argon2id (as tensorizer).

        Raises:
            ConfigError: empty passphrase, a salt that is not 16 bytes, swapped limits.
        """
        if isinstance(salt, str):
            salt = salt.encode(encoding)
        params = super().from_string(source, opslimit, memlimit, salt, encoding=encoding)
        return params  # type: ignore[return-value]


class DecryptionParams(_DecryptionParams):
    """tensorstream's ``DecryptionParams`` with tensorizer's ``from_string(source=...)``."""

    __slots__ = ()

    @classmethod
    def from_string(  # type: ignore[override]
        cls, source: str | bytes, *, encoding: str = "utf-8"
    ) -> DecryptionParams:
        """Decrypt with the passphrase ``source``; the salt and limits come from the file."""
        return super().from_string(source, encoding=encoding)  # type: ignore[return-value]


def _redis_check(target: Any) -> None:
    if isinstance(target, (str, bytes)) and os.fsdecode(target).lower().startswith("redis://"):
        raise NotImplementedError(stream_io._REDIS)


def _reader_target(file_obj: Any) -> tuple[Any, StorageOptions | None, Any]:
    """What to hand tensorstream's loader, its storage options, and a stream to close."""
    _redis_check(file_obj)
    if isinstance(file_obj, int):
        stream = open(file_obj, "rb")
        return stream, None, stream
    if isinstance(file_obj, (str, bytes, os.PathLike)):
        uri = os.fsdecode(file_obj)
        if isinstance(file_obj, os.PathLike) or "://" not in uri:
            return uri, None, None
        return uri, stream_io.storage_options(uri, "rb"), None
    source = getattr(file_obj, "tensorstream_source", None)
    return (source if source is not None else file_obj), None, file_obj


class TensorDeserializer(_Deserializer):
    """Load a ``.tensors`` file; tensorizer 2.12.1's constructor over tensorstream's loader.

    Args:
        file_obj: path, ``http(s)://`` or ``s3://`` URI, open binary file, stream
            from ``open_stream``, or file descriptor. Closed by ``close()``.
        device: target device; ``None`` means CUDA when available, else CPU.
        filter_func: ``f(name) -> bool`` choosing the tensors to load.
        dtype: cast floating-point tensors to this dtype.
        lazy_load: load each tensor on first access.
        plaid_mode, plaid_mode_buffers: accepted and ignored (as in tensorizer).
        num_readers: parallel readers; ``None`` picks a good number.
        verify_hash: check each tensor's stored hashes (``HashMismatchError``).
        encryption: ``DecryptionParams`` for encrypted files.

    Raises:
        CryptographyError: missing, wrong or unneeded key.
        HashMismatchError: with ``verify_hash``, a tensor differs from its hash.
        NotImplementedError: a ``redis://`` source.
    """

    def __init__(
        self,
        file_obj: Any,
        device: str | torch.device | int | None = None,
        filter_func: FilterFuncType | None = None,
        dtype: torch.dtype | None = None,
        *,
        lazy_load: bool = False,
        plaid_mode: bool | None = None,
        plaid_mode_buffers: int | None = None,
        num_readers: int | None = None,
        verify_hash: bool = False,
        encryption: _DecryptionParams | None = None,
    ) -> None:
        target, storage, self._compat_stream = _reader_target(file_obj)
        super().__init__(
            target,
            device,
            num_readers=num_readers,
            verify_hash=bool(verify_hash),
            lazy_load=lazy_load,
            filter_func=filter_func,
            dtype=dtype,
            encryption=encryption,
            storage=storage,
        )

    @property
    def _file_header(self) -> _FileHeader:
        header = self.index.header
        if header is None:
            return _FileHeader(0, 0, len(self.index.records))
        return _FileHeader(header.version, header.tensor_size, header.tensor_count)

    @property
    def _file_flags(self) -> _FileFeatureFlags:
        header = self.index.header
        return _FileFeatureFlags(header.flags if header is not None else 0)

    @property
    def cache_status(self) -> str | None:
        """A CDN cache status header of the response (tensorizer); always ``None`` here."""
        return None

    def close(self) -> None:
        """Release the source and close ``file_obj`` (tensorizer closes it too)."""
        super().close()
        stream = getattr(self, "_compat_stream", None)
        if stream is not None:
            self._compat_stream = None
            stream.close()

    def read_numpy_arrays(
        self,
        filter_func: FilterFuncType | None = None,
        num_tensors: int = -1,
        allow_raw_data: bool = False,
        verify_hash: bool | None = None,
    ) -> Iterator[tuple[int, int, Any, Any, bool, str | None]]:
        """Yield ``(module_idx, tensor_type, name, array, is_opaque, opaque_dtype)``.

        Tensors whose dtype numpy lacks (``bfloat16``, ``float8_*``) come back as raw
        bytes (a void-dtype array, ``is_opaque=True``) when ``allow_raw_data=True``.

        Raises:
            ValueError: such a tensor and ``allow_raw_data=False``.
        """
        for idx, kind, name, tensor in self.read_tensors(filter_func, num_tensors, verify_hash):
            data = tensor.detach().cpu()
            try:
                yield idx, kind, name, data.numpy(), False, None
            except TypeError:
                opaque = str(data.dtype).removeprefix("torch.")
                if not allow_raw_data:
                    raise ValueError(
                        f"tensor {name!r} has dtype {opaque}, which numpy cannot hold; "
                        "pass allow_raw_data=True to get its raw bytes"
                    ) from None
                raw = data.contiguous().reshape(-1).view(torch.uint8).numpy()
                array = raw.view(f"V{data.element_size()}").reshape(tuple(data.shape))
                yield idx, kind, name, array, True, opaque

    def verify_module(self, m: torch.nn.Module) -> tuple[bool, list[tuple[str, bool]]]:
        """Compare ``m``'s parameters and buffers with the tensors in this file.

        Each tensor of the file is compared by name, dtype, shape and exact bytes
        with the module's tensor of that name (with ``verify_hash=True`` the file's
        tensors were checked against their stored hashes while loading).

        Returns:
            ``(all_passed, [(name, passed), ...])`` in file order.
        """
        targets = dict(m.named_parameters(remove_duplicate=False))
        targets.update(m.named_buffers(remove_duplicate=False))
        results: list[tuple[str, bool]] = []
        for _, _, name, tensor in self.read_tensors():
            label = name if isinstance(name, str) else ".".join(map(str, name))
            theirs = targets.get(label)
            results.append((label, theirs is not None and _same_bytes(tensor, theirs)))
        return all(ok for _, ok in results), results

    def load_into_module(  # type: ignore[override]
        self,
        m: torch.nn.Module,
        filter_func: FilterFuncType | None = None,
        verify_hash: bool | None = None,
    ) -> int:
        """Register the file's tensors as ``m``'s parameters and buffers (tensorizer's names)."""
        return super().load_into_module(m, filter_func, verify_hash)

    def to_redis(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: tensorstream has no Redis source or sink."""
        raise NotImplementedError(stream_io._REDIS)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.is_meta or b.is_meta:
        return a.is_meta == b.is_meta
    a8 = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    b8 = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a8, b8))


def _writer_target(file_obj: Any) -> tuple[Any, StorageOptions | None, Any]:
    """What to hand tensorstream's writer, its storage options, and a stream to close."""
    _redis_check(file_obj)
    if isinstance(file_obj, int):
        stream = open(file_obj, "wb+")
        return stream, None, stream
    if isinstance(file_obj, (str, bytes, os.PathLike)):
        uri = os.fsdecode(file_obj)
        if isinstance(file_obj, os.PathLike) or "://" not in uri:
            return uri, None, None
        return uri, stream_io.storage_options(uri, "wb"), None
    sink = getattr(file_obj, "tensorstream_sink", None)
    return (sink if sink is not None else file_obj), None, file_obj


class TensorSerializer(_Serializer):
    """Write a ``.tensors`` file; tensorizer 2.12.1's constructor over tensorstream's writer.

    Args:
        file_obj: path, ``s3://`` URI, writable binary file (closed by ``close()``, as
            tensorizer does), stream from ``open_stream(..., "wb")``, or descriptor.
        compress_tensors: must be ``False`` (tensorizer accepts it and does nothing).
        encryption: ``EncryptionParams`` to encrypt tensor data.
        limit_cpu_concurrency: cap on hashing / encryption threads.

    Raises:
        NotImplementedError: ``compress_tensors=True`` or a ``redis://`` target.
    """

    def __init__(
        self,
        file_obj: Any,
        compress_tensors: bool = False,
        *,
        encryption: _EncryptionParams | None = None,
        limit_cpu_concurrency: int | None = None,
    ) -> None:
        if compress_tensors:
            raise NotImplementedError(
                "compress_tensors=True is not supported: tensorstream writes tensors "
                "uncompressed (tensorizer 2.12.1 accepts the flag but ignores it); drop it"
            )
        target, storage, stream = _writer_target(file_obj)
        super().__init__(
            target,
            encryption=encryption,
            limit_cpu_concurrency=limit_cpu_concurrency,
            storage=storage,
        )
        self._compat_stream = stream

    def write_tensor(  # type: ignore[override]
        self,
        idx: int,
        name: str | Sequence[str | int],
        tensor_type: int,
        tensor: Any,
    ) -> None:
        """Write one tensor (a ``torch.Tensor`` or numpy array) under ``name``."""
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.from_numpy(tensor)
        super().write_tensor(idx, name, tensor_type, tensor)

    def write_module(  # type: ignore[override]
        self,
        m: torch.nn.Module,
        remove_tensors: bool = False,
        *,
        include_non_persistent_buffers: bool = True,
    ) -> None:
        """Write ``m``'s parameters and buffers (tensorizer's argument names)."""
        super().write_module(
            m, remove_tensors, include_non_persistent_buffers=include_non_persistent_buffers
        )

    def close(self) -> None:
        """Finish the file, then close ``file_obj`` as tensorizer does."""
        try:
            super().close()
        finally:
            self._close_stream(commit=True)

    def abort(self) -> None:
        """Discard the file being written."""
        try:
            super().abort()
        finally:
            self._close_stream(commit=False)

    def _close_stream(self, commit: bool) -> None:
        stream = getattr(self, "_compat_stream", None)
        if stream is None:
            return
        self._compat_stream = None
        if getattr(stream, "tensorstream_sink", None) is not None:
            # The writer already committed (or aborted) the sink; just mark it closed.
            stream.detach_sink()
        elif not stream.closed:
            if commit:
                stream.flush()
            stream.close()
