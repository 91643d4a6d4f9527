"""Rollback and resume: the ledger, the crash-safe order of I/O, and the data position.

* :class:`Ledger`: the skipped ranges and rollbacks of a run, in every checkpoint's meta
  item and in the rollback record (``stabljax-rollback.json``), so they survive rollbacks
  and restarts.
* :func:`resume`: check the state and data config against the newest readable
  checkpoint, finish a rollback that a crash interrupted, restore the newest checkpoint
  that reads and verifies (setting aside the ones that do not), merge the record.
* :func:`roll_back`: choose the target (:func:`~stabljax.control.policy.restore_order`),
  restore it, compute the skip (:func:`~stabljax.control.policy.skip_range`), write the
  crash record, and only then delete the checkpoints newer than the target.
* :func:`place`: the one place the data position is set after a checkpoint is read.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from stabljax.control import policy
from stabljax.control import remedies as rm
from stabljax.control import store as ck
from stabljax.control import triage as tr
from stabljax.control.data import first_allowed, merge_ranges
from stabljax.control.detectors import Detection
from stabljax.control.errors import DataExhausted, TrainingDiverged

if TYPE_CHECKING:  # the monitor imports this module
    from stabljax.control.monitor import Monitor

# ------------------------------------------------------------------------------------------ ledger
# The run ledger: skipped ranges, rollbacks, the crash record, and the give-up message.


RECORD = "stabljax-rollback.json"
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


def read_record(directory: pathlib.Path) -> dict[str, Any] | None:
    """The rollback record in ``directory``, or ``None`` (missing or unreadable)."""
    try:
        record = json.loads((directory / RECORD).read_text())
        int(record["rollbacks"]), int(record["target_step"]), int(record["data_index"])
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


# ---------------------------------------------------------------------------------------- recovery
# The two procedures that bring a checkpoint back: resuming a run and rolling back.


@dataclasses.dataclass
class Restored:
    """A checkpoint brought back: its state and meta, the ledger and the data index."""

    state: Any
    meta: dict[str, Any]
    ledger: Ledger
    index: int
    step: int
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    saved: tuple[int, Any] | None = None  # resume: the data item read, for place()
    redo: dict[str, Any] | None = None  # resume: a rollback's remedy the state lacks


@dataclasses.dataclass(frozen=True)
class RollbackConfig:
    """The controller's settings a rollback reads.

    Attributes:
      margin: the target is at least this many steps before the onset.
      extra_skip: batches skipped beyond the last one fed.
      window: ``save_every * keep``, the span that makes rollbacks consecutive.
      max_rollbacks: rollbacks allowed; the next one gives up.
      triage: a :class:`~stabljax.control.triage.TriageConfig`, or None.
      step_fn: the train step triage replays.
      remedy: ``remedy(state, info) -> state`` applied to the restored state, or None.
    """

    margin: int
    extra_skip: int
    window: int
    max_rollbacks: int
    triage: Any = None
    step_fn: Callable[..., Any] | None = None
    remedy: Callable[..., Any] | None = None


class Decision(NamedTuple):
    """What one step's detections call for (:func:`decide`)."""

    action: str  # "rollback" or "give_up"
    detections: list[Detection]
    headline: str = ""


def decide(
    found: Sequence[Detection], ledger: Ledger, *, step: int, max_rollbacks: int
) -> Decision | None:
    """The one place a rollback is decided, from the detections of step ``step``.

    A detection whose action is ``"raise"`` gives up; otherwise detections that roll back
    (:attr:`~stabljax.control.detectors.Detection.rolls_back`) roll back, unless
    ``max_rollbacks`` are spent, which gives up too. None: nothing to do.
    """
    if raising := [d for d in found if d.action == "raise"]:
        return Decision("give_up", raising, f"Training stopped at step {step}: a detector raised.")
    triggers = [d for d in found if d.rolls_back]
    if not triggers:
        return None
    if ledger.rollbacks >= max_rollbacks:
        headline = (
            f"Training diverged: {ledger.rollbacks} rollback(s) (max_rollbacks="
            f"{max_rollbacks}) did not get past the trouble."
        )
        return Decision("give_up", triggers, headline)
    return Decision("rollback", triggers)


