"""What the controller raises and how it warns.

* :class:`CheckpointMismatch`: the state or data config given on resume differs from the
  checkpoint's (a config change, never corruption: nothing on disk moves).
* :class:`CheckpointSaveError`: a checkpoint could not be written.
* :class:`TrainingDiverged`: rollbacks did not get past the trouble, or a detector raised.
* :class:`DataExhausted`: the data ran out inside the controller.
* :class:`Preempted`: a preemption signal stopped the run after a save.
* :func:`warn`: a ``RuntimeWarning`` at the user's line.
"""

from __future__ import annotations

import os
import pathlib
import signal
import warnings
from collections.abc import Mapping, Sequence
from typing import Any


class CheckpointMismatch(RuntimeError, ValueError):
    """The train state or data config given on resume differs from the checkpoint's."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; ``step`` and ``directory`` say which.

    ``errno`` is the cause's (``errno.ENOSPC`` when the disk is full). The checkpoints
    committed before it are intact, and no ``save`` event claims the failed one.
    """

    def __init__(self, message: str, *, step: int, directory: os.PathLike, code: int | None):
        super().__init__(code, message)
        self.step, self.directory = int(step), pathlib.Path(directory)

    def __str__(self) -> str:
        return str(self.strerror)


class TrainingDiverged(RuntimeError):
    """Raised when training keeps failing after ``max_rollbacks`` rollbacks, or when a
    detection's action is ``"raise"``.

    The message lists what was seen (the losses around each event, the ranges skipped)
    and what to try. ``history`` holds the rollback records as dicts.
    """

    def __init__(self, message: str, history: Sequence[Mapping[str, Any]] = ()):
        super().__init__(message)
        self.history = [dict(h) for h in history]


class Preempted(SystemExit):
    """Raised by ``RollbackController.step`` after a preemption save.

    A SIGTERM (or a signal in ``preemption_signals``) asked the job to stop; the state
    of step ``step`` was saved (unless unhealthy, see ``saved``), events and the ledger
    are on disk, and a restart resumes exactly. It derives from ``SystemExit`` (code 0)
    so that an unhandled one ends the process cleanly; :meth:`RollbackController.run`
    catches it and returns, with ``ctl.last_run.preempted`` true.
    """

    def __init__(self, step: int, signum: int | None, saved: bool, state: Any = None):
        super().__init__(0)
        self.step, self.signum, self.saved, self.state = step, signum, saved, state

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name if self.signum else "preemption notice"
        return f"preempted by {name} at step {self.step} (saved: {self.saved})"


class DataExhausted(RuntimeError):
    """The data ran out inside the controller (a rollback's skip past its end).

    ``RollbackController.run`` turns it into ``ctl.last_run.data_exhausted``; a
    hand-written loop sees it from ``step``. ``state``: the state as restored.
    """

    def __init__(self, message: str, *, state: Any = None):
        super().__init__(message)
        self.state = state


def warn(message: str, category: type[Warning] = RuntimeWarning, *, stacklevel: int = 1) -> None:
    """``warnings.warn`` pointing ``stacklevel`` calls up from the caller: the user's line.

    ``stacklevel`` counts as :func:`warnings.warn`'s, from the function calling ``warn``:
    1 is the line calling it, 2 that function's caller, and so on. Each call site in stabljax
    passes the number of stabljax calls between it and its public entry point, plus one
    (Python 3.12's ``skip_file_prefixes`` would find the user's line; 3.11 has none, and
    stabljax reads no frames).

    Args:
      message: the warning's text.
      category: the warning's class.
      stacklevel: where the warning points, as above.
    """
    warnings.warn(message, category, stacklevel=stacklevel + 1)
