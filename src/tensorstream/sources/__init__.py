"""Byte sources and sinks by URI scheme: local, http(s), s3, memory."""

from tensorstream.sources.base import RangeReader, Sink, Source, StorageOptions
from tensorstream.sources.registry import open_sink, open_source
from tensorstream.sources.uri import join_uri, parse_uri, redact_uri

__all__ = [
    "RangeReader",
    "Sink",
    "Source",
    "StorageOptions",
    "join_uri",
    "open_sink",
    "open_source",
    "parse_uri",
    "redact_uri",
]
