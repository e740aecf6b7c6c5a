"""O_DIRECT writes: the same bytes as buffered writes, nothing left behind on failure,
used when asked or for large writes, and a clean fallback where the filesystem refuses."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import tensorizer
import torch

from tensorstream import TensorDeserializer, TensorSerializer
from tensorstream.crypto import DecryptionParams, EncryptionParams
from tensorstream.serialize import writer as writer_module
from tensorstream.sources import direct
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.direct import DirectSink
from tensorstream.sources.local import LocalSink

DIRECT = StorageOptions(direct_io=True)
BUFFERED = StorageOptions(direct_io=False)


def _takes_o_direct(directory: Path) -> bool:
    probe = directory / ".probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 64 KiB so a few MB exercise block reuse, a first block that must grow,
    and an unaligned tail."""
    monkeypatch.setattr(direct, "_BLOCK", 64 << 10)
    monkeypatch.setattr(direct, "_MIN_FIRST", 4096)


def _state_dict(n: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    sd = {f"layer.{i}.w": torch.randn(97 + 13 * i, 61, generator=g) for i in range(n)}
    sd["odd"] = torch.arange(7, dtype=torch.int8)  # leaves the file at an unaligned size
    return sd


def _write(path: Path, storage: StorageOptions, **kwargs: object) -> TensorSerializer:
    s = TensorSerializer(path, storage=storage, **kwargs)  # type: ignore[arg-type]
    s.write_state_dict(_state_dict())
    return s


@pytest.mark.usefixtures("small_blocks")
def test_direct_writes_the_same_bytes_and_both_readers_load_them(tmp_path: Path) -> None:
    assert _takes_o_direct(tmp_path)
    s = _write(tmp_path / "direct.tensors", DIRECT)
    assert isinstance(s._sink, DirectSink)  # noqa: SLF001 - which sink is the point here
    s.close()
    _write(tmp_path / "buffered.tensors", BUFFERED).close()
    data = (tmp_path / "direct.tensors").read_bytes()
    assert data == (tmp_path / "buffered.tensors").read_bytes()
    assert len(data) % 4096  # the tail padding was cut off
    sd = _state_dict()
    with TensorDeserializer(tmp_path / "direct.tensors", verify_hash=True) as d:
        assert all(torch.equal(d[k], v) for k, v in sd.items())
    theirs = tensorizer.TensorDeserializer(
        str(tmp_path / "direct.tensors"), device="cpu", verify_hash=True
    )
    assert all(torch.equal(theirs[k], v) for k, v in sd.items())
    assert sorted(os.listdir(tmp_path)) == ["buffered.tensors", "direct.tensors"]


@pytest.mark.usefixtures("small_blocks")
def test_a_large_index_grows_the_first_block(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.full((3,), float(i)) for i in range(600)}  # index > 4 KiB
    for name, storage in (("d.tensors", DIRECT), ("b.tensors", BUFFERED)):
        with TensorSerializer(tmp_path / name, storage=storage) as s:
            s.write_state_dict(sd)
    assert (tmp_path / "d.tensors").read_bytes() == (tmp_path / "b.tensors").read_bytes()


@pytest.mark.usefixtures("small_blocks")
def test_encrypted_direct_write_round_trips(tmp_path: Path) -> None:
    enc = EncryptionParams.random()
    _write(tmp_path / "e.tensors", DIRECT, encryption=enc).close()
    sd = _state_dict()
    with TensorDeserializer(
        tmp_path / "e.tensors", encryption=DecryptionParams.from_key(enc.key), verify_hash=True
    ) as d:
        assert all(torch.equal(d[k], v) for k, v in sd.items())
    assert sorted(os.listdir(tmp_path)) == ["e.tensors", "e.tensors.manifest"]


@pytest.mark.usefixtures("small_blocks")
@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failed_direct_write_leaves_nothing(tmp_path: Path, exc: BaseException) -> None:
    target = tmp_path / "model.tensors"
    target.write_bytes(b"old contents")
    with pytest.raises(type(exc)):
        with TensorSerializer(target, storage=DIRECT) as s:
            s.write_state_dict(_state_dict())
            raise exc
    assert target.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["model.tensors"]


def test_default_goes_direct_only_for_large_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = sum(t.nbytes for t in _state_dict().values())
    monkeypatch.setattr(writer_module, "_DIRECT_IO_MIN_BYTES", size)
    s = _write(tmp_path / "big.tensors", StorageOptions())
    assert isinstance(s._sink, DirectSink)  # noqa: SLF001
    s.close()
    monkeypatch.setattr(writer_module, "_DIRECT_IO_MIN_BYTES", size + 1)
    s = _write(tmp_path / "small.tensors", StorageOptions())
    assert type(s._sink) is LocalSink  # noqa: SLF001
    s.close()
    monkeypatch.setattr(writer_module, "_DIRECT_IO_MIN_BYTES", 0)
    s = _write(tmp_path / "never.tensors", BUFFERED)
    assert type(s._sink) is LocalSink  # noqa: SLF001
    s.close()
    assert (tmp_path / "big.tensors").read_bytes() == (tmp_path / "small.tensors").read_bytes()


def test_a_filesystem_refusing_o_direct_falls_back_to_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Some filesystems (older tmpfs, some network ones) refuse O_DIRECT at open with
    # EINVAL; none here does, so the refusal is simulated at that one call.
    real_open = os.open

    def refusing_open(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="tensorstream.serialize"):
        s = _write(tmp_path / "m.tensors", DIRECT)
    assert type(s._sink) is LocalSink  # noqa: SLF001
    s.close()
    assert "refuses O_DIRECT" in caplog.text and "page cache" in caplog.text
    with TensorDeserializer(tmp_path / "m.tensors") as d:
        assert torch.equal(d["odd"], _state_dict()["odd"])
    assert os.listdir(tmp_path) == ["m.tensors"]


@pytest.mark.usefixtures("small_blocks")
def test_direct_sink_counts_bytes_not_items(tmp_path: Path) -> None:
    from tensorstream.sources.uri import parse_uri

    words = torch.arange(50_000, dtype=torch.int32).numpy()  # a memoryview of 4-byte items
    sink = DirectSink(parse_uri(str(tmp_path / "raw.bin")))
    with sink:
        sink.write(b"head")
        sink.write(memoryview(words))
        assert sink.position == 4 + words.nbytes
        sink.patch(0, b"HEAD")
    assert (tmp_path / "raw.bin").read_bytes() == b"HEAD" + words.tobytes()
