"""Remote and encrypted CPU loads land in the same arenas: exact storages, freed with
their last tensor, bit-identical (real nginx; real libsodium)."""

from __future__ import annotations

import gc

import pytest
import torch
from _arena_util import assert_same, dtype_matrix, tensorizer_readable, write_ours, write_theirs

from tensorstream import TensorDeserializer
from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.deserialize.arena import live_arena_bytes


def _check_arena_load(load, want):
    gc.collect()
    before = live_arena_bytes()
    got = load()
    gc.collect()
    assert live_arena_bytes() > before, "no tensor of this load came from an arena"
    for name, t in want.items():
        assert_same(got[name], t.contiguous(), name)
        if got[name].numel():
            assert got[name].untyped_storage().nbytes() == got[name].nbytes, name
    got.clear()
    gc.collect()
    assert live_arena_bytes() == before, "an arena outlived its tensors"


@pytest.mark.integration
@pytest.mark.parametrize("writer", [write_ours, write_theirs], ids=["ours", "theirs"])
def test_http_load_fills_arenas(http_server, writer):
    sd = tensorizer_readable(dtype_matrix())
    name = f"arena-{writer.__name__}.tensors"
    writer(http_server.root / name, sd)

    def load():
        with TensorDeserializer(http_server.url(name), device="cpu", num_readers=3) as d:
            return dict(d)

    _check_arena_load(load, sd)


@pytest.mark.parametrize("use_mmap", [True, False], ids=["decrypt-from-map", "read-then-decrypt"])
def test_encrypted_load_decrypts_into_arenas(tmp_path, use_mmap):
    sd = {f"w{i}": torch.randn(64, 1000 + i) for i in range(4)}
    sd["ids"] = torch.arange(77, dtype=torch.int64)
    enc = EncryptionParams.random()
    path = write_ours(tmp_path / "e.tensors", sd, encryption=enc)
    key = DecryptionParams.from_key(enc.key)

    def load():
        with TensorDeserializer(path, device="cpu", encryption=key, use_mmap=use_mmap) as d:
            return dict(d)

    _check_arena_load(load, sd)
