"""Issue #15: one verification rule on every load path.

``verify_hash=True`` keeps tensorizer's meaning: every stored hash (CRC32 and SHA-256)
is checked, and a tensor whose header stores no hash, or a hash type this reader does
not know, cannot be verified and is refused (tensorizer raises on unknown types).
Without ``verify_hash`` unknown types are ignored.
"""

from __future__ import annotations

import struct

import pytest
import torch

from tensorstream.errors import HashMismatchError, IntegrityError
from tensorstream.formats.tensorizer import HASH_CRC32, HASH_SHA256

from ._edit import edit_header, edit_index, entry, hash_section_offset, header
from .conftest import write


@pytest.fixture()
def original(tmp_path):
    return write(tmp_path / "m.tensors")


def _first_hash_is(data: bytes, name: str, htype: int) -> None:
    e, h = header(data, name)
    assert data[e.header_offset + h.hash_spans[0][0] - 2] == htype


def _patched(path, name: str, *, count: int | None = None, types: dict[int, int] | None = None):
    data = bytearray(path.read_bytes())
    at = hash_section_offset(bytes(data), name)
    if count is not None:
        data[at] = count
    for i, new_type in (types or {}).items():
        _, h = header(bytes(data), name)
        start = h.hash_spans[i][0]
        data[entry(bytes(data), name).header_offset + start - 2] = new_type
    out = path.with_name(f"{name}-hash.tensors")
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("tensor", ["w", "meta", "empty"])
def test_no_hash_refused_under_verify(original, load, tensor) -> None:
    path = _patched(original, tensor, count=0)
    with pytest.raises(IntegrityError, match=f"'{tensor}'.*stores no hash"):
        load(path, verify=True)
    load(path, verify=False)  # nothing to verify against: loads


@pytest.mark.parametrize("tensor", ["w", "meta"])
def test_unknown_hash_type_refused_under_verify(original, load, tensor) -> None:
    path = _patched(original, tensor, types={1: 7})  # SHA-256 entry relabelled type 7
    with pytest.raises(IntegrityError, match=f"'{tensor}'.*hash types \\[7\\]"):
        load(path, verify=True)
    got = load(path, verify=False)  # unknown types are ignored without verify_hash
    assert got[tensor].shape == (2, 3) if tensor == "w" else got[tensor].shape == (5,)


def _crc_only(original, name: str):
    """The file with tensor ``name`` stored with a CRC32 only (a correct one)."""
    data = original.read_bytes()
    _first_hash_is(data, name, HASH_CRC32)
    path = _patched(original, name, count=1)  # the SHA-256 entry is now outside the count
    fixed = edit_header(path.read_bytes(), name, rehash=True)
    assert list(header(fixed, name)[1].hashes) == [HASH_CRC32]
    path.write_bytes(fixed)
    return path


def test_crc32_only_tensor_is_verified_on_every_path(original, load) -> None:
    """Regression: the staged path checked SHA-256 only, so this loaded unverified."""
    path = _crc_only(original, "w")
    assert torch.equal(load(path, verify=True)["w"], load(original)["w"])
    data = bytearray(path.read_bytes())
    data[entry(bytes(data), "w").data_offset + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(HashMismatchError, match="'w' failed CRC32"):
        load(path, verify=True)


def test_both_hashes_are_checked(original, load) -> None:
    """A file whose SHA-256 matches but whose CRC32 was altered is refused."""
    data = bytearray(original.read_bytes())
    _first_hash_is(bytes(data), "w", HASH_CRC32)
    e, h = header(bytes(data), "w")
    start, _ = h.hash_spans[0]
    (crc,) = struct.unpack_from("<I", data, e.header_offset + start)
    struct.pack_into("<I", data, e.header_offset + start, crc ^ 1)
    path = original.with_name("crc.tensors")
    path.write_bytes(bytes(data))
    assert HASH_SHA256 in h.hashes
    with pytest.raises(HashMismatchError, match="'w' failed CRC32"):
        load(path, verify=True)


def test_meta_header_hash_is_verified(original, load) -> None:
    """A meta tensor's header is hashed too: editing its shape in both places is caught."""
    data = original.read_bytes()
    edited = edit_header(edit_index(data, "meta", shape=(6,)), "meta", shape=(6,))
    path = original.with_name("metahash.tensors")
    path.write_bytes(edited)
    with pytest.raises(HashMismatchError, match="'meta'"):
        load(path, verify=True)
    assert load(path)["meta"].shape == (6,)  # without verify_hash: a consistent edit loads
