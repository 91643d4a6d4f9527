"""A hand-written loop's contract with the controller: what it must never lose in silence.

A rollback moves ``state.step`` back, so a loop that counts its own steps
(``for step in range(N)``) ends short; a loop that forgets ``finish`` leaves its last state
unsaved and its last loss unchecked; ``screen_ahead`` on data that can only be read
forward screens less well than it says. Here are the checks of what the loop hands the
controller and the messages the controller raises or warns with; the controller decides
when (:class:`~stabljax.control.controller.RollbackController`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stabljax.control.diagnose.screen import can_screen
from stabljax.control.errors import warn

FIX = (
    "Loop with `for step in ctl.steps(N):` (it runs until state.step == N), or declare the "
    "target with `ctl.restore_or_init(state, data, total_steps=N)` so that finish() raises "
    "if the run ends short"
)


def check_target(num_steps: Any) -> int:
    """The run's target ``state.step``: an int >= 0, else ``ValueError``.

    Example:
      >>> from stabljax.control.loop import check_target
      >>> check_target(100)
      100
      >>> check_target(1.5)
      Traceback (most recent call last):
      ...
      ValueError: the target number of steps must be an int >= 0, got 1.5
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"the target number of steps must be an int >= 0, got {num_steps!r}")
    return int(num_steps)


def moved_back(step: int, restored: int) -> str:
    """The first rollback's warning in a run with no target: the loop may now end short.

    Example:
      >>> from stabljax.control.loop import moved_back
      >>> moved_back(37, 20)[:60]
      'rollback at step 37: state.step went back to 20, so 17 steps'
    """
    back = step - restored
    return (
        f"rollback at step {step}: state.step went back to {restored}, so {back} steps are "
        f"trained again, and a loop that counts its own steps (`for step in range(N)`) now "
        f"ends {back} steps short of N, silently. {FIX}"
    )


def ended_short(step: int, target: int) -> str:
    """:meth:`finish`'s error when the saved state is below the declared target."""
    return (
        f"the run ended at step {step}, {target - step} steps short of its target {target} "
        "(total_steps): a rollback moved state.step back, and the loop stopped counting by "
        f"itself. The state of step {step} is saved. Loop with `for step in "
        f"ctl.steps({target}):`, which runs until state.step == {target} and so re-runs the "
        "steps a rollback took back; a restart resumes from the checkpoint"
    )


def not_called(step: int, target: int) -> str:
    """The error of a ``ctl.steps`` loop whose iteration did not call ``ctl.step``."""
    return (
        f"step {step}: the loop over ctl.steps({target}) did not call "
        "ctl.step(state, metrics, data) in its iteration; call it once per step"
    )


def unfinished(how: str, step: int | None, saved: int | None) -> str:
    """The warning of a controller closed or collected after steps without ``finish``.

    Example:
      >>> from stabljax.control.loop import unfinished
      >>> unfinished("closed", 14, 10)[:74]
      'RollbackController was closed at step 14 without finish(): the final state'
    """
    return (
        f"RollbackController was {how} at step {step} without finish(): the final state was "
        f"not saved (the newest checkpoint is step {saved}) and its last loss was not "
        "checked. Call `state, data = ctl.finish(state, data)` after the loop"
    )


def screen_warning(data: Any, screen_ahead: int) -> str | None:
    """Why ``screen_ahead`` screens ``data`` less well than in place, or ``None``.

    Data that can neither fetch a batch by index nor move back is read ahead instead
    (:mod:`~stabljax.control.diagnose.screen`), against the restored checkpoint's smoothed
    loss.
    """
    if not screen_ahead or can_screen(data):
        return None
    source = getattr(data, "source", None)
    over = f" over a {type(source).__module__}.{type(source).__name__}" if source else ""
    return (
        f"screen_ahead={screen_ahead}: {type(data).__name__}{over} can neither fetch a batch "
        "by index nor move back, so a rollback screens it by reading ahead: against the "
        "restored checkpoint's smoothed loss, not the restored state's own loss on the "
        "batches before the onset, and not at all after a rollback to an untrained state (the "
        "skip then stays blind, doubled on each consecutive rollback). For the exact screen "
        "use IndexedBatches(batch_fn), a grain.MapDataset, or a grain.DataLoader whose "
        "operations are 1:1 maps and one Batch"
    )


