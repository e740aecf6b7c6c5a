"""Progress of long byte transfers: a bar on a terminal, periodic INFO lines elsewhere.

On a TTY (``enabled=True``) a tqdm bar shows bytes against the known total. Without
one (a Kubernetes log, a pipe) nothing is drawn, but a transfer that runs longer
than :data:`LOG_EVERY_S` logs an INFO line every :data:`LOG_EVERY_S` seconds or
every 10 % of the total, whichever comes later, so a long load or upload is never
silent in a log.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

__all__ = ["LOG_EVERY_S", "ByteProgress"]

logger = logging.getLogger("tensorstream.progress")

#: Seconds between INFO progress lines when no bar is drawn.
LOG_EVERY_S = 5.0


class ByteProgress:
    """A thread-safe byte counter that draws a bar when ``enabled`` (tqdm if present).

    Args:
        total: bytes the transfer will move (the bar's 100 %).
        label: what moves ("load", "serialize").
        enabled: draw a bar (callers pass ``sys.stderr.isatty()``).
        log_every: seconds between INFO lines when no bar is drawn.
    """

    def __init__(
        self, total: int, label: str, enabled: bool = False, log_every: float = LOG_EVERY_S
    ) -> None:
        self.total = max(0, int(total or 0))
        self.label = label
        self.done = 0
        self.started = time.perf_counter()
        self._lock = threading.Lock()
        self._log_every = log_every
        self._next_log = self.started + log_every
        self._next_fraction = 0.1
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=self.total,
                    desc=label,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1000,
                    file=sys.stderr,
                    dynamic_ncols=True,
                    leave=True,
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                    "[{elapsed}<{remaining}, {rate_fmt}]",
                )
            else:
                print(f"{label}: {self.total / 1e9:.2f} GB ...", file=sys.stderr)

    def update(self, n: int) -> None:
        """Count ``n`` more bytes."""
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.perf_counter()
            if now < self._next_log or self.total <= 0:
                return
            fraction = self.done / self.total
            if fraction < self._next_fraction and now < self._next_log + self._log_every:
                return
            self._next_log = now + self._log_every
            self._next_fraction = fraction + 0.1
            done, total, elapsed = self.done, self.total, now - self.started
        logger.info(
            "%s: %3.0f%% (%.2f of %.2f GB, %.2f GB/s, %.0f s)",
            self.label,
            100 * done / total,
            done / 1e9,
            total / 1e9,
            done / elapsed / 1e9 if elapsed > 0 else 0.0,
            elapsed,
        )

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @property
    def elapsed(self) -> float:
        """Seconds since the transfer started."""
        return time.perf_counter() - self.started
