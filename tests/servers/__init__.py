"""Real servers for the test suite, and the process plumbing they share.

Owns: picking free loopback ports, waiting for a child server to listen, and
stopping a child server's whole process group so no test run leaves orphans.
The servers themselves live beside this file: ``seaweed`` (S3 via SeaweedFS),
``nginx`` (static HTTP with Range) and ``faultproxy`` (a TCP proxy that cuts,
stalls or fails requests on purpose). ``tests/conftest.py`` turns them into
fixtures; tests should use the fixtures rather than these modules directly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["free_ports", "log_tail", "stop_process_group", "wait_for_port"]

LOOPBACK = "127.0.0.1"


def free_ports(count: int) -> list[int]:
    """Pick ``count`` distinct free TCP ports on 127.0.0.1.

    All sockets stay bound until every port is picked, so the ports are
    distinct; they are released before returning, so a short race with other
    processes remains (callers retry start-up once on a bind failure).

    Args:
        count: how many ports to pick.

    Returns:
        The port numbers.
    """
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], timeout: float, what: str, log: Path
) -> None:
    """Block until something accepts TCP connections on 127.0.0.1:``port``.

    Args:
        port: the port to probe.
        proc: the child expected to open it; its early exit aborts the wait.
        timeout: seconds to wait at most.
        what: server name for error messages.
        log: the child's log file, quoted in error messages.

    Raises:
        RuntimeError: the child exited or the port stayed closed until ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with code {proc.returncode} before listening on port {port}; "
                f"log {log}:\n{log_tail(log)}"
            )
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(
        f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f}s; log {log}:\n"
        f"{log_tail(log)}"
    )


def stop_process_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """Stop a child started with ``start_new_session=True`` and everything it spawned.

    Sends SIGTERM to the child's process group, waits up to ``grace`` seconds,
    then SIGKILLs the group. Safe to call twice.

    Args:
        proc: the child (its pid is the process-group id).
        grace: seconds to wait for a clean exit before SIGKILL.
    """
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # Children of the leader may outlive it; the group id stays the leader's pid.
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - the kernel reaps SIGKILLed children
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(path: Path, limit: int = 4000) -> str:
    """Return the last ``limit`` characters of a log file ('' if unreadable)."""
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""
