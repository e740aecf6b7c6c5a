"""One conformance suite for every byte source: local file, memory, nginx HTTP, SeaweedFS S3.

Each case serves the same 3 MiB of random bytes; the tests check size, exact
ranged reads at awkward offsets, sequential range readers with small and large
skips, concurrent readers, and that reading past the end is a TruncatedFileError.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest

from tensorstream.errors import TruncatedFileError
from tensorstream.sources.base import Source, StorageOptions
from tensorstream.sources.memory import MemorySource
from tensorstream.sources.registry import open_source

pytestmark = pytest.mark.integration

SIZE = 3 * (1 << 20) + 12345
DATA = random.Random(1234).randbytes(SIZE)


@pytest.fixture(params=["local", "memory", "http", "s3"])
def source(request: pytest.FixtureRequest, tmp_path) -> Iterator[Source]:
    kind = request.param
    if kind == "local":
        path = tmp_path / "blob.bin"
        path.write_bytes(DATA)
        src = open_source(str(path))
    elif kind == "memory":
        src = MemorySource(DATA, name="<conformance>")
    elif kind == "http":
        server = request.getfixturevalue("http_server")
        name = f"conformance-{request.node.name}.bin".replace("[", "-").replace("]", "")
        (server.root / name).write_bytes(DATA)
        src = open_source(server.url(name))
    else:
        server = request.getfixturevalue("s3_server")
        bucket = request.getfixturevalue("s3_bucket")
        server.client().put_object(Bucket=bucket, Key="dir/blob.bin", Body=DATA)
        src = open_source(
            f"s3://{bucket}/dir/blob.bin",
            StorageOptions(
                s3_endpoint=server.endpoint,
                s3_access_key_id=server.access_key,
                s3_secret_access_key=server.secret_key,
                s3_region=server.region,
            ),
        )
    with src:
        yield src


def test_size(source: Source) -> None:
    assert source.size == SIZE
    assert source.preferred_readers >= 1


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, 1), (0, 73), (1, 4096), (65535, 1 << 20), (SIZE - 10, 10), (SIZE - 1, 1), (0, SIZE)],
)
def test_read_into(source: Source, offset: int, length: int) -> None:
    buf = bytearray(length)
    source.read_into(offset, memoryview(buf))
    assert buf == DATA[offset : offset + length]


def test_read_zero_bytes(source: Source) -> None:
    source.read_into(SIZE, memoryview(bytearray()))
    assert source.read(100, 0) == b""


def test_read_past_end_is_truncated(source: Source) -> None:
    with pytest.raises(TruncatedFileError):
        source.read_into(SIZE - 5, memoryview(bytearray(10)))
    with pytest.raises(TruncatedFileError):
        source.read(SIZE + 100, 1)


def test_open_range_sequential_with_skips(source: Source) -> None:
    start = 1000
    with source.open_range(start, SIZE) as reader:
        pos = start
        for length, gap in [(10, 0), (4096, 7), (100_000, 2 << 20), (50, 1), (1, 0)]:
            buf = bytearray(length)
            reader.readinto_exact(memoryview(buf))
            assert buf == DATA[pos : pos + length], f"mismatch at {pos}"
            pos += length
            reader.skip(gap)
            pos += gap
        rest = bytearray(SIZE - pos)
        reader.readinto_exact(memoryview(rest))
        assert rest == DATA[pos:]


def test_open_range_past_its_end_is_truncated(source: Source) -> None:
    with source.open_range(100, 200) as reader:
        reader.readinto_exact(memoryview(bytearray(60)))
        with pytest.raises(TruncatedFileError):
            reader.readinto_exact(memoryview(bytearray(41)))


def test_open_range_past_file_end_is_truncated(source: Source) -> None:
    with source.open_range(SIZE - 100, SIZE + 100) as reader:
        buf = bytearray(100)
        reader.readinto_exact(memoryview(buf))
        assert buf == DATA[-100:]
        with pytest.raises(TruncatedFileError):
            reader.readinto_exact(memoryview(bytearray(1)))


def test_concurrent_readers(source: Source) -> None:
    out = bytearray(SIZE)
    view = memoryview(out)
    n = 4
    step = SIZE // n + 1
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            lo, hi = i * step, min(SIZE, (i + 1) * step)
            if i % 2:
                source.read_into(lo, view[lo:hi])
            else:
                with source.open_range(lo, hi) as reader:
                    reader.readinto_exact(view[lo:hi])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert out == DATA
