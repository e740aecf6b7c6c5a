"""Unknown flags: the subcommand's usage and a "did you mean", not the top-level usage.

argparse hands flags a subcommand does not know back to the top-level parser, which
then prints ``tensorstream [-h] ... COMMAND`` and no hint. :func:`parse_with_suggestions`
parses as usual, and when flags are left over it reports them on the subcommand's
parser with the closest flags it has (difflib; Python 3.11's argparse has no
``suggest_on_error``).
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["parse_with_suggestions", "suggestions"]


def suggestions(unknown: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """For each unknown ``--flag`` (or ``--flag=value``), the closest flag of ``parser``.

    Example:
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("--max-model-len")
        >>> suggestions(["--max-modle-len=8"], p)
        ['--max-modle-len: did you mean --max-model-len?']
    """
    flags = [f for action in parser._actions for f in action.option_strings]
    hints = []
    for arg in unknown:
        if not arg.startswith("-"):
            continue
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
        if close:
            hints.append(f"{name}: did you mean {close[0]}?")
    return hints


def _innermost(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The deepest subcommand parser ``args`` went through (``tensorize serialize``...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return _innermost(action.choices[chosen], args)
    return parser


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every subcommand parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def parse_with_suggestions(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, but unknown flags are reported by the subcommand's parser.

    Exits with status 2 (argparse's) after printing the subcommand's usage, the unknown
    arguments and, where one is close, the flag that was probably meant. A typo in a
    required flag makes the subcommand report the missing flag; the hint is added there
    too.
    """
    parsers = _parsers(parser)
    known = {f for p in parsers for action in p._actions for f in action.option_strings}
    typos = [a for a in argv if a.startswith("--") and a.split("=", 1)[0] not in known]
    for each in parsers:
        each.error = _with_hints(each, typos)  # type: ignore[method-assign]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _with_hints(parser: argparse.ArgumentParser, typos: list[str]) -> Any:
    original = parser.error

    def error(message: str) -> NoReturn:
        hints = suggestions(typos, parser)
        original(message + ("; " + "; ".join(hints) if hints else ""))
        raise AssertionError("argparse's error() returned")  # pragma: no cover

    return error
