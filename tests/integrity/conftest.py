"""Fixtures for the load-integrity tests: one loader per load path, small files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorstream import TensorDeserializer, TensorSerializer

#: every way a tensor can be loaded; each must apply the same checks
LOAD_MODES = ["mmap", "copy", "bytes", "lazy", "filtered", "staged", "staged-1"]


def state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(2, 3, generator=g),
        "ints": torch.arange(6, dtype=torch.int32),
        "meta": torch.empty(5, device="meta"),
        "empty": torch.empty(0, 4, 4),
        "tail": torch.randn(4, generator=g),
    }


def write(path: Path, sd: dict[str, Any] | None = None) -> Path:
    with TensorSerializer(path) as s:
        s.write_state_dict(state_dict() if sd is None else sd)
    return path


def load_all(path: Path, mode: str, verify: bool = False, monkeypatch: Any = None) -> dict:
    """Load every tensor of ``path`` through the load path ``mode``; returns them."""
    kwargs: dict[str, Any] = {"device": "cpu", "verify_hash": verify}
    source: Any = path
    if mode == "copy":
        kwargs["use_mmap"] = False
    elif mode == "bytes":
        source = path.read_bytes()
    elif mode == "lazy":
        kwargs["lazy_load"] = True
    elif mode.startswith("staged"):
        monkeypatch.setattr(TensorDeserializer, "_force_staged", True)
        kwargs["num_readers"] = 1 if mode == "staged-1" else 3
    if mode == "filtered":
        # select each tensor alone, so every one is loaded through a filtered load
        out = {}
        with TensorDeserializer(source, device="cpu", lazy_load=True) as d:
            names = list(d.keys())
        for name in names:
            with TensorDeserializer(source, filter_func=lambda k, n=name: k == n, **kwargs) as d:
                out[name] = d[name]
        return out
    with TensorDeserializer(source, **kwargs) as d:
        return {k: d[k] for k in d.keys()}


@pytest.fixture(params=LOAD_MODES)
def load(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[..., dict]:
    """``load(path, verify=False)`` through one load path."""
    mode = request.param

    def run(path: Path, verify: bool = False) -> dict:
        return load_all(path, mode, verify, monkeypatch)

    return run
