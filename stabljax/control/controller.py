"""The rollback controller: PaLM's remedy for loss spikes, made automatic.

:class:`RollbackController` is the public face and the order of things; the parts are
:mod:`~stabljax.control.checkpoint.store` (checkpoints), :mod:`~stabljax.control.resume` (resume,
roll back, the data position), :mod:`~stabljax.control.decide.policy` (pure decisions) and
:mod:`~stabljax.control.detect.monitor` (detectors); the operator's world (the directory
lock, preemption, the run loop) is :mod:`~stabljax.control.session`.

References:
  Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
  <https://arxiv.org/abs/2204.02311>`_, 2022 (section 5.1, "Training instability").
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from stabljax.control import loop, resume
from stabljax.control.checkpoint.fsutil import RunFiles
from stabljax.control.checkpoint.integrity import Seal, check_verify, jsonable, state_bytes
from stabljax.control.checkpoint.saver import Saver
from stabljax.control.checkpoint.store import CheckpointStore
from stabljax.control.data.grain_iterators import as_data_iterator
from stabljax.control.data.iterators import DataIterator
from stabljax.control.decide import policy
from stabljax.control.decide.policy import Ledger
from stabljax.control.decide.remedies import RollbackInfo, check_remedy, describe, remedy_event
from stabljax.control.detect.detectors import Detection, Detector
from stabljax.control.detect.drift import default_detectors
from stabljax.control.detect.monitor import Monitor
from stabljax.control.diagnose.screen import SCREENED, extend_over_window
from stabljax.control.diagnose.triage import TriageConfig, as_config, for_rollback
from stabljax.control.errors import DataExhausted, Preempted
from stabljax.control.events import Event, EventLog, rollback_events
from stabljax.control.hosts import is_primary, to_host
from stabljax.control.session import (
    PreemptionWatch,
    Progress,
    RunResult,
    check_state,
    close_at_exit,
    drive,
)

# -------------------------------------------------------------------------------------- controller
# The rollback controller: PaLM's remedy for loss spikes, made automatic.


def _append(events: EventLog, kind: str, step: int, **details: Any) -> None:
    events.append(Event(kind, step, details=details))


class RollbackController:
    """Checkpoints training, detects spikes and divergence, and rolls back past bad data.

    Use :meth:`run` (in a ``with`` block), or :meth:`restore_or_init`, :meth:`step` and
    :meth:`finish` in a hand-written loop. A rollback restores train state, data position
    and detector state together; ``skipped_ranges`` and the rollback count survive
    rollbacks and restarts, and the final state was trained on exactly
    ``range(data.index)`` minus ``skipped_ranges``, in order. docs/guides/rollback.md has
    the operator's view: the directory lock, preemption, disk space, end of data and the
    resume checks.

    Args:
      directory: checkpoints, ``events.jsonl``, the rollback record and the lock, created
        with its parents: a local path or any directory Orbax takes (``gs://bucket/run``,
        :class:`~stabljax.control.checkpoint.fsutil.RunFiles`). Unwritable: ``OSError``; a
        missing bucket: ``FileNotFoundError`` naming it; held by another controller:
        ``RuntimeError`` naming the holder.
        An all-digit folder that is no checkpoint (no Orbax commit marker, no meta item) is
        never read, moved or deleted (a ``RuntimeWarning``); one past the run's step stops
        the first save with a ``RuntimeError`` naming it.
      save_every: save when ``state.step % save_every == 0``; deferred while an episode is
        open or after a non-finite loss (``save_deferred``).
      keep: checkpoints kept (the newest; the best too for ``rollback_best``). Disk room
        for ``keep + 1`` is needed: the oldest goes once the next has committed.
      rollback_margin: the target is at least this many steps before the onset (less than
        ``save_every * keep``, else ``ValueError``). Below ``save_every`` (the default, 10),
        the target is the newest checkpoint before the trouble, not one a whole interval older.
      extra_skip: batches skipped beyond the last one fed before the rollback.
      detectors: default :func:`~stabljax.control.detect.drift.default_detectors`. Action
        ``"raise"`` raises :class:`TrainingDiverged`; an unknown action is a ``ValueError``.
      max_rollbacks: rollbacks allowed (``None``: unlimited); the next raises
        ``TrainingDiverged``. Integer arguments are ``int`` in range, else ``ValueError``.
      async_save: Orbax writes in the background (the host copy is made in :meth:`step`).
      background_save: a worker thread writes an on-device copy; one process, no other Orbax
        saves in it (Orbax's operation ids are global). Errors raise at the next wait.
      verify: ``True``: fingerprint the state (accidents); ``"digest"``: a SHA-256 per leaf
        too (any edit); an HMAC with ``STABLJAX_CHECKPOINT_KEY`` set. Checked on restore.
      preemption_signals: "save at the next step boundary and stop" (SIGTERM; add SIGINT
        for Ctrl-C); JAX's sync point decides on several processes.
      data_config: JSON-able batch size, sequence length, corpus...; default the data's
        ``config``. A resume with another one is a ``CheckpointMismatch``.
      triage: ``True`` or a ``TriageConfig``: after each rollback under :meth:`run`, replay the
        window on copies of the state and log a ``triage`` event (verdict ``data``/``state``/
        ``nondeterministic``, evidence, culprits, attribution). Off by default.
      remedy: ``remedy(state, info: RollbackInfo) -> state``, applied to the restored state at
        every rollback, after triage, and logged; a restart with only older checkpoints
        applies it again (built-ins: :mod:`~stabljax.control.decide.remedies`).
      screen_ahead: after each rollback, run up to this many batches past the skip from
        copies of the restored state and extend the skip while their loss is a spike
        (:mod:`~stabljax.control.diagnose.screen`), so one rollback passes a whole bad
        window. ``0`` (the default): the blind skip, doubled on each consecutive rollback.
        Needs the train step (:meth:`run`'s, or ``screen_step``).
      screen_step: the train step to screen with in a hand-written loop (under
        :meth:`run`, the one given to it).
      warning_response: ``f(state, detectors, log, step) -> state`` each step: ``WarningResponse``.
      fast_every: a fast tier: every ``fast_every`` steps a healthy state, with what its
        checkpoint would hold, is copied to host RAM (the newest ``keep``), beside the saves
        to ``directory``. Rollback targets both by the same rule; a fast one reads nothing
        from ``directory``. A restart resumes from ``directory``. ``None`` (the default): none;
        one process only (``ValueError``).

    Attributes:
      directory, events (the :class:`~stabljax.control.events.EventLog`), detectors, and
      last_run (the :class:`~stabljax.control.session.RunResult` of :meth:`run`).

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
      >>> def batch_fn(i):  # batch 30 is poisoned: its loss spikes, its update throws w off
      ...     return jnp.full((4,), 1e3 if i == 30 else 1.0 + 0.1 * (i % 3))
      >>> with RollbackController(
      ...     tempfile.mkdtemp(), save_every=10, rollback_margin=5,
      ...     detectors=[SpikeDetector(warmup=5)], async_save=False) as ctl:
      ...     state, data = ctl.run(train_step, State(jnp.int32(0), jnp.float32(0.0)),
      ...                           IndexedBatches(batch_fn), 50, progress=False)
      >>> print(int(state.step), data.index, ctl.skipped_ranges, ctl.rollbacks)
      50 62 [(20, 32)] 1
      >>> print(round(float(state.w), 4), ctl.last_run.reached)
      2.0 True
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int = 100,
        keep: int = 3,
        rollback_margin: int = 10,
        extra_skip: int = 0,
        detectors: Sequence[Detector] | None = None,
        max_rollbacks: int | None = 10,
        async_save: bool = True,
        background_save: bool = False,
        verify: bool | str = True,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        data_config: Any = None,
        triage: bool | TriageConfig = False,
        remedy: Callable[[Any, RollbackInfo], Any] | None = None,
        screen_ahead: int = 0,
        screen_step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]] | None = None,
        warning_response: Callable[..., Any] | None = None,
        fast_every: int | None = None,
    ):
        sizes = dict(save_every=save_every, keep=keep, rollback_margin=rollback_margin)
        more = dict(extra_skip=extra_skip, max_rollbacks=max_rollbacks, fast_every=fast_every)
        policy.check_config(
            **sizes, **more, background_save=background_save, processes=jax.process_count()
        )
        self.save_every, self.keep = int(save_every), int(keep)
        self.rollback_margin, self.extra_skip = int(rollback_margin), int(extra_skip)
        self.max_rollbacks = None if max_rollbacks is None else int(max_rollbacks)
        self.fast_every = None if fast_every is None else int(fast_every)
        self.verify = check_verify(verify)
        self.async_save, self.background_save = bool(async_save), bool(background_save)
        self.data_config = jsonable(data_config)
        self.triage, self._train_step = as_config(triage), None
        self.remedy, self.warning_response = check_remedy(remedy), warning_response
        if isinstance(screen_ahead, bool) or not isinstance(screen_ahead, int) or screen_ahead < 0:
            raise ValueError(f"screen_ahead must be an int >= 0, got {screen_ahead!r}")
        if screen_step is not None and not callable(screen_step):
            raise TypeError(f"screen_step must be a train step (callable), got {screen_step!r}")
        self.screen_ahead, self.screen_step = screen_ahead, screen_step
        self._files = RunFiles(directory, process=jax.process_index())
        self.directory = self._files.path
        self._watch = PreemptionWatch(preemption_signals)
        self._files.check()
        self.events = EventLog(self._files.file("events.jsonl"), write=is_primary())
        self._log = functools.partial(_append, self.events)  # no reference back to self
        detectors = default_detectors() if detectors is None else detectors
        self._monitor = Monitor(detectors, self._log)
        self.detectors = self._monitor.detectors
        self._lock, self._closed = self._files.lock, True
        self._open()
        self._data: DataIterator | None = None
        self._step: int | None = None
        self._abstract = self._pending = None  # the state's structure; (step, metrics) unread
        self._ledger = Ledger()  # survives rollbacks
        self._stepped: tuple[int, Any] | None = None  # (expected, state.step): last call's
        self.last_run: RunResult | None = None
        self._loop = loop.LoopGuard()  # the run's target; whether its final state is saved

    def _open(self) -> None:
        self._lock.acquire()
        try:
            best, seal = self._monitor.rolls_back_to_best, Seal.from_env(self.verify)
            kw = dict(async_save=self.async_save, log=self._log, keep=self.keep, seal=seal)
            self._store = CheckpointStore(self._files, keeps_best=best, **kw)
        except BaseException:
            self._lock.release()
            raise
        kw = dict(keep=self.keep, verify=self.verify, background=self.background_save)
        kw |= dict(fast_every=self.fast_every)
        self._saver = Saver(self._store, self._monitor, self._log, **kw)
        self._closed = False
        close_at_exit(self)
        self._poll = not self.background_save and jax.process_count() == 1

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
        return self._monitor.smoothed_loss

    def checkpoint_steps(self) -> list[int]:
        """The steps of the checkpoints on disk (waits for a save in flight)."""
        self._store.settle()
        self._store.manager.reload()
        return self._store.steps()

    def restore_or_init(
        self, state: Any, data: Any, *, total_steps: int | None = None
    ) -> tuple[Any, DataIterator]:
        """Resumes from the newest valid checkpoint, or saves ``state`` as the first one.

        Restores train state (to ``state``'s shapes, dtypes and shardings), data position,
        ledger and detector state; an unreadable checkpoint is a ``corrupt_checkpoint``
        event and goes to ``stabljax-corrupt/``; a crash mid-rollback is finished first.
        Other leaves, dtypes, shapes, tree structure or data config than the checkpoint's
        raise ``CheckpointMismatch``. Returns the state (``state`` itself in an empty
        directory) and a ``DataIterator`` at the next batch: use it from now on.
        ``total_steps``: the target; :meth:`finish` raises below it (without one, the first
        rollback warns: :mod:`~stabljax.control.loop`).
        """
        check_state(state)
        if total_steps is not None:
            self._loop.declare(total_steps)
        if self._closed:
            self._open()
        self._stepped = None
        self._loop.forget()
        self._data = as_data_iterator(data, stacklevel=2)  # warns at the user's line
        loop.check_data(self._data, self.screen_ahead, self.triage)
        self._abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        self._saver.bind(self._data, self._abstract)
        self._store.expect_size(state_bytes(self._abstract))
        self._pending, _ = None, self._monitor.trim(0)
        self._store.warn_foreign(refuse_if_no_run=True)  # a user's all-digit folder: left alone
        self._store.clean_leftovers()  # waits for saves in flight first
        steps = self._store.steps()
        if not steps:
            self._step = int(to_host(state.step))
            self._watch.install(self._step)
            self._data.restore(self._data.index, self._ledger.ranges)
            self._save(state, sync=True)
            return state, self._data
        r = resume.resume(self._store, self._saver, self._data_config())
        self._monitor.load(r.meta)
        self._step, self._ledger = self._store.load(r.meta), r.ledger
        self._watch.install(self._step)
        state = r.state
        if r.redo is not None and self.remedy is not None:
            state = resume.reapply_remedy(self.remedy, state, r.redo)
        self._place(r.index, state, data_state=r.saved)
        self._store.retain()
        details = dict(skipped_ranges=r.ledger.ranges, rollbacks=r.ledger.rollbacks)
        self._log("restore", self._step, data_index=self._data.index, **r.detail, **details)
        if r.redo is not None and self.remedy is not None:
            self._log("remedy", r.redo["detected"], **remedy_event(r.redo, reapplied=True))
        return state, self._data

    def step(self, state: Any, metrics: Mapping[str, Any], data: Any) -> tuple[Any, Any]:
        """Records one training step; saves, rolls back or stops when it is time.

        Call it right after dispatching each train step, with the state and device metrics
        it returned. It reads the previous call's metrics (ready by now), and these too on
        a save step. Returns ``(state, data)``: after a rollback the restored state and the
        data past the skipped range, else the inputs.

        Raises ``TrainingDiverged`` (past ``max_rollbacks``, or a detection that raises),
        ``Preempted`` (after saving, on a preemption signal), ``DataExhausted`` (a skip ran
        past the end of the data), ``ValueError`` (``state.step`` is not the step counted).
        """
        if self._step is None or self._data is None or self._closed:
            raise RuntimeError("call restore_or_init(state, data) before step() (or after close)")
        Monitor.check_metrics(metrics, self._step)
        data = self._resolve(data)
        self._check_advanced()
        self._step += 1
        self._loop.stepped()
        previous, self._pending = self._pending, (self._step - 1, metrics)
        # A device copy (the next train step may donate this state), read on the next call,
        # when it is ready: the check costs no wait.
        self._stepped = (self._step, Monitor.snapshot_step(state.step))
        if previous is not None and (restored := self._process(*previous)) is not None:
            return restored, data
        if self.warning_response is not None:
            state = self.warning_response(state, self.detectors, self._log, self._step)
        if self._poll:
            self._store.poll()
        due = self._step % self.save_every == 0
        if self._watch.should_stop(self._step, agree=due):
            state = self._flush_and_save(state, sync=True, off_grid=not due)
            saved = self._store.saved_at == self._step
            if saved:  # the state is on disk: no missing-finish warning
                self._loop.forget()
            self._log("preempted", self._step, signal=self._watch.signum, saved=saved)
            raise Preempted(self._step, self._watch.signum, saved, state)
        if due or self._store.deferred is not None or self._saver.fast.due(self._step):
            state = self._flush_and_save(state, persist=due or self._store.deferred is not None)
        return state, data

    def finish(self, state: Any, data: Any) -> tuple[Any, Any]:
        """Reads the last pending metrics and saves the state (waits); may roll back.
        Then a state below the declared target raises ``RuntimeError`` (the steps missing)."""
        data = self._resolve(data)
        self._check_advanced()
        state = self._flush_and_save(state, sync=True)
        self._loop.finished(self._step)
        return state, data

    def steps(self, num_steps: int) -> Iterator[int]:
        """Yields ``current_step`` until it is ``num_steps`` (a target, as in :meth:`run`), so a
        loop re-runs what a rollback took back (``range(N)`` would end short); each iteration
        calls :meth:`step` once (docs/guides/trainer_guards.md)."""
        if self._step is None:
            raise RuntimeError("call restore_or_init(state, data) before steps()")
        return loop.count_to(self, self._loop.declare(num_steps))

    def run(
        self,
        train_step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
        state: Any,
        data: Any,
        num_steps: int,
        *,
        progress: bool = True,
        metrics_writer: Callable[[int, Mapping[str, Any]], Any] | None = None,
        log_every: int = 1,
    ) -> tuple[Any, DataIterator]:
        """Trains until ``state.step == num_steps`` (a target: a restart ends there too).

        Resumes (:meth:`restore_or_init`) unless done, and closes on every way out, so no
        save is left in flight. Returns ``(state, data)``; ``ctl.last_run`` says whether it
        ``reached`` the target, was ``preempted`` (saved; a restart resumes exactly) or ran
        out of data (a ``data_exhausted`` event and a ``RuntimeWarning``).
        ``metrics_writer(step, metrics)`` gets every ``log_every``-th step's scalars one step
        late (:mod:`stabljax.control.events`), so the device never waits for them.
        """
        target = self._loop.declare(num_steps, by_run=True)
        if self._closed or self._step is None or self._data is None:
            state, data = self.restore_or_init(state, data)
        data = self._resolve(data)
        self._train_step = train_step  # what triage replays
        bar = Progress(target, self._step, enabled=progress)
        try:
            args = (train_step, state, data, target, bar, metrics_writer, log_every)
            state, data, preempted, exhausted = drive(self, *args)
        except BaseException:
            self.close(quiet=True)
            raise
        self.close()
        self.last_run = RunResult(self._step, target, self._step == target, preempted, exhausted)
        return state, data

    def close(self, *, quiet: bool = False) -> None:
        """Finishes saves in flight, drops surplus checkpoints, closes Orbax, restores the
        signal handlers and unlocks the directory. Idempotent; raises a failed save's error
        (``quiet``: swallows it, for an exit that already has an exception)."""
        if self._closed:
            return
        self._closed = True
        self._loop.closing("closed", self._step, self._store.saved_at)
        try:
            self._store.settle()
            self._store.retain()
        except Exception:
            if not quiet:
                raise
        finally:
            try:
                self._store.close()
            finally:
                self._watch.restore()
                try:
                    self.events.flush()  # an object store's buffered tail
                finally:
                    self._lock.release()

    def __enter__(self) -> RollbackController:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self._loop.forget()  # the exception says it, not a second warning
        self._loop.closing("closed", self._step, self._store.saved_at)
        self.close(quiet=exc_type is not None)

    def __del__(self) -> None:
        if hasattr(self, "_loop") and not self._closed:
            self._loop.closing("garbage-collected", self._step, self._store.saved_at)

    def __repr__(self) -> str:
        args = f"save_every={self.save_every}, keep={self.keep}, step={self._step}"
        return f"RollbackController({str(self.directory)!r}, {args}, rollbacks={self.rollbacks})"

    def _check_advanced(self) -> None:
        """Checks, one call late, that the last call's ``state.step`` advanced by one."""
        stepped, self._stepped = self._stepped, None
        if stepped is not None:
            Monitor.check_step(*stepped)

    def _resolve(self, data: Any) -> DataIterator:
        if data is self._data or data is getattr(self._data, "source", object()):
            return self._data
        raise ValueError(
            "pass the data iterator that restore_or_init returned (it tracks the position)"
        )

    def _process(self, step: int, metrics: Mapping[str, Any], *, early: bool = False) -> Any:
        """Feeds one step's metrics to the detectors; returns a restored state or None.

        ``early``: read before the next batch was fetched (a preemption off a save
        boundary). A rollback then counts that batch as fed, as the next step would have,
        so its skip, and the resumed run, are the uninterrupted run's.
        """
        found = self._monitor.observe(step, metrics)
        verdict = policy.decide(found, self._ledger, step=step, max_rollbacks=self.max_rollbacks)
        if verdict is None:
            return None
        if verdict.action == "give_up":
            losses = self._monitor.losses_before(verdict.detections[0].step)
            resume.give_up(verdict.detections, verdict.headline, losses, self._ledger, self._store)
        fed_end = self._data.next_index + 1 if early else self._data.index
        before, restored = self._step, self._rollback(verdict.detections, fed_end)
        self._loop.after_rollback(before, self._step)
        return restored

    def _flush_and_save(
        self, state: Any, *, sync: bool = False, off_grid: bool = False, persist: bool = True
    ) -> Any:
        """Reads the pending metrics, then saves unless they rolled back.

        ``off_grid``: a preemption between save steps; the metrics are read early and the
        checkpoint is a resume point only, never a rollback target. ``persist=False``: only
        the fast tier's copy is due.
        """
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if (restored := self._process(*pending, early=off_grid)) is not None:
                return restored
        self._save(state, sync=sync, resume_only=off_grid, persist=persist)
        if sync:
            self._store.settle()
            self._store.retain()
        return state

    def _data_config(self) -> Any:
        return jsonable(self.data_config or getattr(self._data, "config", None))

    def _save(self, state: Any, *, sync: bool = False, resume_only: bool = False, **kw) -> None:
        kw |= dict(sync=sync, resume_only=resume_only)  # and persist (False: fast tier only)
        self._saver.maybe_save(self._step, state, self._ledger, self._data_config(), **kw)

    def _rollback(self, triggers: Sequence[Detection], fed_end: int) -> Any:
        """Carries out a rollback for ``triggers``, crash-safely, in this order.

        Restore the target (:func:`~stabljax.control.decide.policy.restore_order`; an unreadable
        one is set aside and the next tried), run the hooks on the restored state (triage,
        then the remedy), plan (:func:`~stabljax.control.decide.policy.plan_rollback`), write the
        crash record, and only then delete the states (both tiers) newer than the target; then
        log the events, take the checkpoint's trajectory and set the data position.
        A crash before the record leaves nothing that resume reads; one after it is
        finished on restart.

        Args:
          triggers: the detections that roll back.
          fed_end: one past the last data index fed before the rollback.
        """
        store, monitor, fast = self._store, self._monitor, self._saver.fast
        # With a fast tier (one process) the directory is not listed: CheckpointStore.steps
        steps = sorted({*store.settled_steps(known=fast.every is not None), *fast.copies})
        onsets = monitor.active_onsets()
        onset = policy.onset_of(triggers, onsets)
        detected = max(d.step for d in triggers)
        to_best = monitor.rolls_back_to_best and all(d.action == "rollback_best" for d in triggers)
        best = store.best(steps) if to_best else None
        losses = monitor.losses_before(detected)
        order, margin_met = policy.restore_order(
            steps, onset=onset, margin=self.rollback_margin, best=best, exclude=store.resume_only
        )
        found = store.first_restorable(order, self._abstract, verify=self.verify, fast=fast.copies)
        if found is None:
            raise RuntimeError(
                f"rollback at step {detected}: no checkpoint in {store.directory} could be "
                f"restored (tried {order})"
            )
        target, (state, meta, _) = found
        report = self._triage_hook(target, state, meta, onset)
        narrow = self.triage is not None and self.triage.narrow_skip
        window = self.save_every * self.keep
        cfg = policy.RollbackSettings(self.rollback_margin, self.extra_skip, window, narrow)
        checkpoint = policy.Target(target, int(meta["data_index"]), margin_met)
        kw = dict(active_onsets=onsets, losses=losses, triage=report)
        plan = policy.plan_rollback(triggers, self._ledger, checkpoint, fed_end, cfg, **kw)
        plan = self._screen_hook(state, plan, losses, meta["ema"])
        state, plan = self._remedy_hook(state, plan, triggers)
        store.write_record(plan.record(time.time()))
        store.delete_newer_than(target, later=target in fast.copies)  # a crash: see resume
        if fast.copies:
            fast.drop_newer_than(target)
        kw = dict(steps_back=self._step - target, target_steps=self._loop.target)
        kw |= dict(fed_end=fed_end, screened=SCREENED, triage=report)
        for event in rollback_events(plan, losses=losses, **kw):  # rollback, skip, ...
            self.events.append(event)
        # The checkpoint's trajectory (detectors, EMA) comes back; the run ledger moves on,
        # and the losses of the abandoned branch leave the history shown in events.
        monitor.load(meta)
        self._step, self._ledger, self._pending = store.load(meta), plan.ledger, None
        monitor.trim(target)
        self._place(plan.resume_at, state)
        self._log("restore", target, data_index=self._data.index, reason="rollback")
        return state

    def _triage_hook(self, target: int, state: Any, meta: Any, onset: int) -> Any:
        """With ``triage``, replays the window on copies of the restored state
        (:func:`~stabljax.control.diagnose.triage.for_rollback`) and returns its report."""
        if self.triage is None:
            return None
        kw = dict(step_fn=self._train_step, data=self._data, store=self._store, verify=self.verify)
        kw |= dict(abstract=self._abstract, history=list(self._monitor.recent), meta=meta)
        kw |= dict(target=target, state=state, onset=onset, ranges=self._ledger.ranges)
        return for_rollback(self.triage, **kw)

    def _screen_hook(self, state: Any, plan: policy.RollbackPlan, losses: Any, ema: Any) -> Any:
        """With ``screen_ahead``, extends the skip over the anomalous batches past it
        (``ema``: the restored checkpoint's loss EMA, the level for data read ahead)."""
        step_fn = self.screen_step or self._train_step
        if not self.screen_ahead or plan.narrowed or step_fn is None:
            return plan
        rule = self.triage or TriageConfig()
        args = (plan, step_fn, state, self._data, losses, rule, self.screen_ahead, ema)
        return extend_over_window(*args)

    def _remedy_hook(self, state: Any, plan: policy.RollbackPlan, triggers: Sequence[Detection]):
        """With ``remedy``, changes the restored state and records it in the plan's entry
        (so the crash record carries it and a restart applies it again)."""
        if self.remedy is None:
            return state, plan
        skip, kinds = (plan.skip.start, plan.skip.end), tuple(d.kind for d in triggers)
        kw = dict(verdict=plan.entry.get("verdict"), kinds=kinds, detected=plan.detected)
        info = RollbackInfo(plan.target, plan.onset, plan.ledger.rollbacks, skip, **kw)
        state = self.remedy(state, info)
        return state, plan.with_remedy(describe(self.remedy, info), info.to_json())

    def _place(self, index: int, state: Any, *, data_state: Any = None) -> None:
        """Sets the data position after a restore (the ledger's ranges); running out is
        :class:`DataExhausted` with ``state``."""
        try:
            self._data.restore(index, self._ledger.ranges, state=data_state)
        except StopIteration:
            msg = f"the data ran out moving to batch {index} at step {self._step}"
            raise DataExhausted(msg, state=state) from None
