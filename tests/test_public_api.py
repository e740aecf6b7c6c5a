"""The public surface: sorted, complete ``__all__`` lists that import cleanly."""

from __future__ import annotations

import importlib

import pytest

MODULES = [
    "tensorstream",
    "tensorstream.errors",
    "tensorstream.sources",
    "tensorstream.crypto",
    "tensorstream.engine.lora",
    "tensorstream.engine.adapter_files",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_is_sorted_and_importable(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names missing attributes: {missing}"


def test_every_error_class_is_exported() -> None:
    from tensorstream import errors

    classes = {
        n for n, v in vars(errors).items()
        if isinstance(v, type) and issubclass(v, errors.TensorStreamError)
    }  # fmt: skip
    assert classes == set(errors.__all__)
