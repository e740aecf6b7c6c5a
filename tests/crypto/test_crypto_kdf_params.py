"""Argon2id derivation and its cache; EncryptionParams / DecryptionParams; no secret leaks."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import threading

import pytest

from tensorstream.crypto import (
    CryptInfo,
    DecryptionParams,
    EncryptionParams,
    KeyDerivation,
    MemLimit,
    OpsLimit,
    UnknownChunk,
    derive_key,
    kdf,
    open_tensor,
    params,
    seal_tensor,
)
from tensorstream.errors import (
    ConfigError,
    CryptoError,
    DecryptionError,
    FormatError,
    KeyRequiredError,
)

SALT = bytes(range(16))
PASSPHRASE = "correct horse battery staple"


def test_presets_match_libsodium_argon2id() -> None:
    assert [int(x) for x in OpsLimit] == [1, 2, 3, 4]
    assert [int(x) for x in MemLimit] == [8192, 64 << 20, 256 << 20, 1 << 30]
    assert EncryptionParams.OpsLimit is OpsLimit and EncryptionParams.MemLimit is MemLimit


def test_argon2_cffi_equals_libsodium_crypto_pwhash() -> None:
    for alg, ops in ((2, 1), (2, 2), (1, 3)):
        a = kdf._argon2_cffi(b"pw", SALT, ops, 8192, alg)
        b = kdf._libsodium(b"pw", SALT, ops, 8192, alg)
        assert a == b and len(a) == 32


def test_derive_key_is_deterministic_and_salted() -> None:
    a = derive_key(b"pw", SALT, 1, 8192)
    assert a == derive_key(b"pw", SALT, 1, 8192)
    assert a != derive_key(b"pw", bytes(16), 1, 8192)
    assert a != derive_key(b"pw", SALT, 2, 8192)
    assert a != derive_key(b"pw2", SALT, 1, 8192)


def test_cache_computes_once_even_under_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    kdf.clear_cache()
    calls = []
    real = kdf._compute
    gate = threading.Event()

    def counting(*args: object) -> bytes:
        calls.append(args[2:])
        gate.wait(5)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kdf, "_compute", counting)
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: results.append(derive_key(b"cache", SALT, 1, 8192)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 4
    derive_key(b"cache", SALT, 1, 8192)
    assert len(calls) == 1
    kdf.clear_cache()
    derive_key(b"cache", SALT, 1, 8192)
    assert len(calls) == 2


def test_hostile_or_invalid_parameters_are_refused() -> None:
    with pytest.raises(ConfigError, match="opslimit 0"):
        derive_key(b"pw", SALT, 0, 8192)
    with pytest.raises(ConfigError, match="opslimit 1000"):
        derive_key(b"pw", SALT, 1000, 8192)
    with pytest.raises(ConfigError, match="memlimit"):
        derive_key(b"pw", SALT, 1, 1 << 40)
    with pytest.raises(ConfigError, match="salt"):
        derive_key(b"pw", b"abc", 1, 8192)
    with pytest.raises(CryptoError, match="algorithm 99"):
        derive_key(b"pw", SALT, 1, 8192, alg=99)


def test_falls_back_to_libsodium_without_argon2_cffi() -> None:
    code = (
        "import sys; sys.modules['argon2'] = None\n"
        "from tensorstream.crypto import derive_key\n"
        f"print(derive_key(b'pw', {SALT!r}, 1, 8192).hex())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == derive_key(b"pw", SALT, 1, 8192).hex(), out.stderr


def test_encryption_params_raw_and_random() -> None:
    a, b = EncryptionParams.random(), EncryptionParams.random()
    assert len(a.key) == 32 and a.key != b.key
    assert a.key_derivation is None
    with pytest.raises(ConfigError, match="only passphrase keys have a salt"):
        _ = a.salt
    assert EncryptionParams(bytes(32)).key == bytes(32)
    with pytest.raises(ConfigError, match="exactly 32 bytes, got 31"):
        EncryptionParams(bytes(31))
    with pytest.raises(ConfigError, match="must be bytes"):
        EncryptionParams("a" * 32)  # type: ignore[arg-type]


def test_encryption_params_from_string() -> None:
    p = EncryptionParams.from_string(PASSPHRASE, OpsLimit.MIN, MemLimit.MIN, SALT)
    assert p.salt == SALT
    assert p.key_derivation == KeyDerivation(opslimit=1, memlimit=8192, salt=SALT, alg=2)
    assert p.key == derive_key(PASSPHRASE.encode(), SALT, 1, 8192)
    assert p.key == EncryptionParams.from_string(PASSPHRASE.encode(), 1, 8192, SALT).key
    fresh = EncryptionParams.from_string(PASSPHRASE, OpsLimit.MIN, MemLimit.MIN)
    assert len(fresh.salt) == 16 and fresh.salt != SALT and fresh.key != p.key


def test_from_string_defaults_to_moderate(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(params, "derive_key", lambda *a: seen.append(a[2:]) or bytes(32))
    p = EncryptionParams.from_string(PASSPHRASE)
    assert seen == [(3, 256 << 20, 2)]
    assert (p.key_derivation.opslimit, p.key_derivation.memlimit) == (3, 256 << 20)


def test_from_string_argument_errors() -> None:
    with pytest.raises(ConfigError, match="swapped"):
        EncryptionParams.from_string(PASSPHRASE, MemLimit.MIN, OpsLimit.MIN)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="empty"):
        EncryptionParams.from_string("")
    with pytest.raises(ConfigError, match="salt must be 16 bytes"):
        EncryptionParams.from_string(PASSPHRASE, 1, 8192, b"short")
    with pytest.raises(ConfigError, match="empty"):
        DecryptionParams.from_string(b"")


def test_encoding_is_honoured() -> None:
    utf8 = EncryptionParams.from_string("pässwörd", 1, 8192, SALT)
    latin = EncryptionParams.from_string("pässwörd", 1, 8192, SALT, encoding="latin-1")
    assert utf8.key != latin.key
    kdf_chunk = latin.key_derivation
    assert (
        DecryptionParams.from_string("pässwörd", encoding="latin-1").key_for(kdf_chunk) == latin.key
    )
    assert DecryptionParams.from_string("pässwörd").key_for(kdf_chunk) == utf8.key


def test_decryption_params_key_for() -> None:
    enc = EncryptionParams.from_string(PASSPHRASE, 1, 8192, SALT)
    by_pw = DecryptionParams.from_string(PASSPHRASE)
    assert by_pw.is_passphrase
    assert by_pw.key_for(enc.key_derivation) == enc.key
    by_key = DecryptionParams.from_key(enc.key)
    assert not by_key.is_passphrase
    assert by_key.key_for(None) == by_key.key_for(enc.key_derivation) == enc.key
    with pytest.raises(KeyRequiredError, match="raw 32-byte key, not a passphrase") as info:
        by_pw.key_for(None, label="tensor 'w'")
    assert "DecryptionParams.from_key" in str(info.value) and "tensor 'w'" in str(info.value)
    with pytest.raises(CryptoError, match="unknown key-derivation method"):
        by_pw.key_for(UnknownChunk(1, b"\x09\x00"))
    with pytest.raises(ConfigError, match="refused"):
        by_pw.key_for(KeyDerivation(opslimit=10**6, memlimit=8192, salt=SALT))
    with pytest.raises(ConfigError, match="exactly 32 bytes"):
        DecryptionParams.from_key(b"short")


def test_params_pickle_round_trip() -> None:
    enc = EncryptionParams.from_string(PASSPHRASE, 1, 8192, SALT)
    back = pickle.loads(pickle.dumps(enc))
    assert back.key == enc.key and back.key_derivation == enc.key_derivation
    dec = pickle.loads(pickle.dumps(DecryptionParams.from_string(PASSPHRASE)))
    assert dec.key_for(enc.key_derivation) == enc.key


def test_secrets_never_appear_in_repr_str_logs_or_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    pw = "Sup3r-Secret-Passphrase"
    enc = EncryptionParams.from_string(pw, 1, 8192, SALT)
    raw = EncryptionParams.random()
    secrets_ = [pw, pw.encode().hex(), enc.key.hex(), repr(enc.key), raw.key.hex(), repr(raw.key)]
    texts = []
    for obj in (
        enc,
        raw,
        DecryptionParams.from_string(pw),
        DecryptionParams.from_key(raw.key),
    ):
        texts += [repr(obj), str(obj), f"{obj}", f"{obj!r}"]
    assert "opslimit=1" in repr(enc) and "<raw key>" in repr(raw)

    buf = bytearray(3000)
    info = seal_tensor(buf, enc.key, key_derivation=enc.key_derivation, chunk_size=1024)
    for attempt in (
        lambda: open_tensor(buf, info, raw.key, label="w"),
        lambda: open_tensor(
            buf, info, DecryptionParams.from_string(pw + "x").key_for(info.key_derivation)
        ),
        lambda: DecryptionParams.from_string(pw).key_for(None),
        lambda: EncryptionParams(pw.encode()),
        lambda: open_tensor(buf, CryptInfo(()), enc.key),
    ):
        with pytest.raises((DecryptionError, KeyRequiredError, ConfigError, FormatError)) as err:
            attempt()
        texts.append(str(err.value))
        texts.append(repr(err.value))
    texts.append(caplog.text)
    for text in texts:
        for secret in secrets_:
            assert secret not in text
