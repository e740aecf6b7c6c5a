"""compat ``torch_compat`` (torch.save/torch.load with a .tensors sidecar) and encryption params.

Round trips here, and both directions against the real tensorizer 2.12.1: a
``.pt`` + sidecar written by one library loads with the other.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from tensorstream.compat import tensorizer as tz
from tensorstream.compat.tensorizer.torch_compat import tensorizer_loading, tensorizer_saving

_SAVE, _LOAD = torch.save, torch.load


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def test_save_load_round_trip_keeps_tensors_out_of_the_pickle(tmp_path: Path) -> None:
    model = _model()
    plain = tmp_path / "plain.pt"
    torch.save(model, plain)
    pt = tmp_path / "m.pt"
    with tensorizer_saving():
        assert torch.save is not _SAVE
        torch.save(model, pt)
    assert torch.save is _SAVE  # restored when the last context closes
    sidecar = tmp_path / "m.pt.tensors"
    assert sidecar.is_file()
    # 8 x 16 + 8 + 2 x 8 + 2 floats live in the sidecar, not in the .pt
    assert pt.stat().st_size < plain.stat().st_size - 400
    with tensorizer_loading(device="cpu"):
        loaded = torch.load(pt, weights_only=False)
    assert torch.load is _LOAD
    _assert_same(model, loaded)


def test_loaded_storages_span_exactly_their_tensors(tmp_path: Path) -> None:
    """torch.load rebuilds tensors from storages: each must be that storage alone."""
    a = torch.arange(6, dtype=torch.int64)
    b = torch.arange(10, 13, dtype=torch.float32)
    c = a.view(torch.float64)  # shares a's storage
    pt = tmp_path / "s.pt"
    with tensorizer_saving():
        torch.save([a, b, c], pt)
    with tensorizer_loading(device="cpu"):
        la, lb, lc = torch.load(pt, weights_only=False)
    assert torch.equal(la, a) and torch.equal(lb, b)
    assert la.untyped_storage().nbytes() == a.untyped_storage().nbytes()
    assert lc.untyped_storage().data_ptr() == la.untyped_storage().data_ptr()
    assert torch.equal(lc.view(torch.int64), a)


def test_meta_tensors_stay_meta_and_weights_only(tmp_path: Path) -> None:
    t = torch.arange(4)
    pt = tmp_path / "meta.pt"
    with tensorizer_saving():
        torch.save([t, t.to("meta")], pt)
    with tensorizer_loading(device="cpu"), pytest.raises(RuntimeError, match="pickle_module"):
        torch.load(pt, weights_only=True)
    with tensorizer_loading(device="cpu", suppress_weights_only=True):
        lt, lm = torch.load(pt, weights_only=True)
    assert torch.equal(lt, t)
    assert lm.is_meta and lm.shape == t.shape


def test_encrypted_sidecar_needs_its_key(tmp_path: Path) -> None:
    enc = tz.EncryptionParams.random()
    pt, sidecar = tmp_path / "e.pt", tmp_path / "e.tensors"
    with tensorizer_saving(sidecar, encryption=enc):
        torch.save(_model(), pt)
    with tensorizer_loading(
        sidecar, device="cpu", encryption=tz.DecryptionParams.from_key(enc.key)
    ):
        _assert_same(_model(), torch.load(pt, weights_only=False))
    with tensorizer_loading(sidecar, device="cpu"), pytest.raises(tz.CryptographyError):
        torch.load(pt, weights_only=False)


def test_callable_file_obj_and_custom_functions(tmp_path: Path) -> None:
    saved: dict[str, list[torch.Tensor]] = {}

    def save_func(target: object, tensors: list[torch.Tensor], kwargs: dict) -> None:
        saved[str(target)] = [t.clone() for t in tensors]

    def load_func(target: object, kwargs: dict) -> list[torch.Tensor]:
        return saved[str(target)]

    pt = tmp_path / "c.pt"
    with tensorizer_saving(lambda f: f"{f}.side", save_func=save_func):
        torch.save({"w": torch.ones(3)}, pt)
    assert list(saved) == [f"{pt}.side"]
    with tensorizer_loading(lambda f: f"{f}.side", load_func=load_func):
        assert torch.equal(torch.load(pt, weights_only=False)["w"], torch.ones(3))


def test_bytesio_falls_back_to_plain_torch_save() -> None:
    buf = io.BytesIO()
    with tensorizer_saving():
        torch.save({"w": torch.ones(2)}, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf)["w"], torch.ones(2))


def test_custom_pickle_module_is_refused(tmp_path: Path) -> None:
    import pickle as stdlib_pickle
    import types

    other = types.ModuleType("other_pickle")
    other.__dict__.update(stdlib_pickle.__dict__)
    with tensorizer_saving(), pytest.raises(ValueError, match="pickle_module"):
        torch.save(torch.ones(1), tmp_path / "x.pt", pickle_module=other)


def test_passphrase_params_use_tensorizers_argument_names(tmp_path: Path) -> None:
    enc = tz.EncryptionParams.from_string(
        source="correct horse",
        opslimit=tz.EncryptionParams.OpsLimit.MIN,
        memlimit=tz.EncryptionParams.MemLimit.MIN,
        salt=bytes(16),
    )
    path = str(tmp_path / "p.tensors")
    s = tz.TensorSerializer(path, encryption=enc)
    s.write_state_dict({"w": torch.arange(5.0)})
    s.close()
    with tz.TensorDeserializer(
        path, device="cpu", encryption=tz.DecryptionParams.from_string(source="correct horse")
    ) as d:
        assert torch.equal(d["w"], torch.arange(5.0))
    for wrong in (tz.DecryptionParams.from_string(source="wrong horse"), None):
        with pytest.raises(tz.CryptographyError):
            tz.TensorDeserializer(path, device="cpu", lazy_load=True, encryption=wrong)["w"]


@pytest.mark.interop
def test_sidecars_interoperate_with_real_tensorizer(tmp_path: Path) -> None:
    real = pytest.importorskip("tensorizer.torch_compat")
    model = _model()
    ours_pt, theirs_pt = tmp_path / "ours.pt", tmp_path / "theirs.pt"
    with tensorizer_saving():
        torch.save(model, ours_pt)
    with real.tensorizer_loading(device="cpu"):
        _assert_same(model, torch.load(ours_pt, weights_only=False))
    with real.tensorizer_saving():
        torch.save(model, theirs_pt)
    with tensorizer_loading(device="cpu"):
        _assert_same(model, torch.load(theirs_pt, weights_only=False))
    assert torch.save is _SAVE and torch.load is _LOAD
