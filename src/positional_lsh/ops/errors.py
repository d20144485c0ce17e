"""The exception for problems the user caused (bad input files, flags, run directories).

:class:`UserError` is a ``ValueError``, so code that catches ``ValueError`` keeps working. The ``plsh`` command
prints it as one line (``plsh <command>: error: <message>``) and exits with code 2; ``--debug`` (or
``PLSH_DEBUG=1``) shows the traceback instead. It lives in the op layer so that every room may raise it.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(ValueError):
    """A problem the user can fix: the message names the file or flag and says what to do."""
