"""The engine: build a transformers model from loaded weights and generate text.

Public names: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput`,
:class:`CompletionOutput`, :class:`LoadStats`, :class:`EngineCore` (the
step-able core a server drives) and :func:`resolve_model`. Importing this
package does not import transformers, nor torch: the names load on first use, so
``LLM(...)`` can start fetching weights before torch's import (engine/prefetch.py).
"""

from typing import TYPE_CHECKING

from tensorstream.utils.lazy import lazy_attributes

# name -> module that defines it, imported on first access (PEP 562).
_LAZY = {
    "LLM": "tensorstream.engine.llm",
    "CompletionOutput": "tensorstream.engine.outputs",
    "EngineCore": "tensorstream.engine.core",
    "LoadStats": "tensorstream.engine.load_stats",
    "Logprob": "tensorstream.engine.outputs",
    "ModelLocation": "tensorstream.engine.resolve",
    "RequestOutput": "tensorstream.engine.outputs",
    "SamplingParams": "tensorstream.engine.sampling",
    "resolve_model": "tensorstream.engine.resolve",
}

if TYPE_CHECKING:
    from tensorstream.engine.core import EngineCore
    from tensorstream.engine.llm import LLM
    from tensorstream.engine.load_stats import LoadStats
    from tensorstream.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from tensorstream.engine.resolve import ModelLocation, resolve_model
    from tensorstream.engine.sampling import SamplingParams


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineCore",
    "LoadStats",
    "Logprob",
    "ModelLocation",
    "RequestOutput",
    "SamplingParams",
    "resolve_model",
]
