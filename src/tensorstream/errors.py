"""The one exception tree of tensorstream.

Every error raised on purpose by the library derives from ``TensorStreamError``.
Where a builtin exception already names the situation, the class also derives
from it, so ``except FileNotFoundError`` keeps working::

    TensorStreamError
    ├── FormatError (ValueError)            not a readable .tensors/safetensors file
    │   ├── UnsupportedVersionError         data version this reader does not know
    │   └── TruncatedFileError              the file ends before a header or tensor does
    ├── IntegrityError                      bytes do not match what the file promises
    │   └── HashMismatchError               CRC32 / SHA-256 of a tensor differs
    ├── CryptoError                         encryption and keys
    │   ├── CryptoUnavailableError          libsodium / argon2 not installed
    │   ├── KeyRequiredError                encrypted file, no key given
    │   ├── NotEncryptedError               key given for a plain file
    │   ├── DecryptionError                 wrong key or tampered ciphertext (MAC failed)
    │   ├── KeyDerivationLimitError (ConfigError)  Argon2 cost above the reader's cap
    │   └── ManifestError                   authenticated manifest refused the file
    ├── SourceError (OSError)               reading from / writing to storage
    │   ├── SourceNotFoundError (FileNotFoundError)
    │   ├── AccessDeniedError (PermissionError)
    │   ├── RangeNotSupportedError          server ignores HTTP Range
    │   ├── SourceChangedError              object changed while loading (ETag / size)
    │   └── RetriesExhaustedError           transient failures outlasted the retry budget
    ├── SerializationError                  cannot write what was asked
    │   └── MetadataOverflowError           more tensors than the reserved index holds
    ├── ParallelError                       a tensor-parallel rank failed (names rank, cause)
    └── ConfigError (ValueError)            bad option, key or argument
        └── ShardMismatchError              rank files vs. world size / plan / sidecar

Messages name the tensor, byte offset or URI involved and say what to do next.
Backend errors are re-raised with ``raise ... from`` so the original stays attached.
"""

from __future__ import annotations

__all__ = [
    "AccessDeniedError",
    "ConfigError",
    "CryptoError",
    "CryptoUnavailableError",
    "DecryptionError",
    "FormatError",
    "HashMismatchError",
    "IntegrityError",
    "KeyDerivationLimitError",
    "KeyRequiredError",
    "ManifestError",
    "MetadataOverflowError",
    "NotEncryptedError",
    "ParallelError",
    "RangeNotSupportedError",
    "RetriesExhaustedError",
    "SerializationError",
    "ShardMismatchError",
    "SourceChangedError",
    "SourceError",
    "SourceNotFoundError",
    "TensorStreamError",
    "TruncatedFileError",
    "UnsupportedVersionError",
]


class TensorStreamError(Exception):
    """Base of every error tensorstream raises on purpose."""


class FormatError(TensorStreamError, ValueError):
    """The bytes are not a valid tensorizer or safetensors file."""


class UnsupportedVersionError(FormatError):
    """The file's data version is not one this reader understands."""


class TruncatedFileError(FormatError):
    """The file ends before a header, index or tensor it declares."""


class IntegrityError(TensorStreamError):
    """Bytes read do not match what the file says they should be."""


class HashMismatchError(IntegrityError):
    """A tensor's CRC32 or SHA-256 differs from the hash stored in its header."""


class CryptoError(TensorStreamError):
    """Encryption, decryption or key handling failed."""


class CryptoUnavailableError(CryptoError, ImportError):
    """The crypto backend (libsodium, argon2) is not installed."""


class KeyRequiredError(CryptoError):
    """The file is encrypted and no decryption key was given."""


class NotEncryptedError(CryptoError):
    """A decryption key was given for a file that is not encrypted."""


class DecryptionError(CryptoError):
    """Authentication failed: wrong key or passphrase, or tampered ciphertext."""


class ManifestError(CryptoError):
    """The authenticated manifest does not match the file (tampered or swapped)."""


class SourceError(TensorStreamError, OSError):
    """Reading from or writing to a storage location failed."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """The file or object does not exist."""


class AccessDeniedError(SourceError, PermissionError):
    """The storage refused access (HTTP 401/403, bad credentials)."""


class RangeNotSupportedError(SourceError):
    """The server does not honour HTTP Range requests."""


class SourceChangedError(SourceError):
    """The object changed (size, ETag or Last-Modified) while it was being read."""


class RetriesExhaustedError(SourceError):
    """Transient failures (5xx, timeouts, cut connections) outlasted the retry budget."""


class SerializationError(TensorStreamError):
    """A tensor or module cannot be written as asked."""


class MetadataOverflowError(SerializationError):
    """The tensor index outgrew the space reserved for it at the top of the file."""


class ConfigError(TensorStreamError, ValueError):
    """An option, key or argument is invalid."""


class ShardMismatchError(ConfigError):
    """A tensor-parallel rank file set does not match the ranks loading it."""


class ParallelError(TensorStreamError):
    """A tensor-parallel rank failed; every rank stops (the message names rank and cause)."""


class KeyDerivationLimitError(CryptoError, ConfigError):
    """A file asks for more Argon2 work (memory, passes, distinct salts) than allowed."""
