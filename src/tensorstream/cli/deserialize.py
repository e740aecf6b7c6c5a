"""``tensorstream deserialize URI``: load a ``.tensors`` (or safetensors) file, report throughput."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tensorstream.cli.keys import add_key_options, decryption_from_args

__all__ = ["check_device", "configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``deserialize`` options."""
    parser.add_argument("uri", help="path, file://, http(s):// or s3:// URI")
    parser.add_argument(
        "--num-readers",
        type=int,
        help="parallel readers (default: 4; locally min(4, CPUs), 8 on a cold page cache)",
    )
    verify = parser.add_mutually_exclusive_group()
    verify.add_argument(
        "--verify-hash",
        action="store_const",
        const=True,
        default=False,
        help="check every stored hash (CRC32 and SHA-256)",
    )
    verify.add_argument(
        "--verify-crc32",
        dest="verify_hash",
        action="store_const",
        const="crc32",
        help="check the stored CRC32 only (fast; catches corruption, see docs/security.md)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 (default cpu)")
    parser.add_argument(
        "--no-mmap", action="store_true", help="copy into fresh memory instead of mapping the file"
    )
    add_key_options(parser, for_writing=False)


def check_device(name: str) -> Any:
    """The ``torch.device`` for ``--device``, refused up front when it cannot work here.

    Raises:
        ConfigError: not a device name, or a CUDA device on a machine without one.
    """
    import torch

    from tensorstream.errors import ConfigError

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"--device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {name}: no CUDA GPU is available here (torch "
                f"{torch.__version__}, torch.cuda.is_available() is False); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                "device(s); pick one of cuda:0.."
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    elif device.type not in ("cpu", "meta"):
        raise ConfigError(f"--device {name}: only cpu and cuda devices are supported")
    return device


def run(args: argparse.Namespace) -> int:
    """Load every tensor and print bytes, seconds and GB/s.

    Raises:
        TensorStreamError: unreadable file, wrong key, hash mismatch.
    """
    import torch

    from tensorstream import TensorDeserializer

    device = check_device(args.device)
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
        mapped = getattr(deserializer, "mapped_bytes", 0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    verified = {True: " (hashes verified)", "crc32": " (CRC32 verified)"}.get(args.verify_hash, "")
    read = nbytes - mapped
    if mapped and read < mapped:
        # A mapped load reads nothing until the tensors are touched: no rate to report.
        what = f"{mapped} bytes mapped from the page cache"
        if read:
            what += f", {read} bytes read"
        print(
            f"loaded {count} tensors from {args.uri} to {args.device} in {seconds:.3f} s: "
            f"{what}; mapped bytes are read when first touched{verified}"
        )
        return 0
    print(
        f"loaded {count} tensors, {nbytes} bytes from {args.uri} to {args.device} in {seconds:.3f} s "
        f"({nbytes / seconds / 1e9:.2f} GB/s){verified}"
    )
    return 0
