"""``TensorDeserializer(into=...)``: the named tensors' bytes land in the caller's own
tensors on every CPU path (views, cold reads, unaligned copies, hashed, decrypted,
remote), and the deserializer hands out that same memory. Bad destinations are refused
before anything is read."""

from __future__ import annotations

import gc

import pytest
import torch
from _arena_util import assert_same, drop_from_page_cache, write_ours, write_theirs

from tensorstream import TensorDeserializer
from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.deserialize.arena import live_arena_bytes
from tensorstream.errors import ConfigError, HashMismatchError


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed": torch.randn(300, 64, dtype=torch.bfloat16),
        "norm": torch.randn(64),
        "odd": torch.randn(3, 7, dtype=torch.float16),
        "ids": torch.arange(1000, dtype=torch.int64),
        "empty": torch.empty(0, 5),
    }


def _dest(sd: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    return {n: torch.full_like(sd[n], 7) for n in names}


def _check(got, sd, into):
    for name, t in sd.items():
        assert_same(got[name], t, name)
    for name, dest in into.items():
        assert_same(dest, sd[name], name)  # the caller's tensor holds the file's bytes
        if dest.numel():
            assert got[name].data_ptr() == dest.data_ptr(), name  # the same memory


@pytest.mark.parametrize("writer", [write_ours, write_theirs], ids=["ours", "theirs"])
@pytest.mark.parametrize("how", ["cached", "cold", "verify_hash", "no_mmap"])
def test_local_loads_fill_the_callers_tensors(tmp_path, monkeypatch, writer, how):
    sd = _state()
    path = writer(tmp_path / "m.tensors", sd)
    if how == "cold":
        monkeypatch.setenv("TENSORSTREAM_COLD_READ", "read")
        drop_from_page_cache(path)
    else:
        path.read_bytes()
    into = _dest(sd, ["embed", "odd", "ids", "empty"])
    kwargs = {"verify_hash": how == "verify_hash", "use_mmap": how != "no_mmap"}
    gc.collect()
    before = live_arena_bytes()
    with TensorDeserializer(path, device="cpu", into=into, **kwargs) as d:
        got = dict(d)
        _check(got, sd, into)
        if how != "cached" or writer is write_theirs:
            # only "norm" may need fresh memory: the rest landed in place
            assert live_arena_bytes() - before <= 2 << 20


def test_encrypted_load_decrypts_into_the_callers_tensors(tmp_path):
    sd = _state()
    enc = EncryptionParams.random()
    path = write_ours(tmp_path / "e.tensors", sd, encryption=enc)
    key = DecryptionParams.from_key(enc.key)
    for use_mmap in (True, False):  # decrypt out of the map / read, then decrypt
        into = _dest(sd, ["embed", "norm"])
        with TensorDeserializer(
            path, device="cpu", encryption=key, use_mmap=use_mmap, into=into
        ) as d:
            _check(dict(d), sd, into)


@pytest.mark.integration
def test_http_load_fills_the_callers_tensors(http_server):
    sd = _state()
    write_theirs(http_server.root / "into.tensors", sd)
    into = _dest(sd, ["embed", "norm", "ids"])
    with TensorDeserializer(
        http_server.url("into.tensors"), device="cpu", num_readers=3, into=into
    ) as d:
        _check(dict(d), sd, into)


def test_lazy_load_fills_on_first_access(tmp_path):
    sd = _state()
    path = write_theirs(tmp_path / "m.tensors", sd)
    into = _dest(sd, ["embed"])
    with TensorDeserializer(path, device="cpu", lazy_load=True, into=into) as d:
        assert_same(into["embed"], torch.full_like(sd["embed"], 7), "not read yet")
        assert d["embed"].data_ptr() == into["embed"].data_ptr()
        assert_same(into["embed"], sd["embed"], "embed")


def test_a_tampered_tensor_is_refused_in_place(tmp_path):
    """With verify_hash the hash is checked on the caller's bytes: a flipped byte is
    refused by name, not handed out."""
    sd = _state()
    path = write_ours(tmp_path / "m.tensors", sd)
    with TensorDeserializer(path, device="cpu", lazy_load=True) as d:
        record = next(r for r in d.index.records if r.name == "embed")
    raw = bytearray(path.read_bytes())
    raw[record.data_offset + 10] ^= 0x40
    path.write_bytes(bytes(raw))
    into = _dest(sd, ["embed"])
    with pytest.raises(HashMismatchError, match="embed"):
        with TensorDeserializer(path, device="cpu", verify_hash=True, into=into) as d:
            dict(d)


@pytest.mark.parametrize(
    ("into", "kwargs", "message"),
    [
        ({"nope": torch.empty(1)}, {}, "does not select"),
        ({"embed": torch.empty(300, 65, dtype=torch.bfloat16)}, {}, r"shape \[300, 64\]"),
        ({"embed": torch.empty(300, 64)}, {}, "dtype torch.bfloat16"),
        ({"embed": torch.empty(64, 300, dtype=torch.bfloat16).t()}, {}, "contiguous"),
        ({"embed": torch.empty(300, 64, dtype=torch.bfloat16)}, {"dtype": torch.float32}, "cast"),
        (
            {"embed": torch.empty(300, 64, dtype=torch.bfloat16)},
            {"filter_func": "norm".__eq__},
            "does not select",
        ),
        ({"norm": "x"}, {}, "torch.Tensor"),
    ],
    ids=["unknown", "shape", "dtype", "strided", "cast", "filtered", "not-a-tensor"],
)
def test_bad_destinations_are_refused_before_reading(tmp_path, into, kwargs, message):
    path = write_ours(tmp_path / "m.tensors", _state())
    with pytest.raises(ConfigError, match=message):
        TensorDeserializer(path, device="cpu", into=into, **kwargs)


def test_two_names_one_memory_is_refused(tmp_path):
    sd = {"a": torch.randn(8), "b": torch.randn(8)}
    path = write_ours(tmp_path / "m.tensors", sd)
    shared = torch.empty(8)
    with pytest.raises(ConfigError, match="share memory"):
        TensorDeserializer(path, device="cpu", into={"a": shared, "b": shared})


def test_into_with_shard_slices_is_refused(tmp_path):
    from tensorstream.deserialize.shard import ShardSpec

    sd = _state()
    path = write_ours(tmp_path / "m.tensors", sd)
    with pytest.raises(ConfigError, match="cannot be combined with shard="):
        TensorDeserializer(path, device="cpu", shard=ShardSpec(0, 2), into=_dest(sd, ["norm"]))
