"""Retry budgets for remote reads: exponential backoff with full jitter, bounded twice.

A ``RetryBudget`` covers one logical read (a range). Each failure spends one
attempt and sleeps ``uniform(0, min(cap, base * 2**attempt))``; the budget is
exhausted after ``max_retries`` consecutive failures or once the next sleep
would end past ``retry_deadline`` seconds since the last progress. Progress
(bytes received) refills the budget, so a long transfer that is cut many times
but keeps moving is never abandoned, while a server that stops answering is
given up on within the deadline.
"""

from __future__ import annotations

import logging
import random
import time

from tensorstream.errors import RetriesExhaustedError

__all__ = ["RetryBudget", "TRANSIENT_STATUSES"]

_log = logging.getLogger("tensorstream.sources")

#: HTTP statuses worth retrying: the server or a proxy is overloaded or timed out.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class RetryBudget:
    """Backoff state for one range read.

    Args:
        display_uri: the location being read, already redacted (used in messages).
        max_retries: consecutive failures tolerated before giving up.
        deadline: seconds without progress after which retrying stops.
        base: first backoff ceiling in seconds.
        cap: largest backoff ceiling in seconds.

    Example:
        >>> budget = RetryBudget("http://h/f", max_retries=3, deadline=10.0)
        >>> budget.progress()  # after receiving bytes
    """

    def __init__(
        self,
        display_uri: str,
        *,
        max_retries: int,
        deadline: float,
        base: float = 0.1,
        cap: float = 5.0,
    ) -> None:
        self._uri = display_uri
        self._max = max(0, max_retries)
        self._deadline = max(0.0, deadline)
        self._base = base
        self._cap = cap
        self._failures = 0
        self._since = time.monotonic()

    @property
    def failures(self) -> int:
        """Consecutive failures since the last progress."""
        return self._failures

    def progress(self) -> None:
        """Record that bytes arrived: the next failure starts a fresh budget."""
        if self._failures:
            self._failures = 0
        self._since = time.monotonic()

    def remaining(self) -> float:
        """Seconds left before the deadline (never negative)."""
        return max(0.0, self._since + self._deadline - time.monotonic())

    def fail(
        self, error: BaseException | str, offset: int, retry_after: float | None = None
    ) -> None:
        """Spend one attempt: sleep with backoff, or raise if the budget is gone.

        Args:
            error: what went wrong (its text must already be free of secrets).
            offset: the byte offset the retry will resume from, for the message.
            retry_after: a server-requested delay (``Retry-After``), honoured up to the cap.

        Raises:
            RetriesExhaustedError: ``max_retries`` consecutive failures, or the
                deadline would pass during the next wait.
        """
        self._failures += 1
        ceiling = min(self._cap, self._base * (2 ** (self._failures - 1)))
        delay = random.uniform(0.0, ceiling)
        if retry_after is not None:
            delay = max(delay, min(self._cap, retry_after))
        elapsed = time.monotonic() - self._since
        if self._failures > self._max or elapsed + delay > self._deadline:
            raise RetriesExhaustedError(
                f"giving up on {self._uri} at byte offset {offset} after "
                f"{self._failures - 1} retries over {elapsed:.1f}s without progress "
                f"(max_retries={self._max}, retry_deadline={self._deadline:g}s); "
                f"last error: {error}. Check that the server is up and reachable, or raise "
                "StorageOptions.max_retries / retry_deadline / timeout"
            ) from (error if isinstance(error, BaseException) else None)
        _log.warning(
            "retrying %s at offset %d in %.2fs (attempt %d/%d): %s",
            self._uri,
            offset,
            delay,
            self._failures,
            self._max,
            error,
        )
        time.sleep(delay)
