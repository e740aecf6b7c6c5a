"""JSON-object arguments (``--model-loader-extra-config '{...}'`` and friends)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tensorstream.errors import ConfigError

__all__ = ["json_object"]


def json_object(value: Mapping[str, Any] | str | None, what: str) -> dict[str, Any]:
    """A dict from a mapping, a JSON object string, or nothing (``None`` / ``""``).

    Raises:
        ConfigError: invalid JSON, or JSON that is not an object; ``what`` names the option.
    """
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a JSON object, got {type(value).__name__}")
    return dict(value)
