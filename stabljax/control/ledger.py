"""The run ledger: skipped ranges, rollbacks, the crash record, and the give-up message.

The ledger survives rollbacks and restarts: every checkpoint's meta item holds it, and
before a rollback deletes the checkpoints newer than its target it writes the new ledger
to a small record (``stabljax-rollback.json``, JSON, atomic rename), so a crash between
the two is finished on restart (:meth:`Ledger.merge_record`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stabljax.control.data import merge_ranges

RECORD = "stabljax-rollback.json"
HISTORY = 10  # rollbacks kept in the ledger for the give-up message

ADVICE = (
    "What to try: lower the learning rate or lengthen the warmup; add a z-loss on the "
    "softmax normaliser (z_loss_weight=1e-4) if log Z drifts; raise Adam's eps or use "
    "safe_adamw / adamw_atan2 if the update ratio saturates; check the initialization "
    "(a smaller init std, scaled residual branches); inspect the skipped batches for bad "
    "data; raise max_rollbacks or extra_skip if the bad data stretch is long."
)


class TrainingDiverged(RuntimeError):
    """Raised when training keeps failing after ``max_rollbacks`` rollbacks, or when a
    detection's action is ``"raise"``.

    The message lists what was seen (the losses around each event, the ranges skipped)
    and what to try. ``history`` holds the rollback records as dicts.
    """

    def __init__(self, message: str, history: Sequence[Mapping[str, Any]] = ()):
        super().__init__(message)
        self.history = [dict(h) for h in history]


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
