"""The ``plsh`` command line.

Each subcommand is a module of this package exposing ``register_cli(subparsers)``, which adds its parser
(generated from the command's settings dataclass by :mod:`positional_lsh.cli.config`) and sets ``func`` to a
callable taking the parsed namespace and returning an exit code. ``python -m positional_lsh.cli`` is ``plsh``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        module = importlib.import_module(name)
        module.register_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``plsh ARGV``; return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
