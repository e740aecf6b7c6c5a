"""Each key or tampering problem is its own clear error naming the tensor; never garbage
tensors; keys and passphrases never show up in errors, logs or reprs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.deserialize.reader import TensorDeserializer
from tensorstream.errors import (
    DecryptionError,
    KeyRequiredError,
    ManifestError,
    NotEncryptedError,
    TensorStreamError,
)
from tensorstream.serialize.writer import TensorSerializer

from .conftest import PASSPHRASE, fast_passphrase_params, load, manifest_of, state_dict, write


def _data_offset(path: Path, position: int) -> int:
    return manifest_of(path)["manifest"]["tensors"][position]["data_offset"]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x80
    path.write_bytes(bytes(data))


def _errors(tmp_path: Path) -> dict[str, TensorStreamError]:
    """Provoke every error once; returns them by case."""
    enc = EncryptionParams.random()
    raw = tmp_path / "raw.tensors"
    write(raw, enc)
    raw_nomf = tmp_path / "raw-nomf.tensors"
    write(raw_nomf, enc, manifest=False)
    pw = tmp_path / "pw.tensors"
    write(pw, fast_passphrase_params())
    plain = tmp_path / "plain.tensors"
    write(plain, None)
    data_tampered = tmp_path / "data.tensors"
    write(data_tampered, enc)
    _flip(data_tampered, _data_offset(data_tampered, 1) + 100)
    header_tampered = tmp_path / "header.tensors"
    write(header_tampered, enc)
    mac = bytes.fromhex(manifest_of(header_tampered)["manifest"]["tensors"][1]["cipher"]["macs"][0])
    _flip(header_tampered, header_tampered.read_bytes().index(mac))
    key = DecryptionParams.from_key(enc.key)
    cases = {
        "wrong key": (raw, DecryptionParams.from_key(bytes(reversed(enc.key))), {}),
        "wrong key, no manifest": (raw_nomf, DecryptionParams.from_key(bytes(32)), {}),
        "wrong passphrase": (pw, DecryptionParams.from_string("wrong " + PASSPHRASE), {}),
        "wrong passphrase, no manifest": (
            pw,
            DecryptionParams.from_string("wrong " + PASSPHRASE),
            {"manifest": False},
        ),
        "tampered ciphertext": (data_tampered, key, {}),
        "tampered ciphertext, no manifest": (data_tampered, key, {"manifest": False}),
        "tampered header": (header_tampered, key, {}),
        "missing key": (raw, None, {}),
        "key for plain file": (plain, key, {}),
    }
    found = {}
    for name, (path, dec, kwargs) in cases.items():
        with pytest.raises(TensorStreamError) as info:
            load(path, dec, **kwargs)
        found[name] = info.value
    return found


def test_each_problem_is_a_distinct_clear_error(tmp_path: Path) -> None:
    errors = _errors(tmp_path)
    expected = {
        "wrong key": (DecryptionError, "wrong key: .*raw.tensors was encrypted with a different"),
        "wrong key, no manifest": (DecryptionError, "'embed.weight'.*key or passphrase is wrong"),
        "wrong passphrase": (DecryptionError, "wrong passphrase: .*pw.tensors"),
        "wrong passphrase, no manifest": (DecryptionError, "'embed.weight'.*MAC does not match"),
        "tampered ciphertext": (
            DecryptionError,
            "'layer.0.w'.*chunk 0 of 1.*key is right.*modified or corrupted",
        ),
        "tampered ciphertext, no manifest": (DecryptionError, "'layer.0.w'.*chunk 0 of 1"),
        "tampered header": (ManifestError, "'layer.0.w' \\(header at offset \\d+\\): its nonce"),
        "missing key": (KeyRequiredError, "raw.tensors is encrypted; pass encryption="),
        "key for plain file": (NotEncryptedError, "plain.tensors is not encrypted"),
    }
    import re

    for name, (cls, pattern) in expected.items():
        exc = errors[name]
        assert type(exc) is cls, (name, exc)
        assert re.search(pattern, str(exc)), (name, str(exc))
    # the messages that a user sees are all different from each other
    assert len({str(e).split(":")[0] + type(e).__name__ for e in errors.values()}) > 5
    assert len({str(e) for e in errors.values()}) == len(errors)


def test_secrets_never_in_errors_logs_or_reprs(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    enc = EncryptionParams.random()
    pw_params = fast_passphrase_params()
    texts = [repr(enc), str(enc), repr(pw_params), repr(DecryptionParams.from_key(enc.key))]
    texts.append(repr(DecryptionParams.from_string(PASSPHRASE)))
    path = tmp_path / "m.tensors"
    with TensorSerializer(str(path), encryption=enc) as s:
        texts.append(repr(s))
        s.write_state_dict(state_dict())
    with TensorDeserializer(
        str(path), device="cpu", encryption=DecryptionParams.from_key(enc.key)
    ) as d:
        texts.append(repr(d))
    texts += [str(e) + repr(e) for e in _errors(tmp_path).values()]
    texts += [r.getMessage() for r in caplog.records]
    texts.append(Path(f"{path}.manifest").read_text())
    assert any("manifest verified" in t for t in texts)  # debug logging was captured
    blob = "\n".join(texts)
    for secret in (enc.key, pw_params.key):
        assert secret.hex() not in blob
        assert repr(secret)[2:-1] not in blob
    assert PASSPHRASE not in blob


def test_no_partially_decrypted_tensor_is_returned(tmp_path: Path) -> None:
    enc = EncryptionParams.random()
    path = tmp_path / "m.tensors"
    sd = write(path, enc)
    # tamper the second 2 MiB chunk of the first tensor: its first chunk decrypts fine
    _flip(path, _data_offset(path, 0) + (2 << 20) + 5)
    key = DecryptionParams.from_key(enc.key)
    with pytest.raises(DecryptionError, match="'embed.weight'.*chunk 1 of 2"):
        TensorDeserializer(str(path), device="cpu", encryption=key)  # eager: no object at all
    with TensorDeserializer(str(path), device="cpu", encryption=key, lazy_load=True) as d:
        import torch

        assert torch.equal(d["layer.0.w"], sd["layer.0.w"])
        for _ in range(2):  # a failed tensor is never cached, not even on retry
            with pytest.raises(DecryptionError, match="'embed.weight'"):
                d["embed.weight"]
        got = []
        with pytest.raises(DecryptionError):
            for _, _, name, _t in d.read_tensors():
                got.append(name)
        assert got == []  # embed.weight is first in the file: nothing yielded before it