def check_data(data: Any, screen_ahead: int, triage: Any) -> None:
    """Warns for ``screen_ahead`` on data read ahead (:func:`screen_warning`); raises
    ``ValueError`` for ``TriageConfig(narrow_skip=True)`` on data that cannot move back."""
    if (message := screen_warning(data, screen_ahead)) is not None:
        warn(message, stacklevel=3)  # check_data < ctl.restore_or_init < the user
    if triage is not None and triage.narrow_skip and not data.can_rewind:
        raise ValueError(
            f"TriageConfig(narrow_skip=True) moves the data back to the restored "
            f"checkpoint's position after a rollback, and {type(data).__name__} "
            "cannot move back (a plain iterator, a filtered or packed Grain pipeline): "
            "use IndexedBatches or a seekable Grain iterator, or narrow_skip=False"
        )


class LoopGuard:
    """The loop's side of a run: its target, and whether its last state is saved.

    The controller tells it what happened (:meth:`declare`, :meth:`stepped`,
    :meth:`finished`, :meth:`after_rollback`, :meth:`closing`); it raises or warns where
    silence would lose work.

    Attributes:
      target: the ``state.step`` the run trains to, or ``None`` (not declared).
      by_run: declared by ``run``, which loops to it itself.
      unfinished: steps were taken since the final state was last saved (``finish``).
    """

    def __init__(self):
        self.target: int | None = None
        self.by_run = False
        self.unfinished = False
        self._warned = False

    def declare(self, num_steps: Any, *, by_run: bool = False) -> int:
        """Records the run's target (:func:`check_target`) and returns it."""
        self.target, self.by_run = check_target(num_steps), by_run
        return self.target

    def stepped(self) -> None:
        self.unfinished = True

    def finished(self, step: int) -> None:
        """The final state of ``step`` is saved: ``RuntimeError`` if short of the target."""
        self.unfinished = False
        if self.target is not None and not self.by_run and step < self.target:
            raise RuntimeError(ended_short(step, self.target))

    def after_rollback(self, step: int, restored: int) -> None:
        """The first rollback of a run with no target warns (:func:`moved_back`)."""
        if self.target is None and not self._warned:
            self._warned = True
            warn(moved_back(step, restored), stacklevel=4)  # < _process < ctl.step < the user

    def closing(self, how: str, step: int | None, saved: int | None, stacklevel: int = 2) -> None:
        """Warns once if the final state was not saved (:func:`unfinished`); ``run`` saves
        it on every way out, or raises. ``stacklevel`` counts from the line calling this, as
        :func:`~stabljax.control.errors.warn` does: 2 (the default) is the caller of
        ``ctl.close()`` or of ``__exit__``, the user's line."""
        if self.unfinished and not self.by_run:
            self.unfinished = False
            warn(unfinished(how, step, saved), stacklevel=stacklevel + 1)

    def forget(self) -> None:
        """An exception ends the loop: it is the news, not a missing ``finish``."""
        self.unfinished = False


def count_to(ctl: Any, target: int) -> Iterator[int]:
    """:meth:`RollbackController.steps`: ``ctl.current_step`` until it is ``target``.

    Each iteration must move the controller (a step, or a rollback), else ``RuntimeError``.
    """
    while ctl.current_step < target:
        at = (ctl.current_step, ctl.rollbacks)
        yield ctl.current_step
        if (ctl.current_step, ctl.rollbacks) == at:
            raise RuntimeError(not_called(ctl.current_step, target))
