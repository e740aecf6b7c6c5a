"""A file cannot make a passphrase reader burn memory, parse without bound, or return ciphertext.

Files are real tensorstream-written ``.tensors`` files, edited byte by byte the way
an attacker (or a broken copy) would.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.crypto import DecryptionParams, EncryptionParams, KeyDerivation, MemLimit
from tensorstream.crypto.manifest import Manifest
from tensorstream.errors import (
    ConfigError,
    FormatError,
    KeyDerivationLimitError,
    ManifestError,
)

PASSPHRASE = "limits are features"
SALT = bytes(range(16))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 64, generator=g), "b": torch.randn(300, generator=g)}


def _write(path: Path, enc: EncryptionParams) -> dict[str, torch.Tensor]:
    state = _state()
    with TensorSerializer(str(path), encryption=enc, manifest=False) as s:
        s.write_state_dict(state)
    return state


def _kdf_offsets(data: bytes | bytearray, salt: bytes) -> list[int]:
    """Offsets of every KeyDerivation chunk's opslimit (``method u16`` precedes it)."""
    found, at = [], data.find(salt)
    while at >= 0:
        # ... u64 opslimit; u64 memlimit; i32 alg; u16 salt_len; salt
        found.append(at - 2 - 4 - 8 - 8)
        at = data.find(salt, at + 1)
    return found


# -- Argon2 cost caps ----------------------------------------------------------------


def test_opslimit_above_cap_refused_before_deriving(tmp_path: Path) -> None:
    """Regression: Argon2 costs came from the file unbounded (up to 64 passes, 16 GiB)."""
    path = tmp_path / "ops.tensors"
    _write(path, EncryptionParams.from_string(PASSPHRASE, 1, int(MemLimit.MIN), SALT))
    data = bytearray(path.read_bytes())
    offsets = _kdf_offsets(data, SALT)
    assert len(offsets) == 2
    for off in offsets:
        struct.pack_into("<Q", data, off, 5)  # SENSITIVE is 4 passes
    path.write_bytes(data)
    with pytest.raises(KeyDerivationLimitError) as info:
        TensorDeserializer(str(path), encryption=DecryptionParams.from_string(PASSPHRASE))
    message = str(info.value)
    assert "opslimit" in message and "max_opslimit" in message and "ops.tensors" in message
    assert isinstance(info.value, ConfigError)  # older code caught ConfigError


def test_memlimit_above_cap_refused_without_allocating() -> None:
    params = DecryptionParams.from_string(PASSPHRASE)
    kdf = KeyDerivation(opslimit=1, memlimit=2 << 30, salt=SALT)
    with pytest.raises(KeyDerivationLimitError, match="max_memlimit"):
        params.key_for(kdf, label="tensor 'w'")


def test_raised_cap_loads_a_file_written_above_the_presets(tmp_path: Path) -> None:
    path = tmp_path / "strong.tensors"
    state = _write(path, EncryptionParams.from_string(PASSPHRASE, 6, int(MemLimit.MIN)))
    with pytest.raises(KeyDerivationLimitError, match="max_opslimit=6"):
        TensorDeserializer(str(path), encryption=DecryptionParams.from_string(PASSPHRASE))
    raised = DecryptionParams.from_string(PASSPHRASE, max_opslimit=6)
    with TensorDeserializer(str(path), encryption=raised) as d:
        assert torch.equal(d["a"], state["a"])


def test_cap_arguments_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_memlimit"):
        DecryptionParams.from_string(PASSPHRASE, max_memlimit=1 << 40)
    with pytest.raises(ConfigError, match="max_derivations"):
        DecryptionParams.from_string(PASSPHRASE, max_derivations=0)


def _three_salt_file(path: Path) -> dict[str, torch.Tensor]:
    """A real file whose tensors were sealed under three passphrase keys (three salts),
    as a writer that switched ``EncryptionParams`` between tensors would produce."""
    from tensorstream.serialize import writer

    state = {f"t{i}": torch.full((10,), float(i)) for i in range(3)}
    with TensorSerializer(str(path), manifest=False, encryption=EncryptionParams.random()) as s:
        for i, (name, tensor) in enumerate(state.items()):
            salt = bytes([i]) + SALT[1:]
            enc = EncryptionParams.from_string(PASSPHRASE, 1, int(MemLimit.MIN), salt)
            s._encryptor = writer._make_encryptor(enc)
            s.write_tensor(0, name, 0, tensor)
    return state


