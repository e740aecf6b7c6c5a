"""HTTP and S3 bench sources: nginx and SeaweedFS on loopback, serving the checkpoint dir.

Both reuse the project's test-server launchers (``tests/servers``: nginx with Range and
sendfile; ``weed mini`` with SigV4 credentials), so the benchmark and the integration tests
talk to identically configured servers. Loopback numbers measure client CPU cost and
parallelism, not a network: read them as ratios.

* ``http`` — nginx serves the checkpoint dir; the page cache behind a URL is the file itself.
* ``http-slow`` — the same nginx through its ``/slow/`` view: each connection is capped
  at 16 MiB/s (``limit_rate``), so the source, not the client, is the bottleneck.
* ``s3`` — every checkpoint file is uploaded once per run into bucket ``bench``; the page
  cache behind an object is SeaweedFS's volume files, which ``cache_paths`` lists.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from bench.sources import BenchSource, Located

__all__ = ["NginxBenchSource", "SeaweedBenchSource", "SlowNginxBenchSource"]

_BUCKET = "bench"


class NginxBenchSource(BenchSource):
    """nginx on 127.0.0.1 serving the checkpoint dir."""

    name = "http"

    def __init__(self) -> None:
        self._server = None
        self._prefix: str | None = None

    def start(self, directory: Path) -> None:
        from tests.servers.nginx import HTTPServer

        self._prefix = tempfile.mkdtemp(prefix="bench-nginx-")
        self._server = HTTPServer.start(Path(self._prefix), Path(directory))

    def locate(self, directory: Path, filename: str) -> Located:
        assert self._server is not None, "start() first"
        return Located(
            uri=self._server.url(filename), cache_paths=(str(Path(directory) / filename),)
        )

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._prefix:
            shutil.rmtree(self._prefix, ignore_errors=True)
            self._prefix = None


class SeaweedBenchSource(BenchSource):
    """SeaweedFS ``weed mini`` on 127.0.0.1 holding a copy of every checkpoint file."""

    name = "s3"

    def __init__(self) -> None:
        self._server = None
        self._workdir: str | None = None

    def start(self, directory: Path) -> None:
        from boto3.s3.transfer import TransferConfig
        from tests.servers.seaweed import S3Server

        self._workdir = tempfile.mkdtemp(prefix="bench-weed-", dir=Path(directory).parent)
        self._server = S3Server.start(Path(self._workdir))
        client = self._server.client()
        client.create_bucket(Bucket=_BUCKET)
        config = TransferConfig(multipart_chunksize=64 * 2**20, max_concurrency=4)
        for path in sorted(Path(directory).iterdir()):
            if path.is_file() and path.suffix in (".tensors", ".safetensors"):
                client.upload_file(str(path), _BUCKET, path.name, Config=config)

    def locate(self, directory: Path, filename: str) -> Located:
        assert self._server is not None and self._workdir, "start() first"
        s = self._server
        # SeaweedFS keeps object bytes in its volume files (*.dat); warm/cold act on those.
        volumes = tuple(
            str(p) for p in Path(self._workdir).rglob("*.dat") if p.stat().st_size > 2**20
        )
        return Located(
            uri=f"s3://{_BUCKET}/{filename}",
            cache_paths=volumes,
            options={
                "endpoint": s.endpoint,
                "access_key": s.access_key,
                "secret_key": s.secret_key,
                "region": s.region,
            },  # fmt: skip
            env={
                "AWS_ACCESS_KEY_ID": s.access_key,
                "AWS_SECRET_ACCESS_KEY": s.secret_key,
                "AWS_ENDPOINT_URL": s.endpoint,
                "AWS_REGION": s.region,
                "AWS_DEFAULT_REGION": s.region,
                "AWS_EC2_METADATA_DISABLED": "true",
                "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
            },
        )

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


class SlowNginxBenchSource(NginxBenchSource):
    """nginx's ``/slow/`` view of the checkpoint dir: each connection is capped by nginx's
    ``limit_rate`` (``tests/servers/nginx.py``: ``SLOW_RATE_BYTES``, 16 MiB/s).

    Object stores cap each connection's throughput (S3: tens of MB/s per GET), which is
    why loaders open parallel ranged readers and why more ranks, each with its own
    connections, load faster. On loopback the plain ``http`` source is CPU-bound; this
    one is source-bound, the case the tensor-parallel target (tp=2 <= 0.6x tp=1) is about.
    """

    name = "http-slow"

    def locate(self, directory: Path, filename: str) -> Located:
        assert self._server is not None, "start() first"
        return Located(
            uri=self._server.slow_url(filename), cache_paths=(str(Path(directory) / filename),)
        )
