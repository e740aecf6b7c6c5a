"""The case registry: every measurement the harness knows, as data.

A case names the worker function that runs in the child process (``bench.workers.WORKERS``),
the peer it measures, the source the bytes come from, which checkpoint file it reads, its
parameters and the page-cache states it runs under. Adding a peer, a source (HTTP, S3) or an
operation (encrypted load, engine cold start) is one new worker function plus one
``register(Case(...))`` line; the runner and the report need no change.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CASES", "OPS", "PEERS", "Case", "register", "select"]

# Peers that count for "ratio vs best peer"; tensorstream and raw references do not.
PEERS = ("tensorizer", "safetensors", "runai")
OPS = ("load", "serialize", "touch")


@dataclass(frozen=True)
class Case:
    """One benchmark case.

    Attributes:
        name: unique, stable id used on the command line and in results (``tensorizer-r4``).
        peer: ``tensorstream``, a peer from ``PEERS``, or ``reference`` for raw baselines.
        op: ``load`` (bytes into CPU tensors, then every byte touched), ``serialize`` or
            ``touch`` (the touch pass alone on resident memory).
        worker: key of the function in ``bench.workers.WORKERS``.
        fmt: checkpoint format the case reads (``bench.checkpoint.FORMAT_FILES`` key).
        source: where the bytes come from (``bench.sources.SOURCES`` key).
        params: JSON-able keyword arguments for the worker.
        caches: page-cache states it runs under: ``warm``, ``cold`` or ``none``.
        fallback_fmt: format to read when ``fmt`` could not be written here (tensorstream's
            loads read the tensorizer-written file until tensorstream's writer exists).
        note: one line for the report (what is special about the case).
    """

    name: str
    peer: str
    op: str
    worker: str
    fmt: str
    source: str = "local"
    params: Mapping[str, Any] = field(default_factory=dict)
    caches: tuple[str, ...] = ("warm", "cold")
    fallback_fmt: str | None = None
    note: str = ""


CASES: dict[str, Case] = {}


def register(case: Case) -> Case:
    """Add a case to the registry.

    Args:
        case: the case; its name must be new.

    Returns:
        The case, so this works as an expression.

    Raises:
        ValueError: the name is taken or the op is unknown.
    """
    if case.name in CASES:
        raise ValueError(f"bench case {case.name!r} is already registered")
    if case.op not in OPS:
        raise ValueError(f"bench case {case.name!r}: op {case.op!r} not in {OPS}")
    CASES[case.name] = case
    return case


def select(
    patterns: Iterable[str] | None = None, sources: Iterable[str] | None = None
) -> list[Case]:
    """Cases whose name matches any glob in ``patterns`` and whose source is in ``sources``.

    Args:
        patterns: fnmatch globs (``tensorizer-*``); None or empty selects all.
        sources: source names; None selects all.

    Returns:
        Matching cases in registration order.

    Raises:
        ValueError: a pattern matches no case (a typo should not silently run nothing).
    """
    pats = [p for p in (patterns or []) if p]
    srcs = set(sources) if sources is not None else None
    out = []
    for case in CASES.values():
        if srcs is not None and case.source not in srcs:
            continue
        if pats and not any(fnmatch.fnmatchcase(case.name, p) for p in pats):
            continue
        out.append(case)
    for p in pats:
        if not any(fnmatch.fnmatchcase(c, p) for c in CASES):
            raise ValueError(f"no bench case matches {p!r}; known: {', '.join(CASES)}")
    return out


def _local_cases() -> None:
    for n in (1, 2, 4, 8):
        register(Case(f"tensorstream-r{n}", "tensorstream", "load", "tensorstream_load", "tensorstream",
                      params={"num_readers": n}, fallback_fmt="tensorizer"))  # fmt: skip
    # What a user gets without num_readers: the source's count warm, COLD_READERS cold.
    register(Case("tensorstream-default", "tensorstream", "load", "tensorstream_load",
                  "tensorstream", params={}, fallback_fmt="tensorizer",
                  note="num_readers=None: min(4, CPUs) warm, 8 on a cold file"))  # fmt: skip
    register(Case("tensorstream-default-tzfile", "tensorstream", "load", "tensorstream_load",
                  "tensorizer", params={},
                  note="tensorizer's file, num_readers=None"))  # fmt: skip
    # Issue #12: TENSORSTREAM_COLD_READ=map is the behaviour before the page-cache probe
    # (views whatever the cache holds), to compare with in the same run.
    for n in (1, 4):
        register(Case(f"tensorstream-r{n}-map", "tensorstream", "load", "tensorstream_load",
                      "tensorstream", params={"num_readers": n,
                                              "env": {"TENSORSTREAM_COLD_READ": "map"}},
                      caches=("cold",), fallback_fmt="tensorizer",
                      note="TENSORSTREAM_COLD_READ=map: views even when the file is not cached"))  # fmt: skip
    register(Case("tensorstream-r4-noprefault", "tensorstream", "load", "tensorstream_load",
                  "tensorstream", params={"num_readers": 4, "env": {"TENSORSTREAM_PREFAULT": "0"}},
                  caches=("cold",), fallback_fmt="tensorizer",
                  note="TENSORSTREAM_PREFAULT=0: a cold file read into arenas faulting pages in"))  # fmt: skip
    register(Case("tensorstream-r4-verify", "tensorstream", "load", "tensorstream_load",
                  "tensorstream", params={"num_readers": 4, "verify_hash": True},
                  fallback_fmt="tensorizer"))  # fmt: skip
    register(Case("tensorstream-r4-verify-crc32", "tensorstream", "load", "tensorstream_load",
                  "tensorstream", params={"num_readers": 4, "verify_hash": "crc32"},
                  note='verify_hash="crc32": the stored CRC32 only (ISA-L)'))  # fmt: skip
    # The file users already have: written by tensorizer, most tensors at odd offsets.
    for n in (2, 4, 8):
        register(Case(f"tensorstream-r{n}-tzfile", "tensorstream", "load", "tensorstream_load",
                      "tensorizer", params={"num_readers": n},
                      note="tensorizer's file: unaligned tensors copied into arenas"))  # fmt: skip
    register(Case("tensorstream-r4-tzfile-noarena", "tensorstream", "load", "tensorstream_load",
                  "tensorizer", params={"num_readers": 4, "env": {"TENSORSTREAM_ARENA": "0"}},
                  caches=("warm",),
                  note="the same with TENSORSTREAM_ARENA=0 (torch.empty per tensor)"))  # fmt: skip
    # prefault.py's MADV_POPULATE_WRITE before each fresh segment, against ordinary faults
    register(Case("tensorstream-r4-tzfile-noprefault", "tensorstream", "load",
                  "tensorstream_load", "tensorizer",
                  params={"num_readers": 4, "env": {"TENSORSTREAM_PREFAULT": "0"}},
                  note="tensorizer's file, TENSORSTREAM_PREFAULT=0: copies fault pages in"))  # fmt: skip
    register(Case("tensorstream-r4-tzfile-map", "tensorstream", "load", "tensorstream_load",
                  "tensorizer", params={"num_readers": 4, "env": {"TENSORSTREAM_COLD_READ": "map"}},
                  caches=("cold",),
                  note="tensorizer's file, TENSORSTREAM_COLD_READ=map: views even when cold"))  # fmt: skip
    register(Case("tensorstream-r4-verify-tzfile", "tensorstream", "load", "tensorstream_load",
                  "tensorizer", params={"num_readers": 4, "verify_hash": True},
                  note="verify_hash=True on tensorizer's file: the same work as tensorizer's"))  # fmt: skip
    register(Case("tensorstream-r4-crc32-tzfile", "tensorstream", "load", "tensorstream_load",
                  "tensorizer", params={"num_readers": 4, "verify_hash": "crc32"},
                  note='verify_hash="crc32" on tensorizer\'s file'))  # fmt: skip
    register(Case("tensorizer-default", "tensorizer", "load", "tensorizer_load", "tensorizer",
                  params={"num_readers": None}, note="num_readers=None (8 for a local file)"))  # fmt: skip
    for n in (1, 4, 8):
        register(Case(f"tensorizer-r{n}", "tensorizer", "load", "tensorizer_load", "tensorizer",
                      params={"num_readers": n}))  # fmt: skip
    register(Case("tensorizer-r1-verify", "tensorizer", "load", "tensorizer_load", "tensorizer",
                  params={"num_readers": 1, "verify_hash": True},
                  note="verify_hash=True; 1 reader was its best unverified setting on the dev VM"))  # fmt: skip
    register(Case("tensorizer-default-verify", "tensorizer", "load", "tensorizer_load", "tensorizer",
                  params={"num_readers": None, "verify_hash": True},
                  note="verify_hash=True; num_readers=None (4 when verifying)"))  # fmt: skip
    register(Case("safetensors-load_file", "safetensors", "load", "safetensors_load", "safetensors",
                  note="mmap; pages fault in during the touch pass"))  # fmt: skip
    register(Case("readinto-fresh", "reference", "load", "readinto", "safetensors",
                  params={"pretouch": False}, note="readinto a fresh torch.empty per tensor"))  # fmt: skip
    register(Case("readinto-touched", "reference", "load", "readinto", "safetensors",
                  params={"pretouch": True}, note="readinto buffers allocated and touched before timing"))  # fmt: skip
    register(Case("touch-resident", "reference", "touch", "resident", "safetensors",
                  caches=("none",), note="the touch pass alone, on resident memory"))  # fmt: skip
    register(Case("serialize-tensorstream", "tensorstream", "serialize", "serialize", "safetensors",
                  params={"writer": "tensorstream"}, caches=("none",)))  # fmt: skip
    register(Case("serialize-tensorizer", "tensorizer", "serialize", "serialize", "safetensors",
                  params={"writer": "tensorizer"}, caches=("none",)))  # fmt: skip


_local_cases()


def _remote_cases() -> None:
    register(Case("runai-local", "runai", "load", "runai_load", "safetensors",
                  note="SafetensorsStreamer, default concurrency"))  # fmt: skip
    for src in ("http", "s3"):
        for n in (1, 4, 8):
            register(Case(f"tensorstream-{src}-r{n}", "tensorstream", "load", "tensorstream_load",
                          "tensorstream", source=src, params={"num_readers": n},
                          fallback_fmt="tensorizer"))  # fmt: skip
        register(Case(f"tensorstream-{src}-default", "tensorstream", "load",
                      "tensorstream_load", "tensorstream", source=src,
                      params={"num_readers": None}, fallback_fmt="tensorizer",
                      note="num_readers=None (the source's preferred count)"))  # fmt: skip
        register(Case(f"tensorstream-{src}-r4-noprefault", "tensorstream", "load",
                      "tensorstream_load", "tensorstream", source=src,
                      params={"num_readers": 4, "env": {"TENSORSTREAM_PREFAULT": "0"}},
                      fallback_fmt="tensorizer",
                      note="TENSORSTREAM_PREFAULT=0: readers fault fresh pages in"))  # fmt: skip
        register(Case(f"tensorstream-{src}-r4-safetensors", "tensorstream", "load",
                      "tensorstream_load", "safetensors", source=src,
                      params={"num_readers": 4}, note="safetensors file, same path"))  # fmt: skip
        register(Case(f"tensorizer-{src}-default", "tensorizer", "load", "tensorizer_load",
                      "tensorizer", source=src, params={"num_readers": None},
                      note="num_readers=None (2 for HTTP/S3); curl subprocesses"))  # fmt: skip
        for n in (1, 4, 8):
            register(Case(f"tensorizer-{src}-r{n}", "tensorizer", "load", "tensorizer_load",
                          "tensorizer", source=src, params={"num_readers": n}))  # fmt: skip
    for n in (1, 4, 8):
        register(Case(f"urllib3-http-t{n}", "reference", "load", "urllib3_ranged", "safetensors",
                      source="http", params={"threads": n},
                      note=f"{n} ranged GETs readinto one pre-touched buffer"))  # fmt: skip
        register(Case(f"socket-http-t{n}-fresh", "reference", "load", "socket_ranged",
                      "safetensors", source="http", params={"threads": n},
                      note=f"{n} raw-socket ranged GETs recv_into fresh memory: the ceiling "
                           "for a loader that fills new pages"))  # fmt: skip
    register(Case("runai-s3", "runai", "load", "runai_load", "safetensors", source="s3",
                  note="SafetensorsStreamer, default concurrency"))  # fmt: skip
    for n in (4, 8):
        register(Case(f"boto3-s3-t{n}", "reference", "load", "boto3_ranged", "safetensors",
                      source="s3", params={"threads": n},
                      note=f"{n} ranged get_object, read() chunks copied into one pre-touched "
                           "buffer"))  # fmt: skip
    for writer in ("tensorstream", "tensorizer"):
        register(Case(f"upload-{writer}-s3", writer, "serialize", "s3_serialize", "safetensors",
                      source="s3", params={"writer": writer}, caches=("none",),
                      note="TensorSerializer('s3://…') until close() returns"))  # fmt: skip


_remote_cases()