def test_too_many_distinct_salts_refused(tmp_path: Path) -> None:
    """Regression: every distinct salt in a file cost a full derivation, unbounded."""
    path = tmp_path / "salts.tensors"
    state = _three_salt_file(path)
    with pytest.raises(KeyDerivationLimitError) as info:
        with TensorDeserializer(str(path), encryption=DecryptionParams.from_string(PASSPHRASE)):
            pass
    assert "max_derivations" in str(info.value) and "salts.tensors" in str(info.value)
    raised = DecryptionParams.from_string(PASSPHRASE, max_derivations=3)
    with TensorDeserializer(str(path), encryption=raised) as d:
        assert all(torch.equal(d[k], v) for k, v in state.items())


def test_each_distinct_derivation_counted_once() -> None:
    params = DecryptionParams.from_string(PASSPHRASE, max_derivations=3)
    seen: set = set()
    kdfs = [
        KeyDerivation(opslimit=1, memlimit=int(MemLimit.MIN), salt=bytes([i]) + SALT[1:])
        for i in range(4)
    ]
    for kdf in kdfs[:3] * 2:  # repeats are free: derived once, never counted twice
        params.key_for(kdf, seen=seen)
    assert len(seen) == 3
    with pytest.raises(KeyDerivationLimitError, match="max_derivations"):
        params.key_for(kdfs[3], seen=seen)


# -- manifest parsing ----------------------------------------------------------------


def test_deeply_nested_manifest_is_a_manifest_error() -> None:
    """Regression: a manifest nested 100,000 deep raised RecursionError."""
    data = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(ManifestError, match="deeper"):
        Manifest.verify(data, DecryptionParams.from_key(bytes(32)), where="m.tensors")
    nested = b'{"manifest": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001
    with pytest.raises(ManifestError, match="m.tensors"):
        Manifest.verify(nested, DecryptionParams.from_key(bytes(32)), where="m.tensors")


def test_manifest_with_wrong_shapes_is_a_manifest_error() -> None:
    body = b'{"manifest": {"format": "tensorstream-manifest/1", "key_derivation": null, '
    body += b'"key_check": "00", "tensors": "abc", "file": {}}, "mac": "00"}'
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.verify(body, DecryptionParams.from_key(bytes(32)), where="m.tensors")


def test_real_manifest_still_verifies(tmp_path: Path) -> None:
    path = tmp_path / "ok.tensors"
    enc = EncryptionParams.random()
    state = _state()
    with TensorSerializer(str(path), encryption=enc) as s:
        s.write_state_dict(state)
    dec = DecryptionParams.from_key(enc.key)
    with TensorDeserializer(str(path), encryption=dec, require_manifest=True) as d:
        assert torch.equal(d["b"], state["b"])


# -- an encrypted file claiming to be plain --------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_encrypted_file_claiming_plain_version_is_refused(tmp_path: Path, version: int) -> None:
    """Regression: editing the version to 2 returned ciphertext when loaded without a key."""
    path = tmp_path / "claims-plain.tensors"
    _write(path, EncryptionParams.random())
    data = bytearray(path.read_bytes())
    (original,) = struct.unpack_from("<I", data, 5)
    assert original >= 3
    struct.pack_into("<I", data, 5, version)
    path.write_bytes(data)
    with pytest.raises(FormatError) as info:
        with TensorDeserializer(str(path)) as d:
            list(d.values())
    message = str(info.value)
    assert "encryption" in message and f"version {version}" in message
    assert "claims-plain.tensors" in message


def test_plain_files_with_padding_still_load(tmp_path: Path) -> None:
    path = tmp_path / "plain.tensors"
    state = _state()
    with TensorSerializer(str(path), align=4096) as s:  # headers padded with zeros
        s.write_state_dict(state)
    with TensorDeserializer(str(path), verify_hash=True) as d:
        assert all(torch.equal(d[k], v) for k, v in state.items())
