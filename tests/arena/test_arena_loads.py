"""CPU loads hand out tensors with storages of exactly their bytes (page-cache views
or arena memory), bit-identical, from files written by tensorizer and by us.

Regressions: issue #14 defect 1 (a mapped tensor's storage was the whole file) and
issue #15 (``verify_hash=True`` returned views of the file it had verified).
"""

from __future__ import annotations

import gc
import io
import os

import pytest
import torch
from _arena_util import (
    Net,
    all_tensors,
    assert_same,
    dtype_matrix,
    run_child,
    tensorizer_readable,
    write_ours,
    write_theirs,
)

from tensorstream import TensorDeserializer
from tensorstream.deserialize.arena import live_arena_bytes
from tensorstream.deserialize.index import read_index
from tensorstream.sources.registry import open_source

MODES = {
    "mapped": {},
    "verify": {"verify_hash": True},
    "crc32": {"verify_hash": "crc32"},
    "no-mmap": {"use_mmap": False},
}


@pytest.fixture(scope="module")
def matrix():
    return tensorizer_readable(dtype_matrix())


@pytest.fixture(scope="module")
def files(tmp_path_factory, matrix):
    d = tmp_path_factory.mktemp("arena")
    return {
        "ours": write_ours(d / "ours.tensors", matrix),
        "theirs": write_theirs(d / "theirs.tensors", matrix),
    }


def test_tensorizer_file_has_unaligned_tensors(files):
    """The point of the tensorizer-file rows: some data cannot be viewed in place."""
    with open_source(str(files["theirs"])) as src:
        records = read_index(src).records
    odd = [r for r in records if r.data_length and r.data_offset % r.dtype.itemsize]
    assert odd, "tensorizer put every tensor at an aligned offset; the test proves nothing"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("writer", ["ours", "theirs"])
def test_bit_identical_across_the_dtype_matrix(files, matrix, writer, mode):
    with TensorDeserializer(files[writer], device="cpu", **MODES[mode]) as d:
        got = dict(d)
    assert set(got) == set(matrix)
    for name, want in matrix.items():
        t = got[name]
        assert_same(t, want.contiguous(), name)
        if t.numel():
            # issue #14: every tensor owns a storage of exactly its bytes
            assert t.untyped_storage().nbytes() == t.nbytes, name


def test_mapped_tensor_storage_is_its_bytes_not_the_file(tmp_path):
    """Issue #14 defect 1: torch.save of one 40-byte tensor wrote the whole mapped file."""
    sd = {"small": torch.arange(10, dtype=torch.float32), "big": torch.zeros(1 << 20)}
    path = write_ours(tmp_path / "m.tensors", sd)
    with TensorDeserializer(path, device="cpu") as d:
        small = d["small"]
    assert small.untyped_storage().nbytes() == 40
    buf = io.BytesIO()
    torch.save(small.detach(), buf)
    assert buf.tell() < 4096, f"torch.save wrote {buf.tell()} bytes for a 40-byte tensor"
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue())), sd["small"])


def test_mapped_tensors_outlive_the_closed_and_collected_deserializer(tmp_path):
    sd = {f"t{i}": torch.full((1000,), float(i)) for i in range(5)}
    path = write_ours(tmp_path / "m.tensors", sd)
    d = TensorDeserializer(path, device="cpu")
    got = dict(d)
    d.close()
    del d
    gc.collect()
    for name, t in got.items():
        assert torch.equal(t, sd[name])  # the map is still there: no segfault, same bytes


def test_arena_freed_once_its_last_tensor_is_gone(tmp_path):
    sd = {f"w{i}": torch.randn(3, 1001) for i in range(6)}  # odd offsets in tensorizer's file
    path = write_theirs(tmp_path / "t.tensors", sd)
    gc.collect()
    before = live_arena_bytes()
    d = TensorDeserializer(path, device="cpu")
    got = dict(d)
    d.close()
    del d
    gc.collect()
    assert live_arena_bytes() > before, "no tensor of this load came from an arena"
    names = list(got)
    for name in names[:-1]:
        del got[name]
    gc.collect()
    assert live_arena_bytes() > before, "the arena was unmapped while a tensor still used it"
    assert torch.equal(got[names[-1]], sd[names[-1]])
    got.clear()
    gc.collect()
    assert live_arena_bytes() == before, "the arena outlived its last tensor"


@pytest.mark.parametrize("writer", ["ours", "theirs"])
def test_module_keeps_working_after_the_deserializer_is_gone(tmp_path, writer):
    src = Net().randomize(3)
    path = tmp_path / f"{writer}.tensors"
    (write_ours if writer == "ours" else write_theirs)(path, src, module=True)
    dst = Net()
    d = TensorDeserializer(path, device="cpu")
    d.load_into_module(dst)
    d.close()
    del d
    gc.collect()
    x = torch.arange(4).reshape(2, 2) % 11
    with torch.no_grad():
        assert torch.equal(dst.block(dst.embed(x)), src.block(src.embed(x)))
    for name, t in all_tensors(src).items():
        if name != "block.scale":  # non-persistent: not written
            assert_same(all_tensors(dst)[name], t, name)


