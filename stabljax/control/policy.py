"""The rollback controller's decisions, as pure functions of plain numbers.

No Orbax, no JAX, no I/O: which checkpoints to keep, which one a rollback restores,
which data range it skips, whether a save may happen now, and which configurations
cannot work. Each is tested on its own, without a model (``tests/test_policy.py``).

The rules:

* **Target.** The newest checkpoint with ``step <= onset - rollback_margin``; if none is
  that old, the oldest kept one (``margin_met`` false). ``rollback_best`` detections go to
  the checkpoint with the lowest smoothed loss. Resume-only checkpoints (written on
  preemption, off the ``save_every`` grid) are never targets, so a preempted and resumed
  run rolls back exactly as an uninterrupted one.
* **Skip.** ``[target's data index, one past the last batch fed + extra_skip)``; a
  rollback within ``save_every * keep`` steps of the previous one's target skips at least
  twice the previous range, so a long bad stretch is passed in logarithmically many
  rollbacks.
* **Health.** No checkpoint while a detector's episode is open or right after a
  non-finite loss: the newest checkpoint is always one the detectors called healthy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, get_args

Action = Literal["record", "warn", "rollback", "rollback_best", "raise"]
ACTIONS: tuple[str, ...] = get_args(Action)  # what the controller knows, defined once


def check_config(
    *,
    save_every: int,
    keep: int,
    rollback_margin: int,
    extra_skip: int = 0,
    max_rollbacks: int = 0,
    background_save: bool = False,
    processes: int = 1,
) -> None:
    """Raises ``ValueError`` for a combination of arguments that cannot work.

    A rollback needs a kept checkpoint at least ``rollback_margin`` steps before the onset.
    The ``keep`` newest checkpoints span ``(keep - 1) * save_every`` steps back from the
    newest, which is less than ``save_every`` old; so with
    ``rollback_margin >= keep * save_every`` no kept checkpoint is ever old enough, and
    every rollback would silently go to the oldest one instead.

    Example:
      >>> from stabljax.control.policy import check_config
      >>> check_config(save_every=100, keep=3, rollback_margin=100)
      >>> check_config(save_every=10, keep=3, rollback_margin=100)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: rollback_margin=100 is more than save_every=10 x keep=3 checkpoints can hold ...
    """
    for name, value, low in (
        ("save_every", save_every, 1),
        ("keep", keep, 1),
        ("rollback_margin", rollback_margin, 0),
        ("extra_skip", extra_skip, 0),
        ("max_rollbacks", max_rollbacks, 0),
    ):
        if isinstance(value, bool) or int(value) != value or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if background_save and processes > 1:
        raise ValueError(
            f"background_save=True needs a single process, got {processes}: Orbax "
            "synchronises hosts with device collectives, which a background thread would "
            "issue in an order unrelated to the train step's own"
        )
    if rollback_margin and rollback_margin >= keep * save_every:
        need_keep = rollback_margin // save_every + 1
        raise ValueError(
            f"rollback_margin={rollback_margin} is more than save_every={save_every} x "
            f"keep={keep} checkpoints can hold (the oldest kept one is at most "
            f"{(keep - 1) * save_every + save_every - 1} steps old), so every rollback would "
            f"fall back to the oldest checkpoint: raise keep to >= {need_keep}, lower "
            f"save_every to <= {max(rollback_margin // keep, 1) if keep > 1 else 1}, or lower "
            f"rollback_margin below {keep * save_every}"
        )


def check_action(action: Any, detector: str) -> None:
    """Raises ``ValueError`` for a detection action the controller does not know."""
    if action not in ACTIONS:
        raise ValueError(
            f"detector {detector!r} returned a detection with action {action!r}; the "
            f"controller knows {ACTIONS}"
        )


def kept_steps(
    steps: Iterable[int], *, keep: int, best: int | None, resume_only: Iterable[int] = ()
) -> list[int]:
    """The checkpoints to keep: the ``keep`` newest regular ones, the best, and a
    resume-only one newer than every regular one (the point to resume from).

    Example:
      >>> from stabljax.control.policy import kept_steps
      >>> kept_steps([0, 10, 20, 30, 37], keep=2, best=0, resume_only=[37])
      [0, 20, 30, 37]
      >>> kept_steps([0, 10, 20, 25, 30], keep=2, best=None, resume_only=[25])
      [20, 30]
    """
    steps = sorted(steps)
    special = set(resume_only)
    regular = [s for s in steps if s not in special]
    out = set(regular[-keep:])
    newest = max(regular, default=-1)
    out.update(s for s in steps if s in special and s > newest)
    if best is not None and best in steps:
        out.add(best)
    return sorted(out)


def best_step(steps: Iterable[int], scores: Mapping[int, float]) -> int | None:
    """The step with the lowest score among ``steps`` (``None`` if none is scored)."""
    scored = [(scores[s], s) for s in steps if s in scores]
    return min(scored)[1] if scored else None


def restore_order(
    steps: Iterable[int],
    *,
    onset: int,
    margin: int,
    best: int | None = None,
    exclude: Iterable[int] = (),
) -> tuple[list[int], bool]:
    """The checkpoints to try for a rollback, best first, and whether the margin is met.

    Example:
      >>> from stabljax.control.policy import restore_order
      >>> restore_order([0, 10, 20, 30], onset=35, margin=10)
      ([20, 10, 0, 30], True)
      >>> restore_order([20, 30], onset=35, margin=100)
      ([20, 30], False)
      >>> restore_order([0, 10, 20, 30], onset=35, margin=10, best=10)
      ([10, 0], True)
    """
    skip = set(exclude)
    newest_first = sorted((s for s in steps if s not in skip), reverse=True)
    if best is not None and best in newest_first:
        return [best] + [s for s in newest_first if s < best], True
    eligible = [s for s in newest_first if s <= onset - margin]
    rest = sorted(s for s in newest_first if s not in eligible)
    return eligible + rest, bool(eligible)


@dataclasses.dataclass(frozen=True)
class Skip:
    """A rollback's data skip: ``[start, end)``, its length, whether it was doubled."""

    start: int
    end: int
    length: int
    doubled: bool


