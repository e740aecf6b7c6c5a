"""Issue #15: the index and each tensor header must agree, on every load path.

Each test edits one field in one place only (the index, or the header) and expects a
``FormatError`` naming the tensor and the field, whatever the load path; before the
fix some paths loaded such files silently with wrong dtypes, shapes or zeros.
"""

from __future__ import annotations

import pytest
import torch

from tensorstream.errors import FormatError

from ._edit import edit_header, edit_index, entry
from .conftest import state_dict, write


@pytest.fixture()
def original(tmp_path):
    return write(tmp_path / "m.tensors")


def _expect(load, path, *words: str, verify: bool = False) -> None:
    with pytest.raises(FormatError) as info:
        load(path, verify=verify)
    msg = str(info.value)
    for w in words:
        assert w in msg, msg


def test_clean_file_loads_on_every_path(original, load) -> None:
    got = load(original, verify=True)
    for name, want in state_dict().items():
        if want.is_meta:
            assert torch.equal(got[name], torch.zeros(5))
        else:
            assert torch.equal(got[name], want), name


@pytest.mark.parametrize("verify", [False, True])
def test_index_dtype_edit_is_refused(original, load, verify) -> None:
    path = original.with_name("dtype.tensors")
    path.write_bytes(edit_index(original.read_bytes(), "w", dtype="<i4"))
    _expect(load, path, "'w'", "dtype", "'<i4'", "'<f4'", verify=verify)


def test_header_dtype_edit_is_refused(original, load) -> None:
    path = original.with_name("hdtype.tensors")
    path.write_bytes(edit_header(original.read_bytes(), "ints", dtype="<f4"))
    _expect(load, path, "'ints'", "dtype")


def test_index_shape_edit_is_refused(original, load) -> None:
    path = original.with_name("shape.tensors")
    path.write_bytes(edit_index(original.read_bytes(), "w", shape=(3, 2)))
    _expect(load, path, "'w'", "shape", "[3, 2]", "[2, 3]")


def test_index_name_edit_is_refused(original, load) -> None:
    path = original.with_name("name.tensors")
    path.write_bytes(edit_index(original.read_bytes(), "tail", raw_name=b"tall"))
    _expect(load, path, "'tall'", "name")


def test_index_tensor_type_edit_is_refused(original, load) -> None:
    path = original.with_name("type.tensors")
    path.write_bytes(edit_index(original.read_bytes(), "w", tensor_type=1))
    _expect(load, path, "'w'", "tensor type")


def test_index_data_length_zero_does_not_make_a_meta_tensor(original, load) -> None:
    """Regression: data_length=0 in the index alone turned 'w' into zeros on CPU loads."""
    path = original.with_name("meta.tensors")
    path.write_bytes(edit_index(original.read_bytes(), "w", data_length=0))
    _expect(load, path, "'w'", "data length")


def test_index_only_meta_shape_edit_is_refused(original, load) -> None:
    """Regression: a meta tensor's header was never read on CPU loads."""
    path = original.with_name("metashape.tensors")
    path.write_bytes(edit_index(original.read_bytes(), "meta", shape=(7,)))
    _expect(load, path, "'meta'", "shape")


def test_index_only_meta_name_edit_is_refused(original, load) -> None:
    path = original.with_name("metaname.tensors")
    path.write_bytes(edit_index(original.read_bytes(), "meta", raw_name=b"mota"))
    _expect(load, path, "'mota'", "name")


@pytest.mark.parametrize("verify", [False, True])
def test_zero_length_tensor_header_is_checked(original, load, verify) -> None:
    """Regression: the staged path with verify_hash never read empty tensors' headers."""
    path = original.with_name("empty.tensors")
    path.write_bytes(edit_header(original.read_bytes(), "empty", shape=(0, 4, 5)))
    _expect(load, path, "'empty'", "shape", verify=verify)


def test_header_offset_named_in_message(original, load) -> None:
    path = original.with_name("off.tensors")
    data = original.read_bytes()
    path.write_bytes(edit_index(data, "w", dtype="<i4"))
    _expect(load, path, f"offset {entry(data, 'w').header_offset}")
