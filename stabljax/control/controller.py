"""The rollback controller: PaLM's remedy for loss spikes, made automatic.

:class:`RollbackController` is the public face and the order of things; the parts are
:mod:`~stabljax.control.store` (checkpoints), :mod:`~stabljax.control.rollback` (resume,
roll back, the data position), :mod:`~stabljax.control.policy` (pure decisions) and
:mod:`~stabljax.control.monitor` (detectors). Here too is the controller's life in an
operator's world:

* :class:`DirectoryLock`: an advisory ``fcntl.flock`` on ``stabljax.lock`` (process 0;
  ``stabljax.lock.<i>`` for process ``i``), so a second job on the same directory is
  refused; the kernel drops it when its holder dies.
* :class:`PreemptionWatch`: SIGTERM (and SIGINT, if asked) asks to stop at the next step
  boundary; on several processes JAX's preemption sync point decides, by ``state.step``.
* :class:`RunResult` (how a run ended), :func:`drive` (the loop of ``run``) and the
  progress bar.

References:
  Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
  <https://arxiv.org/abs/2204.02311>`_, 2022 (section 5.1, "Training instability").
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import gc
import os
import pathlib
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from stabljax.control import policy
from stabljax.control import rollback as rb
from stabljax.control import store as ck
from stabljax.control import triage as tr
from stabljax.control.data import DataIterator, as_data_iterator
from stabljax.control.detectors import Detection, Detector, default_detectors
from stabljax.control.errors import DataExhausted, Preempted
from stabljax.control.errors import warn as warn
from stabljax.control.events import Event, EventLog, host_metrics
from stabljax.control.monitor import Monitor
from stabljax.control.remedies import RollbackInfo, check_remedy
from stabljax.control.rollback import RECORD, Ledger
from stabljax.control.store import Saver

# --------------------------------------------------------------------------------------- lifecycle
# The controller's life in an operator's world: one job per directory, preemption,


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How :meth:`RollbackController.run` ended (``ctl.last_run``).

    Attributes:
      step: ``state.step`` at the end.
      target: the ``num_steps`` asked for.
      reached: ``step == target``.
      preempted: a preemption signal stopped it (the state was saved). A signal that lands
        in the last step gives ``preempted`` and ``reached`` both: saved at the target.
      data_exhausted: the data ran out (``StopIteration``, or ``IndexError`` from a
        ``batch_fn``) before the target, possibly inside a rollback's skip.
    """

    step: int
    target: int
    reached: bool
    preempted: bool = False
    data_exhausted: bool = False


class DirectoryLock:
    """An exclusive advisory lock on ``directory/stabljax.lock[.<process>]``."""

    def __init__(self, directory: pathlib.Path):
        i = jax.process_index()
        self.path = directory / ("stabljax.lock" if i == 0 else f"stabljax.lock.{i}")
        self._fd: int | None = None

    def acquire(self) -> None:
        for attempt in range(2):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                if attempt == 0:
                    gc.collect()  # an unreachable controller of this process may hold it
                    continue
                try:
                    holder = self.path.read_text().strip() or "unknown"
                except OSError:
                    holder = "unknown"
                raise RuntimeError(
                    f"checkpoint directory {str(self.path.parent)!r} is already in use by "
                    f"another RollbackController (lock {self.path.name} held by {holder}); "
                    "two jobs on one directory would race on saves and deletes. Stop the "
                    "other job, close() the other controller, or use another directory."
                ) from e
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
            self._fd = fd
            return

    def release(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self):  # a controller dropped without close() frees its directory
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit os/fcntl may be gone already
            pass


_OPEN: weakref.WeakSet = weakref.WeakSet()  # controllers to close at interpreter exit
_HOOKED = False


def close_at_exit(controller: Any) -> None:
    """Closes ``controller`` at interpreter exit if nothing else did.

    A hand-written loop that dies of an exception never calls ``close()``, and by the
    time ``atexit`` hooks run, ``concurrent.futures`` refuses new work, so Orbax abandons
    the async save in flight ("cannot schedule new futures after interpreter shutdown")
    and the restart resumes one ``save_every`` earlier. ``threading``'s exit hooks run
    before that (last registered first), so the save in flight is finished there. Only a
    weak reference is held.
    """
    global _HOOKED
    if not _HOOKED:
        try:
            threading._register_atexit(_close_open)  # what concurrent.futures itself uses
        except (AttributeError, RuntimeError):  # another Python, or already shutting down
            import atexit

            atexit.register(_close_open)
        _HOOKED = True
    _OPEN.add(controller)


