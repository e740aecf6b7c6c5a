"""How many parallel readers one load of ``TensorDeserializer`` gets.

Owns the choice: the caller's ``num_readers`` or the source's preferred count, one
reader for a small lazily loaded tensor (one ranged GET of header plus data), and one
sequential reader on a server without Range support, where asking for more is an
error and leaving the count to the source gets a warning, once per deserializer.
"""

from __future__ import annotations

import logging

from tensorstream.errors import RangeNotSupportedError
from tensorstream.sources.base import Source

__all__ = ["COLD_READERS", "LAZY_SPLIT_BYTES", "cold_reader_count", "reader_count"]

log = logging.getLogger("tensorstream")

#: Lazily loaded tensors smaller than this are fetched by one reader (one ranged GET).
LAZY_SPLIT_BYTES = 64 << 20

#: Readers for a local file found cold (read into memory rather than mapped) when the
#: caller left the count open. A cold read waits on the disk, not the CPU, so the count
#: follows the disk's queue rather than the cores: on a 2-CPU VM (issue #12, cold page
#: cache, 1 GiB, medians of 5) 2 / 4 / 8 readers loaded 0.99 / 1.49 / 1.54 GB/s from our
#: file and 1.05 / 1.37 / 1.46 from tensorizer's, against tensorizer's 8 readers at 1.42.
COLD_READERS = 8


def reader_count(
    source: Source, num_readers: int | None, *, lazy: bool, nbytes: int, warn: bool
) -> int:
    """Readers for a load of ``nbytes`` (headers included) from ``source``.

    Args:
        warn: log the one-sequential-reader warning if the count falls to one for
            lack of Range support (the caller passes ``False`` once it has warned).

    Raises:
        RangeNotSupportedError: ``num_readers`` > 1 on a server without Range support.
    """
    n = num_readers or source.preferred_readers
    if lazy and nbytes < LAZY_SPLIT_BYTES:
        n = 1  # one ranged GET of header plus data per lazily loaded tensor
    if source.supports_ranges:
        return max(1, n)
    if num_readers is not None and num_readers > 1:
        raise RangeNotSupportedError(
            f"{source.display_uri} does not support HTTP Range requests, so "
            f"num_readers={num_readers} cannot work; use num_readers=1 (or None) "
            "or serve the file from a server with Range support"
        )
    if num_readers is None and warn:
        log.warning(
            "%s does not support HTTP Range requests; loading with one sequential reader",
            source.display_uri,
        )
    return 1


def cold_reader_count(num_readers: int | None, *, lazy: bool, nbytes: int) -> int | None:
    """Readers for this load if its local file turns out cold, or None to keep
    :func:`reader_count`'s: the caller's count always stands, and a small lazily loaded
    tensor stays one read."""
    if num_readers is not None or (lazy and nbytes < LAZY_SPLIT_BYTES):
        return None
    return COLD_READERS
