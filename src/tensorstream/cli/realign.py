"""``tensorstream realign SRC DEST``: rewrite a tensorizer file with aligned tensor data.

Files written by tensorizer or vLLM put most tensors at odd offsets, which CPU loads
must copy; the realigned file is what ``tensorstream serialize`` would have written
(64-byte aligned data, page-aligned for tensors of 64 KiB or more) and loads as
page-cache views. tensorizer reads it unchanged.
"""

from __future__ import annotations

import argparse

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``SRC``, ``DEST`` and ``--align``."""
    parser.add_argument("src", metavar="SRC", help="tensorizer .tensors file (path or URI)")
    parser.add_argument("dest", metavar="DEST", help="where to write (path or s3://)")
    parser.add_argument(
        "--align",
        type=int,
        default=64,
        help="byte alignment of tensor data (power of two; default 64, the writer's)",
    )


def run(args: argparse.Namespace) -> int:
    """Rewrite; print one line saying what moved."""
    from tensorstream.serialize.realign import realign

    result = realign(args.src, args.dest, align=args.align)
    print(
        f"wrote {args.dest}: {result.tensors} tensors, {result.moved} moved to "
        f"{args.align}-byte boundaries ({result.source_bytes} -> {result.written_bytes} bytes)"
    )
    return 0
