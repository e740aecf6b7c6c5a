"""``tensorstream keygen PATH``: write a new random 32-byte key file (local or s3://).

Local files get mode 0600 (the key never exists on disk with looser permissions: the
temp file is chmod-ed before the key is written, then renamed into place). An
existing key is never overwritten without ``--force``: losing a key loses the model.
"""

from __future__ import annotations

import argparse
import logging

from tensorstream.errors import ConfigError, SourceNotFoundError

__all__ = ["configure", "run"]

log = logging.getLogger("tensorstream")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``PATH`` and ``--force``."""
    parser.add_argument("path", metavar="PATH", help="where to write the key (path or s3://)")
    parser.add_argument(
        "--force", action="store_true", help="overwrite an existing key file (the old key is lost)"
    )


def _exists(path: str) -> bool:
    from tensorstream.sources import open_source

    try:
        with open_source(path):
            return True
    except SourceNotFoundError:
        return False


def run(args: argparse.Namespace) -> int:
    """Write the key; print where it went (never the key).

    Raises:
        ConfigError: ``PATH`` exists and ``--force`` was not given.
        SourceError: the location cannot be written.
    """
    from tensorstream.crypto.keyfile import write_keyfile
    from tensorstream.crypto.params import EncryptionParams

    if not args.force and _exists(args.path):
        raise ConfigError(
            f"{args.path} already exists; refusing to overwrite a key (files encrypted with "
            "it could no longer be read). Pass --force to replace it"
        )
    write_keyfile(args.path, EncryptionParams.random().key)
    print(f"wrote a new 32-byte key to {args.path}")
    print(f"encrypt with: --keyfile {args.path}   (keep it safe: without it the data is lost)")
    return 0
