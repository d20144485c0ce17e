"""The ``plsh`` command line.

Each subcommand is a module of this package exposing ``register_cli(subparsers)``, which adds its parser
(generated from the command's settings dataclass by :mod:`positional_lsh.cli.config`) and sets ``func`` to a
callable taking the parsed namespace and returning an exit code. ``python -m positional_lsh.cli`` is ``plsh``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

from positional_lsh.ops.errors import UserError

__all__ = ["UserError", "build_parser", "guarded", "main"]

# Modules that contribute subcommands, in the order they appear in --help.
_COMMAND_MODULES = (
    "positional_lsh.cli.demo",
    "positional_lsh.cli.bench",
    "positional_lsh.cli.train",
    "positional_lsh.cli.eval",
    "positional_lsh.cli.validate",
)


def build_parser() -> argparse.ArgumentParser:
    """The ``plsh`` parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="plsh",
        description="Positional LSH: ALiBi attention as an average of random contiguous block masks.",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of errors (also: environment PLSH_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``plsh ARGV``; return the exit code.

    A problem the user caused (:class:`~positional_lsh.ops.errors.UserError`, and ``ValueError``/``OSError``
    from the commands) prints one line ``plsh <command>: error: <message>`` and returns 2; ``--debug`` (or
    ``PLSH_DEBUG=1``) shows the traceback instead. Ctrl-C outside training returns 130 with one line.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return guarded(f"plsh {args.command}", lambda: int(args.func(args) or 0), debug=bool(args.debug))


def guarded(prog: str, call: Callable[[], int], *, debug: bool = False) -> int:
    """Run ``call()`` and return its exit code; a user-caused error prints ``<prog>: error: <one line>`` and
    returns 2, Ctrl-C prints one line and returns 130 (with ``debug`` or ``PLSH_DEBUG=1``: the traceback)."""
    debug = debug or os.environ.get("PLSH_DEBUG", "") not in ("", "0")
    try:
        return call()
    except (ValueError, OSError, FloatingPointError) as exc:  # UserError is a ValueError; TypeError = a bug
        if debug:
            raise
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (an ``OSError`` with its file name)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
