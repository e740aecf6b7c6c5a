"""``verify_hash="crc32"``: the stored CRC32 alone is checked (ISA-L), on every path."""

from __future__ import annotations

import pytest
import torch
from _arena_util import write_ours, write_theirs

from tensorstream import TensorDeserializer
from tensorstream.deserialize.index import read_index
from tensorstream.errors import ConfigError, HashMismatchError
from tensorstream.formats.tensorizer import HASH_CRC32, HASH_SHA256, unpack_tensor_header
from tensorstream.sources.registry import open_source

SD = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7, 33, dtype=torch.bfloat16)}
PATHS = ["cpu", "staged", "no-mmap"]


def _load(path, verify, how):
    TensorDeserializer._force_staged = how == "staged"
    try:
        kw = {"use_mmap": False} if how == "no-mmap" else {}
        with TensorDeserializer(path, device="cpu", verify_hash=verify, **kw) as d:
            return {k: v.clone() for k, v in d.items()}
    finally:
        TensorDeserializer._force_staged = False


def _spoil_stored_hash(path, htype):
    """Flip one byte of the stored hash of type ``htype`` of tensor 'a'."""
    with open_source(str(path)) as src:
        index = read_index(src)
        r = next(r for r in index.records if r.key == "a")
        buf = bytearray(r.header_size)
        src.read_into(r.header_offset, memoryview(buf))
    parsed = unpack_tensor_header(buf, long_shape=False, crypt_info=False)
    types = [t for t in (HASH_CRC32, HASH_SHA256) if t in parsed.hashes]
    start, _ = parsed.hash_spans[types.index(htype)]
    with open(path, "r+b") as f:
        f.seek(r.header_offset + start)
        byte = f.read(1)
        f.seek(r.header_offset + start)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("how", PATHS)
@pytest.mark.parametrize("writer", [write_ours, write_theirs], ids=["ours", "theirs"])
def test_crc32_mode_skips_sha256_and_true_checks_it(tmp_path, writer, how):
    path = writer(tmp_path / "f.tensors", SD)
    _spoil_stored_hash(path, HASH_SHA256)
    got = _load(path, "crc32", how)  # SHA-256 is not computed: the spoiled value is unseen
    assert torch.equal(got["a"], SD["a"]) and torch.equal(got["b"], SD["b"])
    with pytest.raises(HashMismatchError, match="SHA-256"):
        _load(path, True, how)


@pytest.mark.parametrize("how", PATHS)
def test_crc32_mode_catches_corrupt_data(tmp_path, how):
    path = write_ours(tmp_path / "f.tensors", SD)
    with open_source(str(path)) as src:
        r = next(r for r in read_index(src).records if r.key == "a")
    with open(path, "r+b") as f:
        f.seek(r.data_offset + 100)
        f.write(b"\x42")
    with pytest.raises(HashMismatchError, match=r"'a' failed CRC32 verification.*offset"):
        _load(path, "crc32", how)


@pytest.mark.parametrize("how", PATHS)
def test_crc32_mode_checks_the_crc_itself(tmp_path, how):
    path = write_ours(tmp_path / "f.tensors", SD)
    _spoil_stored_hash(path, HASH_CRC32)
    with pytest.raises(HashMismatchError, match="CRC32"):
        _load(path, "crc32", how)


def test_unknown_verify_mode_refused(tmp_path):
    path = write_ours(tmp_path / "f.tensors", SD)
    with pytest.raises(ConfigError, match="verify_hash"):
        TensorDeserializer(path, device="cpu", verify_hash="md5")
