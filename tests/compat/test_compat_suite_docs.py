"""docs/compat.md lists every test the tensorizer-suite runner deselects, with its reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _runner() -> object:
    spec = importlib.util.spec_from_file_location(
        "tensorizer_suite_run", ROOT / "scripts" / "tensorizer_suite" / "run.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_deselection_is_documented() -> None:
    deselected: dict[str, str] = _runner().DESELECTED  # type: ignore[attr-defined]
    docs = (ROOT / "docs" / "compat.md").read_text()
    assert deselected, "the runner deselects nothing; update docs/compat.md"
    for nodeid, reason in deselected.items():
        assert reason.strip(), nodeid
        file_and_class = nodeid.rsplit("::", 1)[0] + "::*" if nodeid.count("::") == 2 else nodeid
        assert f"`{nodeid}`" in docs or f"`{file_and_class}`" in docs, nodeid


def test_runner_pins_tensorizer_2_12_1() -> None:
    runner = _runner()
    assert runner.VERSION == "2.12.1"  # type: ignore[attr-defined]
    # The suite's own dependencies are pinned and kept out of the project venv.
    assert all("==" in dep for dep in runner.SUITE_DEPS)  # type: ignore[attr-defined]
