"""A writer killed mid-write leaves nothing behind: SIGTERM aborts, SIGKILL's leftovers go.

Each case runs a real serializer in a child process (SeaweedFS for S3, a local
directory otherwise), waits until the write is visibly under way, signals it,
and then looks at what the storage holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tensorstream import TensorDeserializer, TensorSerializer

# The child writes 6 MiB tensors until it is killed; it prints "writing" first.
_CHILD = textwrap.dedent(
    """
    import os, sys, time, signal, torch
    from tensorstream import TensorSerializer
    from tensorstream.sources import s3
    from tensorstream.sources.base import StorageOptions

    s3._MIN_FIRST_PART = 5 << 20  # SeaweedFS takes 5 MiB parts; upload starts sooner
    target, mode = sys.argv[1], sys.argv[2]
    if mode == "chained":
        def previous(signum, frame):
            print("previous handler ran", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, previous)
    storage = StorageOptions(
        s3_endpoint=os.environ.get("T_ENDPOINT"),
        s3_access_key_id=os.environ.get("T_KEY"),
        s3_secret_access_key=os.environ.get("T_SECRET"),
        s3_region=os.environ.get("T_REGION"),
        s3_part_size=5 << 20,
        direct_io=False,
    )
    with TensorSerializer(target, storage=storage) as s:
        print("writing", flush=True)
        for i in range(100_000):
            s.write_tensor(0, f"t{i}", 0, torch.full((3 << 19,), float(i)))
            if mode != "fast":
                time.sleep(0.05)
    """
)


def _spawn(target: str, mode: str = "slow", env: dict[str, str] | None = None):
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, target, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "writing", child.stderr.read() if child.stderr else line
    return child


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _partials(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".partial"))


# -- SIGTERM -----------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("pace", ["slow", "fast"])  # fast: SIGTERM lands mid-write, in locks
def test_sigterm_aborts_s3_multipart_upload(s3_server, s3_bucket, pace: str) -> None:
    """Regression: SIGTERM mid-upload left an orphaned multipart upload."""
    client = s3_server.client()
    env = {
        "T_ENDPOINT": s3_server.endpoint,
        "T_KEY": s3_server.access_key,
        "T_SECRET": s3_server.secret_key,
        "T_REGION": s3_server.region,
    }
    child = _spawn(f"s3://{s3_bucket}/model.tensors", pace, env=env)
    try:
        _wait_for(
            lambda: client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads"),
            "the multipart upload to start",
        )
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM  # still dies of SIGTERM
    finally:
        child.kill()
    leftover = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert leftover == [], child.stderr.read() if child.stderr else ""
    assert client.list_objects_v2(Bucket=s3_bucket).get("Contents", []) == []


@pytest.mark.parametrize("pace", ["slow", "fast"])
def test_sigterm_removes_local_temp_file(tmp_path: Path, pace: str) -> None:
    child = _spawn(str(tmp_path / "model.tensors"), pace)
    try:
        _wait_for(lambda: _partials(tmp_path), "the temp file")
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM
    finally:
        child.kill()
    assert os.listdir(tmp_path) == []


def test_sigterm_chains_to_the_previous_handler(tmp_path: Path) -> None:
    child = _spawn(str(tmp_path / "model.tensors"), mode="chained")
    try:
        _wait_for(lambda: _partials(tmp_path), "the temp file")
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == 3  # the program's own handler decided the exit
    finally:
        child.kill()
    assert child.stdout is not None and "previous handler ran" in child.stdout.read()
    assert os.listdir(tmp_path) == []


def test_handler_installed_only_while_a_sink_is_open(tmp_path: Path) -> None:
    from tensorstream.sources import termination

    before = signal.getsignal(signal.SIGTERM)
    s = TensorSerializer(str(tmp_path / "m.tensors"))
    assert signal.getsignal(signal.SIGTERM) is not before
    s.write_state_dict({"w": torch.ones(3)})
    s.close()
    assert signal.getsignal(signal.SIGTERM) is before
    assert termination._installed is None


# -- SIGKILL leftovers ---------------------------------------------------------------


def test_sigkill_partial_is_removed_by_next_write(tmp_path: Path) -> None:
    """Regression: kill -9 left a hidden .partial that no later write removed."""
    target = tmp_path / "model.tensors"
    child = _spawn(str(target))
    _wait_for(lambda: _partials(tmp_path), "the temp file")
    child.kill()
    child.wait(timeout=60)
    leftover = _partials(tmp_path)
    assert len(leftover) == 1 and leftover[0].startswith(".model.tensors.")
    # A partial of another target in the same directory is never touched.
    other = tmp_path / f".model.tensors.v2.{child.pid}.abcdefgh.partial"
    other.write_bytes(b"x")
    with TensorSerializer(str(target)) as s:
        s.write_state_dict({"w": torch.arange(5.0)})
    assert _partials(tmp_path) == [other.name]
    with TensorDeserializer(str(target)) as d:
        assert torch.equal(d["w"], torch.arange(5.0))


def test_live_writers_partial_is_kept(tmp_path: Path) -> None:
    from tensorstream.sources.local import remove_stale_partials

    target = tmp_path / "model.tensors"
    child = _spawn(str(target))
    try:
        _wait_for(lambda: _partials(tmp_path), "the temp file")
        live = _partials(tmp_path)
        assert remove_stale_partials(str(target)) == []
        with TensorSerializer(str(target)) as s:
            s.write_state_dict({"w": torch.ones(2)})
        assert set(live) <= set(_partials(tmp_path))  # the live writer's file survived
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(timeout=60)
