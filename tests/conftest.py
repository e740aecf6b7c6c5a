"""Suite-wide pytest set-up: hermetic environment, GPU skipping, real-server fixtures.

Owns:
- an offline, AWS-free environment for every test (``HF_HUB_OFFLINE``,
  ``TRANSFORMERS_OFFLINE``; no ``~/.aws`` and no instance-metadata lookups);
- skipping ``@pytest.mark.gpu`` tests when CUDA is absent (the only skip allowed);
- fixtures for real servers, started once per session on 127.0.0.1:
  ``s3_server`` / ``s3_bucket`` / ``s3_env`` (SeaweedFS S3, SigV4 enforced),
  ``http_server`` (nginx with Range, a no-Range view and a 403 prefix) and
  ``fault_proxy`` (a factory for fault-injecting proxies in front of either).

A server that cannot start FAILS the tests that need it, with a message saying
what to install; it never skips.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator

import pytest

try:  # tests/ as a package (tests/__init__.py present)
    from .servers.faultproxy import FaultProxy
    from .servers.nginx import NGINX_HINT, HTTPServer
    from .servers.seaweed import S3Server
except ImportError:  # rootdir-style conftest: pytest put tests/ itself on sys.path
    from servers.faultproxy import FaultProxy
    from servers.nginx import NGINX_HINT, HTTPServer
    from servers.seaweed import S3Server

# tests/vllm_plugin runs inside .venv-vllm only (`make test-vllm`); the main suite never
# collects it.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_plugin"]

# Set for the whole run: tests must never reach the Hugging Face Hub or a real AWS
# account. Library code reads these at import time, so they are set at configure
# time, before any test module is collected.
_OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # Without credentials botocore would probe the EC2 metadata service (seconds of timeouts).
    "AWS_EC2_METADATA_DISABLED": "true",
}
_AWS_UNSET = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "S3_ENDPOINT_URL",
    "S3_ACCESS_KEY_ID",
    "S3_SECRET_ACCESS_KEY",
    # container / web-identity credential providers would be called over the network
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)


def _make_hermetic() -> None:
    os.environ.update(_OFFLINE_ENV)
    for name in _AWS_UNSET:
        os.environ.pop(name, None)
    # Point boto3 at files that do not exist, so ~/.aws cannot leak in.
    os.environ["AWS_CONFIG_FILE"] = os.devnull
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull


def pytest_configure(config: pytest.Config) -> None:
    _make_hermetic()


@pytest.fixture(scope="session", autouse=True)
def _offline_guard() -> Iterator[None]:
    """Re-assert the offline environment for the session (a plugin may have changed it)."""
    _make_hermetic()
    yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # don't import torch for runs without GPU tests
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


# -- S3 (SeaweedFS) --------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 endpoint on 127.0.0.1 that enforces SigV4 credentials.

    Gives ``endpoint``, ``access_key``, ``secret_key``, ``region``,
    ``client()`` (boto3) and ``make_bucket(prefix)``.
    """
    try:
        server = S3Server.start(tmp_path_factory.mktemp("seaweedfs"))
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.fail(f"could not start SeaweedFS for the S3 tests: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """Name of a fresh, empty bucket on ``s3_server``."""
    # Bucket names allow lower-case letters, digits and '-' only.
    stem = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:30]
    return s3_server.make_bucket(stem.strip("-") or "test")


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Export ``S3_ENDPOINT_URL``, ``S3_ACCESS_KEY_ID``, ``S3_SECRET_ACCESS_KEY`` (vLLM's names)."""
    monkeypatch.setenv("S3_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("S3_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("S3_SECRET_ACCESS_KEY", s3_server.secret_key)
    return s3_server


# -- HTTP (nginx) ----------------------------------------------------------------


@pytest.fixture(scope="session")
def http_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServer]:
    """nginx on 127.0.0.1 serving ``root``; ``url``, ``norange_url``, ``forbidden_url``.

    Files written under ``http_server.root`` are served immediately. The
    directory is shared by the session: write under a test-unique name.
    """
    base = tmp_path_factory.mktemp("nginx")
    try:
        server = HTTPServer.start(base / "prefix", base / "root")
    except FileNotFoundError:
        pytest.fail(NGINX_HINT, pytrace=False)
    except RuntimeError as exc:
        pytest.fail(f"could not start nginx for the HTTP tests: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


# -- Fault injection -------------------------------------------------------------


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[str], FaultProxy]]:
    """Factory: ``fault_proxy(upstream_url)`` -> a :class:`FaultProxy`, closed after the test.

    Use ``proxy.url`` instead of the upstream's base URL, ``proxy.set_mode(...)``
    to inject faults and ``proxy.stats`` to see what happened.
    """
    proxies: list[FaultProxy] = []

    def make(upstream_url: str) -> FaultProxy:
        proxy = FaultProxy(upstream_url)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()
