"""``tensorstream realign``: tensorizer's files rewritten into the aligned layout, which
the real tensorizer 2.12.1 still loads bit-identically with its hashes verified."""

from __future__ import annotations

import gc

import pytest
import tensorizer
import torch
from _arena_util import (
    Net,
    all_tensors,
    assert_same,
    dtype_matrix,
    tensorizer_readable,
    write_ours,
    write_theirs,
)

from tensorstream import TensorDeserializer
from tensorstream.cli.main import main
from tensorstream.deserialize.arena import live_arena_bytes
from tensorstream.deserialize.index import read_index
from tensorstream.errors import HashMismatchError
from tensorstream.serialize.realign import realign
from tensorstream.sources.registry import open_source

pytestmark = pytest.mark.interop


def _records(path):
    with open_source(str(path)) as src:
        return read_index(src).records


def test_realigned_state_dict_loads_in_tensorizer_bit_identically(tmp_path, capsys):
    sd = tensorizer_readable(dtype_matrix())
    src = write_theirs(tmp_path / "theirs.tensors", sd)
    dest = tmp_path / "aligned.tensors"
    assert main(["realign", str(src), str(dest)]) == 0
    assert "moved to 64-byte boundaries" in capsys.readouterr().out
    assert any(r.data_offset % 64 for r in _records(src) if r.data_length)
    assert all(r.data_offset % 64 == 0 for r in _records(dest) if r.data_length)
    theirs = tensorizer.TensorDeserializer(str(dest), device="cpu", verify_hash=True)
    for name, want in sd.items():
        assert_same(theirs[name], want.contiguous(), name)
    theirs.close()
    with TensorDeserializer(dest, device="cpu", verify_hash=True) as d:
        for name, want in sd.items():
            assert_same(d[name], want.contiguous(), name)


def test_realigned_module_loads_as_views_in_both_readers(tmp_path):
    net = Net().randomize(5)
    src = write_theirs(tmp_path / "theirs.tensors", net, module=True)
    dest = tmp_path / "aligned.tensors"
    result = realign(str(src), str(dest))
    assert result.tensors == len(_records(src)) and result.moved > 0
    got = Net()
    tensorizer.TensorDeserializer(str(dest), device="cpu", verify_hash=True).load_into_module(got)
    for name, t in all_tensors(net).items():
        if name != "block.scale":
            assert_same(all_tensors(got)[name], t, name)
    gc.collect()
    before = live_arena_bytes()
    ours = Net()
    with TensorDeserializer(dest, device="cpu") as d:
        d.load_into_module(ours)
        assert live_arena_bytes() == before, "a realigned file still needed copies"
    for name, t in all_tensors(net).items():
        if name != "block.scale":
            assert_same(all_tensors(ours)[name], t, name)


def test_realign_is_stable_on_an_aligned_file(tmp_path):
    sd = {"a": torch.randn(33, 7), "b": torch.arange(5, dtype=torch.int16)}
    ours = write_ours(tmp_path / "ours.tensors", sd)
    dest = tmp_path / "again.tensors"
    result = realign(str(ours), str(dest))
    assert result.moved == 0
    assert dest.read_bytes() == ours.read_bytes()


def test_corrupt_source_is_refused_and_nothing_written(tmp_path, capsys):
    sd = {"a": torch.randn(100), "b": torch.randn(100)}
    src = write_theirs(tmp_path / "theirs.tensors", sd)
    r = next(r for r in _records(src) if r.key == "b")
    with open(src, "r+b") as f:
        f.seek(r.data_offset + 3)
        f.write(b"\x00\x01")
    dest = tmp_path / "out.tensors"
    with pytest.raises(HashMismatchError, match=r"'b' failed CRC32.*refusing to realign"):
        realign(str(src), str(dest))
    assert not dest.exists()
    assert main(["realign", str(src), str(dest)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error:") and "Traceback" not in err


def test_same_path_refused(tmp_path, capsys):
    src = write_theirs(tmp_path / "theirs.tensors", {"a": torch.ones(3)})
    assert main(["realign", str(src), str(src)]) == 2
    assert "DEST other than" in capsys.readouterr().err
