"""A drop-in for CoreWeave tensorizer 2.12.1's API, built on tensorstream.

Change ``import tensorizer`` to ``from tensorstream.compat import tensorizer`` (or
``from tensorstream.compat.tensorizer import TensorDeserializer, ...``) and the
same calls run on tensorstream's loaders and writers. Laid out like tensorizer:

* ``serialization``: ``TensorSerializer``, ``TensorDeserializer``, ``TensorType``,
  ``TensorHash``, ``EncryptionParams``, ``DecryptionParams``, the exceptions;
* ``stream_io``: ``open_stream``, ``CAInfo``;
* ``utils``: ``no_init_or_tensor``, ``convert_bytes``, ``get_mem_usage``...;
* ``torch_compat``: ``tensorizer_saving``, ``tensorizer_loading``.

Never imports the real ``tensorizer``. docs/compat.md lists what differs.
"""

from tensorstream.compat.tensorizer import serialization, stream_io, torch_compat, utils
from tensorstream.compat.tensorizer.serialization import (
    CryptographyError,
    DecryptionParams,
    EncryptionParams,
    FilterFuncType,
    HashMismatchError,
    TensorDeserializer,
    TensorSerializer,
    TensorType,
)

#: The tensorizer release whose API this package mirrors.
__version__ = "2.12.1"

__all__ = [
    "CryptographyError",
    "DecryptionParams",
    "EncryptionParams",
    "FilterFuncType",
    "HashMismatchError",
    "TensorDeserializer",
    "TensorSerializer",
    "TensorType",
    "serialization",
    "stream_io",
    "torch_compat",
    "utils",
]
