"""tensorstream.compat.tensorizer: tensorizer's names, argument order and refusals.

The real tensorizer 2.12.1 is the oracle for signatures; the compat package itself
must never import it (checked in a fresh interpreter).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tensorstream.compat import tensorizer as tz
from tensorstream.compat.tensorizer import serialization, stream_io, utils


def _tensors_file(path: Path, **tensors: torch.Tensor) -> str:
    s = tz.TensorSerializer(str(path))
    s.write_state_dict(tensors)
    s.close()
    return str(path)


def test_import_does_not_import_real_tensorizer() -> None:
    code = (
        "import sys\n"
        "import tensorstream.compat.tensorizer as tz\n"
        "from tensorstream.compat.tensorizer import stream_io, torch_compat, utils\n"
        "assert 'tensorstream' in tz.__file__, tz.__file__\n"
        "bad = [m for m in sys.modules if m == 'tensorizer' or m.startswith('tensorizer.')]\n"
        "assert not bad, bad\n"
        "assert 'boto3' not in sys.modules and 'redis' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# Callables whose parameters (names, order, kinds, defaults) must match tensorizer's.
_SIGNATURES = [
    ("TensorDeserializer.__init__", lambda m: m.TensorDeserializer.__init__),
    ("TensorSerializer.__init__", lambda m: m.TensorSerializer.__init__),
    ("TensorSerializer.write_tensor", lambda m: m.TensorSerializer.write_tensor),
    ("TensorSerializer.write_module", lambda m: m.TensorSerializer.write_module),
    ("TensorDeserializer.read_tensors", lambda m: m.TensorDeserializer.read_tensors),
    ("TensorDeserializer.read_numpy_arrays", lambda m: m.TensorDeserializer.read_numpy_arrays),
    ("TensorDeserializer.load_into_module", lambda m: m.TensorDeserializer.load_into_module),
    ("TensorDeserializer.verify_module", lambda m: m.TensorDeserializer.verify_module),
    ("EncryptionParams.from_string", lambda m: m.EncryptionParams.from_string),
    ("DecryptionParams.from_string", lambda m: m.DecryptionParams.from_string),
    ("stream_io.open_stream", lambda m: m.stream_io.open_stream),
    ("stream_io.CAInfo.__init__", lambda m: m.stream_io.CAInfo.__init__),
    ("torch_compat.tensorizer_saving", lambda m: m.torch_compat.tensorizer_saving),
    ("torch_compat.tensorizer_loading", lambda m: m.torch_compat.tensorizer_loading),
    ("utils.no_init_or_tensor", lambda m: m.utils.no_init_or_tensor),
    ("utils.convert_bytes", lambda m: m.utils.convert_bytes),
]


def _params(func: object) -> list[tuple[str, object, object]]:
    # follow_wrapped: tensorizer's context managers are @contextmanager generators.
    sig = inspect.signature(func)  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


@pytest.mark.interop
@pytest.mark.parametrize("name,get", _SIGNATURES, ids=[n for n, _ in _SIGNATURES])
def test_signature_matches_tensorizer(name: str, get: object) -> None:
    real = pytest.importorskip("tensorizer")
    import tensorizer.stream_io  # noqa: F401 - attribute access below
    import tensorizer.torch_compat  # noqa: F401

    theirs = _params(get(real))  # type: ignore[operator]
    ours = _params(get(tz))  # type: ignore[operator]
    assert [(n, k) for n, k, _ in ours] == [(n, k) for n, k, _ in theirs]
    for (n, _, d_ours), (_, _, d_theirs) in zip(ours, theirs, strict=True):
        if d_theirs is inspect.Parameter.empty or isinstance(
            d_theirs, (bool, int, str, type(None))
        ):
            assert d_ours == d_theirs, f"{name}: default of {n}"


def test_exported_names_match_tensorizer() -> None:
    expected = {
        "TensorSerializer",
        "TensorDeserializer",
        "TensorType",
        "CryptographyError",
        "EncryptionParams",
        "DecryptionParams",
        "FilterFuncType",
    }
    assert expected <= set(tz.__all__)
    assert [t.name for t in tz.TensorType] == ["PARAM", "BUFFER", "STATE_DICT"]
    assert [int(t) for t in tz.TensorType] == [0, 1, 2]
    assert {"open_stream", "CAInfo"} <= set(stream_io.__all__)
    for name in (
        "no_init_or_tensor",
        "convert_bytes",
        "get_mem_usage",
        "get_gpu_name",
        "get_device",
    ):
        assert name in utils.__all__


def test_default_s3_endpoints_are_coreweaves() -> None:
    assert stream_io.default_s3_read_endpoint == "accel-object.ord1.coreweave.com"
    assert stream_io.default_s3_write_endpoint == "object.ord1.coreweave.com"


def test_positional_filter_func_and_dtype(tmp_path: Path) -> None:
    path = _tensors_file(
        tmp_path / "m.tensors", a=torch.arange(4, dtype=torch.float32), b=torch.ones(2)
    )
    with tz.TensorDeserializer(path, "cpu", lambda n: n == "a", torch.float16) as d:
        assert list(d.keys()) == ["a"]
        assert d["a"].dtype == torch.float16
        assert torch.equal(d["a"], torch.arange(4, dtype=torch.float16))


def test_ignored_and_supported_keywords(tmp_path: Path) -> None:
    path = _tensors_file(tmp_path / "m.tensors", a=torch.arange(6.0))
    with tz.TensorDeserializer(
        path,
        device="cpu",
        lazy_load=True,
        plaid_mode=True,
        plaid_mode_buffers=4,
        num_readers=2,
        verify_hash=True,
    ) as d:
        assert d.total_tensor_bytes == 24
        assert d.cache_status is None
        assert torch.equal(d["a"], torch.arange(6.0))
        assert d._file_header.version_number == serialization.NON_OPAQUE_TENSORIZER_VERSION


def test_write_tensor_positional_order_and_numpy(tmp_path: Path) -> None:
    import numpy as np

    path = str(tmp_path / "w.tensors")
    s = tz.TensorSerializer(path)
    s.write_tensor(0, "t", tz.TensorType.PARAM, torch.full((3,), 7.0))
    s.write_tensor(1, "n", tz.TensorType.BUFFER, np.arange(5, dtype=np.int32))
    s.close()
    with tz.TensorDeserializer(path, device="cpu") as d:
        kinds = {name: kind for _, kind, name, _ in d.read_tensors()}
        assert kinds == {"t": tz.TensorType.PARAM, "n": tz.TensorType.BUFFER}
        assert torch.equal(d["n"], torch.arange(5, dtype=torch.int32))


def test_compress_tensors_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match="compress_tensors=True is not supported"):
        tz.TensorSerializer(str(tmp_path / "c.tensors"), True)
    assert not (tmp_path / "c.tensors").exists()


def test_redis_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(NotImplementedError, match="redis:// streams are not supported"):
        stream_io.open_stream("redis://localhost:6379/model")
    with pytest.raises(NotImplementedError, match="redis://"):
        tz.TensorDeserializer("redis://localhost:6379/model")
    path = _tensors_file(tmp_path / "r.tensors", a=torch.zeros(1))
    with (
        tz.TensorDeserializer(path, device="cpu") as d,
        pytest.raises(NotImplementedError, match="to_redis"),
    ):
        d.to_redis(None, "key")


def test_file_objects_are_closed_like_tensorizer(tmp_path: Path) -> None:
    path = tmp_path / "f.tensors"
    out = open(path, "wb+")  # noqa: SIM115 - the serializer closes it, as tensorizer does
    s = tz.TensorSerializer(out)
    s.write_state_dict({"x": torch.arange(3)})
    s.close()
    assert out.closed
    src = open(path, "rb")  # noqa: SIM115 - closed by the deserializer
    d = tz.TensorDeserializer(src, device="cpu")
    assert torch.equal(d["x"], torch.arange(3))
    d.close()
    assert src.closed


def test_file_descriptor_targets(tmp_path: Path) -> None:
    path = tmp_path / "fd.tensors"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    s = tz.TensorSerializer(fd)
    s.write_state_dict({"x": torch.arange(5.0)})
    s.close()
    with tz.TensorDeserializer(os.open(path, os.O_RDONLY), device="cpu") as d:
        assert torch.equal(d["x"], torch.arange(5.0))


def test_verify_module_reports_each_tensor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    path = str(tmp_path / "v.tensors")
    s = tz.TensorSerializer(path)
    s.write_module(model)
    s.close()
    with tz.TensorDeserializer(path, device="cpu", verify_hash=True) as d:
        ok, results = d.verify_module(model)
        assert ok and all(passed for _, passed in results)
        assert {name for name, _ in results} == set(model.state_dict())
        with torch.no_grad():
            model[1].bias.add_(1.0)
        ok, results = d.verify_module(model)
    assert not ok
    assert dict(results) == {name: name != "1.bias" for name in model.state_dict()}


def test_hash_mismatch_raises_tensorizers_exception(tmp_path: Path) -> None:
    path = tmp_path / "h.tensors"
    _tensors_file(path, a=torch.arange(64, dtype=torch.float32))
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF  # inside the tensor's data (the file ends with an 8-byte zero)
    path.write_bytes(bytes(data))
    with pytest.raises(tz.HashMismatchError):
        tz.TensorDeserializer(str(path), device="cpu", verify_hash=True).close()


def test_read_numpy_arrays_raw_for_bfloat16(tmp_path: Path) -> None:
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    path = _tensors_file(tmp_path / "n.tensors", f=torch.arange(3.0), b=t)
    with tz.TensorDeserializer(path, device="cpu") as d:
        with pytest.raises(ValueError, match="allow_raw_data=True"):
            list(d.read_numpy_arrays())
        rows = {r[2]: r for r in d.read_numpy_arrays(allow_raw_data=True)}
    assert rows["f"][3].tolist() == [0.0, 1.0, 2.0] and rows["f"][4] is False
    _, _, _, raw, opaque, dtype = rows["b"]
    assert opaque is True and dtype == "bfloat16" and raw.shape == (2, 3)
    back = torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.bfloat16).reshape(2, 3)
    assert torch.equal(back, t)


def test_no_init_or_tensor_allocates_nothing() -> None:
    with utils.no_init_or_tensor():
        layer = torch.nn.Linear(1024, 1024)
    assert layer.weight.is_meta
    built = utils.no_init_or_tensor(lambda: torch.nn.Embedding(10, 4))
    assert built.weight.is_meta
    assert not torch.nn.Linear(2, 2).weight.is_meta  # the context is over
    with pytest.raises(TypeError, match="callable"):
        utils.no_init_or_tensor(42)  # type: ignore[arg-type]


def test_utils_reports() -> None:
    assert utils.convert_bytes(1500) == "1.5 KB"
    assert utils.convert_bytes(1536, decimal=False) == "1.5 KiB"
    assert utils.convert_bytes(12) == "12.0 bytes"
    usage = utils.CPUMemoryUsage.now()
    assert usage.free > 0 and usage.maxrss > 0
    assert utils.get_mem_usage().startswith("CPU: (maxrss:")
    assert utils.get_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        assert utils.get_gpu_name() == "N/A"
