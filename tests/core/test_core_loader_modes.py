"""TensorDeserializer options and source kinds, on files written by us and by tensorizer."""

from __future__ import annotations

import random

import pytest
import tensorizer
import torch
from _core_util import assert_same, assert_tree_same, dtype_matrix, make, nested_state_dict

from tensorstream import TensorDeserializer, TensorSerializer

MODES = {
    "default": {},
    "no_mmap": {"use_mmap": False},
    "lazy": {"lazy_load": True},
    "readers1": {"num_readers": 1},
    "readers3": {"num_readers": 3},
    "verify": {"verify_hash": True},
    "verify_no_mmap_readers3": {"verify_hash": True, "use_mmap": False, "num_readers": 3},
    "lazy_verify": {"lazy_load": True, "verify_hash": True},
}


@pytest.fixture(scope="module")
def state_dict():
    sd = dtype_matrix(seed=7)
    sd["big"] = make(torch.float32, (300, 257), 99)  # spans several reader ranges
    return sd


@pytest.fixture(scope="module", params=["ours", "theirs"])
def written(request, tmp_path_factory, state_dict):
    path = tmp_path_factory.mktemp("modes") / f"{request.param}.tensors"
    if request.param == "ours":
        with TensorSerializer(path) as s:
            s.write_state_dict(state_dict)
    else:
        s = tensorizer.TensorSerializer(str(path))
        s.write_state_dict(state_dict)
        s.close()
    return path


@pytest.mark.parametrize("mode", MODES, ids=list(MODES))
def test_modes_bit_identical(written, state_dict, mode):
    with TensorDeserializer(written, device="cpu", **MODES[mode]) as d:
        assert len(d) == len(state_dict)
        for k, v in state_dict.items():
            assert_same(d[k], v, k)
        assert d.total_tensor_bytes == sum(
            v.numel() * v.element_size() for v in state_dict.values()
        )
        assert d.total_bytes_read == d.total_tensor_bytes


@pytest.mark.parametrize("order", ["reverse", "random"])
def test_lazy_access_any_order(written, state_dict, order):
    keys = list(state_dict)
    if order == "reverse":
        keys.reverse()
    else:
        random.Random(3).shuffle(keys)
    with TensorDeserializer(written, device="cpu", lazy_load=True, verify_hash=True) as d:
        assert d.total_bytes_read == 0  # nothing loaded up front
        for k in keys:
            assert_same(d[k], state_dict[k], k)
        # cached: a second access returns the same object
        assert d[keys[0]] is d[keys[0]]


def test_default_device_is_cpu_here(written, state_dict):
    with TensorDeserializer(written) as d:
        assert d.device == torch.device("cpu")
        assert_same(d["big"], state_dict["big"])


@pytest.mark.parametrize("kind", ["fileobj", "bytes"])
def test_file_object_and_bytes_sources(written, state_dict, kind):
    if kind == "fileobj":
        with open(written, "rb") as f, TensorDeserializer(f, device="cpu", verify_hash=True) as d:
            got = {k: d[k] for k in state_dict}
    else:
        with TensorDeserializer(
            written.read_bytes(), device="cpu", verify_hash=True, num_readers=3
        ) as d:
            got = {k: d[k] for k in state_dict}
    for k, v in state_dict.items():
        assert_same(got[k], v, k)


def test_filter_func(written, state_dict):
    wanted = {k for k in state_dict if k.startswith("int")}
    with TensorDeserializer(written, device="cpu", filter_func=lambda k: k in wanted) as d:
        assert set(d) == wanted
        assert "float32.vec" not in d
        with pytest.raises(KeyError):
            d["float32.vec"]
        assert d.total_tensor_bytes == sum(
            state_dict[k].numel() * state_dict[k].element_size() for k in wanted
        )


def test_dtype_casts_floats_only(written, state_dict):
    with TensorDeserializer(written, device="cpu", dtype=torch.float16) as d:
        for k, v in state_dict.items():
            got = d[k]
            if v.is_floating_point():
                assert got.dtype == torch.float16, k
                assert got.shape == v.shape
                if v.dtype in (torch.float32, torch.float64, torch.bfloat16):
                    assert_same(got, v.to(torch.float16), k)
            else:  # ints, bools, complex untouched
                assert_same(got, v, k)


def test_read_tensors_and_parameters(written, state_dict):
    with TensorDeserializer(written, device="cpu") as d:
        seen = list(d.read_tensors())
        limited = list(d.read_tensors(num_tensors=3))
        filtered = list(d.read_tensors(filter_func=lambda k: k.endswith(".vec")))
    assert [name for _, _, name, _ in seen] == list(state_dict)  # file order
    assert len(limited) == 3
    assert {n for _, _, n, _ in filtered} == {k for k in state_dict if k.endswith(".vec")}
    for _, ttype, name, t in seen:
        assert ttype == 2
        assert_same(t, state_dict[name], name)
        assert isinstance(t, torch.nn.Parameter)
        assert t.requires_grad == (t.is_floating_point() or t.is_complex())


def test_tree_nested(tmp_path):
    sd = nested_state_dict()
    path = tmp_path / "n.tensors"
    with TensorSerializer(path) as s:
        s.write_state_dict(sd)
    with TensorDeserializer(path, device="cpu", lazy_load=True) as d:
        assert_tree_same(d.tree(), sd)
        assert_tree_same(d.tree("model"), sd["model"])
        assert_tree_same(d.tree(("model", "layers", 1)), sd["model"]["layers"][1])
        assert d.tree("nothing", default={}) == {}
        with pytest.raises(KeyError):
            d.tree("nothing")


def test_int_dict_keys_round_trip(tmp_path):
    # tensorizer refuses int dict keys; we store them as path ints and read them back
    sd = {"experts": {3: make(torch.float32, (2,), 1), 7: make(torch.float32, (2,), 2)}}
    path = tmp_path / "k.tensors"
    with TensorSerializer(path) as s:
        s.write_state_dict(sd)
    with TensorDeserializer(path, device="cpu") as d:
        assert_same(d["experts"][7], sd["experts"][7])
        assert_tree_same(d.tree(), sd)


def test_mmap_tensors_are_copy_on_write(tmp_path):
    t = make(torch.float32, (64, 64), 5)
    path = tmp_path / "cow.tensors"
    with TensorSerializer(path) as s:
        s.write_state_dict({"t": t})
    before = path.read_bytes()
    with TensorDeserializer(path, device="cpu") as d:
        got = d["t"]
        with torch.no_grad():
            got.fill_(1.0)
        assert torch.all(got == 1.0)
    assert path.read_bytes() == before
    with TensorDeserializer(path, device="cpu") as d2:
        assert_same(d2["t"], t)
    # tensors stay valid after close()
    assert torch.all(got == 1.0)