def skip_range(
    *,
    start: int,
    fed_end: int,
    extra_skip: int,
    detected: int,
    last_rollback: Mapping[str, Any] | None,
    window: int,
) -> Skip:
    """The range a rollback skips.

    Args:
      start: the data index of the restored checkpoint.
      fed_end: one past the last batch index fed before the rollback.
      extra_skip: batches skipped beyond it.
      detected: the step of the detection.
      last_rollback: the previous rollback's entry (``restored`` step and ``length``).
      window: ``save_every * keep``: a rollback detected within this many steps of the
        previous one's target is consecutive and skips at least twice as much.

    Example:
      >>> from stabljax.control.policy import skip_range
      >>> skip_range(start=20, fed_end=37, extra_skip=0, detected=36, last_rollback=None,
      ...            window=30)
      Skip(start=20, end=37, length=17, doubled=False)
      >>> skip_range(start=20, fed_end=25, extra_skip=0, detected=40,
      ...            last_rollback={"restored": 20, "length": 17}, window=30)
      Skip(start=20, end=54, length=34, doubled=True)
    """
    length = fed_end + extra_skip - start
    consecutive = last_rollback is not None and (
        detected - int(last_rollback["restored"]) <= window
    )
    if consecutive:
        length = max(length, 2 * int(last_rollback["length"]))
    return Skip(start, start + length, length, bool(consecutive))


def save_blocker(active_onsets: Sequence[int | None], last_loss: float | None) -> str | None:
    """Why a checkpoint must not be saved now, or ``None`` when it may.

    Example:
      >>> from stabljax.control.policy import save_blocker
      >>> save_blocker([None, None], 1.5) is None
      True
      >>> save_blocker([None, 42], 9.0)
      'an episode is open (onset 42)'
      >>> save_blocker([None], float("nan"))
      'the last loss was not finite (nan)'
    """
    onsets = [o for o in active_onsets if o is not None]
    if onsets:
        return f"an episode is open (onset {min(onsets)})"
    if last_loss is not None and not math.isfinite(last_loss):
        return f"the last loss was not finite ({last_loss})"
    return None
