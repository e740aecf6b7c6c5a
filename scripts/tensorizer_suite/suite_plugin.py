"""pytest plugin for running tensorizer 2.12.1's own tests against a chosen library.

Owns: making ``import tensorizer`` resolve to the library under test, proving it
did, and recording each test's outcome for the runner (``run.py``) to compare.

``TS_SUITE_TARGET=compat``: before any test module is imported, ``tensorizer``
and its submodules are entered in ``sys.modules`` as
``tensorstream.compat.tensorizer`` and its submodules. The real tensorizer is
then never imported; the session checks that at its end and fails otherwise.
``TS_SUITE_TARGET=tensorizer``: the real package from site-packages, checked too.

``TS_SUITE_RESULTS``: path of a JSON file ``{nodeid: outcome}`` written at the end.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

_TARGET = os.environ.get("TS_SUITE_TARGET", "")
_SUBMODULES = ("serialization", "stream_io", "utils", "torch_compat", "_crypt")
_outcomes: dict[str, str] = {}


def _alias_compat() -> None:
    package = importlib.import_module("tensorstream.compat.tensorizer")
    sys.modules["tensorizer"] = package
    for name in _SUBMODULES:
        sys.modules[f"tensorizer.{name}"] = importlib.import_module(
            f"tensorstream.compat.tensorizer.{name}"
        )


def _identity_problem() -> str | None:
    """Why the imported ``tensorizer`` is not the one this run is meant to test."""
    import tensorizer

    where = Path(tensorizer.__file__).resolve()
    if _TARGET == "compat":
        if "tensorstream" not in where.parts or "compat" not in where.parts:
            return f"tensorizer resolved to {where}, not tensorstream.compat.tensorizer"
        real = [
            name
            for name, mod in list(sys.modules.items())
            if (name == "tensorizer" or name.startswith("tensorizer."))
            and "site-packages" in str(getattr(mod, "__file__", "") or "")
        ]
        if real:
            return f"the real tensorizer was imported during the compat run: {real}"
        return None
    if _TARGET == "tensorizer":
        if "site-packages" not in where.parts:
            return f"tensorizer resolved to {where}, not the installed tensorizer 2.12.1"
        return None
    return f"TS_SUITE_TARGET must be 'compat' or 'tensorizer', got {_TARGET!r}"


if _TARGET == "compat":
    _alias_compat()


def pytest_report_header(config: Any) -> str:
    import tensorizer

    return f"tensorizer under test: {tensorizer.__file__} (target {_TARGET})"


def pytest_runtest_logreport(report: Any) -> None:
    previous = _outcomes.get(report.nodeid)
    if report.when == "call" or report.skipped or report.failed:
        outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
        if report.when != "call" and report.failed:
            outcome = "error"
        # A teardown error after a passed call still fails the test.
        if previous in (None, "passed") or outcome in ("failed", "error"):
            _outcomes[report.nodeid] = outcome


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _outcomes[report.nodeid or "<collection>"] = "error"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    problem = _identity_problem()
    if problem:
        _outcomes["<identity>"] = "error"
        sys.stderr.write(f"\nSUITE IDENTITY CHECK FAILED: {problem}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    path = os.environ.get("TS_SUITE_RESULTS")
    if path:
        Path(path).write_text(json.dumps(_outcomes, indent=1, sort_keys=True))
