"""``tensorstream deserialize URI``: load a ``.tensors`` (or safetensors) file, report throughput."""

from __future__ import annotations

import argparse
import sys
import time

from tensorstream.cli.keys import add_key_options, decryption_from_args

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``deserialize`` options."""
    parser.add_argument("uri", help="path, file://, http(s):// or s3:// URI")
    parser.add_argument("--num-readers", type=int, help="parallel readers (default: dynamic)")
    parser.add_argument("--verify-hash", action="store_true", help="check every tensor's hash")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default cpu)")
    parser.add_argument(
        "--no-mmap", action="store_true", help="copy into fresh memory instead of mapping the file"
    )
    add_key_options(parser, for_writing=False)


def run(args: argparse.Namespace) -> int:
    """Load every tensor and print bytes, seconds and GB/s.

    Raises:
        TensorStreamError: unreadable file, wrong key, hash mismatch.
    """
    import torch

    from tensorstream import TensorDeserializer

    encryption = decryption_from_args(args)
    kwargs = {}
    if getattr(args, "require_manifest", False):
        kwargs["require_manifest"] = True
    started = time.perf_counter()
    with TensorDeserializer(
        args.uri,
        device=args.device,
        num_readers=args.num_readers,
        verify_hash=args.verify_hash,
        encryption=encryption,
        use_mmap=not args.no_mmap,
        progress=sys.stderr.isatty(),
        **kwargs,
    ) as deserializer:
        count = len(deserializer.index.records)
        nbytes = deserializer.total_tensor_bytes
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    print(
        f"loaded {count} tensors, {nbytes} bytes from {args.uri} to {args.device} in {seconds:.3f} s "
        f"({nbytes / seconds / 1e9:.2f} GB/s){' (hashes verified)' if args.verify_hash else ''}"
    )
    return 0
