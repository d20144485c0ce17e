"""The ``plsh`` command line.

Each subcommand is a module of this package exposing ``register_cli(subparsers)``, which adds its parser
(generated from the command's settings dataclass by :mod:`positional_lsh.cli.parsers`) and sets ``func`` to a
callable taking the parsed namespace and returning an exit code (most are
:func:`~positional_lsh.cli.parsers.run_command`). :func:`main` runs it through :func:`guarded`, the one place
where errors become exit codes. ``python -m positional_lsh.cli`` is ``plsh``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from positional_lsh.ops.errors import UserError

__all__ = ["USER_ERRORS", "OneLineParser", "UserError", "build_parser", "command_main", "guarded", "main"]

# Modules that contribute subcommands, in the order they appear in --help.
_COMMAND_MODULES = (
    "positional_lsh.cli.demo",
    "positional_lsh.cli.bench",
    "positional_lsh.cli.train",
    "positional_lsh.cli.train_hf",
    "positional_lsh.cli.eval",
    "positional_lsh.cli.generate",
    "positional_lsh.cli.validate",
)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, as every other ``plsh`` error: ``<prog>: error: <message>
    (see <prog> --help)`` on stderr, exit code 2 (argparse's ``SystemExit(2)``); subcommand parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``plsh`` parser with every subcommand."""
    parser = OneLineParser(
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
    """Run ``plsh ARGV`` (default ``sys.argv[1:]``); return the exit code.

    Every command runs through :func:`guarded`: a problem the user caused prints one line
    ``plsh <command>: error: <message>`` and returns 2; ``--debug`` (or ``PLSH_DEBUG=1``) shows the traceback
    instead. The command line is recorded as ``args.command_line`` (``plsh ...``, e.g. in a training run's
    checkpoint).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    args.command_line = shlex.join(["plsh", *argv])
    return guarded(f"plsh {args.command}", lambda: int(args.func(args) or 0), debug=bool(args.debug))


def command_main(command: str, argv: Sequence[str] | None = None) -> int:
    """``plsh COMMAND ARGV`` (default ``sys.argv[1:]``): :func:`main` with ``command`` in front, the same parser and
    the same error handling; the ``main`` of each command module that has one."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])


USER_ERRORS = (ValueError, TypeError, OSError, FloatingPointError)
"""The exceptions :func:`guarded` reports as a user's mistake (exit code 2): a refused setting or argument
(``ValueError``, :class:`~positional_lsh.ops.errors.UserError` among them, and ``TypeError``), a file that is
missing or unreadable (``OSError``), a training run that diverged (``FloatingPointError``)."""


def guarded(prog: str, call: Callable[[], int], *, debug: bool = False) -> int:
    """Run ``call()`` and return its exit code: the one error-to-exit-code path of every ``plsh`` command.

    An exception of :data:`USER_ERRORS` prints ``<prog>: error: <message on one line>`` on stderr and returns 2;
    Ctrl-C prints ``<prog>: interrupted`` and returns 130. With ``debug`` (or the environment ``PLSH_DEBUG=1``)
    both are raised instead, with their traceback. Other exceptions always propagate.
    """
    debug = debug or os.environ.get("PLSH_DEBUG", "") not in ("", "0")
    try:
        return call()
    except USER_ERRORS as exc:
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
    """The message of ``exc`` on one line (an ``OSError`` as ``<file name>: <reason>``)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())
