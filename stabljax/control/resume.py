"""Resume: the rollback record, the newest valid checkpoint, and giving up.

* :func:`read_record`: the rollback record (``stabljax-rollback.json``), the crash-safe
  copy of the ledger (:class:`~stabljax.control.decide.policy.Ledger`) that a rollback writes
  before it deletes anything.
* :func:`resume`: check the state and data config against the newest readable
  checkpoint, finish a rollback that a crash interrupted, restore the newest checkpoint
  that reads and verifies (setting aside the ones that do not), merge the record, and say
  whether the record's remedy must be applied again (:func:`reapply_remedy`).
* :func:`give_up`: the ``diverged`` event and :class:`TrainingDiverged`.

A rollback itself is planned by :func:`~stabljax.control.decide.policy.plan_rollback` and carried
out by :meth:`~stabljax.control.controller.RollbackController._rollback`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from stabljax.control.checkpoint.integrity import check_compatible
from stabljax.control.checkpoint.jsonio import read_rollback_record
from stabljax.control.checkpoint.saver import Saver
from stabljax.control.checkpoint.store import RECORD, CheckpointStore, try_everywhere
from stabljax.control.decide.policy import Ledger, diverged_message, first_allowed
from stabljax.control.decide.remedies import RollbackInfo
from stabljax.control.detect.detectors import Detection
from stabljax.control.errors import TrainingDiverged

# ------------------------------------------------------------------------------------------ ledger
# The run ledger: skipped ranges, rollbacks, the crash record, and the give-up message.


def read_record(directory: pathlib.Path) -> dict[str, Any] | None:
    """The rollback record in ``directory``, or ``None`` if there is none.

    Raises:
      MalformedJSONError: the record is not what stabljax writes (it is renamed into place
        whole, so a bad one was edited); the message names the file and the field.
      UnsafePathError: the record is a symlink, a FIFO or a device.
    """
    return read_rollback_record(directory / RECORD)


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
    saved: dict[str, Any] | None = None  # resume: the data state read, for data.restore
    redo: dict[str, Any] | None = None  # resume: a rollback's remedy the state lacks


def resume(store: CheckpointStore, saver: Saver, data_config: Any) -> Restored:
    """Restores the newest valid checkpoint with its data state (for ``data.restore``)."""
    directory, steps = store.directory, store.steps()
    record = read_record(directory)
    metas = (try_everywhere(lambda s=s: store.read_meta(s), store.log, None) for s in steps[::-1])
    newest = next(filter(None, metas), None)
    if newest is not None:
        check_compatible(newest, saver.abstract, data_config, directory)
    # The target may have been a fast-tier copy (host memory, gone now): then the newest
    # checkpoint at or before it is restored, and the record's ledger taken over.
    pending = record is not None and any(s <= record["target_step"] for s in steps)
    pending = pending and (newest is None or newest["rollbacks"] < record["rollbacks"])
    if pending:
        store.delete_newer_than(record["target_step"])
        steps = [s for s in steps if s <= record["target_step"]]
    found = store.first_restorable(
        steps[::-1], saver.abstract, verify=saver.verify, data=saver.data
    )
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
    # The checkpoint predates the record's rollback, so it lacks that rollback's remedy.
    redo = ledger.last_rollback if merged and "remedy" in (ledger.last_rollback or {}) else None
    return Restored(state, meta, ledger, index, step, {"reason": reason}, saved, redo)


def give_up(
    triggers: Sequence[Detection],
    headline: str,
    losses: Sequence[Sequence[Any]],
    ledger: Ledger,
    store: CheckpointStore,
) -> NoReturn:
    """Logs ``diverged``, waits for saves in flight and raises :class:`TrainingDiverged`."""
    step = triggers[0].step
    reasons = [d.reason for d in triggers]
    message = diverged_message(headline, step, reasons, losses, ledger)
    store.settle()  # a save in flight commits (and is logged) before the verdict
    store.log("diverged", max(d.step for d in triggers), message=message)
    raise TrainingDiverged(message, ledger.history)


def reapply_remedy(remedy: Callable[..., Any] | None, state: Any, entry: Mapping[str, Any]) -> Any:
    """Applies ``remedy`` again after a restart, as the rollback ``entry`` applied it."""
    if remedy is None:
        return state
    return remedy(state, RollbackInfo.from_json(entry["remedy_info"]))
