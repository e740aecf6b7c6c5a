"""The ``tensorstream`` command: one entry point, subcommands imported on demand.

Each subcommand lives in ``tensorstream.cli.<name>`` and provides
``configure(parser)`` and ``run(args) -> int``. Importing this module imports none of
them, so ``tensorstream --help`` stays fast and optional dependencies stay unloaded.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from tensorstream.errors import TensorStreamError

__all__ = ["main"]

#: name -> (module, one-line help). Order is the order shown in --help.
SUBCOMMANDS = {
    "inspect": (
        "tensorstream.cli.inspect",
        "show a .tensors/safetensors file's header and tensors",
    ),
    "serialize": ("tensorstream.cli.serialize", "write a model or checkpoint as .tensors"),
    "deserialize": ("tensorstream.cli.deserialize", "load a .tensors file and report throughput"),
    "tensorize": (
        "tensorstream.cli.tensorize",
        "vLLM's tensorize workflow (serialize/deserialize a model)",
    ),
    "generate": ("tensorstream.cli.generate", "generate text with a model"),
    "serve": ("tensorstream.cli.serve", "OpenAI-compatible HTTP server"),
    "keygen": ("tensorstream.cli.keygen", "write a new random 32-byte encryption key file"),
    "realign": (
        "tensorstream.cli.realign",
        "rewrite a tensorizer-written file with aligned tensor data (loads without copies)",
    ),
}


def _version_text() -> str:
    from tensorstream import __version__
    from tensorstream.utils.checksum import CRC32_BACKEND

    text = f"tensorstream {__version__}\ncrc32: {CRC32_BACKEND}"
    try:
        from tensorstream.crypto import describe

        text += f"\ncrypto: {describe()}"
    except Exception as exc:  # noqa: BLE001 - version output must never fail
        text += f"\ncrypto: unavailable ({exc})"
    return text


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show version and crypto backend")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        print(_version_text())
        parser.exit()


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorstream",
        description="Stream model weights from local disk, HTTP(S) and S3 into tensors, "
        "and serve models from them.",
    )
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = None
    if argv:
        wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if wanted is None or wanted == name:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:
                    raise
                continue
            module.configure(sp)
            sp.set_defaults(_run=module.run)
    return parser


def _normalized(argv: list[str]) -> list[str]:
    """Let a subcommand rewrite its own flags (``tensorize`` takes vLLM's ``--a_b`` spelling)."""
    position = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if position is None or argv[position] not in SUBCOMMANDS:
        return argv
    try:
        module = importlib.import_module(SUBCOMMANDS[argv[position]][0])
    except ModuleNotFoundError:
        return argv
    normalize = getattr(module, "normalize_flags", None)
    if normalize is None:
        return argv
    return argv[: position + 1] + list(normalize(argv[position + 1 :]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = _normalized(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    run = getattr(args, "_run", None)
    if run is None:
        parser.error(f"the {args.command!r} command is not available in this installation")
    try:
        return int(run(args) or 0)
    except TensorStreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
