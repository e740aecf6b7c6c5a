"""Writer behaviour: atomic local writes, tied weights, progress output, lazy imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping

import pytest
import tensorizer
import torch
from _core_util import make

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.errors import SerializationError

# ---------------------------------------------------------------- atomic writes


def _leftovers(directory) -> list[str]:
    return sorted(os.listdir(directory))


class _Exploding(Mapping):
    """A state dict whose iteration raises ``exc`` after yielding some tensors."""

    def __init__(self, exc: BaseException) -> None:
        self._exc = exc
        self._good = {f"t{i}": make(torch.float32, (32,), i) for i in range(3)}

    def __getitem__(self, k):
        return self._good[k]

    def __len__(self) -> int:
        return 4

    def __iter__(self) -> Iterator[str]:
        yield from self._good
        raise self._exc

    def items(self):
        for k in self:
            yield k, self._good[k]


@pytest.mark.parametrize(
    "how",
    ["non_tensor", "raise_in_body", "raise_in_iteration", "keyboard_in_body", "keyboard_in_iter"],
)
@pytest.mark.parametrize("preexisting", [False, True])
def test_failed_write_leaves_nothing(tmp_path, how, preexisting):
    target = tmp_path / "model.tensors"
    if preexisting:
        target.write_bytes(b"old contents")
    expected = {
        "non_tensor": SerializationError,
        "raise_in_body": RuntimeError,
        "raise_in_iteration": RuntimeError,
        "keyboard_in_body": KeyboardInterrupt,
        "keyboard_in_iter": KeyboardInterrupt,
    }[how]
    with pytest.raises(expected):
        with TensorSerializer(target) as s:
            s.write_state_dict({"ok": make(torch.float32, (8,), 0)})
            if how == "non_tensor":
                s.write_state_dict({"a": make(torch.float32, (8,), 1), "b": object()})
            elif how == "raise_in_body":
                raise RuntimeError("boom")
            elif how == "raise_in_iteration":
                s.write_state_dict(_Exploding(RuntimeError("boom")))
            elif how == "keyboard_in_body":
                raise KeyboardInterrupt
            else:
                s.write_state_dict(_Exploding(KeyboardInterrupt()))
    if preexisting:
        assert target.read_bytes() == b"old contents"
        assert _leftovers(tmp_path) == ["model.tensors"]
    else:
        assert _leftovers(tmp_path) == []


def test_success_replaces_preexisting(tmp_path):
    target = tmp_path / "model.tensors"
    target.write_bytes(b"old")
    with TensorSerializer(target) as s:
        s.write_state_dict({"x": torch.ones(3)})
    assert _leftovers(tmp_path) == ["model.tensors"]
    with TensorDeserializer(target, device="cpu") as d:
        assert torch.equal(d["x"], torch.ones(3))


def test_sigkill_mid_write_leaves_no_file(tmp_path):
    target = tmp_path / "killed.tensors"
    child = textwrap.dedent(
        f"""
        import sys, torch
        from tensorstream import TensorSerializer
        s = TensorSerializer({str(target)!r})
        i = 0
        while True:
            s.write_tensor(0, f"t{{i}}", 2, torch.full((1 << 18,), float(i)))
            if i == 0:
                print("writing", flush=True)
            i += 1
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert any(n.endswith(".partial") for n in os.listdir(tmp_path))  # really mid-write
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not target.exists()
    assert all(not n.startswith("killed.tensors") for n in os.listdir(tmp_path))


# ---------------------------------------------------------------- tied weights


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight


@pytest.mark.parametrize("writer", ["ours", "theirs"])
def test_tied_weights_come_back_tied(tmp_path, writer):
    torch.manual_seed(0)
    src = _Tied()
    path = tmp_path / "tied.tensors"
    if writer == "ours":
        with TensorSerializer(path) as s:
            s.write_module(src)
    else:
        s = tensorizer.TensorSerializer(str(path))
        s.write_module(src)
        s.close()
    fresh = _Tied()
    fresh.lm_head.weight = torch.nn.Parameter(torch.zeros(10, 4))  # untie, then expect re-tie
    fresh.embed.weight = torch.nn.Parameter(torch.zeros(10, 4))
    fresh.lm_head.weight = fresh.embed.weight
    with TensorDeserializer(path, device="cpu", verify_hash=True) as d:
        d.load_into_module(fresh)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, src.embed.weight)
    assert torch.equal(fresh.mid.weight, src.mid.weight)
    sd_src, sd_new = src.state_dict(), fresh.state_dict()
    assert set(sd_src) == set(sd_new)
    assert all(torch.equal(sd_src[k], sd_new[k]) for k in sd_src)
    # still tied after an in-place update
    with torch.no_grad():
        fresh.embed.weight[0, 0] = 42.0
    assert fresh.lm_head.weight[0, 0] == 42.0


def test_tied_file_loads_in_tensorizer(tmp_path):
    src = _Tied()
    path = tmp_path / "tied.tensors"
    with TensorSerializer(path) as s:
        s.write_module(src)
    fresh = _Tied()
    d = tensorizer.TensorDeserializer(str(path), device="cpu", verify_hash=True)
    d.load_into_module(fresh)
    assert torch.equal(fresh.lm_head.weight, src.embed.weight)
    assert torch.equal(fresh.embed.weight, src.embed.weight)


# ---------------------------------------------------------------- progress


def test_progress_only_when_asked(tmp_path, capsys):
    path = tmp_path / "p.tensors"
    sd = {"x": make(torch.float32, (256, 256), 1)}
    with TensorSerializer(path) as s:
        s.write_state_dict(sd)
    with TensorDeserializer(path, device="cpu") as d:
        d["x"]
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == ""

    with TensorSerializer(path, progress=True) as s:
        s.write_state_dict(sd)
    err = capsys.readouterr().err
    assert "serialize" in err and ("B/s" in err or "GB" in err)
    with TensorDeserializer(path, device="cpu", progress=True) as d:
        d["x"]
    err = capsys.readouterr().err
    assert "load" in err and ("B/s" in err or "GB" in err)


# ---------------------------------------------------------------- lazy imports


def test_local_load_imports_no_optional_dependencies(tmp_path):
    path = tmp_path / "i.tensors"
    with TensorSerializer(path) as s:
        s.write_state_dict({"x": torch.ones(3)})
    code = textwrap.dedent(
        f"""
        import json, sys
        import tensorstream
        d = tensorstream.TensorDeserializer({str(path)!r}, device="cpu")
        assert float(d["x"].sum()) == 3.0
        print(json.dumps([m for m in ("boto3", "botocore", "urllib3", "transformers", "fastapi")
                          if m in sys.modules]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
