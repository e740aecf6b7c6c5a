"""tensorstream: stream model weights from storage straight into tensors.

Reads and writes CoreWeave tensorizer's ``.tensors`` format byte-compatibly, from
local disk, HTTP(S) and S3, into CPU or GPU memory.

The engine's and the crypto's names (``LLM``, ``SamplingParams``, ``LoRARequest``,
``TensorizerConfig``, ``EncryptionParams``, ``DecryptionParams``) are importable from
here, as from ``vllm``, but load on first use: ``import tensorstream`` and a plain
local load never import the engine, transformers or libsodium. The (de)serializers
load on first use too, so ``import tensorstream`` does not import torch: ``LLM(...)``
starts fetching weights before torch's import (seconds) is paid.
"""

from typing import TYPE_CHECKING

from tensorstream.formats.tensorizer import (
    TENSOR_TYPE_BUFFER,
    TENSOR_TYPE_PARAM,
    TENSOR_TYPE_STATE_DICT,
)
from tensorstream.sources.base import StorageOptions
from tensorstream.utils.lazy import lazy_attributes

__version__ = "0.1.0"


class TensorType:
    """Tensor kinds stored in each header (tensorizer's ``TensorType`` values)."""

    PARAM = TENSOR_TYPE_PARAM
    BUFFER = TENSOR_TYPE_BUFFER
    STATE_DICT = TENSOR_TYPE_STATE_DICT


# name -> module that defines it, imported on first access (PEP 562).
_LAZY = {
    "DecryptionParams": "tensorstream.crypto.params",
    "EncryptionParams": "tensorstream.crypto.params",
    "LLM": "tensorstream.engine.llm",
    "LoRARequest": "tensorstream.engine.lora",
    "RequestOutput": "tensorstream.engine.outputs",
    "SamplingParams": "tensorstream.engine.sampling",
    "ShardSpec": "tensorstream.deserialize.shard",
    "ShardedDeserializer": "tensorstream.deserialize.sharded",
    "TensorDeserializer": "tensorstream.deserialize.reader",
    "TensorSerializer": "tensorstream.serialize.writer",
    "TensorizerConfig": "tensorstream.engine.loaders.tensorizer_config",
}

if TYPE_CHECKING:
    from tensorstream.crypto.params import DecryptionParams, EncryptionParams
    from tensorstream.deserialize.reader import TensorDeserializer
    from tensorstream.deserialize.shard import ShardSpec
    from tensorstream.deserialize.sharded import ShardedDeserializer
    from tensorstream.engine.llm import LLM
    from tensorstream.engine.loaders.tensorizer_config import TensorizerConfig
    from tensorstream.engine.lora import LoRARequest
    from tensorstream.engine.outputs import RequestOutput
    from tensorstream.engine.sampling import SamplingParams
    from tensorstream.serialize.writer import TensorSerializer


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


__all__ = [
    "DecryptionParams",
    "EncryptionParams",
    "LLM",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "ShardSpec",
    "ShardedDeserializer",
    "StorageOptions",
    "TensorDeserializer",
    "TensorSerializer",
    "TensorType",
    "TensorizerConfig",
    "__version__",
]
