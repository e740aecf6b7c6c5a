"""Key options shared by every command that reads or writes tensors.

``add_key_options`` adds ``--keyfile PATH`` and ``--passphrase-env VAR`` (the
passphrase is read from that environment variable, never from the command line,
where ``ps`` and shell history would show it); ``encryption_from_args`` /
``decryption_from_args`` turn the parsed options into key parameters::

    def configure(parser):
        add_key_options(parser, for_writing=True)

    def run(args):
        encryption = encryption_from_args(args, storage)   # None when no key option
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from tensorstream.errors import ConfigError

if TYPE_CHECKING:
    from tensorstream.crypto.params import DecryptionParams, EncryptionParams
    from tensorstream.sources.base import StorageOptions

__all__ = ["add_key_options", "decryption_from_args", "encryption_from_args"]

_STRENGTHS = ("min", "interactive", "moderate", "sensitive")


def add_key_options(parser: argparse.ArgumentParser, *, for_writing: bool) -> None:
    """Add the encryption key options to a subcommand's parser.

    Args:
        parser: the subcommand parser.
        for_writing: the command writes tensors: also add ``--kdf-strength`` (Argon2
            preset for passphrases) and ``--no-manifest``. Otherwise add
            ``--require-manifest``.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> add_key_options(p, for_writing=False)
        >>> p.parse_args(["--keyfile", "k.key"]).keyfile
        'k.key'
    """
    group = parser.add_argument_group("encryption")
    keys = group.add_mutually_exclusive_group()
    verb = "encrypt" if for_writing else "decrypt"
    keys.add_argument(
        "--keyfile",
        metavar="PATH",
        help=f"{verb} with the 32-byte key stored at PATH (local, s3://, http(s)://); "
        "make one with `tensorstream keygen`",
    )
    keys.add_argument(
        "--passphrase-env",
        metavar="VAR",
        help=f"{verb} with a passphrase read from environment variable VAR "
        "(never pass a passphrase on the command line)",
    )
    if for_writing:
        group.add_argument(
            "--kdf-strength",
            choices=_STRENGTHS,
            default="moderate",
            help="Argon2id cost for --passphrase-env (tensorizer's presets; default moderate)",
        )
        group.add_argument(
            "--no-manifest",
            action="store_true",
            help="do not write the authenticated manifest (<file>.manifest) beside the file",
        )
    else:
        group.add_argument(
            "--require-manifest",
            action="store_true",
            help="refuse an encrypted file that has no authenticated manifest beside it",
        )


def _passphrase(args: argparse.Namespace) -> str | None:
    var = getattr(args, "passphrase_env", None)
    if not var:
        return None
    value = os.environ.get(var)
    if not value:
        # Name the variable, never a value.
        raise ConfigError(
            f"--passphrase-env {var}: the environment variable {var} is not set or empty; "
            f"export {var}=... first"
        )
    return value


def encryption_from_args(
    args: argparse.Namespace, storage: StorageOptions | None = None
) -> EncryptionParams | None:
    """The ``EncryptionParams`` the options ask for, or ``None`` when no key option is set.

    Args:
        args: parsed options from a parser set up with ``for_writing=True``.
        storage: how to reach a remote key file.

    Raises:
        ConfigError: the key file is not a key, or the passphrase variable is unset.
        SourceError: the key file cannot be read.
    """
    from tensorstream.crypto.params import EncryptionParams, MemLimit, OpsLimit

    if getattr(args, "keyfile", None):
        from tensorstream.crypto.keyfile import read_keyfile

        return EncryptionParams(read_keyfile(args.keyfile, storage))
    passphrase = _passphrase(args)
    if passphrase is None:
        return None
    strength = getattr(args, "kdf_strength", "moderate").upper()
    return EncryptionParams.from_string(
        passphrase, opslimit=OpsLimit[strength], memlimit=MemLimit[strength]
    )


def decryption_from_args(
    args: argparse.Namespace, storage: StorageOptions | None = None
) -> DecryptionParams | None:
    """The ``DecryptionParams`` the options ask for, or ``None`` when no key option is set.

    Args:
        args: parsed options from a parser set up with ``for_writing=False``.
        storage: how to reach a remote key file.

    Raises:
        ConfigError: the key file is not a key, or the passphrase variable is unset.
        SourceError: the key file cannot be read.
    """
    from tensorstream.crypto.params import DecryptionParams

    if getattr(args, "keyfile", None):
        from tensorstream.crypto.keyfile import read_keyfile

        return DecryptionParams.from_key(read_keyfile(args.keyfile, storage))
    passphrase = _passphrase(args)
    if passphrase is None:
        return None
    return DecryptionParams.from_string(passphrase)