def resume(store: ck.CheckpointStore, saver: ck.Saver, data_config: Any) -> Restored:
    """Restores the newest valid checkpoint with its data item (for :func:`place`)."""
    directory, steps = store.directory, store.steps()
    record = read_record(directory)
    metas = (
        ck.try_everywhere(lambda s=s: store.read_meta(s), store.log, None) for s in steps[::-1]
    )
    newest = next(filter(None, metas), None)
    if newest is not None:
        ck.check_compatible(newest, saver.abstract, data_config, directory)
    pending = record is not None and record["target_step"] in steps
    pending = pending and (newest is None or newest["rollbacks"] < record["rollbacks"])
    if pending:
        store.delete_newer_than(record["target_step"])
        steps = [s for s in steps if s <= record["target_step"]]
    found = store.first_restorable(steps[::-1], lambda s: saver.restore(s, with_data=True))
    if found is None:
        raise RuntimeError(
            f"no checkpoint in {directory} could be restored (tried steps {list(steps)}; "
            "see events.jsonl). If the train state's structure changed, use a new directory."
        )
    step, (state, meta, saved) = found
    ledger = Ledger.from_meta(meta)
    index = int(meta["data_index"])
    merged = ledger.merge_record(record)
    if merged and step == record["target_step"]:
        index = max(index, int(record["data_index"]))
    reason = "resume" + (" (finished an interrupted rollback)" if pending else "")
    index = first_allowed(index, ledger.ranges)
    saved_at = (int(meta["data_index"]), saved)
    # The checkpoint predates the record's rollback, so it lacks that rollback's remedy.
    redo = ledger.last_rollback if merged and "remedy" in (ledger.last_rollback or {}) else None
    return Restored(state, meta, ledger, index, step, {"reason": reason}, saved_at, redo)


def give_up(
    triggers: Sequence[Detection],
    headline: str,
    monitor: Monitor,
    ledger: Ledger,
    store: ck.CheckpointStore,
) -> NoReturn:
    """Logs ``diverged``, waits for saves in flight and raises :class:`TrainingDiverged`."""
    step = triggers[0].step
    reasons = [d.reason for d in triggers]
    message = diverged_message(headline, step, reasons, monitor.losses_before(step), ledger)
    store.settle()  # a save in flight commits (and is logged) before the verdict
    store.log("diverged", max(d.step for d in triggers), message=message)
    raise TrainingDiverged(message, ledger.history)


def place(
    data: Any, index: int, state: Any, step: int, *, saved: tuple[int, Any] | None = None
) -> None:
    """Sets the data position to ``index``, back (a narrowed skip) or forward.

    The one place the data position is set after a checkpoint is read. ``saved``: the
    checkpoint's ``(data index, data state)`` read on resume, applied first (a Grain
    iterator, restored in place by Orbax, only takes the index). Running out is
    :class:`DataExhausted` (with ``state``).
    """
    if saved is not None:
        at, data_state = saved
        data.set_state(data_state) if data_state is not None else data._set_index(at)
    try:
        if index < data.index:
            data.rewind(index)
        else:
            data.seek(index)
    except StopIteration:
        err = DataExhausted(f"the data ran out moving to batch {index} at step {step}")
        err.state = state
        raise err from None


