"""`tensorstream deserialize`: honest load figures and the verify modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.cli import main as cli


@pytest.fixture()
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.tensors"
    with TensorSerializer(path) as writer:
        writer.write_state_dict({"a": torch.arange(4096.0), "b": torch.ones(16, 16)})
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_mapped_load_reports_no_throughput(model_file, capsys):
    code, out, _ = _run(["deserialize", str(model_file)], capsys)
    assert code == 0
    assert "GB/s" not in out
    assert f"{4096 * 4 + 256 * 4} bytes mapped" in out


def test_read_load_reports_throughput(model_file, capsys):
    code, out, _ = _run(["deserialize", "--no-mmap", str(model_file)], capsys)
    assert code == 0 and "GB/s" in out and "mapped" not in out


def test_mapped_bytes_counts_views_only(model_file):
    with TensorDeserializer(model_file, device="cpu") as loaded:
        assert loaded.mapped_bytes == loaded.total_tensor_bytes
    with TensorDeserializer(model_file, device="cpu", verify_hash=True) as loaded:
        assert loaded.mapped_bytes == 0


def test_verify_crc32_flag_checks_crc32_only(model_file, capsys):
    code, out, _ = _run(["deserialize", "--verify-crc32", str(model_file)], capsys)
    assert code == 0 and "(CRC32 verified)" in out
    code, out, _ = _run(["deserialize", "--verify-hash", str(model_file)], capsys)
    assert code == 0 and "(hashes verified)" in out
    # Corrupt one data byte: both modes refuse the file with one line.
    data = bytearray(model_file.read_bytes())
    with TensorDeserializer(model_file, device="cpu", lazy_load=True) as loaded:
        offset = loaded.index.records[0].data_offset
    data[offset + 5] ^= 0xFF
    model_file.write_bytes(bytes(data))
    for flag in ("--verify-crc32", "--verify-hash"):
        code, out, err = _run(["deserialize", flag, str(model_file)], capsys)
        assert code == 2, (flag, out, err)
        assert len(err.strip().splitlines()) == 1 and "'a'" in err, err


def test_verify_flags_are_exclusive(model_file, capsys):
    code, _, err = _run(["deserialize", "--verify-hash", "--verify-crc32", str(model_file)], capsys)
    assert code == 2 and "not allowed with" in err
