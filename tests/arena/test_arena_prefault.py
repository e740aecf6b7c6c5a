"""Fresh destination memory is faulted in with one MADV_POPULATE_WRITE before a reader fills it."""

from __future__ import annotations

import ctypes
import errno
import mmap

import pytest
import torch
from _arena_util import write_theirs

from tensorstream import TensorDeserializer
from tensorstream.deserialize import loaders, prefault

PAGE = mmap.PAGESIZE


def _resident_pages(mapping: mmap.mmap, length: int) -> int:
    """Pages of ``mapping``'s first ``length`` bytes that are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    pages = -(-length // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vec) == 0
    return sum(b & 1 for b in vec)


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.setattr(prefault, "_madvise", None)
    monkeypatch.delenv("TENSORSTREAM_PREFAULT", raising=False)


def test_populate_makes_a_fresh_range_resident_whole_pages_only():
    size = 8 << 20
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert _resident_pages(mapping, size) == 0
    # 4 MiB starting mid-page: the whole pages inside are populated, nothing outside
    assert prefault.populate(base + 100, 4 << 20)
    resident = _resident_pages(mapping, size)
    assert resident == (4 << 20) // PAGE - 1  # the partial first and last pages are left
    assert _resident_pages(mapping, PAGE) == 0


def test_small_ranges_are_left_to_ordinary_faults():
    mapping = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert not prefault.populate(base, prefault.MIN_BYTES - PAGE)
    assert _resident_pages(mapping, 4 << 20) == 0


def test_a_kernel_without_the_advice_is_asked_once(monkeypatch):
    calls = []

    def refusing(start, length, advice):
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(prefault, "_madvise", refusing)
    mapping = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    assert not prefault.populate(base, 4 << 20)
    assert not prefault.populate(base, 4 << 20)
    assert calls == [prefault.MADV_POPULATE_WRITE]  # disabled after the first refusal


@pytest.mark.parametrize("setting", ["1", "0"])
def test_unaligned_tensors_are_prefaulted_and_load_the_same(tmp_path, monkeypatch, setting):
    """tensorizer's file: its unaligned tensors land in arenas; with prefault on, each big
    segment is populated before it is read, and the bytes are the same either way."""
    generator = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(1024 + i, 700, generator=generator) for i in range(4)}
    path = write_theirs(tmp_path / "theirs.tensors", state)
    monkeypatch.setenv("TENSORSTREAM_PREFAULT", setting)
    populated = []
    real = prefault.populate

    def recording(address, length):
        done = real(address, length)
        populated.append((length, done))
        return done

    monkeypatch.setattr(loaders, "populate", recording)
    with TensorDeserializer(str(path), device="cpu", num_readers=2) as loaded:
        got = {name: loaded[name].clone() for name in state}
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name
    if setting == "0":
        assert populated == []
    else:
        assert populated and all(done for length, done in populated if length >= 2 << 20)
