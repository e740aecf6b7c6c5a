"""Where a case's bytes come from: local files now, HTTP and S3 servers as plug-ins.

A bench source is started once per run with the checkpoint dir, tells each case the URI of a
checkpoint file plus any options and environment a client needs, and is stopped at the end.
``cache_paths`` names the local files whose page cache backs the URI, so the worker can warm
or drop exactly those. Servers (nginx on loopback, SeaweedFS ``weed mini``) live in their own
modules and are named here by dotted path, so a local run never imports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SOURCES", "BenchSource", "LocalBenchSource", "Located", "open_source"]


@dataclass(frozen=True)
class Located:
    """A checkpoint file as one source serves it.

    Attributes:
        uri: what the loader is given (path, ``http://…``, ``s3://…``).
        cache_paths: local files backing it, for warming or dropping the page cache.
        options: source-specific client options (endpoint, credentials), JSON-able.
        env: environment variables a client reads (``AWS_ENDPOINT_URL`` …).
    """

    uri: str
    cache_paths: tuple[str, ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


class BenchSource:
    """Base: a source that needs no server. Subclasses start one in ``start``."""

    name = "base"

    def start(self, directory: Path) -> None:
        """Get ready to serve the files of ``directory`` (start a server, upload objects)."""

    def locate(self, directory: Path, filename: str) -> Located:
        """The URI and options of ``directory / filename`` through this source."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop whatever ``start`` started; safe to call twice."""


class LocalBenchSource(BenchSource):
    """Plain local files."""

    name = "local"

    def locate(self, directory: Path, filename: str) -> Located:
        path = str((Path(directory) / filename).resolve())
        return Located(uri=path, cache_paths=(path,))


# name -> "module:Class"; imported on first use.
SOURCES: dict[str, str] = {
    "http": "bench.servers:NginxBenchSource",
    "local": "bench.sources:LocalBenchSource",
    "s3": "bench.servers:SeaweedBenchSource",
}


def open_source(name: str) -> BenchSource:
    """Instantiate the bench source called ``name``.

    Args:
        name: key of ``SOURCES``.

    Returns:
        A new, not yet started source.

    Raises:
        ValueError: unknown name.
    """
    try:
        target = SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown bench source {name!r}; known: {sorted(SOURCES)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)()
