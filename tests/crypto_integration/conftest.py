"""Helpers for the encryption integration tests: small state dicts, fast passphrase keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tensorstream.crypto import DecryptionParams, EncryptionParams, MemLimit, OpsLimit
from tensorstream.deserialize.reader import TensorDeserializer
from tensorstream.serialize.writer import TensorSerializer

PASSPHRASE = "correct horse battery staple"


def state_dict() -> dict[str, torch.Tensor]:
    """A few MB: multi-chunk tensors (2 MiB chunks), same-shape pairs, zero-element tensors."""
    g = torch.Generator().manual_seed(4)
    return {
        "embed.weight": torch.randn(700, 1024, generator=g),  # 2.7 MiB: 2 chunks
        "layer.0.w": torch.randn(64, 64, generator=g),
        "layer.1.w": torch.randn(64, 64, generator=g),
        "layer.0.b": torch.randn(64, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 8),
        "steps": torch.arange(17, dtype=torch.int64),
    }


def fast_passphrase_params(passphrase: str = PASSPHRASE) -> EncryptionParams:
    return EncryptionParams.from_string(passphrase, OpsLimit.MIN, MemLimit.MIN)


def write(path: Path | str, encryption: EncryptionParams | None, **kwargs: object) -> dict:
    sd = state_dict()
    with TensorSerializer(str(path), encryption=encryption, **kwargs) as s:  # type: ignore[arg-type]
        s.write_state_dict(sd)
    return sd


def load(path: Path | str, decryption: DecryptionParams | None, **kwargs: object) -> dict:
    with TensorDeserializer(str(path), device="cpu", encryption=decryption, **kwargs) as d:  # type: ignore[arg-type]
        return {k: d[k].detach().clone() for k in d}


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k


def manifest_of(path: Path) -> dict:
    return json.loads(Path(f"{path}.manifest").read_text())


@pytest.fixture
def raw_file(tmp_path: Path) -> tuple[Path, EncryptionParams, dict]:
    enc = EncryptionParams.random()
    path = tmp_path / "model.tensors"
    sd = write(path, enc)
    return path, enc, sd
