"""Server metrics in Prometheus' text exposition format, without a client library.

``prometheus_client`` is not a dependency, so this module keeps the few
instruments the server needs (counters, gauges, histograms, each with optional
labels) and renders them as text format 0.0.4. Updates come from the event
loop and from the engine thread, so every instrument takes a lock.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

__all__ = ["Counter", "Gauge", "Histogram", "ServerMetrics"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class _Instrument:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Instrument):
    """A value that only goes up, per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        """Add ``amount`` to the series named by ``labels``."""
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        """Current value of one series (0 if never touched)."""
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [
            f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items
        ]


class Gauge(_Instrument):
    """A value read at scrape time from a callback, or set directly."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float] | None = None) -> None:
        super().__init__(name, help_text)
        self._read = read
        self._value = 0.0

    def set(self, value: float) -> None:
        """Set the value (ignored when a callback supplies it)."""
        with self._lock:
            self._value = float(value)

    def render(self) -> list[str]:
        value = self._read() if self._read is not None else self._value
        return self.header() + [f"{self.name} {_num(value)}"]


class Histogram(_Instrument):
    """Observations counted into cumulative buckets, plus their sum and count."""

    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Sequence[float] = _LATENCY_BUCKETS
    ) -> None:
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        with self._lock:
            self._sum += value
            self._count += 1
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1

    @property
    def count(self) -> int:
        """How many observations were recorded."""
        return self._count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        lines = self.header()
        for bound, n in zip(self.buckets, counts, strict=True):
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {n}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {count}')
        lines.append(f"{self.name}_sum {_num(total)}")
        lines.append(f"{self.name}_count {count}")
        return lines


class ServerMetrics:
    """Every instrument the server exports, under the ``tensorstream_`` prefix.

    Args:
        running: callback giving the number of running requests.
        waiting: callback giving the number of requests waiting for a slot.
    """

    def __init__(
        self, running: Callable[[], float] = lambda: 0, waiting: Callable[[], float] = lambda: 0
    ) -> None:
        p = "tensorstream_"
        self.load_seconds = Gauge(p + "model_load_seconds", "Seconds to load the model weights.")
        self.load_bytes = Gauge(p + "model_load_bytes", "Bytes of model weights loaded.")
        self.ready = Gauge(p + "ready", "1 once the model is loaded and requests are served.")
        self.http_requests = Counter(
            p + "http_requests_total", "HTTP requests by route and status.", ("path", "status")
        )
        self.finished = Counter(
            p + "request_finished_total",
            "Generation requests that ended, by finish reason.",
            ("finish_reason",),
        )
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Seconds from request to its first token."
        )
        self.latency = Histogram(
            p + "e2e_request_latency_seconds", "Seconds from request to its last token."
        )
        self.running = Gauge(p + "num_requests_running", "Requests being generated.", running)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting for a slot.", waiting)
        self._all: list[_Instrument] = [
            self.ready,
            self.load_seconds,
            self.load_bytes,
            self.http_requests,
            self.finished,
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.latency,
            self.running,
            self.waiting,
        ]

    def render(self) -> str:
        """All instruments as Prometheus text (ends with a newline)."""
        lines: list[str] = []
        for instrument in self._all:
            lines.extend(instrument.render())  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"
