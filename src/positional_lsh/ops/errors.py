"""The exception for problems the user caused (bad input files, flags, run directories).

:class:`UserError` is a ``ValueError``, so code that catches ``ValueError`` keeps working. The ``plsh`` command
prints it as one line (``plsh <command>: error: <message>``) and exits with code 2; ``--debug`` (or
``PLSH_DEBUG=1``) shows the traceback instead. It lives in the op layer so that every room may raise it.
"""

from __future__ import annotations

import os

__all__ = ["UserError", "check_memory", "memory_bytes"]


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


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1024 or unit == "PB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} PB"
