"""A real ``tensorstream serve`` process for tests: start on a free loopback port, wait, stop.

The server runs as a child process in its own session (so stopping it never
touches the test runner), logs to a file that error messages quote, and is
watched from the moment it starts: every ``/health`` status seen while it
loads is kept, so tests can check it answered 503 before 200.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

try:  # tests/ as a package
    from tests.servers import free_ports, log_tail, stop_process_group
except ImportError:  # rootdir-style: pytest put tests/ itself on sys.path
    from servers import free_ports, log_tail, stop_process_group

LOOPBACK = "127.0.0.1"


@dataclass
class ServeProcess:
    """A running ``tensorstream serve``.

    Attributes:
        proc: the child process.
        port: its port on 127.0.0.1.
        log: its log file.
        api_key: the key it requires, if any.
        health_seen: ``(status, body)`` of every ``/health`` probe made while starting.
        start_seconds: from process start to the first 200 on ``/health``.
    """

    proc: subprocess.Popen
    port: int
    log: Path
    api_key: str | None = None
    health_seen: list[tuple[int, dict]] = field(default_factory=list)
    start_seconds: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @classmethod
    def start(
        cls,
        args: list[str],
        log: Path,
        *,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        api_key_flag: bool = True,
        timeout: float = 240.0,
    ) -> ServeProcess:
        """Run ``tensorstream serve <args> --port P`` and wait until ``/health`` is 200.

        ``api_key`` is what requests send; ``api_key_flag=False`` leaves ``--api-key``
        off the command line (the key then comes from ``env``).

        Raises:
            RuntimeError: the server exited or did not become ready within ``timeout``.
        """
        (port,) = free_ports(1)
        cmd = [sys.executable, "-m", "tensorstream", "serve", *args, "--port", str(port)]
        if api_key and api_key_flag:
            cmd += ["--api-key", api_key]
        child_env = dict(os.environ)
        child_env.update(env or {})
        started = time.monotonic()
        out = open(log, "wb")  # noqa: SIM115 - the child owns it for its lifetime
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
        )
        out.close()
        server = cls(proc, port, log, api_key)
        deadline = started + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"tensorstream serve exited with {proc.returncode} while starting; "
                    f"log {log}:\n{log_tail(log)}"
                )
            status, body = server.get_json("/health")
            if status:
                server.health_seen.append((status, body))
            if status == 200:
                server.start_seconds = time.monotonic() - started
                return server
            time.sleep(0.05)
        stop_process_group(proc)
        raise RuntimeError(
            f"tensorstream serve did not become ready in {timeout:.0f}s; log {log}:\n"
            f"{log_tail(log)}"
        )

    def get_json(self, path: str, timeout: float = 5.0) -> tuple[int, dict]:
        """GET ``path``; ``(0, {})`` when nothing answers."""
        return self.request("GET", path, None, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: dict | bytes | None,
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
        auth: bool = True,
    ) -> tuple[int, dict]:
        """Send one request; return ``(status, parsed JSON body or {"text": ...})``."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        if auth and self.api_key and "Authorization" not in all_headers:
            all_headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers=all_headers
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, _parse(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, _parse(err.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, {}

    def metrics_text(self) -> str:
        """``/metrics`` as served (no API key: Prometheus scrapes it unauthenticated)."""
        req = urllib.request.Request(self.base_url + "/metrics")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read().decode()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed by ``prometheus_client`` as ``{'name{k="v",...}': value}``.

        Labels are sorted by name, e.g. ``vllm:request_success_total{finished_reason="abort",
        model_name="smol"}``.
        """
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM the server and return its exit code."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            stop_process_group(self.proc)

    def stop(self) -> None:
        stop_process_group(self.proc)


def _parse(raw: bytes) -> dict:
    try:
        value = json.loads(raw)
        return value if isinstance(value, dict) else {"json": value}
    except ValueError:
        return {"text": raw.decode("utf-8", "replace")}
