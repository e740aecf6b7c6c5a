"""Issue #12: a CPU load of a local file that is not in the page cache reads it into
arena memory with the parallel readers (two or more) instead of mapping it; a cached file
is still viewed in place. ``TENSORSTREAM_COLD_READ=read|map`` forces either path.

A file is made cold with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after an ``fsync``; pages
still mapped by a live tensor would stay, so every mapped load is dropped (and collected)
before that.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _arena_util import assert_same, drop_from_page_cache, write_ours, write_theirs

from tensorstream import TensorDeserializer
from tensorstream.deserialize.coldread import (
    loads_by_reading,
    probe_offsets,
    read_instead_of_map,
)
from tensorstream.deserialize.index import read_index
from tensorstream.deserialize.readercount import (
    COLD_READERS,
    LAZY_SPLIT_BYTES,
    cold_reader_count,
)
from tensorstream.sources.registry import open_source

READ_LOG = "reading into arenas (cold)"
MAP_LOG = "mapping (resident)"


def _state() -> dict[str, torch.Tensor]:
    """~40 MB in mixed dtypes and odd sizes: in tensorizer's file some tensors land at
    offsets their dtype can view in place and some do not."""
    g = torch.Generator().manual_seed(12)
    sd: dict[str, torch.Tensor] = {}
    for i in range(5):
        sd[f"layers.{i}.mlp.weight"] = torch.randn(1024, 1536, generator=g)  # 6 MiB
        sd[f"layers.{i}.norm"] = torch.randn(1001, generator=g).to(torch.bfloat16)
        sd[f"layers.{i}.bias"] = torch.randn(777, generator=g)
    sd["embed.weight"] = torch.randn(2048, 2049, generator=g).to(torch.float16)
    sd["ids"] = torch.arange(4099, dtype=torch.int64)
    return sd


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return _state()


@pytest.fixture(params=["ours", "theirs"])
def path(request, tmp_path, state):
    write = write_ours if request.param == "ours" else write_theirs
    return write(tmp_path / f"{request.param}.tensors", state)


@pytest.fixture(autouse=True)
def _auto_policy(monkeypatch):
    monkeypatch.delenv("TENSORSTREAM_COLD_READ", raising=False)


def _warm(path) -> None:
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


def _load(path, **kw) -> tuple[dict[str, torch.Tensor], int, int]:
    kw.setdefault("num_readers", 4)  # a cold file is read only with 2 readers or more
    with TensorDeserializer(path, device="cpu", **kw) as d:
        got = dict(d)
        return got, d.mapped_bytes, d.total_bytes_read


def _check_storages(got: dict[str, torch.Tensor]) -> None:
    for name, t in got.items():
        if t.numel():
            assert t.untyped_storage().nbytes() == t.nbytes, name


def _check_loaded(got: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """Every tensor equals what was written and owns a storage of exactly its bytes."""
    for name, t in got.items():
        assert_same(t, state[name], name)
    _check_storages(got)


def test_cold_file_loads_through_the_read_path_bit_identical(path, state, caplog):
    _warm(path)
    warm, mapped, _ = _load(path)
    assert mapped > 0, "a warm load viewed nothing: the comparison below proves nothing"
    want = {k: v.detach().clone() for k, v in warm.items()}  # no grad_fn: no ref to the map
    del warm

    drop_from_page_cache(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        cold, mapped, nbytes = _load(path)
    assert mapped == 0, f"a cold file was mapped ({mapped} bytes viewed), not read"
    assert READ_LOG in caplog.text
    assert nbytes == sum(t.nbytes for t in state.values())
    assert set(cold) == set(state)
    for name, t in cold.items():
        assert_same(t, want[name], name)
        assert_same(t, state[name], name)
    _check_storages(cold)


def test_warm_file_still_yields_views(path, state, caplog):
    _warm(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        got, mapped, _ = _load(path)
    with open_source(str(path)) as src:
        records = read_index(src).records
    viewable = sum(r.data_length for r in records if r.data_offset % r.dtype.itemsize == 0)
    assert mapped == viewable > 0
    assert MAP_LOG in caplog.text
    _check_loaded(got, state)


def test_env_read_forces_reading_a_warm_file(path, state, monkeypatch, caplog):
    monkeypatch.setenv("TENSORSTREAM_COLD_READ", "read")
    _warm(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        got, mapped, _ = _load(path)
    assert mapped == 0
    assert "TENSORSTREAM_COLD_READ=read" in caplog.text
    _check_loaded(got, state)


def test_env_map_forces_mapping_a_cold_file(path, state, monkeypatch):
    monkeypatch.setenv("TENSORSTREAM_COLD_READ", "map")
    drop_from_page_cache(path)
    got, mapped, _ = _load(path)
    assert mapped > 0
    _check_loaded(got, state)


def test_one_reader_keeps_mapping_a_cold_file(path, state, caplog):
    """Measured: one reader reading a cold file is no faster than the mapping."""
    drop_from_page_cache(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        got, mapped, _ = _load(path, num_readers=1)
    assert mapped > 0
    assert "mapping (cold, but one reader)" in caplog.text
    _check_loaded(got, state)


def test_cold_file_with_the_count_left_open_gets_the_cold_readers(path, state, caplog):
    """A cold read is disk-bound: ``num_readers=None`` reads it with COLD_READERS threads,
    whatever the cores, and the data is unchanged."""
    drop_from_page_cache(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        got, mapped, _ = _load(path, num_readers=None)
    assert mapped == 0
    assert READ_LOG in caplog.text
    assert f"by up to {COLD_READERS} readers" in caplog.text
    _check_loaded(got, state)


@pytest.mark.parametrize("cached", [False, True])
def test_the_callers_reader_count_stands_cold_or_warm(path, state, caplog, cached):
    if cached:
        _warm(path)
    else:
        drop_from_page_cache(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        got, mapped, _ = _load(path, num_readers=2)
    assert (mapped > 0) == cached
    assert "by up to 2 readers" in caplog.text
    _check_loaded(got, state)


def test_warm_file_with_the_count_left_open_keeps_the_sources_count(path, state, caplog):
    _warm(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        got, mapped, _ = _load(path, num_readers=None)
    assert mapped > 0
    with open_source(str(path)) as src:
        preferred = src.preferred_readers
    assert f"by up to {preferred} readers" in caplog.text
    _check_loaded(got, state)


def test_cold_reader_count_leaves_explicit_counts_and_small_lazy_loads_alone():
    assert cold_reader_count(None, lazy=False, nbytes=1) == COLD_READERS
    assert cold_reader_count(3, lazy=False, nbytes=1 << 30) is None
    assert cold_reader_count(None, lazy=True, nbytes=LAZY_SPLIT_BYTES - 1) is None
    assert cold_reader_count(None, lazy=True, nbytes=LAZY_SPLIT_BYTES) == COLD_READERS


@pytest.mark.parametrize("kw", [{"use_mmap": False}, {"verify_hash": "crc32"}])
def test_mapping_opt_outs_still_read_a_warm_file_with_map_forced(path, state, monkeypatch, kw):
    monkeypatch.setenv("TENSORSTREAM_COLD_READ", "map")
    _warm(path)
    got, mapped, _ = _load(path, **kw)
    assert mapped == 0
    _check_loaded(got, state)


def test_unknown_policy_warns_and_probes(path, monkeypatch, caplog):
    monkeypatch.setenv("TENSORSTREAM_COLD_READ", "sometimes")
    _warm(path)
    with caplog.at_level(logging.DEBUG, logger="tensorstream"):
        _, mapped, _ = _load(path)
    assert "TENSORSTREAM_COLD_READ='sometimes'" in caplog.text
    assert mapped > 0


def test_probes_land_inside_the_viewed_data_only(path):
    with open_source(str(path)) as src:
        records = read_index(src).records
        offsets = probe_offsets(records, probes=16)
        assert len(offsets) == 16
        assert offsets == sorted(offsets)
        for off in offsets:
            assert any(r.data_offset <= off < r.data_offset + r.data_length for r in records)
        assert probe_offsets([], probes=16) == []
        # no descriptor to probe (not a local file): keep the mapping
        assert read_instead_of_map(None, records, "x", readers=4) is False


def test_both_probes_see_a_warm_file_and_mincore_a_cold_one(tmp_path, state, monkeypatch):
    """mincore answers where the kernel lets it; RWF_NOWAIT reads elsewhere. Both say
    "cached" for a warm file; mincore (no side effects) says "not cached" after a drop.
    RWF_NOWAIT may not: a missed page's read-ahead can finish before the kernel looks."""
    import mmap

    from tensorstream.deserialize import coldread

    path = write_ours(tmp_path / "p.tensors", state)
    _warm(path)
    with open_source(str(path)) as src:
        offsets = probe_offsets(read_index(src).records)
        m = mmap.mmap(src.fileno, src.size, flags=mmap.MAP_PRIVATE)
        try:
            assert coldread.resident(src.fileno, offsets, m) == (16, 16)
            assert coldread.resident(src.fileno, offsets) == (16, 16)  # RWF_NOWAIT
            monkeypatch.setattr(coldread, "_mincore_truthful", lambda fd: False)
            assert coldread.resident(src.fileno, offsets, m) == (16, 16)
            monkeypatch.undo()
            drop_from_page_cache(path)
            assert coldread.resident(src.fileno, offsets, m) == (0, 16)
        finally:
            m.close()


def _records(path):
    with open_source(str(path)) as source:
        return list(read_index(source).records)


def test_loads_by_reading_answers_as_the_load_will(path, monkeypatch):
    """What the vLLM plugin asks before loading a whole local file at once: a cold file
    would be read into fresh memory (so it loads in batches), a cached one viewed."""
    records = _records(path)
    _warm(path)
    assert not loads_by_reading(str(path), records, readers=4)
    drop_from_page_cache(path)
    assert loads_by_reading(str(path), records, readers=4)
    assert not loads_by_reading(str(path), records, readers=1)  # one reader maps
    monkeypatch.setenv("TENSORSTREAM_COLD_READ", "map")
    assert not loads_by_reading(str(path), records, readers=4)
    _warm(path)
    monkeypatch.setenv("TENSORSTREAM_COLD_READ", "read")
    assert loads_by_reading(str(path), records, readers=4)


def test_loads_by_reading_leaves_unreadable_files_to_the_load(tmp_path, path):
    records = _records(path)
    assert not loads_by_reading(str(tmp_path / "missing.tensors"), records, readers=4)
    empty = tmp_path / "empty.tensors"
    empty.write_bytes(b"")
    assert not loads_by_reading(str(empty), records, readers=4)
