"""Server metrics with ``prometheus_client``, one registry per app, under vLLM's names.

What vLLM also measures keeps vLLM's name and ``model_name`` label, so
dashboards built for ``vllm serve`` work unchanged:

==========================================  =========  =================================
name                                        kind       labels
==========================================  =========  =================================
``vllm:num_requests_running``               gauge      model_name
``vllm:num_requests_waiting``               gauge      model_name
``vllm:time_to_first_token_seconds``        histogram  model_name
``vllm:e2e_request_latency_seconds``        histogram  model_name
``vllm:inter_token_latency_seconds``        histogram  model_name (one per engine step)
``vllm:time_per_output_token_seconds``      histogram  model_name (mean over a request)
``vllm:prompt_tokens_total``                counter    model_name
``vllm:generation_tokens_total``            counter    model_name
``vllm:request_success_total``              counter    model_name, finished_reason
==========================================  =========  =================================

Ours keep the ``tensorstream_`` prefix: readiness, the model load (bytes,
seconds, read seconds, GB/s), adapter loads and HTTP requests by route and
status. Every app owns its ``CollectorRegistry``, so two apps in one process
never share or collide. Updates come from the event loop and from the engine
thread; ``prometheus_client`` instruments are thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; the same spread vLLM uses, from a fast GPU step to a long CPU request.
_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServerMetrics:
    """Every instrument one server exports, in its own registry.

    Args:
        model_name: the served model's name (the ``model_name`` label).
        running: callback giving the number of running requests.
        waiting: callback giving the number of requests waiting for a slot.
    """

    def __init__(
        self,
        model_name: str = "",
        running: Callable[[], float] = lambda: 0,
        waiting: Callable[[], float] = lambda: 0,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ("model_name",)
        self.model_name = model_name

        def labelled(metric: Any) -> Any:
            return metric.labels(model_name=model_name)

        self._running = Gauge(
            "vllm:num_requests_running", "Requests being generated.", m, registry=r
        )
        self._running.labels(model_name=model_name).set_function(running)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for a slot.", m, registry=r
        )
        self._waiting.labels(model_name=model_name).set_function(waiting)
        self.ttft = labelled(
            Histogram(
                "vllm:time_to_first_token_seconds",
                "Seconds from arrival to the first generated token.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.latency = labelled(
            Histogram(
                "vllm:e2e_request_latency_seconds",
                "Seconds from arrival to the last generated token.",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self.inter_token = labelled(
            Histogram(
                "vllm:inter_token_latency_seconds",
                "Seconds between two consecutive outputs of a request (one per engine step).",
                m,
                buckets=_TOKEN_BUCKETS,
                registry=r,
            )
        )
        self.per_output_token = labelled(
            Histogram(
                "vllm:time_per_output_token_seconds",
                "Mean seconds per generated token after the first, per finished request.",
                m,
                buckets=_TOKEN_BUCKETS,
                registry=r,
            )
        )
        self.prompt_tokens = labelled(
            Counter("vllm:prompt_tokens", "Prompt tokens admitted.", m, registry=r)
        )
        self.generation_tokens = labelled(
            Counter("vllm:generation_tokens", "Tokens generated.", m, registry=r)
        )
        self._success = Counter(
            "vllm:request_success",
            "Requests that ended, by finish reason (stop, length, abort, error).",
            ("model_name", "finished_reason"),
            registry=r,
        )
        p = "tensorstream_"
        self.ready = Gauge(
            p + "ready", "1 once the model is loaded and requests are served.", registry=r
        )
        self.load_seconds = Gauge(
            p + "model_load_seconds", "Seconds to load the model weights.", registry=r
        )
        self.load_read_seconds = Gauge(
            p + "model_load_read_seconds",
            "Seconds spent reading the weights from storage.",
            registry=r,
        )
        self.load_bytes = Gauge(
            p + "model_load_bytes", "Bytes of model weights loaded.", registry=r
        )
        self.load_mapped_bytes = Gauge(
            p + "model_load_mapped_bytes",
            "Bytes of model weights mapped from the page cache (read when first touched).",
            registry=r,
        )
        self.load_gb_per_s = Gauge(
            p + "model_load_gb_per_second",
            "Read throughput: bytes read (not mapped) / read seconds / 1e9.",
            registry=r,
        )
        self.adapter_loads = Counter(
            p + "adapter_loads",
            "Runtime LoRA adapter load attempts, by result (ok, refused, failed).",
            ("result",),
            registry=r,
        )
        self._http = Counter(
            p + "http_requests",
            "HTTP requests by route and status.",
            ("path", "status"),
            registry=r,
        )

    def finished(self, reason: str) -> None:
        """Count one request that ended with ``reason``."""
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def http_request(self, path: str, status: int) -> None:
        """Count one HTTP request by route label and status."""
        self._http.labels(path=path, status=str(status)).inc()

    def record_load(self, stats: Any) -> None:
        """Publish a model load's ``LoadStats`` (bytes, mapped bytes, seconds, read seconds, GB/s)."""
        self.load_seconds.set(float(getattr(stats, "seconds", 0.0)))
        self.load_bytes.set(float(getattr(stats, "bytes", 0)))
        self.load_mapped_bytes.set(float(getattr(stats, "mapped_bytes", 0)))
        self.load_read_seconds.set(float(getattr(stats, "read_seconds", 0.0)))
        self.load_gb_per_s.set(float(getattr(stats, "gb_per_s", 0.0)))

    def render(self) -> bytes:
        """Every metric in Prometheus' text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
