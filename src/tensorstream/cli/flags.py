"""Flag spelling shared by the subcommands that take vLLM's command lines."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["normalize_flags"]


def normalize_flags(argv: Sequence[str]) -> list[str]:
    """Accept ``--max_model_len`` for ``--max-model-len``, as vLLM's parser does.

    Only the flag's name is rewritten; a value after ``=`` keeps its underscores.
    """
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out
