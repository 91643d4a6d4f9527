"""The rollback controller: PaLM's remedy for loss spikes, made automatic.

:class:`RollbackController` orchestrates four parts: :mod:`~stabljax.control.checkpoints`
(Orbax I/O, retention, fingerprints), :mod:`~stabljax.control.policy` (pure decisions:
target, skip range, retention, save health, config checks), :mod:`~stabljax.control.ledger`
(skipped ranges, rollbacks, the crash record, :class:`TrainingDiverged`) and
:mod:`~stabljax.control.lifecycle` (directory lock, preemption, :class:`RunResult`).
Its own job is the order of things (see ``/work/shared/REFERENCES.md``, "Rollback
controller"): the loss of step ``s`` is the one computed on the batch fed when
``state.step == s``; :meth:`~RollbackController.step` reads the previous step's metrics
(one step of lag, so the device never idles) and, on a save step, this step's too, so a
checkpoint's detector state is the one after its losses. Every process calls every method
in the same order; only process 0 writes ``events.jsonl`` and the rollback record.

References:
  Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
  <https://arxiv.org/abs/2204.02311>`_, 2022 (section 5.1, "Training instability").
"""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import pathlib
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from stabljax.control import checkpoints as ck
from stabljax.control import policy
from stabljax.control.data import (
    DataIterator,
    GrainDatasetIterator,
    GrainLoaderIterator,
    as_data_iterator,
    first_allowed,
)
from stabljax.control.detect import Detection, Detector, default_detectors
from stabljax.control.events import Event, EventLog
from stabljax.control.ledger import (
    RECORD,
    Ledger,
    TrainingDiverged,
    diverged_message,
    losses_before,
    read_record,
)
from stabljax.control.lifecycle import (
    DataExhausted,
    DirectoryLock,
    Preempted,
    PreemptionWatch,
    Progress,
    RunResult,
    warn,
)

_EMA_DECAY = 0.98


def _append(events: EventLog, kind: str, step: int, **details: Any) -> None:
    events.append(Event(kind, step, details=details))


