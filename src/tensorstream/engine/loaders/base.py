"""The loader seam: one class per weight format, all returning loaded tensors by name.

A loader turns a :class:`~tensorstream.engine.resolve.ModelLocation` into a
:class:`LoadedWeights` — a read-only mapping from checkpoint names to tensors
that are already on the target device and, where the format allows, already in
the target dtype. ``build.build_model`` then makes those tensors the model's
parameters, so a loader that produces the right dtype/device avoids every copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorstream.engine.resolve import ModelLocation
from tensorstream.errors import ConfigError

if TYPE_CHECKING:  # torch is imported by the loaders' work, not by choosing a loader
    import torch

__all__ = ["LoadRequest", "LoadedWeights", "WeightLoader", "check_extra_keys"]


@dataclass(frozen=True)
class LoadRequest:
    """What the engine wants from a loader.

    Attributes:
        location: where the model is.
        device: target device of the tensors.
        dtype: target dtype of floating-point tensors.
        extra: ``model_loader_extra_config``, already parsed from JSON.
        prefetch: a :class:`~tensorstream.engine.prefetch.Prefetch` of the weights file,
            started before torch was imported; a loader that can use it takes its bytes.
    """

    location: ModelLocation
    device: torch.device
    dtype: torch.dtype
    extra: Mapping[str, Any] = field(default_factory=dict)
    prefetch: Any = None


class LoadedWeights(Mapping[str, "torch.Tensor"]):
    """Tensors by checkpoint name, plus what was read and from where.

    Attributes:
        uri: the weights' location, for logs and errors.
        nbytes: bytes of tensor data the tensors hold.
        mapped_bytes: of those, bytes that are views of a file mapping (not read yet:
            the page cache is read when the model first touches them).
        fetch_seconds: when the bytes were fetched into memory before the load began
            (``engine/prefetch.py``), that fetch's wall time: the read happened there.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        uri: str,
        nbytes: int,
        closer: Any = None,
        mapped_bytes: int = 0,
        fetch_seconds: float | None = None,
    ):
        self._tensors = tensors
        self.uri = uri
        self.nbytes = nbytes
        self.mapped_bytes = mapped_bytes
        self.fetch_seconds = fetch_seconds
        self._closer = closer

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def close(self) -> None:
        """Release the reader (file handles, connections); the tensors stay valid."""
        if self._closer is not None:
            self._closer.close()
            self._closer = None


class WeightLoader(ABC):
    """Base of the per-format loaders.

    Subclasses set ``name`` and ``extra_keys`` and implement :meth:`load`.
    """

    name: str = ""
    #: ``model_loader_extra_config`` keys this loader understands.
    extra_keys: frozenset[str] = frozenset()

    @abstractmethod
    def load(self, request: LoadRequest) -> LoadedWeights:
        """Read every tensor of the model.

        Raises:
            SourceNotFoundError: the weight files are not there.
            ConfigError: bad ``extra`` options.
        """


def check_extra_keys(loader: str, extra: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Reject ``model_loader_extra_config`` keys ``loader`` does not understand.

    Raises:
        ConfigError: naming the unknown keys and listing the valid ones.
    """
    unknown = sorted(set(extra) - allowed)
    if unknown:
        valid = ", ".join(sorted(allowed)) or "none"
        raise ConfigError(
            f"model_loader_extra_config keys {unknown} are not understood by the {loader!r} "
            f"loader; valid keys: {valid}"
        )
