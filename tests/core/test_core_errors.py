"""Bad input: each case raises a documented ``tensorstream.errors`` class with a useful message."""

from __future__ import annotations

import re

import pytest
import torch
from _core_util import Net, make

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.deserialize.index import read_index
from tensorstream.errors import (
    ConfigError,
    FormatError,
    HashMismatchError,
    SerializationError,
    SourceNotFoundError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from tensorstream.sources.registry import open_source


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.tensors"
    with TensorSerializer(path) as s:
        s.write_state_dict(
            {"alpha": make(torch.float32, (16, 16), 1), "beta": make(torch.int32, (64,), 2)}
        )
    with open_source(str(path)) as src:
        index = read_index(src)
    return path, {r.key: r for r in index.records}


def _write(tmp_path, data: bytes, name="bad.tensors"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.tensors"
    with pytest.raises(SourceNotFoundError, match=re.escape(str(missing))):
        TensorDeserializer(missing, device="cpu")
    with pytest.raises(FileNotFoundError):
        TensorDeserializer(missing, device="cpu")


def test_wrong_magic(tmp_path, good):
    path, _ = good
    data = bytearray(path.read_bytes())
    data[0:5] = b"NOPE!"
    with pytest.raises(FormatError, match="neither a tensorizer") as exc:
        TensorDeserializer(_write(tmp_path, bytes(data)), device="cpu")
    assert "bad.tensors" in str(exc.value)


def test_unknown_version(tmp_path, good):
    path, _ = good
    data = bytearray(path.read_bytes())
    data[5] = 9
    with pytest.raises(UnsupportedVersionError, match="version 9"):
        TensorDeserializer(_write(tmp_path, bytes(data)), device="cpu")


@pytest.mark.parametrize(
    "where, expect",
    [
        ("file_header", "file header"),
        ("index", "tensor index"),
        ("tensor_header", "'beta'"),
        ("tensor_data", "'beta'"),
        ("end_marker", "end-of-file marker"),
    ],
)
@pytest.mark.parametrize("lazy", [False, True])
def test_truncated(tmp_path, good, where, expect, lazy):
    path, records = good
    data = path.read_bytes()
    beta = records["beta"]
    cut = {
        "file_header": 30,
        "index": 1000,
        "tensor_header": beta.header_offset + 5,
        "tensor_data": beta.data_offset + beta.data_length // 2,
        "end_marker": len(data) - 8,
    }[where]
    bad = _write(tmp_path, data[:cut])
    with pytest.raises(TruncatedFileError, match=expect) as exc:
        TensorDeserializer(bad, device="cpu", lazy_load=lazy)
    msg = str(exc.value)
    assert "truncated" in msg
    if where in ("tensor_header", "tensor_data"):
        assert str(beta.end) in msg and str(cut) in msg  # offsets named
    if where == "end_marker":
        assert str(beta.end) in msg


@pytest.mark.parametrize(
    "kw",
    [{}, {"lazy_load": True}, {"use_mmap": False}, {"num_readers": 3}],
    ids=["eager", "lazy", "no_mmap", "readers3"],
)
def test_corrupted_data_byte_verify_hash(tmp_path, good, kw):
    path, records = good
    data = bytearray(path.read_bytes())
    beta = records["beta"]
    data[beta.data_offset + 7] ^= 0xFF
    bad = _write(tmp_path, bytes(data))
    with pytest.raises(HashMismatchError) as exc:
        with TensorDeserializer(bad, device="cpu", verify_hash=True, **kw) as d:
            d["alpha"]
            d["beta"]
    assert "'beta'" in str(exc.value) and str(beta.data_offset) in str(exc.value)
    # without verification the load succeeds (the byte is just different)
    with TensorDeserializer(bad, device="cpu", **kw) as d:
        assert not torch.equal(d["beta"], make(torch.int32, (64,), 2))


def test_load_into_module_verify_hash_on_eager_deserializer(tmp_path):
    # tensorizer bug #40: load_into_module(verify_hash=True) after an eager load verifies nothing
    path = tmp_path / "m.tensors"
    with TensorSerializer(path) as s:
        s.write_module(Net().randomize(1))
    with open_source(str(path)) as src:
        rec = next(r for r in read_index(src).records if r.key == "head.weight")
    data = bytearray(path.read_bytes())
    data[rec.data_offset + 3] ^= 0x01
    bad = _write(tmp_path, bytes(data))
    d = TensorDeserializer(bad, device="cpu")  # eager, unverified: loads fine
    with pytest.raises(HashMismatchError, match="head.weight") as exc:
        d.load_into_module(Net(), verify_hash=True)
    assert str(rec.data_offset) in str(exc.value)
    d.close()


def test_corrupted_header_name(tmp_path, good):
    path, records = good
    data = bytearray(path.read_bytes())
    beta = records["beta"]
    # the name sits 13 bytes into the tensor header (u64 size, u16 module, u8 type, u16 len)
    assert data[beta.header_offset + 13 : beta.header_offset + 17] == b"beta"
    data[beta.header_offset + 13] = ord("z")
    bad = _write(tmp_path, bytes(data))
    for kw in ({}, {"use_mmap": False}, {"lazy_load": True}):
        with pytest.raises(FormatError, match="does not match the index") as exc:
            with TensorDeserializer(bad, device="cpu", **kw) as d:
                d["beta"]
        assert "'beta'" in str(exc.value) and str(beta.header_offset) in str(exc.value)


def test_filter_excluding_everything(good):
    path, _ = good
    with pytest.raises(ConfigError, match="excluded all 2 tensors"):
        TensorDeserializer(path, device="cpu", filter_func=lambda k: False)


def test_state_dict_file_to_load_into_module(good):
    path, _ = good
    with TensorDeserializer(path, device="cpu") as d:
        with pytest.raises(FormatError, match="state dict"):
            d.load_into_module(Net())


def test_same_name_twice(tmp_path):
    path = tmp_path / "dup.tensors"
    with pytest.raises(SerializationError, match="'x' is written twice"):
        with TensorSerializer(path) as s:
            s.write_tensor(0, "x", 2, torch.zeros(2))
            s.write_tensor(0, "x", 2, torch.ones(2))
    assert not path.exists()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_dtype(tmp_path):
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    path = tmp_path / "q.tensors"
    with pytest.raises(SerializationError, match=r"'q'.*quantized"):
        with TensorSerializer(path) as s:
            s.write_state_dict({"q": q})
    assert not path.exists()


def test_non_tensor_in_state_dict(tmp_path):
    path = tmp_path / "obj.tensors"
    with pytest.raises(SerializationError, match="cannot serialize a str"):
        with TensorSerializer(path) as s:
            s.write_state_dict({"a": torch.zeros(2), "b": "not a tensor"})
    assert not path.exists()