def roll_back(
    store: ck.CheckpointStore,
    saver: ck.Saver,
    monitor: Monitor,
    ledger: Ledger,
    data: Any,
    cfg: RollbackConfig,
    *,
    triggers: Sequence[Detection],
    fed_end: int,
) -> Restored:
    """Restores the rollback target for ``triggers`` and records the skip, crash-safely.

    The onset is the earliest of the triggers' and of any episode still open in another
    detector. ``rollback_best`` detections (all of them) go to the best checkpoint.

    With ``cfg.triage``, the window is replayed on copies after the restore and before
    the rollback record (:func:`stabljax.control.triage.for_rollback`), so a crash during
    it leaves nothing that resume reads; on a ``data`` verdict with culprits and
    ``narrow_skip``, the skip starts at the first culprit instead of the checkpoint's
    data position (the end is unchanged), and the data goes back to that position.

    Args:
      fed_end: one past the last data index fed before the rollback.
    """
    store.settle()
    saver.retain()
    detected = max(d.step for d in triggers)
    active = [o for o in monitor.active_onsets() if o is not None]
    onset = min([d.onset for d in triggers] + active)
    to_best = monitor.rolls_back_to_best and all(d.action == "rollback_best" for d in triggers)
    best = store.best(store.steps()) if to_best else None
    losses = monitor.losses_before(detected)
    order, margin_met = policy.restore_order(
        store.steps(), onset=onset, margin=cfg.margin, best=best, exclude=store.resume_only
    )

    def restore(step: int) -> tuple[Any, dict[str, Any]]:
        return saver.restore(step)[:2]

    found = store.first_restorable(order, restore)
    if found is None:
        raise RuntimeError(
            f"rollback at step {detected}: no checkpoint in {store.directory} could be "
            f"restored (tried {order})"
        )
    target, (state, meta) = found
    report = None
    if cfg.triage is not None:
        where = dict(target=target, state=state, meta=meta, onset=onset, ranges=ledger.ranges)
        report = tr.for_rollback(
            cfg.triage,
            step_fn=cfg.step_fn,
            data=data,
            steps=store.steps(),
            restore=restore,
            history=list(monitor.recent),
            **where,
        )
    skip = policy.skip_range(
        start=int(meta["data_index"]),
        fed_end=fed_end,
        extra_skip=cfg.extra_skip,
        detected=detected,
        last_rollback=ledger.last_rollback,
        window=cfg.window,
    )
    narrow = cfg.triage is not None and cfg.triage.narrow_skip
    narrowed = narrow and report is not None and report["verdict"] == "data"
    narrowed = narrowed and bool(report["culprits"]) and min(report["culprits"]) > skip.start
    if narrowed:
        first = min(report["culprits"])
        skip = policy.Skip(first, skip.end, skip.end - first, skip.doubled)
    entry = {
        "detected": detected,
        "onset": onset,
        "restored": target,
        "range": [skip.start, skip.end],
        "length": skip.length,
        "doubled": skip.doubled,
        "reason": "; ".join(d.reason for d in triggers),
        "losses": losses,
    }
    if report is not None:
        entry["verdict"], entry["culprits"] = report["verdict"], report["culprits"]
    applied = None
    if cfg.remedy is not None:
        # Before the record: a remedy that raises leaves nothing that resume would adopt.
        info = rm.RollbackInfo(
            step=target,
            onset=onset,
            rollbacks=ledger.rollbacks + 1,
            skip=(skip.start, skip.end),
            verdict=None if report is None else report["verdict"],
            kinds=tuple(d.kind for d in triggers),
            detected=detected,
        )
        state = cfg.remedy(state, info)
        applied = rm.describe(cfg.remedy, info)
        entry["remedy"], entry["remedy_info"] = applied, info.to_json()
    new = ledger.after_rollback(entry, (skip.start, skip.end))
    resume_at = first_allowed(int(meta["data_index"]) if narrowed else skip.end, new.ranges)
    if ck.is_primary():
        record = new.record(target_step=target, data_index=resume_at, time=time.time())
        ck.atomic_write_json(store.directory / RECORD, record)
    ck.barrier(f"rollback_record_{new.rollbacks}")
    store.delete_newer_than(target)  # only now: a crash before this is finished on restart
    store.log(
        "rollback",
        detected,
        onset=onset,
        restored_step=target,
        margin_met=margin_met,
        reason=entry["reason"],
        losses=losses,
        rollbacks=new.rollbacks,
    )
    store.log("skip", detected, range=entry["range"], length=skip.length, doubled=skip.doubled)
    if report is not None:
        store.log("triage", detected, narrowed=narrowed, **report)
    if applied is not None:
        log_remedy(store.log, entry, reapplied=False)
    return Restored(state, meta, new, resume_at, target)


def log_remedy(log: Callable[..., None], entry: Mapping[str, Any], *, reapplied: bool) -> None:
    """The ``remedy`` event of the rollback ledger ``entry``."""
    info = entry["remedy_info"]
    details = dict(entry["remedy"], restored_step=entry["restored"], rollbacks=info["rollbacks"])
    log("remedy", entry["detected"], **details, info=info, reapplied=reapplied)


def reapply_remedy(remedy: Callable[..., Any] | None, state: Any, entry: Mapping[str, Any]) -> Any:
    """Applies ``remedy`` again after a restart, as the rollback ``entry`` applied it."""
    if remedy is None:
        return state
    return remedy(state, rm.RollbackInfo.from_json(entry["remedy_info"]))
