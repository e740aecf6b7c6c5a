"""``LoadStats``: what one weight load did, in numbers that count only work done."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadStats"]


@dataclass(frozen=True)
class LoadStats:
    """How the last weight load went, counting only work that was done.

    A local CPU load of a ``.tensors`` file maps the file: those tensors are views of
    the page cache, read from disk (or the cache) when the model first touches them.
    Their bytes are ``mapped_bytes``, not read bytes, and never enter ``gb_per_s``.

    Attributes:
        load_format: the loader used ("safetensors", "tensorizer").
        uri: where the weights were read from.
        bytes: tensor bytes the model holds.
        read_seconds: time the loader took (storage -> memory, or setting up the map).
        build_seconds: time to construct the model on meta and adopt the tensors.
        mapped_bytes: bytes left as views of a file mapping (not read yet).
        usable_seconds: wall time from the start of the load until the model held its
            weights (the read overlaps config/tokenizer loading, so this is not the sum).
        import_seconds: time ``LLM`` spent importing torch and the model code (the
            weights were already being fetched then).
        fetch_seconds: wall time of the fetch started before those imports (remote
            objects: the whole download; local files: the read-ahead request); None
            when the load did not prefetch.
    """

    load_format: str
    uri: str
    bytes: int
    read_seconds: float
    build_seconds: float
    mapped_bytes: int = 0
    usable_seconds: float | None = None
    import_seconds: float | None = None
    fetch_seconds: float | None = None

    @property
    def bytes_read(self) -> int:
        """Bytes copied from storage into memory (``bytes - mapped_bytes``)."""
        return max(0, self.bytes - self.mapped_bytes)

    @property
    def seconds(self) -> float:
        """Time until the weights were usable by the model."""
        if self.usable_seconds is not None:
            return self.usable_seconds
        return self.read_seconds + self.build_seconds

    @property
    def gb_per_s(self) -> float:
        """``bytes_read / read_seconds / 1e9``; 0.0 when nothing was read (all mapped)."""
        if self.read_seconds <= 0 or self.bytes_read == 0:
            return 0.0
        return self.bytes_read / self.read_seconds / 1e9

    def describe(self) -> str:
        """One honest line: what was read, what was mapped, when the weights were usable.

        Example:
            >>> LoadStats("tensorizer", "m", 2_000_000, 0.5, 0.1).describe()
            'tensorizer, 2.0 MB read in 0.50 s (0.00 GB/s); build 0.10 s'
        """
        parts = [self.load_format]
        if 0 < self.bytes_read < 1_000_000:
            # A few odd tensors beside a mapped file: too little for a meaningful rate.
            parts.append(f"{self.bytes_read / 1e3:.1f} kB read")
        elif self.bytes_read:
            parts.append(
                f"{self.bytes_read / 1e6:.1f} MB read in {self.read_seconds:.2f} s "
                f"({self.gb_per_s:.2f} GB/s)"
            )
        # A few odd tensors mapped beside a read (cast) load are not worth a clause.
        if self.mapped_bytes >= 1_000_000 or (self.mapped_bytes and not self.bytes_read):
            parts.append(
                f"{self.mapped_bytes / 1e6:.1f} MB mapped from the page cache in "
                f"{self.read_seconds:.2f} s (read on first use, no throughput to report)"
            )
        if self.fetch_seconds is not None:
            parts.append(f"fetch started before torch's import took {self.fetch_seconds:.2f} s")
        return ", ".join(parts) + f"; build {self.build_seconds:.2f} s"
