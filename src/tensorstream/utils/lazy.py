"""Package attributes that import their module on first access (PEP 562).

Why: ``import tensorstream`` must not import torch, so ``LLM(...)`` can start fetching
weights before torch's import is paid; the packages that re-export heavy names use
:func:`lazy_attributes` for their ``__getattr__``/``__dir__``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str, table: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` serving ``table`` (name -> module).

    The first access imports the module and stores the value in the package's namespace,
    so later lookups skip ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
