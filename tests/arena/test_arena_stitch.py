"""Page-aligned tensors mapped side by side into one tensor (deserialize/stitch.py), and
the writer's page alignment that makes it possible (serialize/layout.data_alignment)."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import tensorizer
import torch

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.deserialize.stitch import stitch, stitchable
from tensorstream.serialize.layout import PAGE, PAGE_ALIGN_FROM, data_alignment


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def _write(path, tensors: dict[str, torch.Tensor]) -> dict:
    with TensorSerializer(str(path)) as s:
        s.write_state_dict(tensors)
    with TensorDeserializer(str(path), lazy_load=True) as index_only:
        return {r.name: r for r in index_only.index.records}


def test_large_tensors_start_on_a_page_and_tensorizer_still_reads_the_file(tmp_path):
    want = {
        "small": torch.randn(7),  # 28 bytes: 64-byte alignment is enough
        "q": torch.randn(64, 512),  # 128 KiB
        "odd": torch.randn(16411),  # just over 64 KiB, not whole pages
        "k": torch.randn(32, 512),
    }
    records = _write(tmp_path / "m.tensors", want)
    assert records["small"].data_offset % 64 == 0 and records["small"].data_offset % PAGE
    for name in ("q", "odd", "k"):
        assert records[name].data_offset % PAGE == 0
    assert data_alignment(1, 1 << 20) == 1  # align=1 keeps tensorizer's bytes
    assert data_alignment(64, PAGE_ALIGN_FROM - 1) == 64
    with tensorizer.TensorDeserializer(str(tmp_path / "m.tensors"), device="cpu") as d:
        for name, tensor in want.items():
            assert torch.equal(d[name], tensor)


def test_parts_are_mapped_side_by_side_without_a_copy(tmp_path):
    """q, k, v (headers between them in the file) become one contiguous tensor over the
    page cache: equal to their concatenation, a storage of exactly their bytes, writable
    without writing the file, unmapped when the last tensor over it is gone."""
    parts = {"q": torch.randn(64, 512), "k": torch.randn(32, 512), "v": torch.randn(32, 512)}
    path = tmp_path / "m.tensors"
    records = _write(path, parts)
    ranges = [(records[n].data_offset, records[n].data_length) for n in "qkv"]
    assert stitchable(ranges)
    before = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = stitch(fd, ranges)
    finally:
        os.close(fd)
    assert raw is not None
    fused = raw.view(torch.float32).reshape(128, 512)
    assert torch.equal(fused, torch.cat([parts["q"], parts["k"], parts["v"]]))
    assert fused.untyped_storage().nbytes() == sum(t.nbytes for t in parts.values())
    fused[64:].fill_(3.0)  # copy-on-write
    assert path.read_bytes() == before
    assert torch.equal(fused[:64], parts["q"])
    address = fused.data_ptr()
    del raw
    rows = fused[10:20]
    del fused
    gc.collect()
    assert _mapped(address)  # a view of it still holds the mapping
    del rows
    gc.collect()
    assert not _mapped(address)


def test_the_last_part_may_end_inside_a_page(tmp_path):
    parts = {"gate": torch.randn(32, 512), "up": torch.randn(16411)}
    path = tmp_path / "m.tensors"
    records = _write(path, parts)
    ranges = [(records[n].data_offset, records[n].data_length) for n in ("gate", "up")]
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = stitch(fd, ranges)
    finally:
        os.close(fd)
    assert raw is not None and raw.numel() == sum(length for _, length in ranges)
    want = torch.cat([parts["gate"].flatten(), parts["up"]])
    assert torch.equal(raw.view(torch.float32), want)


PAGE_HERE = mmap.PAGESIZE  # what mappings are made of on this machine


@pytest.mark.parametrize(
    "ranges",
    [
        [(PAGE_HERE + 64, PAGE_HERE), (4 * PAGE_HERE, PAGE_HERE)],  # a part off a page
        [(0, PAGE_HERE + 4), (4 * PAGE_HERE, PAGE_HERE)],  # a middle part not whole pages
        [(0, 0), (PAGE_HERE, PAGE_HERE)],  # an empty part
        [],
    ],
    ids=["offset", "length", "empty", "none"],
)
def test_ranges_that_cannot_be_mapped_side_by_side_are_refused(tmp_path, ranges):
    path = tmp_path / "f"
    path.write_bytes(bytes(8 * PAGE_HERE))
    assert not stitchable(ranges)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert stitch(fd, ranges) is None
    finally:
        os.close(fd)
