"""``tensorstream serialize SRC DEST``: write a checkpoint as one ``.tensors`` file.

SRC is a model directory (``*.safetensors`` shards), the built-in model's id or
alias, a single ``.safetensors`` file, or a ``.tensors`` file (re-written, e.g.
to encrypt or re-align). DEST is a path or ``s3://`` URI. Tensor names are the
checkpoint's, so ``LLM`` loads the result when the config files sit beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from tensorstream.cli.keys import add_key_options, encryption_from_args
from tensorstream.errors import SourceNotFoundError

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``serialize`` options."""
    parser.add_argument("src", help="model dir, built-in id, .safetensors or .tensors file")
    parser.add_argument(
        "dest",
        help="output .tensors path or s3:// URI; a directory (existing, or ending in '/') "
        "gets model.tensors inside",
    )
    parser.add_argument(
        "--align", type=int, default=64, help="data alignment (1 = tensorizer bytes)"
    )
    parser.add_argument("--limit-cpu-concurrency", type=int, help="hashing/encryption threads")
    parser.add_argument(
        "--direct-io",
        choices=("auto", "on", "off"),
        default="auto",
        help="local writes bypass the page cache (O_DIRECT): auto = for 512 MiB or more",
    )
    add_key_options(parser, for_writing=True)


def _source_files(src: str) -> list[str]:
    from tensorstream.engine.builtin import is_builtin, materialize_builtin

    if is_builtin(src):
        src = str(materialize_builtin())
    path = os.path.expanduser(src)
    if os.path.isdir(path):
        from pathlib import Path

        from tensorstream.engine.loaders.safetensors import safetensors_files

        return [str(p) for p in safetensors_files(Path(path))]
    if "://" in src or os.path.isfile(path):
        return [src]
    raise SourceNotFoundError(f"{src} is not a model directory, file or URI")


def output_path(dest: str) -> str:
    """``dest``, or ``dest/model.tensors`` when it names a directory (existing, or ending in '/').

    Example:
        >>> output_path("s3://bucket/models/")
        's3://bucket/models/model.tensors'
    """
    if dest.endswith("/") or ("://" not in dest and os.path.isdir(os.path.expanduser(dest))):
        return dest.rstrip("/") + "/model.tensors"
    return dest


def run(args: argparse.Namespace) -> int:
    """Read every tensor of SRC and write them to DEST.

    Raises:
        TensorStreamError: unreadable input, unwritable output, bad key options.
    """
    from tensorstream import TensorDeserializer, TensorSerializer

    args.dest = output_path(args.dest)
    encryption = encryption_from_args(args)
    files = _source_files(args.src)
    started = time.perf_counter()
    tensors: dict[str, Any] = {}
    readers = []
    for uri in files:
        reader = TensorDeserializer(uri, device="cpu")
        readers.append(reader)
        tensors.update({str(k): v.detach() for k, v in reader.items()})
    kwargs: dict[str, Any] = {"align": args.align, "progress": sys.stderr.isatty()}
    if args.limit_cpu_concurrency:
        kwargs["limit_cpu_concurrency"] = args.limit_cpu_concurrency
    if getattr(args, "no_manifest", False):
        kwargs["manifest"] = False
    direct = getattr(args, "direct_io", "auto")
    if direct != "auto":
        from tensorstream.sources.base import StorageOptions

        kwargs["storage"] = StorageOptions(direct_io=direct == "on")
    try:
        with TensorSerializer(args.dest, encryption=encryption, **kwargs) as serializer:
            serializer.write_state_dict(tensors)
    finally:
        for reader in readers:
            reader.close()
    seconds = time.perf_counter() - started
    nbytes = serializer.total_tensor_bytes
    print(
        f"wrote {len(tensors)} tensors, {nbytes} bytes to {args.dest} in {seconds:.2f} s "
        f"({nbytes / seconds / 1e9:.2f} GB/s){' (encrypted)' if encryption else ''}"
    )
    return 0
