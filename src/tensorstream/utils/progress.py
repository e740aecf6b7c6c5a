"""Progress bars in bytes and GB/s; silent unless asked for, tqdm only when installed."""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["ByteProgress"]


class ByteProgress:
    """A thread-safe byte counter that draws a bar when ``enabled`` (tqdm if present)."""

    def __init__(self, total: int, label: str, enabled: bool = False) -> None:
        self.total = total
        self.done = 0
        self.started = time.perf_counter()
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total,
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
                self._label = label
                print(f"{label}: {total / 1e9:.2f} GB ...", file=sys.stderr)

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started
