"""Byte compatibility with the real tensorizer 2.12.1, both directions.

Golden bytes: with ``align=1`` our files are byte-identical to tensorizer's. Every
file we write loads in tensorizer bit-identically with ``verify_hash=True``, and
every file tensorizer writes loads here bit-identically with hashes verified.
"""

from __future__ import annotations

import pytest
import tensorizer
import torch
from _core_util import (
    DTYPES,
    OPAQUE,
    Net,
    all_tensors,
    assert_same,
    assert_tree_same,
    dname,
    dtype_matrix,
    make,
    nested_state_dict,
    tensorizer_readable,
)

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.deserialize.index import read_index
from tensorstream.sources.registry import open_source

pytestmark = pytest.mark.interop


def _ours(path, obj, module=False, **kw):
    with TensorSerializer(path, **kw) as s:
        (s.write_module if module else s.write_state_dict)(obj)


def _theirs(path, obj, module=False):
    s = tensorizer.TensorSerializer(str(path))
    (s.write_module if module else s.write_state_dict)(obj)
    s.close()


def _their_load(path, **kw):
    return tensorizer.TensorDeserializer(str(path), device="cpu", verify_hash=True, **kw)


def _per_dtype(dt):
    return {k: v for k, v in dtype_matrix().items() if k.split(".")[0] == dname(dt)}


# ---------------------------------------------------------------- golden bytes


@pytest.mark.parametrize("dt", DTYPES, ids=dname)
def test_golden_bytes_state_dict_per_dtype(tmp_path, dt):
    sd = _per_dtype(dt)
    _ours(tmp_path / "ours.tensors", sd, align=1)
    _theirs(tmp_path / "theirs.tensors", sd)
    ours = (tmp_path / "ours.tensors").read_bytes()
    theirs = (tmp_path / "theirs.tensors").read_bytes()
    assert len(ours) == len(theirs)
    assert ours == theirs


def test_golden_bytes_nested_and_meta(tmp_path):
    sd = nested_state_dict()
    sd["ghost"] = torch.empty(3, 4, device="meta")
    _ours(tmp_path / "ours.tensors", sd, align=1)
    _theirs(tmp_path / "theirs.tensors", sd)
    assert (tmp_path / "ours.tensors").read_bytes() == (tmp_path / "theirs.tensors").read_bytes()


def test_golden_bytes_module(tmp_path):
    m = Net().randomize(1)
    _ours(tmp_path / "ours.tensors", m, module=True, align=1)
    _theirs(tmp_path / "theirs.tensors", m, module=True)
    assert (tmp_path / "ours.tensors").read_bytes() == (tmp_path / "theirs.tensors").read_bytes()


def test_golden_bytes_module_dtype_matrix(tmp_path):
    m = torch.nn.Module()
    m.inner = torch.nn.Module()
    for i, (k, v) in enumerate(dtype_matrix(seed=4).items()):
        owner = m.inner if i % 2 else m
        owner.register_buffer(k.replace(".", "_"), v, persistent=bool(i % 3))
    m.inner.p = torch.nn.Parameter(make(torch.float32, (3, 5), 1))
    _ours(tmp_path / "ours.tensors", m, module=True, align=1)
    _theirs(tmp_path / "theirs.tensors", m, module=True)
    assert (tmp_path / "ours.tensors").read_bytes() == (tmp_path / "theirs.tensors").read_bytes()


def test_default_alignment_is_64_and_tensorizer_reads_it(tmp_path):
    sd = tensorizer_readable(dtype_matrix())
    path = tmp_path / "aligned.tensors"
    _ours(path, sd)
    with open_source(str(path)) as src:
        index = read_index(src)
    with_data = [r for r in index.records if r.data_length]
    assert with_data and all(r.data_offset % 64 == 0 for r in with_data)
    # align=1 would not have put everything on 64 (the fixture's odd sizes make sure of that)
    _ours(tmp_path / "packed.tensors", sd, align=1)
    with open_source(str(tmp_path / "packed.tensors")) as src:
        assert any(r.data_offset % 64 for r in read_index(src).records if r.data_length)
    d = _their_load(path)
    for k, v in sd.items():
        assert_same(d[k], v, k)
    d.close()


# ---------------------------------------------------------------- dtype x shape matrix


@pytest.mark.parametrize("dt", DTYPES, ids=dname)
def test_ours_to_tensorizer(tmp_path, dt):
    sd = tensorizer_readable(_per_dtype(dt))
    _ours(tmp_path / "f.tensors", sd)
    d = _their_load(tmp_path / "f.tensors")
    assert set(d.keys()) == set(sd)
    for k, v in sd.items():
        assert_same(d[k], v, k)
    d.close()


@pytest.mark.parametrize("dt", DTYPES, ids=dname)
def test_tensorizer_to_ours(tmp_path, dt):
    sd = _per_dtype(dt)
    _theirs(tmp_path / "f.tensors", sd)
    with TensorDeserializer(tmp_path / "f.tensors", device="cpu", verify_hash=True) as d:
        assert set(d.keys()) == set(sd)
        for k, v in sd.items():
            assert_same(d[k], v, k)


