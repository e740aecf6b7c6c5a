"""The authenticated manifest of an encrypted ``.tensors`` file: build, store, load, verify.

tensorizer's format keeps names, dtypes, shapes and the tensor order in clear and
unauthenticated: each tensor's data is sealed on its own, so a file can be cut short,
or tensors renamed, dropped, reordered or swapped, and it still decrypts. The manifest
closes that gap without touching the ``.tensors`` bytes (tensorizer still reads the
file): a small JSON document stored beside it (``<uri>.manifest``) that binds

* the file: data version, flags, tensor count, total data bytes, index size, file size;
* every tensor, in order: name, type, dtype code, shape, header and data offsets, data
  length, its SHA-256/CRC32 (as in the header), its nonce, chunk size and MACs, and a
  BLAKE2b digest of the whole header as written.

Keys (``K`` is the 32-byte data key, raw or derived from the passphrase)::

    K_check    = BLAKE2b-256(key=K, msg="tensorstream key check v1")[:16]   stored
    K_manifest = BLAKE2b-256(key=K, msg="tensorstream manifest v1")
    mac        = BLAKE2b-256(key=K_manifest, msg=canonical JSON of the body)

``K_check`` lets a reader tell "wrong key or passphrase" apart from "tampered
manifest" before any tensor is read; it reveals nothing usable about ``K`` (a
keyed-hash output, like a MAC over a known message). For passphrase keys the body
records the Argon2 parameters and salt (already public in every tensor header), so
the reader derives ``K`` once from the manifest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorstream.crypto.cryptinfo import (
    KeyDerivation,
    XSalsa20Parallel,
    XSalsa20Sequential,
    unpack_crypt_info,
)
from tensorstream.errors import (
    DecryptionError,
    FormatError,
    ManifestError,
    SourceNotFoundError,
)
from tensorstream.formats.tensorizer import HASH_CRC32, HASH_SHA256

if TYPE_CHECKING:
    from tensorstream.crypto.params import DecryptionParams
    from tensorstream.deserialize.index import TensorIndex, TensorRecord
    from tensorstream.formats.tensorizer import FileHeader, IndexEntry, TensorHeader
    from tensorstream.sources.base import StorageOptions

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_SUFFIX",
    "Manifest",
    "build_manifest",
    "load_manifest",
    "manifest_uri_for",
    "write_manifest",
]

MANIFEST_FORMAT = "tensorstream-manifest/1"
MANIFEST_SUFFIX = ".manifest"
_MAX_MANIFEST = 256 << 20
_CHECK_LABEL = b"tensorstream key check v1"
_MAC_LABEL = b"tensorstream manifest v1"


#: Deepest nesting a manifest may have (a real one has 5: doc, body, tensors, tensor,
#: cipher MACs); parsing stays bounded whatever a hostile manifest holds.
_MAX_DEPTH = 16
_TENSOR_FIELDS = frozenset(
    {"name", "type", "shape", "header_offset", "data_offset", "data_length", "dtype"}
)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _too_deep(data: bytes) -> bool:
    """Whether ``data``'s brackets nest deeper than ``_MAX_DEPTH`` (or do not balance).

    Works on the bracket skeleton with C-speed byte operations: each pass drops the
    innermost pairs, so anything left after ``_MAX_DEPTH`` passes is too deep. Brackets
    inside JSON strings count too; a real manifest's strings (hex, the format name)
    have none.
    """
    skeleton = data.translate(None, _NOT_BRACKETS)
    for _ in range(_MAX_DEPTH):
        if not skeleton:
            return False
        shorter = skeleton.replace(b"[]", b"").replace(b"{}", b"")
        if len(shorter) == len(skeleton):
            return True  # unbalanced: no pair left to drop
        skeleton = shorter
    return bool(skeleton)


def _prf(key: bytes, msg: bytes) -> bytes:
    return hashlib.blake2b(msg, key=key, digest_size=32).digest()


def _key_check(key: bytes) -> str:
    return _prf(key, _CHECK_LABEL)[:16].hex()


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(key: bytes, body: Mapping[str, Any]) -> str:
    return _prf(_prf(key, _MAC_LABEL), _canonical(body)).hex()


def manifest_uri_for(uri: str | os.PathLike[str]) -> str:
    """Where the manifest of ``uri`` lives: ``uri + ".manifest"`` (before any ``?query``).

    Example:
        >>> manifest_uri_for("s3://b/model.tensors")
        's3://b/model.tensors.manifest'
    """
    text = os.fspath(uri)
    base, sep, query = text.partition("?")
    if "://" in base and sep:
        return f"{base}{MANIFEST_SUFFIX}?{query}"
    return text + MANIFEST_SUFFIX


def _header_entry(header: bytes, parsed: TensorHeader) -> dict[str, Any]:
    """The header-derived fields of one tensor (hashes, encryption, digest of the bytes)."""
    out: dict[str, Any] = {
        "dtype": parsed.dtype,
        "sha256": parsed.hashes[HASH_SHA256].hex() if HASH_SHA256 in parsed.hashes else None,
        "crc32": parsed.hashes[HASH_CRC32].hex() if HASH_CRC32 in parsed.hashes else None,
        "header_digest": hashlib.blake2b(bytes(header), digest_size=32).hexdigest(),
        "cipher": None,
    }
    body = parsed.crypt_info
    if body:
        info, _ = unpack_crypt_info(struct.pack("<Q", len(body)) + body)
        if not info.is_empty:
            cipher = info.cipher()
            if isinstance(cipher, XSalsa20Parallel):
                out["cipher"] = {
                    "chunk_size": cipher.chunk_size,
                    "nonce": cipher.nonce.hex(),
                    "macs": [m.hex() for m in cipher.macs],
                }
            elif isinstance(cipher, XSalsa20Sequential):
                out["cipher"] = {"nonce": cipher.nonce.hex(), "macs": [cipher.mac.hex()]}
    return out


def _kdf_dict(kdf: KeyDerivation | None) -> dict[str, Any] | None:
    if kdf is None:
        return None
    return {
        "opslimit": kdf.opslimit,
        "memlimit": kdf.memlimit,
        "alg": kdf.alg,
        "salt": kdf.salt.hex(),
    }


def build_manifest(
    key: bytes,
    key_derivation: KeyDerivation | None,
    file_header: FileHeader,
    file_size: int,
    entries: Sequence[IndexEntry],
    headers: Sequence[bytes],
    *,
    long_shapes: Sequence[bool] | None = None,
) -> bytes:
    """Serialize the signed manifest of a file just written.

    Args:
        key: the 32-byte data key (``EncryptionParams.key``).
        key_derivation: ``EncryptionParams.key_derivation`` (``None`` for raw keys).
        file_header: the file header as written.
        file_size: the size of the ``.tensors`` file in bytes.
        entries: the index entries, in file order.
        headers: each tensor's header bytes as written, in the same order.
        long_shapes: per entry, whether its header uses 64-bit dims.

    Returns:
        The manifest file's bytes (UTF-8 JSON).

    Raises:
        FormatError: a header cannot be parsed (an internal error of the writer).
    """
    from tensorstream.formats.tensorizer import unpack_tensor_header

    tensors = []
    for i, (e, header) in enumerate(zip(entries, headers, strict=True)):
        long_shape = e.long_shape if long_shapes is None else long_shapes[i]
        parsed = unpack_tensor_header(
            header, long_shape=long_shape, crypt_info=file_header.encrypted
        )
        item = {
            "name": e.raw_name.hex(),
            "type": e.tensor_type,
            "shape": list(e.shape),
            "header_offset": e.header_offset,
            "data_offset": e.data_offset,
            "data_length": e.data_length,
        }
        item.update(_header_entry(header, parsed))
        tensors.append(item)
    body = {
        "format": MANIFEST_FORMAT,
        "file": {
            "version": file_header.version,
            "flags": file_header.flags,
            "tensor_count": file_header.tensor_count,
            "tensor_size": file_header.tensor_size,
            "metadata_len": file_header.metadata_len,
            "file_size": file_size,
        },
        "key_derivation": _kdf_dict(key_derivation),
        "key_check": _key_check(key),
        "tensors": tensors,
    }
    doc = {"manifest": body, "mac": _mac(key, body)}
    return json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"


def write_manifest(
    uri: str | os.PathLike[str], data: bytes, options: StorageOptions | None = None
) -> None:
    """Store manifest bytes at ``uri`` atomically (local temp file + rename, S3 upload).

    Raises:
        SourceError: the location cannot be written.
    """
    from tensorstream.sources import open_sink

    with open_sink(uri, options) as sink:
        sink.write(data)


def load_manifest(
    uri: str | os.PathLike[str],
    options: StorageOptions | None = None,
    *,
    missing_ok: bool = False,
) -> bytes | None:
    """Read the manifest bytes at ``uri``.

    Args:
        uri: where the manifest is (see ``manifest_uri_for``).
        options: how to reach remote storage.
        missing_ok: return ``None`` instead of raising when nothing is there.

    Returns:
        The bytes, or ``None`` when absent and ``missing_ok``.

    Raises:
        ManifestError: absent (unless ``missing_ok``) or implausibly large.
        SourceError: the storage failed.
    """
    from tensorstream.sources import open_source

    try:
        with open_source(uri, options) as source:
            if source.size > _MAX_MANIFEST:
                raise ManifestError(f"{source.display_uri} is {source.size} bytes; not a manifest")
            return source.read(0, source.size)
    except SourceNotFoundError:
        if missing_ok:
            return None
        raise ManifestError(
            f"no manifest at {uri}, but one is required (require_manifest=True); write the "
            "file with TensorSerializer(..., encryption=..., manifest=True), or pass the "
            "manifest's location"
        ) from None


@dataclass(frozen=True)
class Manifest:
    """A verified manifest; checks a file's index and each tensor header against it.

    Build it with ``Manifest.verify(data, decryption, where=...)``.
    """

    where: str
    file: Mapping[str, int]
    tensors: tuple[Mapping[str, Any], ...]
    key_derivation: Mapping[str, Any] | None

    @classmethod
    def verify(cls, data: bytes, decryption: DecryptionParams, *, where: str) -> Manifest:
        """Parse ``data`` and authenticate it with the reader's key.

        Args:
            data: the manifest's bytes.
            decryption: the reader's key or passphrase.
            where: the ``.tensors`` file it belongs to (for messages).

        Returns:
            The authenticated manifest.

        Raises:
            DecryptionError: the key or passphrase is not the one the file was written with.
            ManifestError: the manifest is malformed or its MAC fails (tampered).
        """
        data = bytes(data)
        if _too_deep(data):
            raise ManifestError(
                f"the manifest of {where} nests deeper than {_MAX_DEPTH} levels (or its "
                "brackets do not balance); it was damaged or is not a tensorstream manifest"
            )
        try:
            doc = json.loads(data)
            body = doc["manifest"]
            mac = bytes.fromhex(doc["mac"])
            if body["format"] != MANIFEST_FORMAT:
                raise ManifestError(
                    f"the manifest of {where} has format {body['format']!r}; this reader "
                    f"knows {MANIFEST_FORMAT!r} (upgrade tensorstream)"
                )
            kdf_raw = body["key_derivation"]
            kdf = None
            if kdf_raw is not None:
                kdf = KeyDerivation(
                    opslimit=int(kdf_raw["opslimit"]),
                    memlimit=int(kdf_raw["memlimit"]),
                    salt=bytes.fromhex(kdf_raw["salt"]),
                    alg=int(kdf_raw["alg"]),
                )
            check = str(body["key_check"])
            if not isinstance(body["tensors"], list) or not all(
                isinstance(t, dict) and _TENSOR_FIELDS <= t.keys() for t in body["tensors"]
            ):
                raise TypeError("tensors")
            tensors = tuple(body["tensors"])
            file = dict(body["file"])
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ManifestError(
                f"the manifest of {where} is malformed ({type(exc).__name__}); it was damaged "
                "or is not a tensorstream manifest"
            ) from None
        key = decryption.key_for(kdf, label=f"the manifest of {where}")
        if not hmac.compare_digest(_key_check(key), check):
            kind = "passphrase" if decryption.is_passphrase else "key"
            raise DecryptionError(
                f"wrong {kind}: {where} was encrypted with a different "
                f"{'passphrase' if kdf is not None else 'key'} (checked against its manifest "
                "before any tensor was read); use the key or passphrase it was written with"
            )
        if not hmac.compare_digest(bytes.fromhex(_mac(key, body)), mac):
            raise ManifestError(
                f"the manifest of {where} failed authentication: the key is right, but the "
                "manifest was modified after it was written; do not trust this file"
            )
        return cls(where, file, tensors, kdf_raw)

    # ------------------------------------------------------------ checks

    def check_index(self, index: TensorIndex) -> None:
        """Refuse the file unless its header and index are exactly what the manifest binds.

        Raises:
            ManifestError: naming the first tensor that differs (or the file-level field).
        """
        from tensorstream.formats.dtypes import decode_dtype

        header = index.header
        if header is None:
            raise ManifestError(f"{self.where} is not a .tensors file, but has a manifest")
        actual = {
            "version": header.version,
            "flags": header.flags,
            "tensor_count": header.tensor_count,
            "tensor_size": header.tensor_size,
            "metadata_len": header.metadata_len,
            "file_size": index.file_size,
        }
        records = index.records
        for i, (r, m) in enumerate(zip(records, self.tensors, strict=False)):
            name = _name(m)
            if r.raw_name.hex() != m["name"]:
                what = (
                    f"tensor {name!r} was removed or renamed"
                    if name not in {x.name for x in records}
                    else f"tensors are reordered or swapped ({r.name!r} where {name!r} belongs)"
                )
                self._fail(f"position {i}: {what}; the file says {r.name!r}")
            for field_name, have in (
                ("type", r.tensor_type),
                ("shape", list(r.shape)),
                ("header_offset", r.header_offset),
                ("data_offset", r.data_offset),
                ("data_length", r.data_length),
            ):
                if m[field_name] != have:
                    self._fail(
                        f"tensor {name!r}: {field_name} is {have}, the manifest says "
                        f"{m[field_name]}"
                    )
            try:
                dtype = decode_dtype(m["dtype"])
            except FormatError:
                dtype = None
            if dtype != r.dtype:
                self._fail(f"tensor {name!r}: dtype is {r.dtype}, the manifest says {m['dtype']}")
        if len(records) != len(self.tensors):
            if len(records) < len(self.tensors):
                missing = [_name(m) for m in self.tensors[len(records) :]]
                self._fail(
                    f"the file has {len(records)} tensors, the manifest {len(self.tensors)}: "
                    f"missing {missing[:5]} (truncated or removed)"
                )
            extra = [r.name for r in records[len(self.tensors) :]]
            self._fail(f"the file has tensors the manifest does not: {extra[:5]}")
        for key, have in actual.items():
            if self.file.get(key) != have:
                self._fail(
                    f"the file's {key} is {have}, the manifest says {self.file.get(key)} "
                    "(truncated, extended or rewritten)"
                )

    def check_header(
        self, position: int, record: TensorRecord, header: bytes | memoryview, parsed: TensorHeader
    ) -> None:
        """Refuse a tensor whose header (hashes, nonce, MACs, bytes) differs from the manifest.

        Args:
            position: the record's position in the file's index.
            record: the index record.
            header: the header bytes as read.
            parsed: the parsed header.

        Raises:
            ManifestError: naming the tensor and the field that differs.
        """
        m = self.tensors[position]
        try:
            have = _header_entry(bytes(header), parsed)
        except FormatError as exc:
            raise ManifestError(f"{self.where}: tensor {record.name!r}: {exc}") from None
        for field_name in ("dtype", "sha256", "crc32", "cipher", "header_digest"):
            if have[field_name] != m.get(field_name):
                what = {
                    "cipher": "its nonce or MACs",
                    "header_digest": "its header bytes",
                }.get(field_name, f"its {field_name}")
                self._fail(
                    f"tensor {record.name!r} (header at offset {record.header_offset}): "
                    f"{what} differ from the manifest"
                )

    def _fail(self, detail: str) -> None:
        raise ManifestError(
            f"{self.where} does not match its authenticated manifest: {detail}. The file was "
            "modified, truncated or mixed with another; refusing to load it"
        )


def _name(m: Mapping[str, Any]) -> str:
    from tensorstream.formats.tensorizer import decode_name

    try:
        key = decode_name(bytes.fromhex(m["name"]))
    except (ValueError, FormatError):
        return str(m.get("name"))
    return key if isinstance(key, str) else ".".join(str(p) for p in key)
