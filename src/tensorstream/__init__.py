"""tensorstream: stream model weights from storage straight into tensors."""

__version__ = "0.1.0"
