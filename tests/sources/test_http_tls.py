"""HTTPS options against a real TLS server on loopback with a throwaway self-signed certificate.

The server is Python's threaded ``http.server`` wrapped in TLS (it has no Range
support, which the HTTPS source handles as a no-range server). The certificate
is made with the ``openssl`` command for 127.0.0.1.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import ssl
import subprocess
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3  # noqa: F401 - named in a warning filter

from tensorstream.errors import ConfigError, SourceError
from tensorstream.sources import connection
from tensorstream.sources.base import StorageOptions
from tensorstream.sources.registry import open_source

pytestmark = pytest.mark.integration

DATA = bytes(range(256)) * 400


SEEN_HEADERS: list[dict[str, str]] = []


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        SEEN_HEADERS.append(dict(self.headers.items()))
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # refused handshakes are the point of some tests


@pytest.fixture(scope="module")
def tls_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the TLS tests need the openssl command (apt-get install openssl)")
    base = tmp_path_factory.mktemp("tls")
    cert, key = base / "cert.pem", base / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    root = base / "root"
    root.mkdir()
    (root / "w.bin").write_bytes(DATA)
    handler = functools.partial(_Quiet, directory=str(root))
    server = _Server(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/w.bin", cert
    finally:
        server.shutdown()
        server.server_close()


def test_untrusted_certificate_is_refused_by_default(tls_site) -> None:
    url, _ = tls_site
    with pytest.raises(SourceError, match="ca_bundle"):
        open_source(url, StorageOptions(max_retries=5))


def test_ca_bundle_file(tls_site) -> None:
    url, cert = tls_site
    src = open_source(url, StorageOptions(ca_bundle=str(cert)))
    assert src.size == len(DATA)
    assert src.read(0, len(DATA)) == DATA


def test_ca_bundle_directory(tls_site, tmp_path) -> None:
    url, cert = tls_site
    digest = subprocess.run(
        ["openssl", "x509", "-hash", "-noout", "-in", str(cert)],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    shutil.copy(cert, tmp_path / f"{digest}.0")
    src = open_source(url, StorageOptions(ca_bundle=str(tmp_path)))
    assert src.read(0, 100) == DATA[:100]


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_verify_tls_false_warns_once(tls_site, monkeypatch) -> None:
    url, _ = tls_site
    monkeypatch.setattr(connection, "_insecure_warned", False)
    with pytest.warns(UserWarning, match="verify_tls=False"):
        src = open_source(url, StorageOptions(verify_tls=False))
    assert src.read(0, 10) == DATA[:10]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert open_source(url, StorageOptions(verify_tls=False)).read(0, 10) == DATA[:10]
    ours = [w for w in caught if "verify_tls=False" in str(w.message)]
    assert ours == []  # warned once per process, not per source


def test_missing_ca_bundle_is_config_error(tls_site, tmp_path) -> None:
    url, _ = tls_site
    with pytest.raises(ConfigError, match="ca_bundle"):
        open_source(url, StorageOptions(ca_bundle=str(tmp_path / "nope.pem")))


def test_extra_headers_are_sent(tls_site) -> None:
    url, cert = tls_site
    SEEN_HEADERS.clear()
    opts = StorageOptions(ca_bundle=str(cert), headers=(("Authorization", "Bearer tok-123"),))
    src = open_source(url, opts)
    assert src.read(0, 5) == DATA[:5]
    assert "tok-123" not in repr(src) and "tok-123" not in repr(opts)
    assert SEEN_HEADERS and all(h.get("Authorization") == "Bearer tok-123" for h in SEEN_HEADERS)
    assert all(h.get("Accept-Encoding") == "identity" for h in SEEN_HEADERS)
