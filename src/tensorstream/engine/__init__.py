"""The engine: build a transformers model from loaded weights and generate text.

Public names: :class:`LLM`, :class:`SamplingParams`, :class:`RequestOutput`,
:class:`CompletionOutput`, :class:`LoadStats`, :class:`EngineCore` (the
step-able core a server drives) and :func:`resolve_model`. Importing this
package does not import transformers; building an ``LLM`` does.
"""

from tensorstream.engine.core import EngineCore
from tensorstream.engine.llm import LLM, LoadStats
from tensorstream.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tensorstream.engine.resolve import ModelLocation, resolve_model
from tensorstream.engine.sampling import SamplingParams

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