def test_thp_off_and_arena_off_load_the_same_bytes(tmp_path, matrix):
    path = write_theirs(tmp_path / "t.tensors", matrix)
    code = """
        import sys, torch
        from tensorstream import TensorDeserializer
        from tensorstream.deserialize.arena import ArenaAllocator, live_arena_bytes
        alloc = ArenaAllocator()
        with TensorDeserializer(sys.argv[1], device="cpu") as d:
            got = dict(d)
        digest = sum(int(t.detach().reshape(-1).view(torch.uint8).sum()) for t in got.values()
                     if t.numel())
        print(alloc.enabled, alloc.huge_pages, live_arena_bytes() > 0, digest)
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSTREAM_")}
    on = run_child(code, str(path), env={**base, "TENSORSTREAM_HUGE_PAGES": "1"}).split()
    no_thp = run_child(code, str(path), env={**base, "TENSORSTREAM_HUGE_PAGES": "0"}).split()
    default = run_child(code, str(path), env=base).split()
    off = run_child(code, str(path), env={**base, "TENSORSTREAM_ARENA": "0"}).split()
    assert on[:3] == ["True", "True", "True"]
    assert no_thp[:3] == default[:3] == ["True", "False", "True"]
    assert off[0] == "False" and off[2] == "False"
    assert on[3] == no_thp[3] == default[3] == off[3]
    want = sum(
        int(t.contiguous().reshape(-1).view(torch.uint8).sum())
        for t in matrix.values()
        if t.numel()
    )
    assert int(on[3]) == want


@pytest.mark.parametrize("verify", [True, "crc32"])
def test_verified_tensors_are_a_snapshot_of_what_was_verified(tmp_path, verify):
    """Issue #15: verify_hash=True handed out views of the file it had verified; a later
    rewrite of the file changed the 'verified' tensors, a truncation made them SIGBUS."""
    sd = {"a": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3, 4096)}
    path = write_ours(tmp_path / "v.tensors", sd)
    code = """
        import os, sys, torch
        from tensorstream import TensorDeserializer
        path, verify = sys.argv[1], sys.argv[2]
        verify = True if verify == "True" else verify
        with TensorDeserializer(path, device="cpu", verify_hash=verify) as d:
            got = {k: v for k, v in d.items()}
        want = {"a": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(3, 4096)}
        size = os.path.getsize(path)
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, b"\\xff" * size, 0)        # rewrite every byte in place
        os.fsync(fd)
        assert all(torch.equal(got[k], want[k]) for k in want), "rewrite changed tensors"
        os.ftruncate(fd, 0)                      # then cut the file to nothing
        os.close(fd)
        assert all(torch.equal(got[k], want[k]) for k in want), "truncation changed tensors"
        print("ok", sum(float(t.sum()) for t in got.values()))
    """
    out = run_child(code, str(path), str(verify))
    assert out.startswith("ok")


def test_plain_mapped_load_does_not_snapshot(tmp_path):
    """What docs/security.md says a plain (unverified) mapped load does not promise:
    the tensors are the file's pages, so an in-place rewrite shows through."""
    sd = {"a": torch.zeros(4096)}
    path = write_ours(tmp_path / "p.tensors", sd)
    with TensorDeserializer(path, device="cpu") as d:
        a = d["a"]
        offset = d.index.records[0].data_offset
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(torch.ones(4, dtype=torch.float32).numpy().tobytes())
    assert a[:4].tolist() == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("writer", ["theirs", "ours"])
@pytest.mark.parametrize("verify", [False, True])
def test_peak_rss_within_model_plus_256_mib(tmp_path, writer, verify):
    n, size = 24, 8 << 20  # 192 MiB of fp32, in 24 tensors
    sd = {f"layer{i}": torch.full((size // 4 + i,), float(i)) for i in range(n)}
    model = sum(t.nbytes for t in sd.values())
    path = (write_ours if writer == "ours" else write_theirs)(tmp_path / "r.tensors", sd)
    del sd
    code = """
        import resource, sys, torch
        from tensorstream import TensorDeserializer
        def peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        x = torch.ones(8)  # torch fully initialised before the baseline
        base = peak()
        with TensorDeserializer(sys.argv[1], device="cpu", verify_hash=sys.argv[2] == "1") as d:
            total = sum(float(t.sum()) for t in d.values())  # touch every byte
        print(peak() - base, total)
    """
    growth, total = run_child(code, str(path), "1" if verify else "0").split()
    assert float(total) == sum(float(i) * (size // 4 + i) for i in range(n))
    assert int(growth) <= model + (256 << 20), f"peak RSS grew {int(growth) >> 20} MiB"
