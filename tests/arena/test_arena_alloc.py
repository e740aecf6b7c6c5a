"""The arena allocator: exact per-tensor storages, alignment, freeing, THP fallbacks."""

from __future__ import annotations

import gc
import mmap
import weakref

import pytest
import torch

from tensorstream.deserialize import arena as arena_mod
from tensorstream.deserialize.arena import (
    ALIGN,
    HUGE_PAGE,
    Arena,
    ArenaAllocator,
    huge_pages_available,
    live_arena_bytes,
)


def test_carved_tensors_own_exactly_their_bytes_and_are_aligned():
    alloc = ArenaAllocator(huge_pages=False)
    shapes = [(torch.bfloat16, (3, 5)), (torch.float64, (7,)), (torch.uint8, (13,))]
    alloc.reserve([dt.itemsize * torch.Size(s).numel() for dt, s in shapes])
    got = [alloc.empty(dt, s) for dt, s in shapes]
    alloc.close()
    for t, (dt, s) in zip(got, shapes, strict=True):
        assert t.dtype == dt and tuple(t.shape) == s
        assert t.untyped_storage().nbytes() == t.nbytes
        assert t.data_ptr() % ALIGN == 0
    assert alloc.arenas == 1  # one right-sized arena for the whole reservation
    # writes to one tensor never touch its neighbours
    for i, t in enumerate(got):
        t.view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(got):
        assert bool((t.view(torch.uint8) == i + 1).all())


def test_arena_unmapped_when_last_tensor_dies_not_before():
    arena = Arena(1 << 20, huge_pages=False)
    mapping = weakref.ref(arena.mapping)
    a = arena.carve(torch.float32, (4,), 16)
    b = arena.carve(torch.int64, (2,), 16)
    arena.seal()
    del arena
    gc.collect()
    assert mapping() is not None
    del a
    gc.collect()
    assert mapping() is not None, "unmapped while a tensor still uses it"
    b.fill_(7)
    assert b.tolist() == [7, 7]
    del b
    gc.collect()
    assert mapping() is None, "the arena outlived its last tensor"


def test_big_tensor_gets_its_own_arena_and_small_ones_share():
    alloc = ArenaAllocator(arena_bytes=4 << 20, huge_pages=False)
    alloc.reserve([1 << 20, 1 << 20, 9 << 20])
    small = [alloc.empty(torch.uint8, (1 << 20,)) for _ in range(2)]
    big = alloc.empty(torch.uint8, (9 << 20,))
    alloc.close()
    assert alloc.arenas == 2
    assert big.untyped_storage().nbytes() == 9 << 20
    assert small[1].data_ptr() - small[0].data_ptr() == 1 << 20


def test_huge_pages_are_opt_in(monkeypatch):
    monkeypatch.delenv("TENSORSTREAM_HUGE_PAGES", raising=False)
    assert not huge_pages_available()
    assert not ArenaAllocator().huge_pages


def test_huge_pages_used_where_the_kernel_allows(monkeypatch):
    monkeypatch.setenv("TENSORSTREAM_HUGE_PAGES", "1")
    arena = Arena(HUGE_PAGE * 2, huge_pages=huge_pages_available())
    assert arena.size % HUGE_PAGE == 0
    with open(arena_mod._THP_ENABLED) as f:
        expected = "[never]" not in f.read()
    assert arena.huge_pages == expected


def test_thp_off_forced_by_env_falls_back_to_small_pages(monkeypatch):
    monkeypatch.setenv("TENSORSTREAM_HUGE_PAGES", "0")
    assert not huge_pages_available()
    alloc = ArenaAllocator()
    assert alloc.enabled and not alloc.huge_pages
    t = alloc.empty(torch.float32, (10,))
    t.copy_(torch.arange(10, dtype=torch.float32))
    assert t.tolist() == list(range(10))
    assert t.untyped_storage().nbytes() == 40


def test_thp_never_in_sysfs_falls_back(monkeypatch, tmp_path):
    fake = tmp_path / "enabled"
    fake.write_text("always madvise [never]\n")
    monkeypatch.setenv("TENSORSTREAM_HUGE_PAGES", "1")
    monkeypatch.setattr(arena_mod, "_THP_ENABLED", str(fake))
    assert not huge_pages_available()


def test_madvise_refused_falls_back(monkeypatch):
    # A kernel without THP answers MADV_HUGEPAGE with EINVAL; an unknown advice value
    # gets the same answer from this one, through the same code path.
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)
    arena = Arena(HUGE_PAGE, huge_pages=True)
    assert not arena.huge_pages
    t = arena.carve(torch.int32, (3,), 12)
    t.fill_(5)
    assert t.tolist() == [5, 5, 5]


def test_arena_off_gives_plain_torch_empty(monkeypatch):
    monkeypatch.setenv("TENSORSTREAM_ARENA", "0")
    before = live_arena_bytes()
    alloc = ArenaAllocator()
    t = alloc.empty(torch.float16, (8,))
    assert not alloc.enabled and alloc.arenas == 0
    assert live_arena_bytes() == before
    assert t.untyped_storage().nbytes() == 16


def test_empty_tensors_need_no_arena():
    alloc = ArenaAllocator()
    t = alloc.empty(torch.float32, (0, 5))
    assert tuple(t.shape) == (0, 5) and alloc.arenas == 0


def test_arena_too_small_is_refused():
    arena = Arena(HUGE_PAGE, huge_pages=False)
    arena.carve(torch.uint8, (HUGE_PAGE - 8,), HUGE_PAGE - 8)
    assert not arena.fits(64)
    with pytest.raises(ValueError):
        arena.carve(torch.uint8, (64,), 64)
