"""``tensorstream inspect`` (text and JSON) and format-level pack/unpack of long dims (v5)."""

from __future__ import annotations

import json

import pytest
import torch
from _core_util import make
from safetensors.torch import save_file

from tensorstream import TensorSerializer
from tensorstream.cli.main import main
from tensorstream.errors import FormatError
from tensorstream.formats.tensorizer import (
    FileHeader,
    IndexEntry,
    pack_file_header,
    pack_metadata,
    pack_tensor_header,
    unpack_file_header,
    unpack_metadata,
    unpack_tensor_header,
)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.tensors"
    with TensorSerializer(path) as s:
        s.write_state_dict(
            {
                "emb": make(torch.bfloat16, (10, 4), 1),
                "layers": [{"w": make(torch.float32, (3, 2), 2)}],
                "ghost": torch.empty(5, device="meta"),
            }
        )
    return path


def test_inspect_json(model_file, capsys):
    assert main(["inspect", "--json", str(model_file)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "tensorizer"
    assert info["version"] == 4  # meta tensor
    assert info["encrypted"] is False and info["flags"] == 0
    assert info["tensor_count"] == 3
    assert info["total_tensor_bytes"] == 10 * 4 * 2 + 3 * 2 * 4
    assert info["file_size"] == model_file.stat().st_size
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["emb"]["dtype"] == "bfloat16" and by_name["emb"]["shape"] == [10, 4]
    assert by_name["layers.0.w"]["key"] == ["layers", 0, "w"]
    assert by_name["layers.0.w"]["bytes"] == 24
    assert by_name["layers.0.w"]["offset"] % 64 == 0
    assert by_name["ghost"]["meta"] is True and by_name["ghost"]["bytes"] == 0


def test_inspect_text(model_file, capsys):
    assert main(["inspect", str(model_file)]) == 0
    out = capsys.readouterr().out
    assert "format:      tensorizer" in out
    assert "version:     4" in out
    assert "encrypted:   no" in out
    assert "tensors:     3" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["emb"][1] == "bfloat16" and rows["emb"][-2] == "80"
    assert rows["layers.0.w"][1] == "float32"
    assert "(10, 4)" in out


def test_inspect_encrypted_with_keyfile(tmp_path, capsys):
    from tensorstream.crypto import EncryptionParams
    from tensorstream.crypto.keyfile import write_keyfile

    params = EncryptionParams.random()
    path = tmp_path / "enc.tensors"
    with TensorSerializer(path, encryption=params) as s:
        s.write_state_dict({"a": make(torch.float32, (4,), 1), "b": make(torch.int8, (9,), 2)})
    key = tmp_path / "k.key"
    write_keyfile(key, params.key)
    assert main(["inspect", "--json", "--keyfile", str(key), str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["encrypted"] is True and info["version"] == 3 and info["key"] == "ok"
    wrong = tmp_path / "wrong.key"
    write_keyfile(wrong, EncryptionParams.random().key)
    assert main(["inspect", "--keyfile", str(wrong), str(path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_inspect_safetensors(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.int64)}, str(path))
    assert main(["inspect", "--json", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "safetensors" and info["version"] is None
    assert {t["name"]: t["dtype"] for t in info["tensors"]} == {"w": "float32", "b": "int64"}


def test_inspect_errors(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.tensors")]) == 2
    assert "missing.tensors" in capsys.readouterr().err
    bad = tmp_path / "bad.tensors"
    bad.write_bytes(b"|TZR|" + bytes(20))
    assert main(["inspect", str(bad)]) == 2
    assert "truncated" in capsys.readouterr().err


# ---------------------------------------------------------------- long dims (v5), no data


def test_long_dims_pack_unpack():
    long_shape = (3, 2**33 + 5)
    entries = [
        IndexEntry(b"short", 2, "<f4", (2, 3), 1000, 1100, 24),
        IndexEntry(b"long", 2, "<f2", long_shape, 2000, 2100, 0, long_shape=True),
    ]
    packed = pack_metadata(entries, versioned=True)
    assert packed[:4] == b"\x01\x00\x00\x00"  # every entry tagged in a v5 file
    back = unpack_metadata(packed, 2, versioned=True)
    assert back == entries
    assert [e.long_shape for e in back] == [False, True]
    with pytest.raises(FormatError, match="long dims"):
        pack_metadata(entries, versioned=False)

    header = pack_tensor_header(
        module_idx=0,
        tensor_type=2,
        raw_name=b"long",
        dtype="<f2",
        shape=long_shape,
        hashes=[(0, bytes(4)), (1, bytes(32))],
        data_length=0,
        long_shape=True,
    )
    parsed = unpack_tensor_header(header, long_shape=True, crypt_info=False)
    assert parsed.shape == long_shape and parsed.raw_name == b"long"

    fh = FileHeader(version=5, flags=2, tensor_size=24, tensor_count=2, metadata_len=len(packed))
    assert unpack_file_header(pack_file_header(fh)) == fh
    assert unpack_file_header(pack_file_header(fh)).versioned_headers
