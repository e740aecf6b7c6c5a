"""tensorstream: stream model weights from storage straight into tensors.

Reads and writes CoreWeave tensorizer's ``.tensors`` format byte-compatibly, from
local disk, HTTP(S) and S3, into CPU or GPU memory.
"""

from tensorstream.deserialize.reader import TensorDeserializer
from tensorstream.deserialize.sharded import ShardedDeserializer
from tensorstream.formats.tensorizer import (
    TENSOR_TYPE_BUFFER,
    TENSOR_TYPE_PARAM,
    TENSOR_TYPE_STATE_DICT,
)
from tensorstream.serialize.writer import TensorSerializer
from tensorstream.sources.base import StorageOptions

__version__ = "0.1.0"


class TensorType:
    """Tensor kinds stored in each header (tensorizer's ``TensorType`` values)."""

    PARAM = TENSOR_TYPE_PARAM
    BUFFER = TENSOR_TYPE_BUFFER
    STATE_DICT = TENSOR_TYPE_STATE_DICT


__all__ = [
    "ShardedDeserializer",
    "StorageOptions",
    "TensorDeserializer",
    "TensorSerializer",
    "TensorType",
    "__version__",
]
