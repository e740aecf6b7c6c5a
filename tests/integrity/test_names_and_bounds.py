"""Issue #15 (duplicate names, allocation bounds) and issue #14 (top-level int keys)."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import torch
from tensorizer import TensorDeserializer as TzDeserializer
from tensorizer import TensorSerializer as TzSerializer

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.deserialize.index import DEFAULT_META_LIMIT, META_LIMIT_ENV
from tensorstream.errors import FormatError

from ._edit import edit_header, edit_index
from .conftest import write


@pytest.fixture()
def original(tmp_path):
    return write(tmp_path / "m.tensors")


def test_duplicate_tensor_name_refused(original, load) -> None:
    """Regression: two tensors named 'w' loaded silently, the last one winning."""
    data = edit_header(original.read_bytes(), "ints", raw_name=b"tail")
    data = edit_index(data, "ints", raw_name=b"tail")
    path = original.with_name("dup.tensors")
    path.write_bytes(data)
    with pytest.raises(FormatError, match="'tail' appears twice"):
        load(path)


def test_tensor_and_branch_with_one_name_refused(tmp_path) -> None:
    sd = {"a": torch.ones(2), "b": {"c": torch.ones(3)}}
    path = write(tmp_path / "tree.tensors", sd)
    data = edit_header(path.read_bytes(), "a", raw_name=b"b")
    data = edit_index(data, "a", raw_name=b"b")
    path.write_bytes(data)
    with pytest.raises(FormatError, match="'b.c' lies under 'b'"):
        TensorDeserializer(path, device="cpu")


def _huge_meta(original, shape):
    data = edit_index(original.read_bytes(), "meta", shape=shape)
    path = original.with_name("huge.tensors")
    path.write_bytes(edit_header(data, "meta", shape=shape, rehash=True))
    return path


def test_meta_shape_edit_cannot_allocate_gigabytes(original, load) -> None:
    """Regression: 4 bytes edited in a 262 KB file asked for 16 GiB of zeros."""
    path = _huge_meta(original, (1 << 32 - 1,))
    assert path.stat().st_size < 300_000
    with pytest.raises(FormatError) as info:
        load(path)
    msg = str(info.value)
    for word in ("'meta'", "limit", META_LIMIT_ENV, str(DEFAULT_META_LIMIT)):
        assert word in msg, msg


def test_meta_limit_is_configurable(original, monkeypatch) -> None:
    path = _huge_meta(original, (1 << 20,))  # 4 MiB of zeros: under the default cap
    got = TensorDeserializer(path, device="cpu", verify_hash=True)["meta"]
    assert got.shape == (1 << 20,) and not got.any()
    monkeypatch.setenv(META_LIMIT_ENV, str(1 << 20))
    with pytest.raises(FormatError, match="more than the limit of 1048576 bytes"):
        TensorDeserializer(path, device="cpu")


@pytest.mark.parametrize("tensor", ["meta", "empty"])
def test_u32_dimension_overflow_is_a_format_error(original, load, tensor) -> None:
    """Regression: dims of 2**32-1 raised torch's bare RuntimeError (stride overflow)."""
    shape = (0, 0xFFFFFFFF, 0xFFFFFFFF) if tensor == "empty" else (0xFFFFFFFF,) * 1
    if tensor == "meta":
        data = edit_index(original.read_bytes(), "meta", dtype="<f4")
        path = original.with_name("dims.tensors")
        data = edit_header(edit_index(data, "meta", shape=shape), "meta", shape=shape)
    else:
        path = original.with_name("dims.tensors")
        data = edit_index(original.read_bytes(), "empty", shape=shape)
        data = edit_header(data, "empty", shape=shape)
    path.write_bytes(data)
    with pytest.raises(FormatError, match=f"'{tensor}'"):
        load(path)


def test_meta_tensor_loads_as_zeros_like_tensorizer(original) -> None:
    ours = TensorDeserializer(original, device="cpu")["meta"]
    theirs = TzDeserializer(str(original), device="cpu")["meta"]
    assert torch.equal(ours, theirs) and ours.shape == (5,)


# ------------------------------------------------------------ issue #14: int keys


@pytest.mark.parametrize("writer", ["tensorstream", "tensorizer"])
@pytest.mark.parametrize("lazy", [False, True])
def test_top_level_int_keys(tmp_path, writer, lazy) -> None:
    """Regression: keys() listed 0..9 but d[0] raised KeyError."""
    tensors = [torch.full((3,), float(i)) for i in range(10)]
    path = tmp_path / "list.tensors"
    if writer == "tensorizer":
        s = TzSerializer(str(path))
        s.write_state_dict(tensors)
        s.close()
    else:
        with TensorSerializer(path) as s:
            s.write_state_dict(tensors)
    theirs = TzDeserializer(str(path), device="cpu")
    d = TensorDeserializer(path, device="cpu", lazy_load=lazy)
    assert list(d.keys()) == list(theirs.keys()) == list(range(10))
    for i in range(10):
        assert torch.equal(d[i], tensors[i]) and torch.equal(d[i], theirs[i])
        assert i in d
    # tensorizer answers KeyError for the text form; so do we
    for probe in ("0", 10):
        with pytest.raises(KeyError):
            theirs[probe]
        with pytest.raises(KeyError):
            d[probe]
    assert dict(d.items()).keys() == set(range(10))


def test_cli_inspect_refuses_duplicate_names_in_one_line(original) -> None:
    data = edit_header(original.read_bytes(), "ints", raw_name=b"tail")
    path = original.with_name("dupcli.tensors")
    path.write_bytes(edit_index(data, "ints", raw_name=b"tail"))
    proc = subprocess.run(
        [sys.executable, "-m", "tensorstream", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "appears twice" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("count", [0, 3])
def test_tensor_count_cut_is_refused(original, count) -> None:
    """Regression (found by the fuzz test): a tensor count of 0 in the file header
    loaded an empty mapping; a smaller count silently dropped the last tensors."""
    data = bytearray(original.read_bytes())
    struct.pack_into("<Q", data, 57, count)  # u64 tensor count after magic/version/flags/size
    path = original.with_name("count.tensors")
    path.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="tensor count in the file header is wrong"):
        TensorDeserializer(path, device="cpu")
