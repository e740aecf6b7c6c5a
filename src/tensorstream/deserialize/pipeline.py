"""What happens to each tensor once its bytes are in: header check against the index
(and the manifest), decryption in place, hash verification, dtype cast, storage.

It also keeps the books every load path is held to: which tensors had their header
checked and which were verified, so the deserializer can catch a path that skipped one.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tensorstream.deserialize.index import TensorIndex, TensorRecord
from tensorstream.deserialize.verify import HashCheck, check_header, verify_hashes
from tensorstream.formats.tensorizer import TensorHeader

__all__ = ["RecordPipeline"]


def _as_parameter(t: torch.Tensor) -> torch.nn.Parameter:
    grad = t.is_floating_point() or t.is_complex()
    return torch.nn.Parameter(t, requires_grad=grad)


class RecordPipeline:
    """Per-tensor post-processing shared by every load path; safe to call from threads."""

    def __init__(
        self,
        index: TensorIndex,
        where: str,
        *,
        decryptor: Any = None,
        manifest: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.index = index
        self.where = where
        self.decryptor = decryptor
        self.manifest = manifest
        self.dtype = dtype
        self.tensors: dict[Any, torch.nn.Parameter] = {}
        self.verified: set[Any] = set()
        #: header offsets of the records whose header passed ``check``
        self.checked: set[int] = set()
        #: ``verify_hash="crc32"``: check only the stored CRC32 (see verify.py)
        self.crc32_only = False
        self._lock = threading.Lock()
        self._positions = {r.header_offset: i for i, r in enumerate(index.records)}

    def check(self, record: TensorRecord, header: bytes | memoryview | None) -> TensorHeader | None:
        """Parse the tensor header and refuse it unless it matches the index (and manifest)."""
        if header is None or not self.index.has_headers:
            return None
        parsed = check_header(self.index, record, header, self.where)
        if self.manifest is not None:
            self.manifest.check_header(
                self._positions[record.header_offset], record, header, parsed
            )
        with self._lock:
            self.checked.add(record.header_offset)
        return parsed

    def process(
        self,
        record: TensorRecord,
        header: bytes | memoryview | None,
        data: memoryview,
        verify: bool,
        *,
        ciphertext: memoryview | None = None,
    ) -> None:
        """Header check, decryption in place, then the hash check of the plaintext.

        With ``ciphertext`` (encrypted files only), ``data`` is empty memory that
        receives the plaintext decrypted out of ``ciphertext`` in one pass.
        """
        parsed = self.check(record, header)
        if parsed is not None and self.decryptor is not None and record.data_length:
            self.decryptor.decrypt(
                record,
                parsed,
                data,
                key_verified=self.manifest is not None,
                source=ciphertext,
            )
        if verify and parsed is not None:
            # meta tensors hash as no bytes (their zeros are not stored), like tensorizer
            payload = data if record.data_length else memoryview(b"")
            verify_hashes(record, parsed, header, payload, self.where, self.crc32_only)  # type: ignore[arg-type]
            self.mark_verified(record)

    def hash_check(
        self, record: TensorRecord, parsed: TensorHeader, header: bytes | bytearray | memoryview
    ) -> HashCheck:
        """Start verifying a tensor whose bytes stream past in pieces (staged loads)."""
        return HashCheck(record, parsed, header, self.where, self.crc32_only)

    def finish_check(self, record: TensorRecord, check: HashCheck) -> None:
        """Compare the streamed hashes with the stored ones; marks the tensor verified."""
        check.finish()
        self.mark_verified(record)

    def mark_verified(self, record: TensorRecord) -> None:
        with self._lock:
            self.verified.add(record.key)

    def finish(self, record: TensorRecord, tensor: torch.Tensor) -> None:
        """Cast floating tensors to the requested dtype and store the result."""
        if self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype:
            tensor = tensor.to(self.dtype)
        with self._lock:
            self.tensors[record.key] = _as_parameter(tensor)
