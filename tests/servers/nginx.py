"""A real HTTP server for tests: Debian nginx serving a temp directory on loopback.

Owns: writing a self-contained nginx config (every path inside a temp prefix),
running nginx in the foreground as a child process on a free 127.0.0.1 port,
and stopping it. Four views of the same directory:

- ``/<relpath>``: static files with Range, ETag and sendfile (nginx defaults).
- ``/norange/<relpath>``: the same files with ``max_ranges 0``, so a Range
  header is ignored and the full body comes back with 200.
- ``/forbidden/<relpath>``: always 403.
- ``/slow/<relpath>``: the same files, each connection limited to
  :data:`SLOW_RATE_BYTES` per second (a load that takes seconds on any machine).

Anything missing is 404, as nginx does for static files.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from . import LOOPBACK, free_ports, log_tail, stop_process_group, wait_for_port

__all__ = ["NGINX_HINT", "SLOW_RATE_BYTES", "HTTPServer", "find_nginx"]

NGINX_HINT = "nginx is required for the HTTP tests; run `bash scripts/system-deps.sh`"
_START_TIMEOUT = 20.0
#: ``/slow/`` sends each connection at most this many bytes per second.
SLOW_RATE_BYTES = 16 * 1024 * 1024

_CONFIG = """\
{user}
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 256; }}
http {{
    default_type application/octet-stream;
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    sendfile on;
    tcp_nopush on;
    etag on;
    keepalive_requests 100000;
    server {{
        listen {host}:{port};
        server_name localhost;
        root {root};
        location / {{ }}
        location /norange/ {{
            alias {root}/;
            max_ranges 0;
        }}
        location /forbidden/ {{ return 403; }}
        location /slow/ {{
            alias {root}/;
            limit_rate {slow_rate};
        }}
    }}
}}
"""


def find_nginx() -> Path:
    """Locate the nginx binary (Debian puts it in /usr/sbin, often off PATH).

    Returns:
        Path of an executable nginx.

    Raises:
        FileNotFoundError: nginx is not installed; the message says how to get it.
    """
    for candidate in ("/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"):
        if os.access(candidate, os.X_OK):
            return Path(candidate)
    raise FileNotFoundError(NGINX_HINT)


@dataclass
class HTTPServer:
    """A running nginx serving :attr:`root` on 127.0.0.1.

    Attributes:
        root: directory whose files are served; tests write files here.
        base_url: ``http://127.0.0.1:PORT`` (no trailing slash).
        prefix: nginx prefix directory holding config, pid and logs.
    """

    root: Path
    base_url: str
    prefix: Path
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        """Process id (and process-group id) of the server."""
        assert self._proc is not None
        return self._proc.pid

    @property
    def port(self) -> int:
        """TCP port nginx listens on."""
        return int(self.base_url.rsplit(":", 1)[1])

    def url(self, relpath: str | os.PathLike[str]) -> str:
        """URL of ``root / relpath`` with Range support.

        Args:
            relpath: path relative to :attr:`root` ('/'-separated).

        Returns:
            The absolute URL, percent-encoded.
        """
        return f"{self.base_url}/{_quote(relpath)}"

    def norange_url(self, relpath: str | os.PathLike[str]) -> str:
        """URL of ``root / relpath`` where Range headers are ignored (always 200)."""
        return f"{self.base_url}/norange/{_quote(relpath)}"

    def slow_url(self, relpath: str | os.PathLike[str]) -> str:
        """URL of ``root / relpath`` served at :data:`SLOW_RATE_BYTES` per connection.

        For tests that need a load to take a while (a server answering 503 while it
        loads) however fast the machine is.
        """
        return f"{self.base_url}/slow/{_quote(relpath)}"

    def forbidden_url(self, relpath: str | os.PathLike[str]) -> str:
        """URL under ``/forbidden/`` that always answers 403."""
        return f"{self.base_url}/forbidden/{_quote(relpath)}"

    @property
    def error_log(self) -> Path:
        """nginx's error log, useful when a test needs to see what the server saw."""
        return self.prefix / "error.log"

    @classmethod
    def start(cls, prefix: Path, root: Path, *, attempts: int = 3) -> HTTPServer:
        """Start nginx serving ``root``, with its config and logs under ``prefix``.

        Args:
            prefix: empty directory for config, pid, logs and temp files.
            root: directory to serve (created if missing).
            attempts: start-ups to try; a port taken between picking and binding
                makes one attempt fail.

        Returns:
            The running server; call :meth:`stop` when done.

        Raises:
            FileNotFoundError: nginx is not installed.
            RuntimeError: nginx did not come up; the message quotes its log.
        """
        nginx = find_nginx()
        root.mkdir(parents=True, exist_ok=True)
        errors: list[str] = []
        for attempt in range(attempts):
            run = prefix / f"run{attempt}"
            (run / "tmp").mkdir(parents=True)
            (port,) = free_ports(1)
            conf = run / "nginx.conf"
            conf.write_text(
                _CONFIG.format(
                    # As root, nginx would drop workers to 'nobody', which cannot
                    # read pytest's 0700 temp dirs.
                    user="user root;" if os.geteuid() == 0 else "",
                    prefix=run,
                    root=root.resolve(),
                    host=LOOPBACK,
                    port=port,
                    slow_rate=SLOW_RATE_BYTES,
                )
            )
            server = cls(root=root, base_url=f"http://{LOOPBACK}:{port}", prefix=run)
            with open(run / "stderr.log", "wb") as out:
                server._proc = subprocess.Popen(
                    # -e: the compiled-in error log must not be touched before the
                    # config is read (it may be unwritable).
                    [str(nginx), "-p", str(run), "-c", str(conf), "-e", str(run / "error.log")]
                    + ["-g", "daemon off;"],
                    cwd=run,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: stop() kills workers too
                )
            try:
                wait_for_port(port, server._proc, _START_TIMEOUT, "nginx", run / "error.log")
                return server
            except RuntimeError as exc:
                server.stop()
                errors.append(f"{exc}\nstderr:\n{log_tail(run / 'stderr.log')}")
                time.sleep(0.1)
        raise RuntimeError(f"nginx failed to start {attempts} times:\n" + "\n---\n".join(errors))

    def stop(self) -> None:
        """Stop nginx (master and workers). Safe to call twice."""
        if self._proc is not None:
            stop_process_group(self._proc)


def _quote(relpath: str | os.PathLike[str]) -> str:
    return urllib.parse.quote(os.fspath(relpath).lstrip("/"))
