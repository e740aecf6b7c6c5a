"""The ``tensorstream`` command: one entry point, subcommands imported on demand.

Each subcommand lives in ``tensorstream.cli.<name>`` and provides
``configure(parser)`` and ``run(args) -> int``. Importing this module imports none of
them, so ``tensorstream --help`` stays fast and optional dependencies stay unloaded.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import traceback
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
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also TENSORSTREAM_DEBUG=1)",
    )
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


def _debug_requested(argv: Sequence[str]) -> bool:
    if os.environ.get("TENSORSTREAM_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return "--debug" in argv


def _quiet_stdout() -> None:
    """The reader of our stdout went away (``| head``): stop writing, like ``cat`` would.

    Pointing the descriptor at /dev/null keeps the interpreter's final flush from
    raising BrokenPipeError again on the way out.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tensorstream`` command; returns the exit status.

    Whatever happens, the user sees one line on stderr, never a traceback: ``error: ...``
    (status 2) for a tensorstream error, ``interrupted`` (130) on Ctrl-C, nothing (141,
    like a process killed by SIGPIPE) when the reader of stdout closed the pipe, and
    for an unexpected exception a line saying it is a bug (status 1); ``--debug`` or
    ``TENSORSTREAM_DEBUG=1`` shows that traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    try:
        return _run(argv)
    except TensorStreamError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 128 + signal.SIGPIPE
    except Exception as exc:  # noqa: BLE001 - the last line of defence of the CLI
        if debug:
            traceback.print_exc()
            return 1
        print(
            f"error: unexpected {type(exc).__name__}: {_one_line(exc)[:300]} -- this is a bug in "
            "tensorstream; rerun with --debug (or TENSORSTREAM_DEBUG=1) for the traceback and "
            "report it",
            file=sys.stderr,
        )
        return 1


def _run(argv: list[str]) -> int:
    # --debug is read by main() and accepted anywhere on the line, also after a subcommand.
    argv = _normalized([a for a in argv if a != "--debug"])
    parser = build_parser(argv)
    from tensorstream.cli.suggest import parse_with_suggestions

    args = parse_with_suggestions(parser, argv)  # a typo names the subcommand's flags
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    run = getattr(args, "_run", None)
    if run is None:
        parser.error(f"the {args.command!r} command is not available in this installation")
    status = int(run(args) or 0)
    sys.stdout.flush()  # a closed pipe shows up here, inside the handler, not at exit
    return status


if __name__ == "__main__":
    sys.exit(main())
