"""The server's start-up timeline: when each phase of this process began and ended.

``tensorstream serve`` marks the phases it runs (interpreter start, imports, the
``LLM`` construction, start-up adapters, ready); the model's own
:class:`~tensorstream.engine.load_stats.LoadStats` supplies the weights read and
the model build inside the ``LLM`` construction; every adapter loaded over HTTP
adds a row. ``GET /v1/load_stats`` returns :meth:`StartupTimeline.as_json`, which
the console draws and scripts can read.

Times are seconds since the process started (read from ``/proc``; where that is
unknown, since the timeline was created). Only measured work is reported: a phase
that was not observed is absent, never estimated.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tensorstream.utils.process import process_age

__all__ = ["AdapterLoad", "Phase", "StartupTimeline"]


@dataclass
class Phase:
    """One bar of the timeline.

    Attributes:
        name: machine name (``imports``, ``weights_read``...).
        label: what a person reads.
        start: seconds since process start.
        end: seconds since process start; None while it runs.
        detail: figures shown beside the bar (bytes, GB/s...).
    """

    name: str
    label: str
    start: float
    end: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        seconds = None if self.end is None else max(0.0, self.end - self.start)
        return {
            "name": self.name,
            "label": self.label,
            "start": round(self.start, 4),
            "end": None if self.end is None else round(self.end, 4),
            "seconds": None if seconds is None else round(seconds, 4),
            **self.detail,
        }


@dataclass
class AdapterLoad:
    """One adapter load: at start-up (``--lora-modules``) or over HTTP."""

    name: str
    path: str
    source: str  # "startup" or "runtime"
    start: float
    end: float
    unloaded_at: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "source": self.source,
            "start": round(self.start, 4),
            "end": round(self.end, 4),
            "seconds": round(max(0.0, self.end - self.start), 4),
            "unloaded_at": None if self.unloaded_at is None else round(self.unloaded_at, 4),
        }


class StartupTimeline:
    """Phases of this server's start-up and its adapter loads, thread-safe.

    Args:
        clock: a ``time.perf_counter``-like clock (tests pass their own).

    Example:
        >>> t = StartupTimeline()
        >>> with t.phase("imports", "imports"):
        ...     pass
        >>> [p["name"] for p in t.as_json()["phases"]]
        ['imports']
    """

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self._clock = clock
        age = process_age()
        now = clock()
        # The zero of every figure: process start where /proc says, else now.
        self._zero = now - age if age is not None else now
        self.process_start_known = age is not None
        self._lock = threading.Lock()
        self._phases: list[Phase] = []
        self._adapters: list[AdapterLoad] = []
        self._model: dict[str, Any] | None = None
        self.ready_at: float | None = None

    @property
    def has_model(self) -> bool:
        """True once the model's load figures are recorded."""
        return self._model is not None

    def now(self) -> float:
        """Seconds since the process started."""
        return self._clock() - self._zero

    def at(self, perf_time: float) -> float:
        """A ``perf_counter`` reading as seconds since the process started."""
        return perf_time - self._zero

    def add(self, name: str, label: str, start: float, end: float | None, **detail: Any) -> None:
        """Record a phase (times in seconds since process start)."""
        with self._lock:
            self._phases.append(Phase(name, label, start, end, dict(detail)))

    def phase(self, name: str, label: str) -> _Running:
        """A context manager timing one phase from now until it exits."""
        return _Running(self, name, label)

    def model_loaded(
        self,
        stats: Any,
        started: float | None = None,
        ended: float | None = None,
        readers: int | None = None,
    ) -> None:
        """Record the model's ``LoadStats`` and, when timed, the ``LLM`` construction's bars.

        ``LoadStats`` counts from the moment the weight read began, a few milliseconds
        into the ``LLM`` construction (after the model was located), so the read and
        build bars are placed from ``started``, the earliest the read can have begun.
        Without ``started``/``ended`` (a model loaded before the server existed) only the
        figures are kept: when the load ran is not known.

        Args:
            stats: the model's ``LoadStats``.
            started: seconds since process start when ``LLM(...)`` was called.
            ended: seconds since process start when it returned.
            readers: parallel readers requested in the loader config, if given.
        """
        read = float(stats.read_seconds)
        build = float(stats.build_seconds)
        usable = float(stats.seconds)
        model = {
            "load_format": stats.load_format,
            "uri": stats.uri,
            "bytes": int(stats.bytes),
            "bytes_read": int(stats.bytes_read),
            "mapped_bytes": int(stats.mapped_bytes),
            "read_seconds": round(read, 4),
            "build_seconds": round(build, 4),
            "usable_seconds": round(usable, 4),
            "gb_per_s": round(stats.gb_per_s, 4),
            "readers": readers,
            "summary": stats.describe(),
        }
        bars = []
        if started is not None and ended is not None:
            weights_end = min(started + read, ended)
            build_end = min(started + usable, ended)
            figures = {
                "bytes_read": model["bytes_read"],
                "mapped_bytes": model["mapped_bytes"],
                "gb_per_s": model["gb_per_s"],
                "readers": readers,
            }
            bars = [
                Phase("weights_read", "weights read", started, weights_end, figures),
                Phase("model_built", "model built", max(started, build_end - build), build_end),
                Phase("engine", "engine set-up", build_end, ended),
            ]
        with self._lock:
            self._model = model
            self._phases.extend(bars)

    def adapter_loaded(self, name: str, path: str, source: str, start: float, end: float) -> None:
        """Record an adapter load (times in seconds since process start)."""
        with self._lock:
            self._adapters.append(AdapterLoad(name, path, source, start, end))

    def adapter_unloaded(self, name: str) -> None:
        """Mark the latest load of adapter ``name`` as unloaded now."""
        now = self.now()
        with self._lock:
            for load in reversed(self._adapters):
                if load.name == name and load.unloaded_at is None:
                    load.unloaded_at = now
                    return

    def mark_ready(self) -> None:
        """The server answers API requests from now on."""
        with self._lock:
            if self.ready_at is None:
                self.ready_at = self.now()

    def as_json(self, status: str = "ready", error: str | None = None) -> dict[str, Any]:
        """The ``/v1/load_stats`` body."""
        with self._lock:
            phases = [p.as_json() for p in sorted(self._phases, key=lambda p: p.start)]
            adapters = [a.as_json() for a in self._adapters]
            model = dict(self._model) if self._model is not None else None
            ready = self.ready_at
        return {
            "object": "load_stats",
            "status": status,
            "error": error,
            "clock": "seconds since process start"
            if self.process_start_known
            else "seconds since the server object was created",
            "now": round(self.now(), 4),
            "ready_at": None if ready is None else round(ready, 4),
            "phases": phases,
            "model": model,
            "adapters": adapters,
        }


class _Running:
    def __init__(self, timeline: StartupTimeline, name: str, label: str) -> None:
        self.timeline, self.name, self.label = timeline, name, label

    def __enter__(self) -> _Running:
        self.start = self.timeline.now()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timeline.add(self.name, self.label, self.start, self.timeline.now())
