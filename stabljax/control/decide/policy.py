"""The rollback controller's decisions, as pure functions of plain numbers.

No Orbax, no JAX, no I/O: which checkpoint a rollback restores, which data range it
skips, whether a save may happen now, and which configurations cannot work (which
checkpoints are kept is Orbax's, under :mod:`~stabljax.control.checkpoint.retention`). Each is
tested on its own, without a model (``tests/test_policy.py``).

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

import bisect
import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, get_args

Action = Literal["record", "warn", "rollback", "rollback_best", "raise"]
ACTIONS: tuple[str, ...] = get_args(Action)  # what the controller knows, defined once


def check_config(
    *,
    save_every: int,
    keep: int,
    rollback_margin: int,
    extra_skip: int = 0,
    max_rollbacks: int | None = 0,
    background_save: bool = False,
    processes: int = 1,
    fast_every: int | None = None,
) -> None:
    """Raises ``ValueError`` for a combination of arguments that cannot work.

    A rollback needs a kept checkpoint at least ``rollback_margin`` steps before the onset.
    The ``keep`` newest checkpoints span ``(keep - 1) * save_every`` steps back from the
    newest, which is less than ``save_every`` old; so with
    ``rollback_margin >= keep * save_every`` no kept checkpoint is ever old enough, and
    every rollback would silently go to the oldest one instead.

    Example:
      >>> from stabljax.control.decide.policy import check_config
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
        ("fast_every", fast_every, 1),
    ):
        if name in ("max_rollbacks", "fast_every") and value is None:
            continue  # unlimited; no fast tier
        # An int (Python's or NumPy's), never a bool, a float (100.0, nan, inf) or a string.
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            unlimited = {"max_rollbacks": " or None (unlimited)", "fast_every": " or None"}
            unlimited = unlimited.get(name, "")
            raise ValueError(f"{name} must be an int >= {low}{unlimited}, got {value!r}")
    if background_save and processes > 1:
        raise ValueError(
            f"background_save=True needs a single process, got {processes}: Orbax "
            "synchronises hosts with device collectives, which a background thread would "
            "issue in an order unrelated to the train step's own: set background_save=False"
        )
    if fast_every is not None and processes > 1:
        raise ValueError(
            f"fast_every={fast_every} needs a single process, got {processes}: the fast tier "
            "keeps one host's copy of the state, not each process's shards; set fast_every=None"
        )
    if rollback_margin and rollback_margin >= keep * save_every:
        # keep checkpoints span less than keep * save_every steps: raising keep or save_every
        # lengthens the span (lowering save_every would shorten it), or the margin comes down.
        raise ValueError(
            f"rollback_margin={rollback_margin} is more than save_every={save_every} x "
            f"keep={keep} checkpoints can hold (the oldest kept one is at most "
            f"{keep * save_every - 1} steps old), so every rollback would fall back to the "
            f"oldest checkpoint: raise keep to >= {rollback_margin // save_every + 1}, raise "
            f"save_every to >= {rollback_margin // keep + 1}, or lower rollback_margin to "
            f"<= {keep * save_every - 1}"
        )


def check_action(action: Any, detector: str) -> None:
    """Raises ``ValueError`` for a detection action the controller does not know."""
    if action not in ACTIONS:
        raise ValueError(
            f"detector {detector!r} returned a detection with action {action!r}; the "
            f"controller knows {ACTIONS}"
        )


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
      >>> from stabljax.control.decide.policy import restore_order
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
      >>> from stabljax.control.decide.policy import skip_range
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
      >>> from stabljax.control.decide.policy import save_blocker
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


# ---------------------------------------------------------------------------------- data ranges


def merge_ranges(ranges: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """Sorts half-open ``[a, b)`` ranges and merges overlapping or touching ones.

    Args:
      ranges: pairs ``(a, b)`` of ints with ``0 <= a``; empty ranges (``b <= a``) are
        dropped.

    Returns:
      Disjoint, sorted, non-touching ranges as tuples.

    Example:
      >>> from stabljax.control.decide.policy import merge_ranges
      >>> merge_ranges([(10, 20), (0, 3), (15, 30), (30, 31), (5, 5)])
      [(0, 3), (10, 31)]
    """
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges):
        if a < 0:
            raise ValueError(f"range start must be >= 0, got [{a}, {b})")
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def first_allowed(index: int, ranges: Sequence[tuple[int, int]]) -> int:
    """The smallest index ``>= index`` outside the merged ``ranges``."""
    k = bisect.bisect_right(ranges, (index, float("inf"))) - 1
    if k >= 0 and ranges[k][0] <= index < ranges[k][1]:
        return ranges[k][1]
    return index