@pytest.mark.parametrize("dt", sorted(OPAQUE, key=str), ids=dname)
def test_empty_opaque_tensor_tensorizer_cannot_read_but_we_can(tmp_path, dt):
    sd = {"empty": torch.empty(0, 5, dtype=dt), "x": make(torch.float32, (2,))}
    _theirs(tmp_path / "theirs.tensors", sd)
    with pytest.raises(TypeError, match="not understood"):  # tensorizer 2.12.1's own bug
        _their_load(tmp_path / "theirs.tensors")
    with TensorDeserializer(tmp_path / "theirs.tensors", device="cpu", verify_hash=True) as d:
        assert_same(d["empty"], sd["empty"])
        assert_same(d["x"], sd["x"])


def test_nested_state_dict_both_ways(tmp_path):
    sd = nested_state_dict()
    _ours(tmp_path / "ours.tensors", sd)
    _theirs(tmp_path / "theirs.tensors", sd)
    d = _their_load(tmp_path / "ours.tensors")
    assert_tree_same(d.tree(), sd)
    assert_same(d.tree()["model"]["layers"][1]["w"], sd["model"]["layers"][1]["w"])
    d.close()
    with TensorDeserializer(tmp_path / "theirs.tensors", device="cpu", verify_hash=True) as ours:
        assert_tree_same(ours.tree(), sd)
        # Mapping access: nested prefixes are read-only mappings keyed by path parts
        assert_same(ours["model"]["layers"][0]["w"], sd["model"]["layers"][0]["w"])
        assert_same(ours["model"]["steps"][1][0], sd["model"]["steps"][1][0])
        assert_same(ours[("model", "layers", 1, "b")], sd["model"]["layers"][1]["b"])
        assert_same(ours["top"], sd["top"])
        assert set(ours) == {"model", "top"}


@pytest.mark.parametrize("writer", ["ours", "theirs"])
def test_module_with_buffers_both_ways(tmp_path, writer):
    src = Net().randomize(3)
    path = tmp_path / "m.tensors"
    (_ours if writer == "ours" else _theirs)(path, src, module=True)
    want = all_tensors(src)
    # ours
    fresh = Net()
    with TensorDeserializer(path, device="cpu", verify_hash=True) as d:
        d.load_into_module(fresh)
    for k, v in want.items():
        assert_same(all_tensors(fresh)[k], v.detach(), k)
    assert "block.scale" not in fresh.state_dict()  # non-persistent stays non-persistent
    assert set(fresh.state_dict()) == set(src.state_dict())
    # theirs
    fresh2 = Net()
    d2 = _their_load(path)
    d2.load_into_module(fresh2)
    for k, v in want.items():
        assert_same(all_tensors(fresh2)[k], v.detach(), k)


@pytest.mark.parametrize("writer", ["ours", "theirs"])
def test_meta_tensors_v4(tmp_path, writer):
    sd = {"real": make(torch.float32, (3,), 1), "ghost": torch.empty(4, 2, device="meta")}
    path = tmp_path / "m.tensors"
    (_ours if writer == "ours" else _theirs)(path, sd)
    with open_source(str(path)) as s:
        assert read_index(s).version == 4
    with TensorDeserializer(path, device="cpu", verify_hash=True) as d:
        assert_same(d["ghost"], torch.zeros(4, 2))
        assert_same(d["real"], sd["real"])
    t = _their_load(path)
    assert_same(t["ghost"], torch.zeros(4, 2))
    assert_same(t["real"], sd["real"])
    t.close()


@pytest.mark.parametrize("writer", ["ours", "theirs"])
def test_long_dims_v5_zero_size(tmp_path, writer):
    # A dim >= 2**32 next to a 0 dim costs no data, yet needs the v5 u64 shape encoding.
    long_ = torch.empty(0, 2**32, dtype=torch.float16)
    sd = {"small": make(torch.int32, (3,), 2), "long": long_}
    path = tmp_path / "v5.tensors"
    (_ours if writer == "ours" else _theirs)(path, sd)
    with open_source(str(path)) as s:
        index = read_index(s)
    assert index.version == 5 and index.header.versioned_headers
    assert {r.key: r.long_shape for r in index.records} == {"small": False, "long": True}
    with TensorDeserializer(path, device="cpu", verify_hash=True) as d:
        assert d["long"].shape == (0, 2**32)
        assert_same(d["small"], sd["small"])
    t = _their_load(path)
    assert t["long"].shape == (0, 2**32)
    assert_same(t["small"], sd["small"])
    t.close()


def test_5000_tensors_overflow_tensorizer_but_not_us(tmp_path):
    sd = {
        f"model.decoder.layers.{i}.self_attention.query_key_value.weight": torch.full(
            (2,), i, dtype=torch.float16
        )
        for i in range(5000)
    }
    with pytest.raises(RuntimeError, match="Metadata overflow"):
        _theirs(tmp_path / "theirs.tensors", sd)
    path = tmp_path / "ours.tensors"
    _ours(path, sd)
    with open_source(str(path)) as s:
        index = read_index(s)
    assert len(index.records) == 5000 and index.header.metadata_len > 262144
    t = _their_load(path)
    assert len(t) == 5000
    for i in (0, 2500, 4999):
        k = f"model.decoder.layers.{i}.self_attention.query_key_value.weight"
        assert_same(t[k], sd[k], k)
    t.close()
    with TensorDeserializer(path, device="cpu", verify_hash=True) as d:
        assert len(d) == 5000
        assert all(torch.equal(d[k], v) for k, v in sd.items())
