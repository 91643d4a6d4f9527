"""Which checkpoints are kept: an Orbax preservation policy built from Orbax's own.

The store's ``CheckpointManager`` is given :class:`Retention` as its
``CheckpointManagerOptions(preservation_policy=...)``; Orbax asks it at every save (the new
step included) and deletes what it does not preserve once that save has committed, in the
save's finalisation. :meth:`~stabljax.control.checkpoint.store.CheckpointStore.retain` asks the same
policy between saves (on resume, before a rollback, on close).

:class:`Retention` is an ``AnyPreservationPolicy`` of four rules:

* ``LatestN(keep)`` over the regular checkpoints: the ``keep`` newest on the ``save_every``
  grid. Resume-only checkpoints (written on preemption, off the grid) do not count, so one
  never displaces a rollback target;
* the resume point: a resume-only checkpoint newer than every regular one;
* ``BestN(n=1)`` on the smoothed loss, when a detector rolls back to the best checkpoint
  (``rollback_best``); ties go to the older step, as the rollback's own choice
  (:func:`~stabljax.control.decide.policy.best_step`) does;
* every folder that is not a checkpoint of the run (a user's folder named like a step) is
  preserved: Orbax lists it, nothing here ever deletes it.

The scores are the store's (the meta item carries them, digest-checked, and a rollback or a
resume brings back the restored checkpoint's), not Orbax's ``metrics`` item, which Orbax
writes only with a ``best_fn`` and which would not come back with a rollback.

Example:
  >>> import datetime
  >>> from stabljax.control.checkpoint.retention import Retention
  >>> class Run:  # what the store says about its checkpoints
  ...     keep, keeps_best, scores, resume_only = 2, True, {0: 0.5, 10: 2.0, 20: 1.0}, {37}
  ...     def holds(self, step):
  ...         return step != 25  # 25: someone's folder named like a step
  >>> Retention(Run()).kept([0, 10, 20, 25, 30, 37])
  [0, 20, 30, 37]
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from orbax.checkpoint import checkpoint_managers as cm

SCORE = "smoothed_loss"  # the metric BestN ranks by


class Checkpoints(Protocol):
    """What the policy reads of the store
    (:class:`~stabljax.control.checkpoint.store.CheckpointStore` has it), at every evaluation."""

    keep: int
    keeps_best: bool
    scores: Mapping[int, float]
    resume_only: Collection[int]

    def holds(self, step: int) -> bool: ...


class Info(NamedTuple):
    """A checkpoint as Orbax's policies read it (``PolicyCheckpointInfo``)."""

    step: int
    metrics: dict[str, Any] | None
    time: datetime.datetime


def _among(
    checkpoints: Sequence[Any], chosen: Sequence[Any], policy: Any, context: Any
) -> list[bool]:
    """``policy``'s decisions on ``chosen`` (a subsequence of ``checkpoints``); the rest
    are not preserved by it."""
    flags = policy.should_preserve(chosen, context=context)
    keep = {c.step for c, k in zip(chosen, flags, strict=True) if k}
    return [c.step in keep for c in checkpoints]


@dataclasses.dataclass
class Regular:
    """``LatestN(keep)`` over the run's checkpoints that are not resume-only."""

    store: Checkpoints

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        s = self.store
        regular = [c for c in checkpoints if s.holds(c.step) and c.step not in s.resume_only]
        return _among(checkpoints, regular, cm.LatestN(n=s.keep), context)


@dataclasses.dataclass
class ResumePoint:
    """A resume-only checkpoint newer than every regular one: where a restart resumes."""

    store: Checkpoints

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        s = self.store
        ours = {c.step for c in checkpoints if s.holds(c.step)}
        newest = max((t for t in ours if t not in s.resume_only), default=-1)
        return [
            c.step in s.resume_only and c.step > newest and s.holds(c.step) for c in checkpoints
        ]


def _score_then_step(metrics: Mapping[str, Any]) -> tuple[float, int]:
    return metrics[SCORE], metrics["step"]


@dataclasses.dataclass
class Best:
    """``BestN(n=1)`` on the smoothed loss of the scored checkpoints, when the run rolls
    back to its best checkpoint; unscored ones are not preserved by it."""

    store: Checkpoints

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        s = self.store
        if not s.keeps_best:
            return [False] * len(checkpoints)
        scored = [
            Info(c.step, {SCORE: s.scores[c.step], "step": c.step}, c.time)
            for c in checkpoints
            if c.step in s.scores and s.holds(c.step)
        ]
        # Sorted from the worst (highest) to the best; BestN keeps the last.
        best = cm.BestN(
            get_metric_fn=_score_then_step,
            reverse=True,
            n=1,
            keep_checkpoints_without_metrics=False,
        )
        return _among(checkpoints, scored, best, context)


@dataclasses.dataclass
class NotOurs:
    """Preserves every folder Orbax lists that is not a checkpoint of the run."""

    store: Checkpoints

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        return [not self.store.holds(c.step) for c in checkpoints]


class Retention(cm.AnyPreservationPolicy):
    """The run's retention, for ``CheckpointManagerOptions(preservation_policy=...)``.

    Args:
      store: the checkpoints' bookkeeping (:class:`Checkpoints`), read at every decision,
        so a rollback's or a resume's scores and marks take effect at once.
    """

    def __init__(self, store: Checkpoints):
        super().__init__(policies=[Regular(store), ResumePoint(store), Best(store), NotOurs(store)])
        self.store = store

    def kept(self, steps: Iterable[int]) -> list[int]:
        """The run's checkpoints among ``steps`` that the policy preserves, sorted."""
        steps = sorted(steps)
        infos = [Info(s, None, datetime.datetime.min) for s in steps]
        flags = self.should_preserve(infos, context=cm.PreservationContext())
        return [s for s, k in zip(steps, flags, strict=True) if k and self.store.holds(s)]
