"""Shared helpers for tests/arena: files written by both writers, run-in-a-child helper."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import tensorizer

from tensorstream import TensorSerializer

# The dtype matrix lives with the core tests; reuse it rather than repeat it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from _core_util import (  # noqa: E402
    Net,
    all_tensors,
    assert_same,
    dtype_matrix,
    raw_bytes,
    tensorizer_readable,
)

__all__ = [
    "Net",
    "all_tensors",
    "assert_same",
    "drop_from_page_cache",
    "dtype_matrix",
    "raw_bytes",
    "run_child",
    "tensorizer_readable",
    "write_ours",
    "write_theirs",
]


def write_ours(path: Path, obj: Any, module: bool = False, **kw: Any) -> Path:
    with TensorSerializer(path, **kw) as s:
        (s.write_module if module else s.write_state_dict)(obj)
    return path


def write_theirs(path: Path, obj: Any, module: bool = False) -> Path:
    """Written by the real tensorizer 2.12.1: data at whatever offset its header ends."""
    s = tensorizer.TensorSerializer(str(path))
    (s.write_module if module else s.write_state_dict)(obj)
    s.close()
    return path


def run_child(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter (a SIGBUS there cannot kill pytest)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, (
        f"child exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc.stdout


def drop_from_page_cache(path: Path) -> None:
    """Evict ``path`` from the page cache, so the next load finds it cold."""
    gc.collect()  # tensors of earlier mapped loads keep their pages otherwise
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
