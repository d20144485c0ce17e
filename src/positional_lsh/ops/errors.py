"""The exception for problems the user caused (bad input files, flags, run directories).

:class:`UserError` is a ``ValueError``, so code that catches ``ValueError`` keeps working. The ``plsh`` command
prints it as one line (``plsh <command>: error: <message>``) and exits with code 2; ``--debug`` (or
``PLSH_DEBUG=1``) shows the traceback instead. It lives in the op layer so that every room may raise it.
"""

from __future__ import annotations

import os

__all__ = ["UserError"]


class UserError(ValueError):
    """A problem the user can fix: the message names the file or flag and says what to do."""


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``None`` where the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def check_memory(need: float, what: str) -> None:
    """Refuse (:class:`UserError`, one line with the estimate) work whose estimated memory ``need`` (bytes)
    exceeds this machine's physical memory; ``what`` names the flags that set it."""
    have = memory_bytes()
    if have is not None and need > have:
        raise UserError(
            f"{what} needs about {_size(need)} of memory; this machine has {_size(have)}: use smaller values"
        )


def check_seconds(seconds: float, limit: float, what: str, why: str = "") -> None:
    """Refuse (:class:`UserError`, one line with the estimate) work whose estimated time ``seconds`` exceeds
    ``limit``; ``what`` names the values that set it, ``why`` (optional) says why the limit is what it is."""
    if seconds > limit:
        raise UserError(
            f"{what} would take about {format_seconds(seconds)} (estimated; refused above {format_seconds(limit)}"
            f"{'' if not why else ': ' + why}): use smaller values"
        )


def format_seconds(seconds: float) -> str:
    """A duration for a message: ``"45 s"``, ``"12 min"``, ``"3.1 h"``, ``"2.4e+03 days"``."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    if seconds < 172800:
        return f"{seconds / 3600:.3g} h"
    return f"{seconds / 86400:.3g} days"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1024 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PB"