class RollbackController:
    """Checkpoints training, detects spikes and divergence, and rolls back past bad data.

    Typical use is :meth:`run` in a ``with`` block; :meth:`restore_or_init`, :meth:`step`
    and :meth:`finish` are its parts for a hand-written loop. Each rollback restores train
    state, data position and detector state together; ``skipped_ranges`` and the rollback
    count survive rollbacks and restarts, and the data indices the final state was trained
    on are exactly ``range(data.index)`` minus ``skipped_ranges``, in order. See
    ``README.md`` ("Rollback and data skipping") for the operator's view: one job per
    directory (a lock), preemption, disk space (``keep + 1`` checkpoints), end of data,
    and what a resume checks.

    Args:
      directory: checkpoints, ``events.jsonl``, the rollback record and the lock file;
        created with its parents if missing. A file in the way, a read-only or otherwise
        unwritable path is an ``OSError`` here; a directory another controller holds is a
        ``RuntimeError``.
      save_every: checkpoint every this many steps (``state.step % save_every == 0``),
        deferred while an episode is open or right after a non-finite loss
        (``save_deferred`` event).
      keep: checkpoints kept (the newest; plus the lowest smoothed loss when a detector
        may roll back to it). Needs disk room for ``keep + 1``: the oldest is deleted
        once the next one has committed.
      rollback_margin: the target is at least this many steps before the episode's
        onset; ``rollback_margin >= save_every * keep`` cannot work (``ValueError``).
      extra_skip: batches skipped beyond the last one fed before the rollback.
      detectors: :class:`~stabljax.control.detect.Detector` list; default
        :func:`~stabljax.control.detect.default_detectors`. A detection with action
        ``"raise"`` raises :class:`TrainingDiverged`; an unknown action is a ``ValueError``.
      max_rollbacks: rollbacks allowed in the run; the next one raises
        :class:`TrainingDiverged`.
      async_save: let Orbax write in the background (the device-to-host copy still
        happens in :meth:`step`, so the train step may donate the state).
      background_save: one process only: a save step dispatches an on-device copy of
        the state, and a worker thread copies and writes it (one more copy of the state in
        device memory meanwhile); its error is raised by the next call that waits for it.
      verify: fingerprint the state and digest the meta item; check both on restore.
      preemption_signals: signals that mean "save at the next step boundary and stop"
        (default SIGTERM; add ``signal.SIGINT`` for Ctrl-C; ``()`` for none). On several
        processes JAX's preemption sync point decides. The previous handlers come back on
        :meth:`close`.
      data_config: JSON-able description of the data (batch size, sequence length,
        corpus); default the data iterator's ``config``. Recorded; a resume with another
        one is a :class:`~stabljax.control.checkpoints.CheckpointMismatch`.

    Attributes:
      directory: the checkpoint directory (absolute).
      events: the :class:`~stabljax.control.events.EventLog` of this run.
      detectors: the detectors, fed once per step in order.

    Example:
      >>> import tempfile
      >>> import jax, jax.numpy as jnp, optax, flax.struct
      >>> from stabljax.control import IndexedBatches, RollbackController, SpikeDetector
      >>> @flax.struct.dataclass
      ... class State:
      ...     step: jax.Array
      ...     w: jax.Array
      >>> @jax.jit
      ... def train_step(state, x):
      ...     loss, g = jax.value_and_grad(lambda w: jnp.mean((x * w - 2 * x) ** 2))(state.w)
      ...     return State(state.step + 1, state.w - 0.1 * g), {"loss": loss}
      >>> def batch_fn(i):  # batch 30 is poisoned: its update throws w off, loss 31 spikes
      ...     return jnp.full((4,), 1e3 if i == 30 else 1.0 + 0.1 * (i % 3))
      >>> with RollbackController(
      ...     tempfile.mkdtemp(), save_every=10, rollback_margin=5,
      ...     detectors=[SpikeDetector(warmup=5)], async_save=False) as ctl:
      ...     state, data = ctl.run(train_step, State(jnp.int32(0), jnp.float32(0.0)),
      ...                           IndexedBatches(batch_fn), 50, progress=False)
      >>> print(int(state.step), data.index, ctl.skipped_ranges, ctl.rollbacks)
      50 63 [(20, 33)] 1
      >>> print(round(float(state.w), 4), ctl.last_run.reached)
      2.0 True
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int = 100,
        keep: int = 3,
        rollback_margin: int = 100,
        extra_skip: int = 0,
        detectors: Sequence[Detector] | None = None,
        max_rollbacks: int = 10,
        async_save: bool = True,
        background_save: bool = False,
        verify: bool = True,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        data_config: Any = None,
    ):
        for name, value, low in (
            ("save_every", save_every, 1),
            ("keep", keep, 1),
            ("rollback_margin", rollback_margin, 0),
            ("extra_skip", extra_skip, 0),
            ("max_rollbacks", max_rollbacks, 0),
        ):
            if isinstance(value, bool) or int(value) != value or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        policy.check_config(save_every=save_every, keep=keep, rollback_margin=rollback_margin)
        self.save_every, self.keep = int(save_every), int(keep)
        self.rollback_margin, self.extra_skip = int(rollback_margin), int(extra_skip)
        self.max_rollbacks = int(max_rollbacks)
        self.async_save, self.background_save = bool(async_save), bool(background_save)
        if self.background_save and jax.process_count() > 1:
            raise ValueError(
                f"background_save=True needs a single process, got {jax.process_count()}: "
                "Orbax synchronises hosts with device collectives, which a background "
                "thread would issue in an order unrelated to the train step's own"
            )
        self.verify = bool(verify)
        self.detectors = list(detectors) if detectors is not None else default_detectors()
        names = [getattr(d, "name", None) for d in self.detectors]
        for d in self.detectors:
            if not all(hasattr(d, a) for a in ("name", "update", "get_state", "set_state")):
                raise TypeError(f"detectors: {d!r} lacks the Detector interface")
        if len(set(names)) != len(names):
            raise ValueError(f"detector names must be unique, got {names}")
        self.data_config = None if data_config is None else json.loads(json.dumps(data_config))
        # Only the metrics some detector reads are fetched (each fetch is a host transfer).
        wanted = [getattr(d, "keys", None) for d in self.detectors]
        self._keys = None if any(k is None for k in wanted) else frozenset({"loss"}.union(*wanted))
        self._protect_best = any(
            getattr(d, "action", "") == "rollback_best" for d in self.detectors
        )
        self._watch = PreemptionWatch(preemption_signals)
        self.directory = pathlib.Path(directory).absolute()
        ck.check_directory(self.directory)
        self.events = EventLog(self.directory / "events.jsonl", write=ck.is_primary())
        self._lock, self._store = DirectoryLock(self.directory), None
        self._open()
        self._data: DataIterator | None = None
        self._abstract: Any = None
        self._step: int | None = None
        self._pending: tuple[int, Mapping[str, Any]] | None = None
        self._recent: collections.deque = collections.deque(maxlen=64)
        self._ledger = Ledger()  # survives rollbacks
        self._ema = [0.0, 0]  # trajectory state: comes back with a checkpoint
        self._saved_at: int | None = None
        self._deferred: int | None = None  # the save step waiting for a healthy state
        self._last_loss: float | None = None
        self.last_run: RunResult | None = None

    def _open(self) -> None:
        self._lock.acquire()
        try:
            log = functools.partial(_append, self.events)  # no reference back to self
            self._store = ck.CheckpointStore(
                self.directory, async_save=self.async_save, log=log, keep=self.keep
            )
        except BaseException:
            self._lock.release()
            raise
        self._closed = False
        self._poll = not self.background_save and jax.process_count() == 1

    # ----------------------------------------------------------------------- properties

    @property
    def skipped_ranges(self) -> list[tuple[int, int]]:
        """Half-open data-index ranges ``[a, b)`` that are never fed again."""
        return list(self._ledger.ranges)

    @property
    def rollbacks(self) -> int:
        """Rollbacks in this run (restarts included)."""
        return self._ledger.rollbacks

    @property
    def current_step(self) -> int | None:
        """The host copy of ``state.step`` (``None`` before :meth:`restore_or_init`)."""
        return self._step

    @property
    def data(self) -> DataIterator | None:
        """The data iterator returned by :meth:`restore_or_init`."""
        return self._data

    @property
    def smoothed_loss(self) -> float | None:
        """A bias-corrected EMA (decay 0.98) of the finite losses seen."""
        m, n = self._ema
        return m / (1 - _EMA_DECAY**n) if n else None

    @property
    def _manager(self) -> ocp.CheckpointManager:
        return self._store.manager

    def checkpoint_steps(self) -> list[int]:
        """The steps of the checkpoints on disk (waits for a save in flight)."""
        self._store.settle()
        self._store.manager.reload()
        return self._store.steps()

    # -------------------------------------------------------------------- public methods

    def restore_or_init(self, state: Any, data: Any) -> tuple[Any, DataIterator]:
        """Resumes from the newest valid checkpoint, or saves ``state`` as the first one.

        Restores train state (against ``state``'s shapes, dtypes and shardings), data
        position, ledger and detector state. A checkpoint that fails to read or verify is
        a ``corrupt_checkpoint`` event, set aside under ``stabljax-corrupt/``, and the
        previous one is used; a rollback record newer than the newest checkpoint (a crash
        mid-rollback) is finished first. A state with other leaves, dtypes or shapes, or
        another data config, than the checkpoints' is a
        :class:`~stabljax.control.checkpoints.CheckpointMismatch` listing the differences.

        Returns:
          ``(state, data)``: the restored state (``state`` itself on an empty directory)
          and the data as a :class:`~stabljax.control.data.DataIterator` at the next
          batch to feed. Use this iterator from now on.
        """
        if not hasattr(state, "step"):
            raise TypeError(
                f"state must have a 'step' field (int32 scalar), got {type(state).__name__}"
            )
        if self._closed:
            self._open()
        self._data = as_data_iterator(data)
        self._abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        self._store.state_bytes = ck.state_bytes(self._abstract)
        self._pending, self._deferred, self._last_loss = None, None, None
        self._recent.clear()
        self._store.settle()
        self._store.clean_leftovers(RECORD)
        self._watch.install()
        steps = self._store.steps()
        if not steps:
            self._step = int(ck.to_host(state.step))
            self._data.skipped_ranges = self._ledger.ranges
            self._save(state, sync=True)
            return state, self._data
        record = read_record(self.directory)
        newest = next(filter(None, (self._try(lambda s=s: self._store.read_meta(s)) for s in steps[::-1])), None)  # fmt: skip
        if newest is not None:
            self._check_compatible(newest)
        pending = (
            record is not None
            and record["target_step"] in steps
            and (newest is None or newest["rollbacks"] < record["rollbacks"])
        )
        if pending:
            self._delete_newer_than(record["target_step"])
            steps = [s for s in steps if s <= record["target_step"]]
        failed: list[int] = []
        for s in reversed(steps):
            restored = self._try(lambda s=s: self._restore(s, with_data=True), step=s)
            if restored is not None:
                break
            failed.append(s)
        else:
            raise RuntimeError(
                f"no checkpoint in {self.directory} could be restored (tried steps "
                f"{sorted(failed)}; see events.jsonl). If the train state's structure "
                "changed, use a new directory."
            )
        new_state, meta = restored
        for s in failed:
            self._store.set_aside(s)
        self._apply_meta(meta, trajectory=True)
        self._ledger = Ledger.from_meta(meta)
        index = int(meta["data_index"])
        if self._ledger.merge_record(record) and int(meta["step"]) == record["target_step"]:
            index = max(index, int(record["data_index"]))
        self._data.skipped_ranges = self._ledger.ranges
        self._seek(first_allowed(index, self._ledger.ranges), self._step, new_state)
        self._retain()
        self._saved_at = self._step
        self._log(
            "restore",
            self._step,
            data_index=self._data.index,
            reason="resume" + (" (finished an interrupted rollback)" if pending else ""),
            skipped_ranges=self._ledger.ranges,
            rollbacks=self._ledger.rollbacks,
        )
        return new_state, self._data

    def step(self, state: Any, metrics: Mapping[str, Any], data: Any) -> tuple[Any, Any]:
        """Records one training step; saves, or rolls back, or stops, when it is time.

        Call it once per train-step call, right after dispatching it, with the state and
        device metrics it returned. It reads the previous call's metrics (ready by now) and
        only stashes these, except on a save step, where it reads these too.

        Returns:
          ``(state, data)``: after a rollback the restored state and the data past the
          skipped range; otherwise the inputs.

        Raises:
          TrainingDiverged: a rollback is needed after ``max_rollbacks``, or a detection
            asked to raise.
          Preempted: a preemption signal arrived; this step's state was saved.
          DataExhausted: a rollback's skip ran past the end of the data.
          ValueError: ``state.step`` does not match the steps counted (save steps).
        """
        if self._step is None or self._data is None or self._closed:
            raise RuntimeError("call restore_or_init(state, data) before step() (or after close)")
        if not isinstance(metrics, Mapping) or "loss" not in metrics:
            keys = sorted(metrics) if isinstance(metrics, Mapping) else type(metrics).__name__
            raise ValueError(
                f"metrics must be a dict with a scalar 'loss' entry (the train step's loss); "
                f"got {keys}"
            )
        data = self._resolve(data)
        self._step += 1
        previous, self._pending = self._pending, (self._step - 1, metrics)
        if previous is not None and (restored := self._process(*previous)) is not None:
            return restored, data
        if self._poll:
            self._store.poll()
        due = self._step % self.save_every == 0
        if self._watch.should_stop(agree=due):
            state = self._flush_and_save(state, sync=True, resume_only=not due)
            saved = self._saved_at == self._step
            self._log("preempted", self._step, signal=self._watch.signum, saved=saved)
            raise Preempted(self._step, self._watch.signum, saved, state)
        if due or self._deferred is not None:
            state = self._flush_and_save(state)
        return state, data

    def finish(self, state: Any, data: Any) -> tuple[Any, Any]:
        """Reads the last pending metrics and saves the final state (waits for it).

        Returns:
          ``(state, data)``; after a rollback on the last metrics, the restored state.
        """
        data = self._resolve(data)
        return self._flush_and_save(state, sync=True), data

    def run(
        self,
        train_step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
        state: Any,
        data: Any,
        num_steps: int,
        *,
        progress: bool = True,
    ) -> tuple[Any, DataIterator]:
        """Trains until ``state.step == num_steps``, then closes the controller.

        ``num_steps`` is a target, not a count: the same command, restarted, resumes from
        the newest checkpoint and ends where an uninterrupted run does. It calls
        :meth:`restore_or_init` first unless that was done (a closed controller reopens
        and resumes from its directory). On every way out, saves in flight are finished
        and :meth:`close` is called. Three outcomes return, told apart by
        ``ctl.last_run`` (a :class:`~stabljax.control.lifecycle.RunResult`): the target
        reached; preempted (a signal in ``preemption_signals``: the state was saved at the
        next step boundary, a restart resumes exactly); the data exhausted (a
        ``data_exhausted`` event and a ``RuntimeWarning``). Anything else raises.

        Returns:
          ``(state, data)``: at ``num_steps``, saved, unless ``last_run`` says otherwise.
        """
        if self._closed or self._step is None or self._data is None:
            state, data = self.restore_or_init(state, data)
        data, target = self._resolve(data), int(num_steps)
        bar = Progress(target, self._step) if progress else None
        preempted = exhausted = False
        try:
            while self._step < target and not exhausted:
                try:
                    batch = next(data)
                except StopIteration:
                    exhausted = True
                    state, data = self.finish(state, data)
                    continue
                state, metrics = train_step(state, batch)
                state, data = self.step(state, metrics, data)
                if bar is not None:
                    bar.update(self._step, self._postfix())
                if self._step >= target:
                    state, data = self.finish(state, data)
        except Preempted as e:
            state, preempted = e.state, True
        except DataExhausted as e:
            state, exhausted = e.state, True
        except BaseException:
            self._close(quiet=True)
            raise
        finally:
            if bar is not None:
                bar.update(self._step, self._postfix())
                bar.close()
        if exhausted:
            self._log("data_exhausted", self._step, data_index=data.index, target=target)
            warn(f"the data ran out at step {self._step} (index {data.index}) of {target}")
        self.close()
        self.last_run = RunResult(self._step, target, self._step == target, preempted, exhausted)
        return state, data

    def close(self) -> None:
        """Finishes saves and deletions in flight, drops surplus checkpoints, closes Orbax,
        restores the signal handlers and releases the directory. Idempotent.

        Raises the error of a failed save (after closing everything).
        """
        self._close(quiet=False)

    def _close(self, *, quiet: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._store.settle()
            self._retain()
        except Exception:
            if not quiet:
                raise
        finally:
            try:
                self._store.close()
            finally:
                self._watch.restore()
                self._lock.release()

    def __enter__(self) -> RollbackController:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(quiet=exc_type is not None)

    def __repr__(self) -> str:
        return (
            f"RollbackController({str(self.directory)!r}, save_every={self.save_every}, "
            f"keep={self.keep}, rollback_margin={self.rollback_margin}, "
            f"step={self._step}, rollbacks={self.rollbacks}, skipped={self.skipped_ranges})"
        )

    # ------------------------------------------------------------------- observation

    def _resolve(self, data: Any) -> DataIterator:
        if data is self._data or data is getattr(self._data, "source", object()):
            return self._data
        raise ValueError(
            "pass the data iterator that restore_or_init returned (it tracks the position)"
        )

    def _postfix(self) -> dict[str, Any]:
        loss = self.smoothed_loss
        return {
            "loss": "-" if loss is None else f"{loss:.4g}",
            "spikes": self.events.count("spike"),
            "rollbacks": self.rollbacks,
            "skipped": self._ledger.skipped,
        }

    def _process(self, step: int, metrics: Mapping[str, Any]) -> Any:
        """Feeds one step's metrics to the detectors; returns a restored state or None."""
        host = ck.host_scalars(metrics, self._keys)
        loss = self._last_loss = float(host["loss"])
        self._recent.append((step, loss, bool(host.get("skipped", False))))
        if math.isfinite(loss):
            self._ema[0] = _EMA_DECAY * self._ema[0] + (1 - _EMA_DECAY) * loss
            self._ema[1] += 1
        found = []
        for det in self.detectors:
            if (d := det.update(step, host)) is None:
                continue
            policy.check_action(d.action, det.name)
            found.append(d)
            details = dict(action=d.action, onset=d.onset, value=d.value, reason=d.reason)
            self._log(d.kind, d.step, **details, detector=det.name, **d.details)
            if d.action == "warn":
                warn(d.reason)
        if raising := [d for d in found if d.action == "raise"]:
            self._give_up(raising, f"Training stopped at step {step}: a detector raised.")
        triggers = [d for d in found if d.action in ("rollback", "rollback_best")]
        return self._rollback(triggers) if triggers else None

    def _flush_and_save(self, state: Any, *, sync: bool = False, resume_only=False) -> Any:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if (restored := self._process(*pending)) is not None:
                return restored
        if self._saved_at != self._step:
            onsets = [getattr(d, "active_onset", None) for d in self.detectors]
            if blocker := policy.save_blocker(onsets, self._last_loss):
                if self._deferred is None:
                    self._log("save_deferred", self._step, reason=blocker)
                self._deferred = self._deferred or self._step
            else:
                self._save(state, sync=sync, resume_only=resume_only and self._deferred is None)
                self._deferred = None
        if sync:
            self._store.settle()
            self._retain()
        return state

    # ---------------------------------------------------------------------- checkpoints

    def _meta(self) -> dict[str, Any]:
        """The checkpoint's meta item as of now (the store adds scores and fingerprints)."""
        return {
            "version": ck.META_VERSION,
            "step": self._step,
            "data_index": self._data.index,
            **self._ledger.to_meta(),
            "detectors": {d.name: d.get_state() for d in self.detectors},
            "ema": list(self._ema),
            "leaves": ck.leaf_specs(self._abstract),
            "data_config": self._data_config(),
        }

    def _data_config(self) -> Any:
        config = self.data_config or getattr(self._data, "config", None)
        return None if config is None else json.loads(json.dumps(config))

    def _grain(self) -> Any:
        grain_data = isinstance(self._data, GrainDatasetIterator | GrainLoaderIterator)
        return self._data.source if grain_data else None

    def _save(self, state: Any, *, sync: bool = False, resume_only: bool = False) -> None:
        """Captures this step's checkpoint (meta, data position) and writes it, here or
        on the worker thread (``background_save``, an on-device copy of the state)."""
        self._store.join_worker()
        background = self.background_save and not sync
        if background:
            state = ck.device_snapshot(state)
        fingerprint = ck.fingerprint(state) if self.verify else None  # dispatched, read later
        meta = json.loads(json.dumps(self._meta()))  # a deep copy: the loop runs on
        item = ck.data_args(self._data, restore=False, grain_source=self._grain())
        write = functools.partial(
            self._write,
            self._step,
            state,
            fingerprint,
            meta,
            item,
            self.smoothed_loss,
            wait=sync or background,
            resume_only=resume_only,
        )
        self._store.submit(write) if background else write()
        self._saved_at = self._step

    def _write(self, step, state, fingerprint, meta, item, smoothed, *, wait, resume_only=False):
        if (actual := int(ck.to_host(state.step))) != step:
            raise ValueError(
                f"state.step is {actual} but the controller counted {step} steps: the train "
                "step must increment state.step by one on every call (skipped or not)"
            )
        self._store.write(
            step, state, fingerprint, meta, item, smoothed, wait=wait, kept=self._kept,
            resume_only=resume_only,
        )  # fmt: skip

    def _restore(self, step: int, *, with_data: bool) -> tuple[Any, dict[str, Any]]:
        grain_source = self._grain()
        item = ck.data_args(self._data, restore=True, grain_source=grain_source)
        state, meta, data_state = self._store.restore(
            step, self._abstract, item if with_data else None, verify=self.verify
        )
        if with_data and grain_source is not None:
            self._data._set_index(int(meta["data_index"]))
        elif with_data:
            if int(data_state["index"]) != int(meta["data_index"]):
                raise ValueError(f"checkpoint {step}: data position disagrees with meta")
            self._data.set_state(dict(data_state))
        return state, meta

    def _check_compatible(self, meta: Mapping[str, Any]) -> None:
        """Raises CheckpointMismatch when the state or data config differs from ``meta``'s."""
        lines = []
        if meta.get("leaves") is not None:
            lines = ck.describe_mismatch(meta["leaves"], ck.leaf_specs(self._abstract))
        saved, now = meta.get("data_config"), self._data_config()
        if saved is not None and saved != now:
            lines.append(f"data config {saved} in the checkpoint, {now} now")
        if lines:
            raise ck.CheckpointMismatch(
                f"cannot resume from checkpoint {meta['step']} in {str(self.directory)!r}: the "
                "train state's structure changed or the data config changed since it was "
                "written (a config change, not corruption):\n  " + "\n  ".join(lines) + "\n"
                "Resume with the original model, optimizer, dtypes and data, or use a new "
                "directory."
            )

    def _try(self, fn: Callable[[], Any], *, step: int | None = None) -> Any:
        """``fn()``, or None (with a ``corrupt_checkpoint`` event) if it fails anywhere."""
        try:
            result, ok, err = fn(), True, None
        except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
            result, ok, err = None, False, e
        if not ck.all_agree(ok):
            if step is not None:
                reason = f"{type(err).__name__}: {err}"[:500] if err else "failed on another host"
                self._log("corrupt_checkpoint", step, reason=reason)
            return None
        return result

    def _apply_meta(self, meta: Mapping[str, Any], *, trajectory: bool) -> None:
        self._step = int(meta["step"])
        states = meta.get("detectors", {})
        for d in self.detectors:
            d.set_state(states.get(d.name, {}))
        self._ema = [float(meta["ema"][0]), int(meta["ema"][1])]
        self._store.scores = {int(k): float(v) for k, v in meta["ckpt_losses"].items()}
        self._store.resume_only = set(meta.get("resume_only", []))

    def _kept(self) -> list[int]:
        steps = self._store.steps()
        best = self._store.best(steps) if self._protect_best else None
        return policy.kept_steps(
            steps, keep=self.keep, best=best, resume_only=self._store.resume_only
        )

    def _retain(self) -> None:
        self._store.retain(self._kept())

    def _delete_newer_than(self, step: int) -> None:
        self._store.delete_newer_than(step)

    def _seek(self, index: int, step: int, state: Any) -> None:
        try:
            self._data.seek(index)
        except StopIteration:
            err = DataExhausted(f"the data ran out moving to batch {index} at step {step}")
            err.state = state
            raise err from None

    # ------------------------------------------------------------------------- rollback

    def _give_up(self, triggers: Sequence[Detection], headline: str) -> None:
        step = triggers[0].step
        message = diverged_message(
            headline,
            step,
            [d.reason for d in triggers],
            losses_before(self._recent, step),
            self._ledger,
        )
        self._log("diverged", max(d.step for d in triggers), message=message)
        self._store.settle()
        raise TrainingDiverged(message, self._ledger.history)

    def _rollback(self, triggers: Sequence[Detection]) -> Any:
        detected = max(d.step for d in triggers)
        if self.rollbacks >= self.max_rollbacks:
            self._give_up(
                triggers,
                f"Training diverged: {self.rollbacks} rollback(s) (max_rollbacks="
                f"{self.max_rollbacks}) did not get past the trouble.",
            )
        self._store.settle()
        self._retain()
        onsets = [d.onset for d in triggers]
        onsets += [o for o in (getattr(d, "active_onset", None) for d in self.detectors) if o is not None]  # fmt: skip
        onset = min(onsets)
        steps = self._store.steps()
        best_only = all(d.action == "rollback_best" for d in triggers)
        order, margin_met = policy.restore_order(
            steps,
            onset=onset,
            margin=self.rollback_margin,
            best=self._store.best(steps) if best_only and self._protect_best else None,
            exclude=self._store.resume_only,
        )
        restored, failed = None, []
        for target in order:
            restored = self._try(lambda t=target: self._restore(t, with_data=False), step=target)
            if restored is not None:
                break
            failed.append(target)
        for s in failed:
            self._store.set_aside(s)
        if restored is None:
            raise RuntimeError(
                f"rollback at step {detected}: no checkpoint in {self.directory} could be "
                f"restored (tried {order})"
            )
        new_state, meta = restored
        skip = policy.skip_range(
            start=int(meta["data_index"]),
            fed_end=self._data.index,
            extra_skip=self.extra_skip,
            detected=detected,
            last_rollback=self._ledger.last_rollback,
            window=self.save_every * self.keep,
        )
        entry = {
            "detected": detected,
            "onset": onset,
            "restored": target,
            "range": [skip.start, skip.end],
            "length": skip.length,
            "doubled": skip.doubled,
            "reason": "; ".join(d.reason for d in triggers),
            "losses": losses_before(self._recent, detected),
        }
        ledger = self._ledger.after_rollback(entry, (skip.start, skip.end))
        resume_at = first_allowed(skip.end, ledger.ranges)
        if ck.is_primary():
            record = ledger.record(target_step=target, data_index=resume_at, time=time.time())
            ck.atomic_write_json(self.directory / RECORD, record)
        ck.barrier(f"rollback_record_{ledger.rollbacks}")
        self._delete_newer_than(target)
        # The checkpoint's trajectory (detectors, EMA) comes back; the run ledger moves on.
        self._apply_meta(meta, trajectory=True)
        self._ledger = ledger
        # Losses of the abandoned branch must not show up in later events.
        self._recent = collections.deque((r for r in self._recent if r[0] < target), maxlen=64)
        self._pending, self._saved_at, self._deferred, self._last_loss = None, target, None, None
        self._data.skipped_ranges = ledger.ranges
        self._log(
            "rollback",
            detected,
            onset=onset,
            restored_step=target,
            margin_met=margin_met,
            reason=entry["reason"],
            losses=entry["losses"],
            rollbacks=ledger.rollbacks,
        )
        self._log("skip", detected, range=entry["range"], length=skip.length, doubled=skip.doubled)
        self._seek(resume_at, detected, new_state)
        self._log("restore", target, data_index=self._data.index, reason="rollback")
        return new_state

    def _log(self, kind: str, step: int, **details: Any) -> None:
        self.events.append(Event(kind, step, details=details))
