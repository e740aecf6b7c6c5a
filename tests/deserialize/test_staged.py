"""The device (staged, double-buffered) load path, exercised on CPU and, with CUDA, on GPU."""

from __future__ import annotations

import pytest
import torch

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.deserialize import place
from tensorstream.errors import HashMismatchError


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: several staging buffers
        "bf": torch.randn(300, 301, generator=g).bfloat16(),
        "ints": torch.arange(1000, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "meta": torch.empty(5, device="meta"),
    }


def _write(tmp_path, sd: dict[str, torch.Tensor], key: EncryptionParams | None = None):
    path = tmp_path / "m.tensors"
    with TensorSerializer(path, encryption=key) as s:
        s.write_state_dict(sd)
    return path


@pytest.fixture()
def staged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TensorDeserializer, "_force_staged", True)
    # small buffers so every tensor crosses buffer boundaries
    monkeypatch.setattr("tensorstream.deserialize.reader._STAGING_BYTES", 4 << 20)


def _check(loaded: TensorDeserializer, sd: dict[str, torch.Tensor]) -> None:
    for name, t in sd.items():
        if t.is_meta:
            assert torch.equal(loaded[name].cpu(), torch.zeros(5))
        else:
            assert torch.equal(loaded[name].cpu(), t), name


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("readers", [1, 3])
def test_staged_plain(tmp_path, staged, verify: bool, readers: int) -> None:
    sd = _state()
    path = _write(tmp_path, sd)
    loaded = TensorDeserializer(path, device="cpu", verify_hash=verify, num_readers=readers)
    _check(loaded, sd)


@pytest.mark.parametrize("verify", [False, True])
def test_staged_encrypted(tmp_path, staged, verify: bool) -> None:
    sd = _state()
    key = EncryptionParams.random()
    path = _write(tmp_path, sd, key)
    loaded = TensorDeserializer(
        path,
        device="cpu",
        verify_hash=verify,
        num_readers=2,
        encryption=DecryptionParams.from_key(key.key),
    )
    _check(loaded, sd)


def test_staged_detects_corruption(tmp_path, staged) -> None:
    sd = _state()
    path = _write(tmp_path, sd)
    from tensorstream.deserialize.index import read_index
    from tensorstream.sources import open_source

    with open_source(path) as src:
        rec = next(r for r in read_index(src).records if r.key == "big")
    data = bytearray(path.read_bytes())
    data[rec.data_offset + (5 << 20)] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(HashMismatchError, match=r"'big'.*offset"):
        TensorDeserializer(path, device="cpu", verify_hash=True)


def test_staging_size_is_bounded_and_quantized() -> None:
    from tensorstream.deserialize.plan import ReadRange

    plan = [[ReadRange(0, 100 << 20)], [ReadRange(0, 3 << 20)]]
    assert place.staging_size(plan, 32 << 20, 2 << 20) == 32 << 20
    assert place.staging_size([[ReadRange(0, 3 << 20)]], 32 << 20, 2 << 20) == 4 << 20


@pytest.mark.gpu
@pytest.mark.parametrize("verify", [False, True])
def test_cuda_load_matches(tmp_path, verify: bool) -> None:
    sd = _state()
    path = _write(tmp_path, sd)
    loaded = TensorDeserializer(path, device="cuda", verify_hash=verify, num_readers=4)
    assert loaded["big"].device.type == "cuda"
    _check(loaded, sd)


@pytest.mark.gpu
def test_cuda_encrypted_and_dtype(tmp_path) -> None:
    sd = _state()
    key = EncryptionParams.random()
    path = _write(tmp_path, sd, key)
    loaded = TensorDeserializer(
        path,
        device="cuda",
        dtype=torch.float16,
        encryption=DecryptionParams.from_key(key.key),
        verify_hash=True,
    )
    assert loaded["big"].dtype == torch.float16
    assert loaded["ints"].dtype == torch.int64
    assert torch.equal(loaded["ints"].cpu(), sd["ints"])