def _close_open() -> None:
    for controller in list(_OPEN):
        try:
            controller.close(quiet=True)
        except BaseException:  # noqa: BLE001 - nothing may be raised at exit
            pass


class PreemptionWatch:
    """A stop request from a signal (one process) or JAX's preemption sync point."""

    def __init__(self, signals: Iterable[int]):
        self.signals = tuple(signal.Signals(s) for s in signals)
        for s in self.signals:
            if s in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"preemption_signals: {s.name} cannot be caught")
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._sync = False  # JAX's preemption service decides (several processes)
        self._probed = False

    def install(self, step: int) -> None:
        """Installs the handlers (main thread only); on several processes, asks JAX whether
        its preemption service runs, with ``step`` (the restored ``state.step``)."""
        self.signum = None
        if jax.process_count() > 1 and not self._probed:
            self._probed = True
            try:
                multihost_utils.reached_preemption_sync_point(int(step))
                self._sync = True
            except RuntimeError:
                self._sync = False
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for s in self.signals:
            if self._sync and s == signal.SIGTERM:
                continue  # JAX's preemption notifier owns SIGTERM
            self._previous[s] = signal.signal(s, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def restore(self) -> None:
        """Puts the previous handlers back."""
        previous, self._previous = self._previous, {}
        for s, handler in previous.items():
            try:
                signal.signal(s, handler)
            except (ValueError, TypeError):  # not the main thread / a C handler
                pass

    def should_stop(self, step: int, *, agree: bool) -> bool:
        """Whether to stop at step boundary ``step``; call once per step on every process.

        Args:
          step: ``state.step`` after this step (the step a save here would hold).
          agree: on several processes without the preemption service, combine the
            processes' flags now (a collective: the caller does it on save steps only).
        """
        if jax.process_count() == 1:
            return self.signum is not None
        if self._sync:
            # JAX stops at (the highest step id any process last gave) + 1, and only when
            # a process gives exactly that id, so the id must be the same on every process
            # and must not jump. state.step is both, across restarts too; after a rollback
            # it goes back, which only delays a notice that came before the rollback. The
            # store's Orbax manager never calls the sync point (StepManager), so no other
            # caller feeds it a different id.
            if multihost_utils.reached_preemption_sync_point(int(step)):
                self.signum = self.signum or signal.SIGTERM
                return True
        if not agree or not self._previous:
            return False  # no handler of ours: only the sync point can ask
        flags = multihost_utils.process_allgather(np.asarray(self.signum is not None, np.int32))
        return bool(flags.any())


def drive(
    ctl: Any,
    train_step: Any,
    state: Any,
    data: Any,
    target: int,
    bar: Progress,
    writer: Any = None,
    log_every: int = 1,
):
    """The loop of ``RollbackController.run``: ``(state, data, preempted, exhausted)``.

    Feeds ``next(data)`` to ``train_step`` and ``ctl.step`` until ``ctl.current_step``
    reaches ``target``, then ``ctl.finish`` (which may roll back, and the loop goes on).
    The data running out (``StopIteration``, or :class:`DataExhausted` from a rollback's
    skip) and :class:`Preempted` end it with the state as saved; anything else propagates.
    ``writer(step, host_metrics)`` gets every ``log_every``-th step's metrics one step
    late (after the next step is dispatched), and the last one on the way out.
    """
    if isinstance(log_every, bool) or int(log_every) != log_every or log_every < 1:
        raise ValueError(f"log_every must be an int >= 1, got {log_every!r}")
    if writer is not None and not callable(writer):
        raise TypeError(f"metrics_writer must be a callable(step, metrics), got {writer!r}")
    preempted = exhausted = False
    pending: tuple[int, Any] | None = None

    def write_pending() -> None:
        nonlocal pending
        if pending is not None and writer is not None:
            writer(pending[0], host_metrics(pending[1]))
        pending = None

    try:
        while ctl.current_step < target and not exhausted:
            try:
                batch = next(data)
            except StopIteration:
                exhausted = True
                state, data = ctl.finish(state, data)
                continue
            step = ctl.current_step
            state, metrics = train_step(state, batch)
            write_pending()  # the previous step's: this one is already dispatched
            if writer is not None and step % log_every == 0:
                pending = (step, metrics)
            state, data = ctl.step(state, metrics, data)
            bar.show(ctl)
            if ctl.current_step >= target:
                state, data = ctl.finish(state, data)
    except Preempted as e:
        state, preempted = e.state, True
    except DataExhausted as e:
        state, exhausted = e.state, True
    finally:
        try:
            write_pending()
            if writer is not None and callable(getattr(writer, "flush", None)):
                writer.flush()
        finally:
            bar.show(ctl)
            bar.close()
    if exhausted:
        step = ctl.current_step
        ctl._log("data_exhausted", step, data_index=data.index, target=target)
        warn(f"the data ran out at step {step} (index {data.index}) of {target}")
    return state, data, preempted, exhausted


class Progress:
    """tqdm when installed, else a line on stderr every 10%."""

    def __init__(self, total: int, initial: int, *, enabled: bool = True):
        self._enabled = enabled
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is an optional dependency
            tqdm = None
        self._bar = None
        if tqdm is not None:
            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
        self._total, self._last = total, initial

    def show(self, ctl: Any) -> None:
        """Shows the controller's step, smoothed loss, spikes, rollbacks, skipped batches."""
        if not self._enabled:
            return
        loss = ctl.smoothed_loss
        postfix = {
            "loss": "-" if loss is None else f"{loss:.4g}",
            "spikes": ctl.events.count("spike"),
            "rollbacks": ctl.rollbacks,
            "skipped": sum(b - a for a, b in ctl.skipped_ranges),
        }
        self.update(ctl.current_step, postfix)

    def update(self, n: int, postfix: Mapping[str, Any]) -> None:
        if self._bar is not None:
            if n < self._bar.n:
                self._bar.n = n
                self._bar.refresh()
            else:
                self._bar.update(n - self._bar.n)
            self._bar.set_postfix(postfix, refresh=False)
        elif n >= self._last + max(self._total // 10, 1) or n < self._last:
            self._last = n
            items = ", ".join(f"{k}={v}" for k, v in postfix.items())
            print(f"train {n}/{self._total} {items}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._enabled and self._bar is not None:
            self._bar.close()


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
    ``range(data.index)`` minus ``skipped_ranges``, in order. README.md ("Rollback and data
    skipping") has the operator's view: the directory lock, preemption, disk space, end of
    data and the resume checks.

    Args:
      directory: checkpoints, ``events.jsonl``, the rollback record and the lock, created
        with its parents. Unwritable: ``OSError``; held by another controller: ``RuntimeError``.
      save_every: save when ``state.step % save_every == 0``; deferred while an episode is
        open or after a non-finite loss (``save_deferred``).
      keep: checkpoints kept (the newest; the best too for ``rollback_best``). Disk room
        for ``keep + 1`` is needed: the oldest goes once the next has committed.
      rollback_margin: the target is at least this many steps before the onset (less than
        ``save_every * keep``, else ``ValueError``).
      extra_skip: batches skipped beyond the last one fed before the rollback.
      detectors: default :func:`~stabljax.control.detectors.default_detectors`. Action
        ``"raise"`` raises :class:`TrainingDiverged`; an unknown action is a ``ValueError``.
      max_rollbacks: rollbacks allowed; the next one raises :class:`TrainingDiverged`.
      async_save: Orbax writes in the background (the host copy is made in :meth:`step`).
      background_save: one process only: a worker thread copies and writes an on-device
        copy of the state; its error is raised by the next call that waits for it.
      verify: fingerprint the state and digest the meta item; check both on restore.
      preemption_signals: "save at the next step boundary and stop" (SIGTERM; add SIGINT
        for Ctrl-C); JAX's sync point decides on several processes.
      data_config: JSON-able batch size, sequence length, corpus...; default the data's
        ``config``. A resume with another one is a ``CheckpointMismatch``.
      triage: ``True`` or a :class:`~stabljax.control.triage.TriageConfig`: after each
        rollback under :meth:`run`, replay the window on copies of the state and log a
        ``triage`` event (verdict ``data``/``state``/``nondeterministic``, evidence,
        culprits, attribution). Off by default; ``False`` changes nothing.
      remedy: ``remedy(state, info) -> state``, applied to the restored state at every
        rollback (after triage, so ``info.verdict`` is set) before training resumes, and
        logged as a ``remedy`` event; ``info`` is a
        :class:`~stabljax.control.remedies.RollbackInfo`. Built-ins in
        :mod:`~stabljax.control.remedies` (``lower_lr``, ``scale_hyperparam``,
        ``reset_second_moment``, ``by_verdict``, ``chain_remedies``). A restart that finds
        only checkpoints from before the last rollback applies it again (``reapplied``).

    Attributes:
      directory, events (the :class:`~stabljax.control.events.EventLog`), detectors, and
      last_run (the :class:`~stabljax.control.controller.RunResult` of :meth:`run`).

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
        rollback_margin: int = 100,
        extra_skip: int = 0,
        detectors: Sequence[Detector] | None = None,
        max_rollbacks: int = 10,
        async_save: bool = True,
        background_save: bool = False,
        verify: bool = True,
        preemption_signals: Sequence[int] = (signal.SIGTERM,),
        data_config: Any = None,
        triage: bool | tr.TriageConfig = False,
        remedy: Callable[[Any, RollbackInfo], Any] | None = None,
    ):
        sizes = dict(save_every=save_every, keep=keep, rollback_margin=rollback_margin)
        more = dict(extra_skip=extra_skip, max_rollbacks=max_rollbacks)
        policy.check_config(
            **sizes, **more, background_save=background_save, processes=jax.process_count()
        )
        self.save_every, self.keep = int(save_every), int(keep)
        self.rollback_margin, self.extra_skip = int(rollback_margin), int(extra_skip)
        self.max_rollbacks, self.verify = int(max_rollbacks), bool(verify)
        self.async_save, self.background_save = bool(async_save), bool(background_save)
        self.data_config = ck.jsonable(data_config)
        self.triage, self._train_step = tr.as_config(triage), None
        self.remedy = check_remedy(remedy)
        self.directory = pathlib.Path(directory).absolute()
        self._watch = PreemptionWatch(preemption_signals)
        ck.check_directory(self.directory)
        self.events = EventLog(self.directory / "events.jsonl", write=ck.is_primary())
        self._log = functools.partial(_append, self.events)  # no reference back to self
        detectors = default_detectors() if detectors is None else detectors
        self._monitor = Monitor(detectors, self._log)
        self.detectors = self._monitor.detectors
        self._lock, self._closed = DirectoryLock(self.directory), True
        self._open()
        self._data: DataIterator | None = None
        self._step: int | None = None
        self._abstract = self._pending = None  # the state's structure; (step, metrics) unread
        self._ledger = Ledger()  # survives rollbacks
        self.last_run: RunResult | None = None

    def _open(self) -> None:
        self._lock.acquire()
        try:
            self._store = ck.CheckpointStore(
                self.directory, async_save=self.async_save, log=self._log, keep=self.keep
            )
        except BaseException:
            self._lock.release()
            raise
        self._saver = Saver(
            self._store, self._monitor, self._log, keep=self.keep, verify=self.verify
        )
        self._saver.background = self.background_save
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

    def restore_or_init(self, state: Any, data: Any) -> tuple[Any, DataIterator]:
        """Resumes from the newest valid checkpoint, or saves ``state`` as the first one.

        Restores train state (to ``state``'s shapes, dtypes and shardings), data position,
        ledger and detector state; an unreadable checkpoint is a ``corrupt_checkpoint``
        event and goes to ``stabljax-corrupt/``; a crash mid-rollback is finished first.
        Other leaves, dtypes, shapes, tree structure or data config than the checkpoint's raise
        :class:`~stabljax.control.errors.CheckpointMismatch`. Returns ``(state, data)``:
        the state (``state`` itself in an empty directory) and a
        :class:`~stabljax.control.data.DataIterator` at the next batch; use it from now on.
        """
        ck.check_state(state)
        if self._closed:
            self._open()
        self._data = as_data_iterator(data)
        if self.triage is not None and self.triage.narrow_skip and not self._data.can_rewind:
            raise ValueError(
                f"TriageConfig(narrow_skip=True) moves the data back to the restored "
                f"checkpoint's position after a rollback, and {type(self._data).__name__} "
                "cannot move back (a plain iterator, a filtered or packed Grain pipeline): "
                "use IndexedBatches or a seekable Grain iterator, or narrow_skip=False"
            )
        self._abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        self._saver.data, self._saver.abstract = self._data, self._abstract
        self._store.state_bytes = ck.state_bytes(self._abstract)
        self._pending, _ = None, self._monitor.trim(0)
        self._store.clean_leftovers(RECORD)  # waits for saves in flight first
        steps = self._store.steps()
        if not steps:
            self._step = int(ck.to_host(state.step))
            self._watch.install(self._step)
            self._data.skipped_ranges = self._ledger.ranges
            self._save(state, sync=True)
            return state, self._data
        r = rb.resume(self._store, self._saver, self._data_config())
        self._step, self._ledger = self._saver.load(r.meta), r.ledger
        self._watch.install(self._step)
        self._data.skipped_ranges = r.ledger.ranges
        state = r.state
        if r.redo is not None and self.remedy is not None:
            state = rb.reapply_remedy(self.remedy, state, r.redo)
        rb.place(self._data, r.index, state, self._step, saved=r.saved)
        self._saver.retain()
        details = dict(skipped_ranges=r.ledger.ranges, rollbacks=r.ledger.rollbacks)
        self._log("restore", self._step, data_index=self._data.index, **r.detail, **details)
        if r.redo is not None and self.remedy is not None:
            rb.log_remedy(self._log, r.redo, reapplied=True)
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
        Monitor.check_metrics(metrics)
        data = self._resolve(data)
        self._step += 1
        previous, self._pending = self._pending, (self._step - 1, metrics)
        if previous is not None and (restored := self._process(*previous)) is not None:
            return restored, data
        if self._poll:
            self._store.poll()
        due = self._step % self.save_every == 0
        if self._watch.should_stop(self._step, agree=due):
            state = self._flush_and_save(state, sync=True, off_grid=not due)
            saved = self._saver.saved_at == self._step
            self._log("preempted", self._step, signal=self._watch.signum, saved=saved)
            raise Preempted(self._step, self._watch.signum, saved, state)
        if due or self._saver.deferred is not None:
            state = self._flush_and_save(state)
        return state, data

    def finish(self, state: Any, data: Any) -> tuple[Any, Any]:
        """Reads the last pending metrics and saves the state (waits); may roll back."""
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
        if self._closed or self._step is None or self._data is None:
            state, data = self.restore_or_init(state, data)
        data, target = self._resolve(data), int(num_steps)
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
        try:
            self._store.settle()
            self._saver.retain()
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
        self.close(quiet=exc_type is not None)

    def __repr__(self) -> str:
        args = f"save_every={self.save_every}, keep={self.keep}, step={self._step}"
        return f"RollbackController({str(self.directory)!r}, {args}, rollbacks={self.rollbacks})"

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
        verdict = rb.decide(found, self._ledger, step=step, max_rollbacks=self.max_rollbacks)
        if verdict is None:
            return None
        if verdict.action == "give_up":
            rb.give_up(
                verdict.detections, verdict.headline, self._monitor, self._ledger, self._store
            )
        fed_end = self._data.next_index + 1 if early else self._data.index
        return self._rollback(verdict.detections, fed_end)

    def _flush_and_save(self, state: Any, *, sync: bool = False, off_grid: bool = False) -> Any:
        """Reads the pending metrics, then saves unless they rolled back.

        ``off_grid``: a preemption between save steps; the metrics are read early and the
        checkpoint is a resume point only, never a rollback target.
        """
        if self._pending is not None:
            pending, self._pending = self._pending, None
            if (restored := self._process(*pending, early=off_grid)) is not None:
                return restored
        self._save(state, sync=sync, resume_only=off_grid)
        if sync:
            self._store.settle()
            self._saver.retain()
        return state

    def _data_config(self) -> Any:
        return ck.jsonable(self.data_config or getattr(self._data, "config", None))

    def _save(self, state: Any, *, sync: bool = False, resume_only: bool = False) -> None:
        kw = dict(sync=sync, resume_only=resume_only)
        self._saver.maybe_save(self._step, state, self._ledger, self._data_config(), **kw)

    def _rollback(self, triggers: Sequence[Detection], fed_end: int) -> Any:
        cfg = rb.RollbackConfig(
            margin=self.rollback_margin,
            extra_skip=self.extra_skip,
            window=self.save_every * self.keep,
            max_rollbacks=self.max_rollbacks,
            triage=self.triage,
            step_fn=self._train_step,
            remedy=self.remedy,
        )
        parts = (self._store, self._saver, self._monitor, self._ledger, self._data, cfg)
        r = rb.roll_back(*parts, triggers=triggers, fed_end=fed_end)
        # The checkpoint's trajectory (detectors, EMA) comes back; the run ledger moves on,
        # and the losses of the abandoned branch leave the history shown in events.
        self._step, self._ledger, self._pending = self._saver.load(r.meta), r.ledger, None
        self._monitor.trim(r.step)
        self._data.skipped_ranges = r.ledger.ranges
        rb.place(self._data, r.index, r.state, self._step)
        self._log("restore", r.step, data_index=self._data.index, reason="rollback")
        return r.state
