"""The ``tensorstream`` command prints one line on failure, never a traceback.

The real command runs in a subprocess for the process-level cases (a directory,
``--device cuda`` without a GPU, ``| head``, Ctrl-C); the seeded mutant loop runs
``main()`` in-process to keep 200 inspections quick.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tensorstream import TensorSerializer
from tensorstream.cli.main import main

_CLI = [sys.executable, "-m", "tensorstream"]


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TENSORSTREAM_DEBUG"}
    return subprocess.run(
        [*_CLI, *args], capture_output=True, text=True, timeout=120, env=env, **kwargs
    )


def _assert_one_line(stderr: str) -> None:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "small.tensors"
    with TensorSerializer(str(path)) as s:
        s.write_state_dict(
            {
                "a": torch.randn(8, 4, generator=torch.Generator().manual_seed(0)),
                "b": torch.arange(10),
                "c.d": torch.ones(3, dtype=torch.bfloat16),
                "e": torch.empty(0, 3),
            }
        )
    return path


@pytest.mark.parametrize("command", ["inspect", "deserialize"])
def test_directory_is_one_line(command: str, tmp_path: Path) -> None:
    """Regression: a directory raised a bare IsADirectoryError with a traceback."""
    done = _cli(command, str(tmp_path))
    assert done.returncode == 2
    _assert_one_line(done.stderr)
    assert str(tmp_path) in done.stderr and "directory" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_gpu_is_one_line(small_file: Path) -> None:
    """Regression: --device cuda without a GPU printed torch's AssertionError traceback."""
    done = _cli("deserialize", str(small_file), "--device", "cuda")
    assert done.returncode == 2
    _assert_one_line(done.stderr)
    assert "--device cpu" in done.stderr


def test_bad_device_name_is_one_line(small_file: Path) -> None:
    done = _cli("deserialize", str(small_file), "--device", "tpu:banana")
    assert done.returncode == 2
    _assert_one_line(done.stderr)


def test_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    """Regression: `tensorstream inspect big | head -1` printed a BrokenPipeError traceback."""
    path = tmp_path / "many.tensors"
    with TensorSerializer(str(path)) as s:
        s.write_state_dict({f"layer.{i}.weight": torch.zeros(2) for i in range(3000)})
    env = {k: v for k, v in os.environ.items() if k != "TENSORSTREAM_DEBUG"}
    child = subprocess.Popen(
        [*_CLI, "inspect", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline().startswith(b"file:")
    child.stdout.close()  # what `head -1` does after its line
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=120) == 128 + signal.SIGPIPE
    assert stderr == ""


def _sigint_as_in_a_terminal() -> None:
    """A background job (``make test &``, ``nohup``) inherits SIGINT ignored, and Python
    then leaves it ignored, so Ctrl-C would do nothing: give the command the usual action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.integration
def test_keyboard_interrupt_is_one_line(http_server, fault_proxy, small_file: Path) -> None:
    name = "hardening-cli-interrupt.tensors"
    (http_server.root / name).write_bytes(small_file.read_bytes())
    proxy = fault_proxy(http_server.base_url)
    proxy.set_mode("stall", after_bytes=0)  # every request hangs until the proxy closes
    env = {k: v for k, v in os.environ.items() if k != "TENSORSTREAM_DEBUG"}
    child = subprocess.Popen(
        [*_CLI, "inspect", f"{proxy.url}/{name}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_sigint_as_in_a_terminal,
    )
    deadline = time.monotonic() + 60
    while proxy.stats.requests < 1:  # the command is now blocked on the network
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130
    _assert_one_line(stderr)
    assert stderr.strip() == "interrupted"


def test_unexpected_exception_is_one_line_unless_debug(
    small_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorstream.cli import inspect as inspect_cmd

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom\nsecond line")

    monkeypatch.delenv("TENSORSTREAM_DEBUG", raising=False)
    monkeypatch.setattr(inspect_cmd, "read_index", broken)
    assert main(["inspect", str(small_file)]) == 1
    err = capsys.readouterr().err
    _assert_one_line(err)
    assert "RuntimeError: boom second line" in err and "bug" in err and "--debug" in err
    assert main(["inspect", str(small_file), "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("TENSORSTREAM_DEBUG", "1")
    assert main(["inspect", str(small_file)]) == 1
    assert "Traceback" in capsys.readouterr().err


_ODD = [-1, 0, 1, 2**31, 2**63, 2**64 + 5, 1.5, "x", None, [], [1, 2], {"a": 1}, True, 10**30]


def _tensorizer_mutant(base: bytes, structured: list[int], rng: random.Random) -> bytes:
    data = bytearray(base)
    for _ in range(rng.choice((1, 1, 2, 3))):
        pos = min(len(data) - 1, max(0, rng.choice(structured) + rng.randrange(-2, 3)))
        data[pos] = rng.choice((0, 0xFF, rng.randrange(256), data[pos] ^ 1 << rng.randrange(8)))
    if rng.random() < 0.2:
        del data[rng.randrange(len(data)) :]  # truncated too
    return bytes(data)


def _safetensors_mutant(header: dict, body: bytes, rng: random.Random) -> bytes:
    """Values of the JSON header replaced by odd ones: negative, huge, wrong types."""
    h = json.loads(json.dumps(header))
    for _ in range(rng.choice((1, 2))):
        key = rng.choice(list(h))
        entry = h[key]
        if key == "__metadata__" or not isinstance(entry, dict) or rng.random() < 0.2:
            h[key] = rng.choice(_ODD)
            continue
        field = rng.choice(("dtype", "shape", "data_offsets"))
        value = entry.get(field)
        if isinstance(value, list) and value and rng.random() < 0.7:
            value[rng.randrange(len(value))] = rng.choice(_ODD)
        else:
            entry[field] = rng.choice([*_ODD, "F8_E4M3", "I4", "", "U64"])
    raw = json.dumps(h).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def test_inspect_never_prints_a_traceback_on_mutants(
    small_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """200 seeded mutants of real files (100 .tensors, 100 safetensors): each inspection
    ends in its output or in one error line from a tensorstream error."""
    from safetensors.torch import save_file

    monkeypatch.delenv("TENSORSTREAM_DEBUG", raising=False)
    base = small_file.read_bytes()
    # Mutate where the structure is: the file header, the index and the tensor headers.
    structured = [i for i, b in enumerate(base[: len(base) - 64]) if b]
    st_path = tmp_path / "base.safetensors"
    save_file({"a": torch.ones(8, 4), "b": torch.arange(10)}, str(st_path), {"format": "pt"})
    st_bytes = st_path.read_bytes()
    (st_len,) = struct.unpack_from("<Q", st_bytes)
    st_header, st_body = json.loads(st_bytes[8 : 8 + st_len]), st_bytes[8 + st_len :]
    rng = random.Random(1515)
    outcomes = {0: 0, 2: 0}
    for i in range(200):
        if i % 2:
            target = tmp_path / "mutant.tensors"
            target.write_bytes(_tensorizer_mutant(base, structured, rng))
        else:
            target = tmp_path / "mutant.safetensors"
            target.write_bytes(_safetensors_mutant(st_header, st_body, rng))
        for extra in ([], ["--json"]):
            status = main(["inspect", str(target), *extra])
            err = capsys.readouterr().err
            assert "Traceback" not in err
            # 1 would mean "unexpected exception": a library bug the mutant found.
            assert status in (0, 2), f"{target.name}: {err}"
            if status:
                _assert_one_line(err)
            outcomes[status] += 1
    assert outcomes[2] > 0  # the mutants really broke files
