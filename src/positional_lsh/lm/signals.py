"""Stop a training run cleanly on Ctrl-C (SIGINT) or SIGTERM (what job schedulers send).

:class:`StopOnSignal` replaces the handlers of both signals while training: the first signal only sets
``StopOnSignal.signal``, and the training loop saves a checkpoint after the current step and returns; a
second signal ends the process at once (exit code ``128 + signal number``), leaving the last complete
checkpoint (checkpoint sets are written atomically, see :mod:`positional_lsh.lm.run_dir`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

_SIGNALS = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None)) if s is not None)


class StopOnSignal:
    """Context manager: while active, SIGINT/SIGTERM request a stop instead of raising or killing.

    ``signal``: the name of the first signal received (``None``: none). Outside the main thread (where Python
    cannot install handlers) it does nothing.
    """

    def __init__(self, prog: str = "plsh train") -> None:
        self.prog = prog
        self.signal: str | None = None
        self.signum = 0
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            sys.stderr.write(f"\n{self.prog}: second {name}: aborting now (the last complete checkpoint is kept)\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signal, self.signum = name, signum
        sys.stderr.write(f"\n{self.prog}: {name}: saving a checkpoint after this step (again to abort at once)\n")
        sys.stderr.flush()

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