# ---------------------------------------------------------------------------------------- ledger
# What the run did to its data: skipped ranges, rollbacks, the give-up message.


HISTORY = 10  # rollbacks kept in the ledger for the give-up message

ADVICE = (
    "What to try: lower the learning rate or lengthen the warmup; add a z-loss on the "
    "softmax normaliser (z_loss_weight=1e-4) if log Z drifts; raise Adam's eps or use "
    "safe_adamw / adamw_atan2 if the update ratio saturates; check the initialization "
    "(a smaller init std, scaled residual branches); inspect the skipped batches for bad "
    "data; raise max_rollbacks or extra_skip if the bad data stretch is long."
)


@dataclasses.dataclass
class Ledger:
    """What the run did to its data: skipped ranges, rollbacks and their history."""

    ranges: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    rollbacks: int = 0
    last_rollback: dict[str, Any] | None = None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_meta(self) -> dict[str, Any]:
        return {
            "skipped_ranges": [list(r) for r in self.ranges],
            "rollbacks": self.rollbacks,
            "last_rollback": self.last_rollback,
            "history": self.history,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Ledger:
        return cls(
            merge_ranges(tuple(r) for r in meta["skipped_ranges"]),
            int(meta["rollbacks"]),
            meta.get("last_rollback"),
            list(meta.get("history", [])),
        )

    def merge_record(self, record: Mapping[str, Any] | None) -> bool:
        """Adopts a rollback record newer than this ledger; True if it did."""
        if record is None or record["rollbacks"] <= self.rollbacks:
            return False
        self.ranges = merge_ranges(self.ranges + [tuple(r) for r in record["skipped_ranges"]])
        self.rollbacks = int(record["rollbacks"])
        self.last_rollback = record.get("last_rollback")
        self.history = list(record.get("history", []))
        return True

    def after_rollback(self, entry: dict[str, Any], skip: tuple[int, int]) -> Ledger:
        """The ledger once the rollback described by ``entry`` has skipped ``skip``."""
        return Ledger(
            merge_ranges(self.ranges + [skip]),
            self.rollbacks + 1,
            entry,
            (self.history + [entry])[-HISTORY:],
        )

    def record(self, *, target_step: int, data_index: int, time: float) -> dict[str, Any]:
        """The crash record of this ledger after a rollback to ``target_step``."""
        return {
            "rollbacks": self.rollbacks,
            "target_step": target_step,
            "data_index": data_index,
            "skipped_ranges": [list(r) for r in self.ranges],
            "last_rollback": self.last_rollback,
            "history": self.history,
            "time": time,
        }

    @property
    def skipped(self) -> int:
        return sum(b - a for a, b in self.ranges)


def losses_before(
    recent: Iterable[tuple[int, float, bool]], step: int, n: int = 12
) -> list[list[Any]]:
    """The last ``n`` ``[step, loss, skipped]`` up to ``step`` (non-finite as strings)."""
    out = [[s, loss, sk] for s, loss, sk in recent if s <= step]
    return [[s, loss if math.isfinite(loss) else str(loss), sk] for s, loss, sk in out[-n:]]


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else f"{v:.4g}"


def diverged_message(
    headline: str,
    step: int,
    reasons: Sequence[str],
    losses: Sequence[Sequence[Any]],
    ledger: Ledger,
) -> str:
    """The :class:`TrainingDiverged` message: what happened, the history, what to try."""
    lines = [
        headline,
        f"Now, at step {step}: " + "; ".join(reasons),
        "Losses before it (step: loss, * = update skipped by a guard): "
        + ", ".join(f"{s}: {_fmt(loss)}{'*' if sk else ''}" for s, loss, sk in losses),
    ]
    if ledger.history:
        lines.append("Rollbacks so far:")
        for i, h in enumerate(ledger.history, 1):
            before = ", ".join(f"{s}: {_fmt(v)}" for s, v, _ in h["losses"])
            lines.append(
                f"  {i}. at step {h['detected']} (onset {h['onset']}) -> step "
                f"{h['restored']}, skipped batches [{h['range'][0]}, {h['range'][1]}): "
                f"{h['reason']}; losses before: {before}"
            )
    lines.append(f"Skipped data ranges: {ledger.ranges} ({ledger.skipped} batches).")
    lines.append(ADVICE)
    return "\n".join(lines)


class Finding(Protocol):
    """What :func:`decide` reads of a detection
    (:class:`~stabljax.control.detect.detectors.Detection` has it)."""

    kind: str
    step: int
    onset: int
    action: str
    reason: str

    @property
    def rolls_back(self) -> bool: ...


class Decision(NamedTuple):
    """What one step's detections call for (:func:`decide`)."""

    action: str  # "rollback" or "give_up"
    detections: list[Finding]
    headline: str = ""


def decide(
    found: Sequence[Finding], ledger: Ledger, *, step: int, max_rollbacks: int | None
) -> Decision | None:
    """The one place a rollback is decided, from the detections of step ``step``.

    A detection whose action is ``"raise"`` gives up; otherwise detections that roll back
    (:attr:`~stabljax.control.detect.detectors.Detection.rolls_back`) roll back, unless
    ``max_rollbacks`` are spent (``None``: never), which gives up too. None: nothing to do.
    """
    if raising := [d for d in found if d.action == "raise"]:
        return Decision("give_up", raising, f"Training stopped at step {step}: a detector raised.")
    triggers = [d for d in found if d.rolls_back]
    if not triggers:
        return None
    if max_rollbacks is not None and ledger.rollbacks >= max_rollbacks:
        headline = (
            f"Training diverged: {ledger.rollbacks} rollback(s) (max_rollbacks="
            f"{max_rollbacks}) did not get past the trouble."
        )
        return Decision("give_up", triggers, headline)
    return Decision("rollback", triggers)


# ------------------------------------------------------------------------------------------- plan
# What a rollback does, decided before any of it is done.


@dataclasses.dataclass(frozen=True)
class RollbackSettings:
    """The controller's numbers a rollback plan reads.

    Attributes:
      margin: the target is at least this many steps before the onset.
      extra_skip: batches skipped beyond the last one fed.
      window: ``save_every * keep``, the span that makes rollbacks consecutive.
      narrow_skip: a ``data`` verdict with culprits starts the skip at the first culprit.
    """

    margin: int
    extra_skip: int
    window: int
    narrow_skip: bool = False


class Target(NamedTuple):
    """The checkpoint a rollback restored: its step and data index, and whether it is at
    least the margin before the onset (:func:`restore_order`)."""

    step: int
    data_index: int
    margin_met: bool


def onset_of(detections: Sequence[Finding], active_onsets: Iterable[int | None] = ()) -> int:
    """The earliest onset of ``detections`` and of any episode still open elsewhere."""
    return min([d.onset for d in detections] + [o for o in active_onsets if o is not None])


@dataclasses.dataclass(frozen=True)
class RollbackPlan:
    """Everything a rollback writes, decided up front (:func:`plan_rollback`).

    Attributes:
      target: the restored checkpoint's step.
      detected, onset: the detection step and the episode's onset.
      margin_met: the target is at least the margin before the onset.
      skip: the data range skipped.
      narrowed: triage narrowed the skip to start at the first culprit.
      resume_at: the data index training resumes from.
      ledger: the run ledger after the rollback (its ``last_rollback`` is the entry).
    """

    target: int
    detected: int
    onset: int
    margin_met: bool
    skip: Skip
    narrowed: bool
    resume_at: int
    ledger: Ledger

    @property
    def entry(self) -> dict[str, Any]:
        """The ledger entry of this rollback (history, record, the give-up message)."""
        return self.ledger.last_rollback or {}

    def record(self, time: float) -> dict[str, Any]:
        """The crash record (``stabljax-rollback.json``), written before any delete."""
        return self.ledger.record(target_step=self.target, data_index=self.resume_at, time=time)

    def with_remedy(self, applied: Mapping[str, Any], info: Mapping[str, Any]) -> RollbackPlan:
        """This plan with the remedy applied recorded in its entry (so a restart redoes it)."""
        entry = dict(self.entry, remedy=dict(applied), remedy_info=dict(info))
        ledger = dataclasses.replace(
            self.ledger, last_rollback=entry, history=self.ledger.history[:-1] + [entry]
        )
        return dataclasses.replace(self, ledger=ledger)

    def extended_to(self, end: int, screened: Mapping[str, Any]) -> RollbackPlan:
        """This plan with its skip extended to ``end``: screening ahead found that the bad
        window goes on there. ``screened`` (what was screened) goes into the entry.

        The example below extends :func:`plan_rollback`'s example plan from 37 to 50:
        ``Skip(start=20, end=50, length=30, doubled=False)``, resuming at 50, ranges
        ``[(20, 50)]`` (tests/test_screen.py).
        """
        entry, plan, end = dict(self.entry, **screened), self, int(end)
        ranges = self.ledger.ranges
        if end > self.skip.end:
            skip = Skip(self.skip.start, end, end - self.skip.start, self.skip.doubled)
            entry.update(range=[skip.start, skip.end], length=skip.length)
            ranges = merge_ranges(ranges + [(skip.start, skip.end)])
            plan = dataclasses.replace(self, skip=skip, resume_at=first_allowed(end, ranges))
        history = self.ledger.history[:-1] + [entry]
        ledger = dataclasses.replace(
            self.ledger, ranges=ranges, last_rollback=entry, history=history
        )
        return dataclasses.replace(plan, ledger=ledger)


def plan_rollback(
    detections: Sequence[Finding],
    ledger: Ledger,
    checkpoint: Target,
    fed_end: int,
    cfg: RollbackSettings,
    *,
    active_onsets: Iterable[int | None] = (),
    losses: Sequence[Sequence[Any]] = (),
    triage: Mapping[str, Any] | None = None,
) -> RollbackPlan:
    """The rollback for ``detections`` to the restored ``checkpoint``: skip, resume, record.

    The skip is :func:`skip_range` from the checkpoint's data index; with
    ``cfg.narrow_skip`` and a ``data`` verdict whose first culprit is past that index, it
    starts at the first culprit instead (the end is unchanged) and training resumes at the
    checkpoint's data index. Else training resumes at the skip's end (past any range
    skipped before).

    Args:
      detections: the detections that roll back.
      ledger: the run ledger before the rollback.
      checkpoint: the restored checkpoint.
      fed_end: one past the last data index fed before the rollback.
      cfg: the controller's numbers.
      active_onsets: onsets of episodes still open in other detectors.
      losses: the last ``[step, loss, skipped]`` before the detection, for the entry.
      triage: triage's report (``verdict``, ``culprits``), or None.

    Example:
      >>> from stabljax.control.detect.detectors import Detection
      >>> from stabljax.control.decide.policy import (
      ...     Ledger, RollbackSettings, Target, plan_rollback)
      >>> spike = Detection("spike", 36, 35, "rollback", "loss 9 > 5", 9.0)
      >>> plan = plan_rollback([spike], Ledger(), Target(20, 20, True), 37,
      ...                      RollbackSettings(margin=10, extra_skip=0, window=30))
      >>> plan.target, plan.skip, plan.resume_at, plan.ledger.ranges
      (20, Skip(start=20, end=37, length=17, doubled=False), 37, [(20, 37)])
      >>> plan.record(time=0.0)["data_index"]
      37
    """
    detected = max(d.step for d in detections)
    onset = onset_of(detections, active_onsets)
    start = int(checkpoint.data_index)
    skip = skip_range(
        start=start,
        fed_end=fed_end,
        extra_skip=cfg.extra_skip,
        detected=detected,
        last_rollback=ledger.last_rollback,
        window=cfg.window,
    )
    culprits = list(triage["culprits"]) if triage is not None else []
    narrowed = cfg.narrow_skip and triage is not None and triage["verdict"] == "data"
    narrowed = narrowed and bool(culprits) and min(culprits) > skip.start
    if narrowed:
        first = min(culprits)
        skip = Skip(first, skip.end, skip.end - first, skip.doubled)
    entry = {
        "detected": detected,
        "onset": onset,
        "restored": checkpoint.step,
        "range": [skip.start, skip.end],
        "length": skip.length,
        "doubled": skip.doubled,
        "reason": "; ".join(d.reason for d in detections),
        "losses": [list(x) for x in losses],
    }
    if triage is not None:
        entry["verdict"], entry["culprits"] = triage["verdict"], triage["culprits"]
    new = ledger.after_rollback(entry, (skip.start, skip.end))
    resume_at = first_allowed(start if narrowed else skip.end, new.ranges)
    margin_met = checkpoint.margin_met
    return RollbackPlan(
        checkpoint.step, detected, onset, margin_met, skip, narrowed, resume_at, new
    )
