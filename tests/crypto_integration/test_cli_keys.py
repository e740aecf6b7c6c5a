"""``tensorstream keygen`` and the shared ``--keyfile`` / ``--passphrase-env`` options."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from tensorstream.cli.keys import add_key_options, decryption_from_args, encryption_from_args
from tensorstream.cli.main import main
from tensorstream.crypto import read_keyfile
from tensorstream.errors import ConfigError

from .conftest import assert_same, load, write


def test_keygen_writes_a_0600_key_and_refuses_to_overwrite(tmp_path: Path, capsys) -> None:
    path = tmp_path / "model.key"
    assert main(["keygen", str(path)]) == 0
    key = path.read_bytes()
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    out = capsys.readouterr().out
    assert str(path) in out and key.hex() not in out
    assert main(["keygen", str(path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert path.read_bytes() == key  # untouched
    assert main(["keygen", "--force", str(path)]) == 0
    assert path.read_bytes() != key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_keygen_to_s3(s3_env, s3_bucket) -> None:
    uri = f"s3://{s3_bucket}/keys/model.key"
    assert main(["keygen", uri]) == 0
    assert len(read_keyfile(uri)) == 32
    assert main(["keygen", uri]) == 2  # exists: refused


def _parser(for_writing: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_key_options(p, for_writing=for_writing)
    return p


def test_keyfile_option_round_trip(tmp_path: Path) -> None:
    key_path = tmp_path / "k.key"
    assert main(["keygen", str(key_path)]) == 0
    w = _parser(True).parse_args(["--keyfile", str(key_path)])
    r = _parser(False).parse_args(["--keyfile", str(key_path), "--require-manifest"])
    enc = encryption_from_args(w)
    sd = write(tmp_path / "m.tensors", enc, manifest=not w.no_manifest)
    got = load(tmp_path / "m.tensors", decryption_from_args(r), require_manifest=r.require_manifest)
    assert_same(got, sd)


def test_passphrase_env_option(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TS_TEST_PASS", "s3cret-phrase")
    w = _parser(True).parse_args(["--passphrase-env", "TS_TEST_PASS", "--kdf-strength", "min"])
    enc = encryption_from_args(w)
    assert enc is not None and enc.key_derivation.opslimit == 1
    sd = write(tmp_path / "m.tensors", enc)
    r = _parser(False).parse_args(["--passphrase-env", "TS_TEST_PASS"])
    assert_same(load(tmp_path / "m.tensors", decryption_from_args(r)), sd)


def test_key_options_absent_or_bad(monkeypatch) -> None:
    assert encryption_from_args(_parser(True).parse_args([])) is None
    assert decryption_from_args(_parser(False).parse_args([])) is None
    monkeypatch.delenv("TS_UNSET_VAR", raising=False)
    args = _parser(False).parse_args(["--passphrase-env", "TS_UNSET_VAR"])
    with pytest.raises(ConfigError, match="TS_UNSET_VAR is not set"):
        decryption_from_args(args)
    with pytest.raises(SystemExit):  # one key source at a time
        _parser(False).parse_args(["--keyfile", "k", "--passphrase-env", "V"])
