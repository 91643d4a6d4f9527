"""The rollback controller: PaLM's remedy for loss spikes, made automatic.

When training spikes or diverges, :class:`RollbackController` restores a checkpoint from
before the episode, skips the data batches fed since that checkpoint, and carries on; on
one host or many, across crashes and restarts. The decisions it implements (see
``/work/shared/REFERENCES.md``, "Rollback controller"):

* **Steps.** The loss of step ``s`` is the one computed on the batch fed when
  ``state.step == s``; the train step increments ``state.step`` on every call, skipped or
  not. The controller keeps a host copy of it and never reads the device value except
  when saving.
* **One step of lag.** :meth:`RollbackController.step` stashes the device metrics of the
  step just dispatched and reads those of the previous one, which are ready by then, so
  the device is never idle. On a save step it also reads the current ones: the
  device-to-host copy of the checkpoint waits for that step anyway. So every checkpoint
  holds a state whose losses all passed the detectors, and the detector state in it is
  exactly the one after those losses.
* **Background saves** (``background_save=True``, one process). A save step dispatches
  an on-device copy of the state and hands the save to one worker thread; the
  checkpoint's data position, ledger and detector state are captured on the training
  thread at that step. Every call that touches checkpoints
  (the next save, a rollback, :meth:`~RollbackController.finish`,
  :meth:`~RollbackController.close`) first waits for the worker and raises its error.
* **Rollback.** On a detection that rolls back, the target is the newest checkpoint with
  ``step <= onset - rollback_margin`` (else the oldest kept one, noted in the event).
  The data moves past every batch fed from the target's data position until now, plus
  ``extra_skip``; that half-open range joins ``skipped_ranges``. A rollback within
  ``save_every * keep`` steps of the previous one's target skips at least twice the
  previous range, so a long bad stretch is passed in logarithmically many rollbacks.
  After ``max_rollbacks`` rollbacks the next one raises :class:`TrainingDiverged`.
* **Crash safety.** Orbax writes each checkpoint to a temporary directory and renames it
  when complete; a half-written one is ignored and cleaned up. The ledger (skipped
  ranges, rollback count) is saved in every checkpoint (an Orbax ``Composite`` with the
  train state, the data position, and a JSON ``meta`` item); before a rollback deletes
  the newer checkpoints it writes a small rollback record (JSON, atomic rename), and a
  restart finishes a record newer than the newest checkpoint first. Each checkpoint
  also stores an on-device fingerprint of the state (two wrap-around uint32 sums per
  leaf), checked on restore, so silent corruption is caught, not just truncation.
* **Several hosts.** Every process calls every method in the same order. Metrics are
  global arrays; a replicated scalar is read from its local copy
  (``addressable_data(0)``), any other through ``process_allgather``, so every process
  sees the same numbers and reaches the same decisions. All processes save, restore and
  delete together (Orbax synchronises them); only the primary host (process 0) writes
  ``events.jsonl`` and the rollback record.

References:
  Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
  <https://arxiv.org/abs/2204.02311>`_, 2022 (section 5.1, "Training instability").
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import math
import os
import pathlib
import shutil
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.experimental import multihost_utils

from stabljax.control.data import (
    DataIterator,
    GrainDatasetIterator,
    GrainLoaderIterator,
    as_data_iterator,
    first_allowed,
    merge_ranges,
)
from stabljax.control.detect import Detection, Detector, default_detectors
from stabljax.control.events import Event, EventLog

_RECORD = "stabljax-rollback.json"
_EVENTS = "events.jsonl"
_TRASH = "stabljax-trash"
_CORRUPT = "stabljax-corrupt"
_META_VERSION = 1
_EMA_DECAY = 0.98
_HISTORY = 10


class TrainingDiverged(RuntimeError):
    """Raised when training keeps failing after ``max_rollbacks`` rollbacks.

    The message lists what was seen (the losses around each event, the ranges skipped)
    and what to try. ``history`` holds the rollback records as dicts.
    """

    def __init__(self, message: str, history: Sequence[Mapping[str, Any]] = ()):
        super().__init__(message)
        self.history = [dict(h) for h in history]


# ---------------------------------------------------------------------------------------
# Host reads and the state fingerprint.


def _to_host(x: Any) -> np.ndarray:
    """A numpy copy of ``x``; on several hosts the same value on every process."""
    if isinstance(x, jax.Array):
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _host_scalars(metrics: Mapping[str, Any], keys: frozenset[str] | None) -> dict[str, Any]:
    """Host Python scalars for the 0-d entries of ``metrics`` (all, or those in ``keys``)."""
    wanted = {
        k: v
        for k, v in metrics.items()
        if (keys is None or k in keys)
        and not (isinstance(v, Mapping) or v is None)
        and np.shape(v) == ()
    }
    for v in wanted.values():  # start every copy before waiting on the first
        if isinstance(v, jax.Array) and v.is_fully_addressable:
            v.copy_to_host_async()
    return {k: _to_host(v).item() for k, v in wanted.items()}


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag])
    words = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    u = lax.bitcast_convert_type(x, words).astype(jnp.uint32)
    # A position-dependent odd weight, built per axis (no reshape of a sharded array).
    w = jnp.ones(u.shape, jnp.uint32)
    mults = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
    for axis in range(u.ndim):
        iota = lax.broadcasted_iota(jnp.uint32, u.shape, axis)
        w = w + iota * jnp.uint32(mults[axis % 4]) * jnp.uint32(2)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * w, dtype=jnp.uint32)])


@jax.jit
def _fingerprint(tree: Any) -> jax.Array:
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.concatenate([_leaf_fingerprint(x) for x in leaves])


def _device_snapshot(tree: Any) -> Any:
    """``tree`` with every ``jax.Array`` copied on its devices (same shardings), async.

    The train step may donate the original buffers as soon as this returns.
    """
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    copies = jax.device_put([leaves[i] for i in where], may_alias=False)
    out = [np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in leaves]
    for i, copy in zip(where, copies, strict=True):
        out[i] = copy
    return jax.tree.unflatten(treedef, out)


class _FrozenState:
    """Stands in for a Grain iterator in a save: its state as it was when this was made.

    Grain's handler writes ``json.dumps(get_state())`` for a ``DatasetIterator`` and
    ``get_state().decode()`` for anything else (a ``DataLoader`` iterator's bytes), so
    this holds the bytes of what Grain would write.
    """

    def __init__(self, iterator: Any):
        state = iterator.get_state()
        if isinstance(iterator, grain.DatasetIterator):
            state = json.dumps(state, indent=4).encode()
        self._state = bytes(state)

    def get_state(self) -> bytes:
        return self._state


class _Sweeper:
    """Removes directories in daemon threads; :meth:`join` waits for all of them."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def remove(self, path: pathlib.Path) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(
            target=shutil.rmtree,
            args=(path,),
            kwargs={"ignore_errors": True},
            name="stabljax-trash",
            daemon=True,
        )
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads = []


def _is_primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"stabljax:{name}")


def _all_agree(ok: bool) -> bool:
    """True when ``ok`` holds on every process (the same answer everywhere)."""
    if jax.process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.asarray(ok, np.int32))
    return bool(np.all(flags))


def _atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Progress:
    """tqdm when installed, else a line on stderr every 10%."""

    def __init__(self, total: int, initial: int):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm is an optional dependency
            tqdm = None
        self._bar = None
        if tqdm is not None:
            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True)
        self._total, self._last, self._post = total, initial, ""

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
        if self._bar is not None:
            self._bar.close()


_ADVICE = (
    "What to try: lower the learning rate or lengthen the warmup; add a z-loss on the "
    "softmax normaliser (z_loss=1e-4) if log Z drifts; raise Adam's eps or use "
    "safe_adamw / adam_atan2 if the update ratio saturates; check the initialization "
    "(a smaller init std, scaled residual branches); inspect the skipped batches for bad "
    "data; raise max_rollbacks or extra_skip if the bad data stretch is long."
)


class RollbackController:
    """Checkpoints training, detects spikes and divergence, and rolls back past bad data.

    Typical use is :meth:`run`; :meth:`restore_or_init` and :meth:`step` are its parts
    for a hand-written loop::

        ctl = RollbackController("ckpt", save_every=100)
        state, data = ctl.restore_or_init(state, IndexedBatches(batch_fn))
        while ctl.current_step < num_steps:
            state, metrics = train_step(state, next(data))
            state, data = ctl.step(state, metrics, data)
        state, data = ctl.finish(state, data)

    Each rollback restores train state, data position and detector state together;
    ``skipped_ranges`` (half-open data-index ranges never fed again) and the rollback
    count survive rollbacks and restarts. The data indices the final state was trained
    on are exactly ``range(data.index)`` minus ``skipped_ranges``, in order.

    Args:
      directory: where checkpoints, ``events.jsonl`` and the rollback record live;
        created if missing. A path that cannot be created or written is an error here.
      save_every: checkpoint every this many steps (``state.step % save_every == 0``).
      keep: checkpoints kept (the newest ones; plus the one with the lowest smoothed
        loss when a detector may roll back to it).
      rollback_margin: the target checkpoint is at least this many steps before the
        episode's onset.
      extra_skip: batches skipped beyond the last one fed before the rollback.
      detectors: the :class:`~stabljax.control.detect.Detector` list; default
        :func:`~stabljax.control.detect.default_detectors` (spike, divergence,
        warn-only slow divergence).
      max_rollbacks: rollbacks allowed in the run; the next one raises
        :class:`TrainingDiverged`.
      async_save: save in the background (Orbax); the device-to-host copy still
        happens before :meth:`step` returns, so the train step may donate the state.
      background_save: hand the whole save to a background thread: on a save step,
        :meth:`step` dispatches an on-device copy of the state and returns; the thread
        copies it to the host and writes it (and deletes surplus checkpoints). Costs one
        more copy of the state in device memory from the save step until its device-to-host
        copy is done. On the controller benchmark's model (48 leaves, CPU) the training
        thread's time in a save step falls from a median 82 ms to 9 ms; the CPU work itself
        remains (on a CPU-only host it still competes with the step). An error in the thread
        is raised by the next call that waits for it (the next save, a rollback,
        :meth:`finish` or :meth:`close`). Single process only: Orbax's barriers are device
        collectives there, which must not race the train step's own collectives on other
        hosts.
      verify: store a fingerprint of the state and check it on restore.

    Attributes:
      directory: the checkpoint directory (absolute).
      events: the :class:`~stabljax.control.events.EventLog` of this process's run
        (also appended to ``directory/events.jsonl`` by the primary host).
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
      >>> def batch_fn(i):  # batch 30 is poisoned: its loss spikes, its update throws w off
      ...     return jnp.full((4,), 1e3 if i == 30 else 1.0 + 0.1 * (i % 3))
      >>> ctl = RollbackController(
      ...     tempfile.mkdtemp(), save_every=10, rollback_margin=5,
      ...     detectors=[SpikeDetector(warmup=5)], async_save=False)
      >>> state, data = ctl.run(train_step, State(jnp.int32(0), jnp.float32(0.0)),
      ...                       IndexedBatches(batch_fn), 50, progress=False)
      >>> print(int(state.step), data.index, ctl.skipped_ranges, ctl.rollbacks)
      50 62 [(20, 32)] 1
      >>> print(round(float(state.w), 4))
      2.0
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
        self.save_every = int(save_every)
        self.keep = int(keep)
        self.rollback_margin = int(rollback_margin)
        self.extra_skip = int(extra_skip)
        self.max_rollbacks = int(max_rollbacks)
        self.async_save = bool(async_save)
        self.background_save = bool(background_save)
        if self.background_save and jax.process_count() > 1:
            raise ValueError(
                f"background_save=True needs a single process, got {jax.process_count()}: "
                "Orbax synchronises hosts with device collectives, which a background "
                "thread would issue in an order unrelated to the train step's own"
            )
        self.verify = bool(verify)
        self.detectors: list[Detector] = (
            list(detectors) if detectors is not None else default_detectors()
        )
        names = [d.name for d in self.detectors]
        if len(set(names)) != len(names):
            raise ValueError(f"detector names must be unique, got {names}")
        # Only the metrics some detector reads are fetched (each fetch is a host transfer).
        wanted = [getattr(d, "keys", None) for d in self.detectors]
        self._keys = None if any(k is None for k in wanted) else frozenset({"loss"}.union(*wanted))
        self._protect_best = any(
            getattr(d, "action", None) == "rollback_best" for d in self.detectors
        )
        self.directory = pathlib.Path(directory).absolute()
        self._check_directory()
        self.events = EventLog(self.directory / _EVENTS, write=_is_primary())
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_names=("state", "data", "meta"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None,
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
                todelete_subdir=_TRASH,
                create=True,
            ),
        )
        self._data: DataIterator | None = None
        self._abstract: Any = None
        self._step: int | None = None
        self._pending: tuple[int, Mapping[str, Any]] | None = None
        self._recent: collections.deque = collections.deque(maxlen=64)
        # Run ledger: survives rollbacks.
        self._ranges: list[tuple[int, int]] = []
        self._rollbacks = 0
        self._last_rollback: dict[str, Any] | None = None
        self._history: list[dict[str, Any]] = []
        # Trajectory state: comes back with a checkpoint.
        self._ema = [0.0, 0]
        self._ckpt_losses: dict[int, float] = {}
        self._saved_at: int | None = None
        self._sweeper = _Sweeper()
        self._saver: concurrent.futures.ThreadPoolExecutor | None = None
        self._saving: concurrent.futures.Future | None = None

    # ----------------------------------------------------------------------- properties

    @property
    def skipped_ranges(self) -> list[tuple[int, int]]:
        """Half-open data-index ranges ``[a, b)`` that are never fed again."""
        return list(self._ranges)

    @property
    def rollbacks(self) -> int:
        """Rollbacks in this run (restarts included)."""
        return self._rollbacks

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

    def checkpoint_steps(self) -> list[int]:
        """The steps of the checkpoints on disk (waits for a save in flight)."""
        self._settle()
        self._manager.reload()
        return sorted(self._manager.all_steps())

    # -------------------------------------------------------------------- public methods

    def restore_or_init(self, state: Any, data: Any) -> tuple[Any, DataIterator]:
        """Resumes from the newest valid checkpoint, or saves ``state`` as the first one.

        Restores train state (against ``state``'s shapes, dtypes and shardings), data
        position, skip ledger and detector state. A checkpoint that fails to restore or
        to verify is reported (``corrupt_checkpoint`` event), set aside under
        ``stabljax-corrupt/`` and the previous one is used. A rollback record newer than
        the newest checkpoint (a crash during a rollback) is finished first.

        Args:
          state: the initial train state (a pytree with an int ``step`` field); its
            arrays give the restore target's shardings.
          data: the training data (see :func:`~stabljax.control.data.as_data_iterator`).

        Returns:
          ``(state, data)``: the restored state, or ``state`` itself on an empty
          directory; and the data as a :class:`~stabljax.control.data.DataIterator`,
          positioned at the next batch to feed. Use this iterator from now on.
        """
        if not hasattr(state, "step"):
            raise TypeError(
                f"state must have a 'step' field (int32 scalar), got {type(state).__name__}"
            )
        self._data = as_data_iterator(data)
        self._abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        self._pending = None
        self._settle()
        if _is_primary():  # a rollback record that a crash left half-written
            for tmp in self.directory.glob(f".{_RECORD}.tmp-*"):
                tmp.unlink(missing_ok=True)
            for doomed in self.directory.glob(f"{_TRASH}.*"):  # a sweep a crash cut short
                self._sweeper.remove(doomed)
        self._manager.reload()
        steps = sorted(self._manager.all_steps())
        if not steps:
            self._step = int(_to_host(state.step))
            self._data.skipped_ranges = self._ranges
            self._save(state, sync=True)
            return state, self._data

        record = self._read_record()
        newest_meta = None
        for s in reversed(steps):
            newest_meta = self._try(lambda s=s: self._read_meta(s))
            if newest_meta is not None:
                break
        pending = (
            record is not None
            and record["target_step"] in steps
            and (newest_meta is None or newest_meta["rollbacks"] < record["rollbacks"])
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
                f"{sorted(failed)}; see {_EVENTS}). If the train state's structure changed, "
                "use a new directory."
            )
        new_state, meta = restored
        for s in failed:
            self._set_aside(s)
        self._apply_meta(meta, trajectory=True, ledger=True)
        index = int(meta["data_index"])
        if record is not None and record["rollbacks"] > self._rollbacks:
            self._ranges = merge_ranges(self._ranges + [tuple(r) for r in record["skipped_ranges"]])
            self._rollbacks = int(record["rollbacks"])
            self._last_rollback = record.get("last_rollback")
            self._history = list(record.get("history", []))
            if int(meta["step"]) == record["target_step"]:
                index = max(index, int(record["data_index"]))
        self._data.skipped_ranges = self._ranges
        self._data.seek(first_allowed(index, self._ranges))
        self._retain()
        self._saved_at = self._step
        self._log(
            "restore",
            self._step,
            data_index=self._data.index,
            reason="resume" + (" (finished an interrupted rollback)" if pending else ""),
            skipped_ranges=self._ranges,
            rollbacks=self._rollbacks,
        )
        return new_state, self._data

    def step(self, state: Any, metrics: Mapping[str, Any], data: Any) -> tuple[Any, Any]:
        """Records one training step; saves, or rolls back, when it is time.

        Call it once per train-step call, right after dispatching it, with the state and
        device metrics it returned. It reads the previous call's metrics (ready by now)
        and only stashes these, so it does not wait for the device, except on a save
        step: there it reads this step's metrics too (the checkpoint's detector state is
        the one after them), and, unless ``background_save``, Orbax copies the state to
        the host before returning.

        Args:
          state: the state the train step returned (``state.step`` one more than before).
          metrics: its metrics dict; must contain ``"loss"``; ``"skipped"`` and
            ``"skip_streak"`` are read when present.
          data: the iterator :meth:`restore_or_init` returned.

        Returns:
          ``(state, data)``: after a rollback, the restored state, and the data moved
          past the skipped range; otherwise the inputs.

        Raises:
          TrainingDiverged: when a rollback is needed after ``max_rollbacks``.
          ValueError: when ``state.step`` does not match the steps counted (checked on
            save steps; with ``background_save``, by the call that waits for that save).
        """
        if self._step is None or self._data is None:
            raise RuntimeError("call restore_or_init(state, data) before step()")
        if not isinstance(metrics, Mapping) or "loss" not in metrics:
            keys = sorted(metrics) if isinstance(metrics, Mapping) else type(metrics).__name__
            raise ValueError(
                f"metrics must be a dict with a scalar 'loss' entry (the train step's loss); "
                f"got {keys}"
            )
        data = self._resolve(data)
        self._step += 1
        previous, self._pending = self._pending, (self._step - 1, metrics)
        if previous is not None:
            restored = self._process(*previous)
            if restored is not None:
                return restored, data
        if self._step % self.save_every == 0:
            state = self._flush_and_save(state)
        return state, data

    def finish(self, state: Any, data: Any) -> tuple[Any, Any]:
        """Reads the last pending metrics and saves the final state (waits for it).

        Returns:
          ``(state, data)``; after a rollback on the last metrics, the restored state
          (train on until ``current_step`` is back at the target).
        """
        data = self._resolve(data)
        state = self._flush_and_save(state, sync=True)
        return state, data

    def run(
        self,
        train_step: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
        state: Any,
        data: Any,
        num_steps: int,
        *,
        progress: bool = True,
    ) -> tuple[Any, DataIterator]:
        """Trains until ``state.step == num_steps``, with checkpoints and rollbacks.

        ``num_steps`` is a target, not a count: the same command, restarted after a
        crash, resumes from the newest checkpoint and ends where an uninterrupted run
        does. :meth:`restore_or_init` is called first unless it already was.

        Args:
          train_step: ``train_step(state, batch) -> (state, metrics)``, typically jitted.
          state: the initial state (ignored in favour of a checkpoint when one exists).
          data: the training data.
          num_steps: the step to train to.
          progress: show a progress bar (tqdm when installed) with the smoothed loss
            and the counts of spikes, rollbacks and skipped batches.

        Returns:
          ``(state, data)`` at ``num_steps``, saved.
        """
        if self._step is None or self._data is None:
            state, data = self.restore_or_init(state, data)
        data = self._resolve(data)
        bar = _Progress(int(num_steps), self._step) if progress else None
        try:
            while True:
                while self._step < num_steps:
                    try:
                        batch = next(data)
                    except StopIteration:
                        warnings.warn(
                            f"the data ran out at step {self._step} (index {data.index})",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                        return self.finish(state, data)
                    state, metrics = train_step(state, batch)
                    state, data = self.step(state, metrics, data)
                    if bar is not None:
                        bar.update(self._step, self._postfix())
                state, data = self.finish(state, data)
                if self._step >= num_steps:
                    return state, data
        finally:
            if bar is not None:
                bar.update(self._step, self._postfix())
                bar.close()

    def close(self) -> None:
        """Waits for saves and deletions in flight, drops surplus checkpoints, closes Orbax.

        Raises the error of a failed background save (after closing everything).
        """
        try:
            self._settle()
            self._retain()
        finally:
            if self._saver is not None:
                self._saver.shutdown(wait=True)
                self._saver = None
            self._manager.close()
            self._sweeper.join()

    def __enter__(self) -> RollbackController:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"RollbackController({str(self.directory)!r}, save_every={self.save_every}, "
            f"keep={self.keep}, rollback_margin={self.rollback_margin}, "
            f"step={self._step}, rollbacks={self._rollbacks}, skipped={self._ranges})"
        )

    # --------------------------------------------------------------------- observation

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
            "rollbacks": self._rollbacks,
            "skipped": sum(b - a for a, b in self._ranges),
        }

    def _observe(self, step: int, metrics: Mapping[str, Any]) -> list[Detection]:
        host = _host_scalars(metrics, self._keys)
        loss = float(host["loss"])
        self._recent.append((step, loss, bool(host.get("skipped", False))))
        if math.isfinite(loss):
            self._ema[0] = _EMA_DECAY * self._ema[0] + (1 - _EMA_DECAY) * loss
            self._ema[1] += 1
        found = []
        for det in self.detectors:
            d = det.update(step, host)
            if d is None:
                continue
            found.append(d)
            self._log(
                d.kind,
                d.step,
                action=d.action,
                onset=d.onset,
                value=d.value,
                reason=d.reason,
                detector=det.name,
                **d.details,
            )
            if d.action == "warn":
                warnings.warn(d.reason, RuntimeWarning, stacklevel=4)
        return [d for d in found if d.rolls_back]

    def _process(self, step: int, metrics: Mapping[str, Any]) -> Any:
        """Feeds one step's metrics to the detectors; returns a restored state or None."""
        triggers = self._observe(step, metrics)
        if not triggers:
            return None
        return self._rollback(triggers)

    def _flush_and_save(self, state: Any, *, sync: bool = False) -> Any:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            restored = self._process(*pending)
            if restored is not None:
                return restored
        if self._saved_at != self._step:
            self._save(state, sync=sync)
        if sync:
            self._settle()
            self._retain()
        return state

    # ---------------------------------------------------------------------- checkpoints

    def _check_directory(self) -> None:
        probe = self.directory / f".stabljax-probe-{os.getpid()}-{jax.process_index()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise OSError(
                f"checkpoint directory {str(self.directory)!r} cannot be created or written "
                f"({type(e).__name__}: {e}); pass a writable directory"
            ) from e

    def _data_args(self, restore: bool):
        """Orbax args for the data item; a save holds the position as of this call."""
        if isinstance(self._data, GrainDatasetIterator | GrainLoaderIterator):
            if restore:
                return grain.checkpoint.CheckpointRestore(self._data.source)
            return grain.checkpoint.CheckpointSave(_FrozenState(self._data.source))
        if restore:
            return ocp.args.JsonRestore()
        return ocp.args.JsonSave(json.loads(json.dumps(self._data.get_state())))

    def _meta(self) -> dict[str, Any]:
        """The checkpoint's meta item as of now; :meth:`_write` adds the scores of the kept
        checkpoints (``ckpt_losses``) and the ``fingerprint``."""
        return {
            "version": _META_VERSION,
            "step": self._step,
            "data_index": self._data.index,
            "skipped_ranges": [list(r) for r in self._ranges],
            "rollbacks": self._rollbacks,
            "last_rollback": self._last_rollback,
            "history": self._history,
            "detectors": {d.name: d.get_state() for d in self.detectors},
            "ema": list(self._ema),
        }

    def _settle(self) -> None:
        """Waits for the save in flight: a background one (raising its error), then Orbax's."""
        self._join_saver()
        self._manager.wait_until_finished()

    def _join_saver(self) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()

    def _check_step(self, actual: int, step: int) -> None:
        if actual != step:
            raise ValueError(
                f"state.step is {actual} but the controller counted {step} steps: the train "
                "step must increment state.step by one on every call (skipped or not)"
            )

    def _save(self, state: Any, *, sync: bool = False) -> None:
        """Captures the checkpoint of this step and writes it, here or on the worker thread.

        What the checkpoint holds besides the state (data position, ledger, detector
        state) is captured here, on the training thread, as of this step; with
        ``background_save`` the state is an on-device copy, so the step may donate it.
        """
        self._join_saver()
        step = self._step
        background = self.background_save and not sync
        if background:
            state = _device_snapshot(state)
        fingerprint = _fingerprint(state) if self.verify else None  # dispatched, read later
        meta = self._meta()
        if background:
            meta = json.loads(json.dumps(meta))  # a deep copy: the loop runs on meanwhile
        write = functools.partial(
            self._write,
            step,
            state,
            fingerprint,
            meta,
            self._data_args(restore=False),
            self.smoothed_loss,
            wait=sync,
        )
        if background:
            if self._saver is None:
                self._saver = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="stabljax-save"
                )
            self._saving = self._saver.submit(write)
        else:
            write()
        self._saved_at = step

    def _write(
        self,
        step: int,
        state: Any,
        fingerprint: jax.Array | None,
        meta: dict[str, Any],
        data_args: Any,
        smoothed: float | None,
        *,
        wait: bool,
    ) -> None:
        """Writes checkpoint ``step``: on the worker thread with ``background_save``.

        The training thread joins that thread before it touches Orbax or the scores of
        the kept checkpoints, which only this method changes while a save is in flight.
        """
        self._manager.wait_until_finished()
        self._retain()
        self._check_step(int(_to_host(state.step)), step)
        if smoothed is not None:
            self._ckpt_losses[step] = smoothed
        meta["ckpt_losses"] = {str(k): v for k, v in self._ckpt_losses.items()}
        meta["fingerprint"] = (
            None if fingerprint is None else [int(v) for v in _to_host(fingerprint)]
        )
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=data_args,
            meta=ocp.args.JsonSave(meta),
        )
        if not self._manager.save(step, args=args):
            raise RuntimeError(
                f"Orbax refused to save step {step} in {self.directory} (existing steps "
                f"{sorted(self._manager.all_steps())})"
            )
        if wait or not self.async_save:
            self._manager.wait_until_finished()
        self._log("save", step, data_index=meta["data_index"], smoothed_loss=smoothed)

    def _read_meta(self, step: int) -> dict[str, Any]:
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = out["meta"]
        if not isinstance(meta, dict) or meta.get("version") != _META_VERSION:
            raise ValueError(f"checkpoint {step} has no stabljax meta (version {_META_VERSION})")
        return meta

    def _restore(self, step: int, *, with_data: bool) -> tuple[Any, dict[str, Any]]:
        """Restores (and verifies) checkpoint ``step``; sets the data state if asked."""
        items = {
            "state": ocp.args.StandardRestore(self._abstract),
            "meta": ocp.args.JsonRestore(),
        }
        grain_data = isinstance(self._data, GrainDatasetIterator | GrainLoaderIterator)
        if with_data:
            items["data"] = self._data_args(restore=True)
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        state, meta = out["state"], out["meta"]
        if not isinstance(meta, dict) or meta.get("version") != _META_VERSION:
            raise ValueError(f"checkpoint {step} has no stabljax meta (version {_META_VERSION})")
        if int(meta["step"]) != step or int(_to_host(state.step)) != step:
            raise ValueError(f"checkpoint {step} holds step {meta['step']} / {state.step}")
        if self.verify and meta.get("fingerprint") is not None:
            got = [int(v) for v in _to_host(_fingerprint(state))]
            if got != meta["fingerprint"]:
                raise ValueError(f"checkpoint {step}: state fingerprint mismatch (corrupted data)")
        if with_data:
            if grain_data:
                self._data._set_index(int(meta["data_index"]))
            else:
                data_state = dict(out["data"])
                if int(data_state["index"]) != int(meta["data_index"]):
                    raise ValueError(f"checkpoint {step}: data position disagrees with meta")
                self._data.set_state(data_state)
        return state, meta

    def _try(self, fn: Callable[[], Any], *, step: int | None = None) -> Any:
        """``fn()``, or None (with a ``corrupt_checkpoint`` event) if it fails anywhere."""
        try:
            result, ok, err = fn(), True, None
        except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
            result, ok, err = None, False, e
        if not _all_agree(ok):
            if step is not None:
                reason = f"{type(err).__name__}: {err}"[:500] if err else "failed on another host"
                self._log("corrupt_checkpoint", step, reason=reason)
            return None
        return result

    def _apply_meta(self, meta: Mapping[str, Any], *, trajectory: bool, ledger: bool) -> None:
        if trajectory:
            self._step = int(meta["step"])
            states = meta.get("detectors", {})
            for d in self.detectors:
                d.set_state(states.get(d.name, {}))
            self._ema = [float(meta["ema"][0]), int(meta["ema"][1])]
            self._ckpt_losses = {int(k): float(v) for k, v in meta["ckpt_losses"].items()}
        if ledger:
            self._ranges = merge_ranges(tuple(r) for r in meta["skipped_ranges"])
            self._rollbacks = int(meta["rollbacks"])
            self._last_rollback = meta.get("last_rollback")
            self._history = list(meta.get("history", []))

    def _step_dir(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def _empty_trash(self) -> None:
        """Removes deleted checkpoints off the training thread (primary host only).

        Orbax's delete only renames a step into ``stabljax-trash/``; removing its files
        can take seconds for a large checkpoint, so the trash is renamed aside (atomic)
        and removed by a background thread. A crash mid-way leaves a
        ``stabljax-trash.*`` folder, which the next :meth:`restore_or_init` removes.
        """
        if not _is_primary():
            return
        trash = self.directory / _TRASH
        if trash.exists():
            doomed = trash.with_name(f"{_TRASH}.{uuid.uuid4().hex}")
            os.replace(trash, doomed)
            self._sweeper.remove(doomed)

    def _delete(self, steps: Sequence[int]) -> None:
        existing = set(self._manager.all_steps())
        for s in sorted(steps, reverse=True):
            if s in existing:
                self._manager.delete(s)
        self._empty_trash()

    def _delete_newer_than(self, step: int) -> None:
        self._settle()
        self._delete([s for s in self._manager.all_steps() if s > step])

    def _set_aside(self, step: int) -> None:
        """Moves a corrupt checkpoint to ``stabljax-corrupt/`` (kept for inspection)."""
        if _is_primary() and self._step_dir(step).exists():
            dest = self.directory / _CORRUPT
            dest.mkdir(exist_ok=True)
            os.replace(self._step_dir(step), dest / f"{step}-{int(time.time())}")
        _barrier(f"set_aside_{step}")
        self._manager.reload()

    def _kept(self) -> list[int]:
        steps = sorted(self._manager.all_steps())
        keep = set(steps[-self.keep :])
        best = self._best(steps)
        if best is not None:
            keep.add(best)
        return sorted(keep)

    def _best(self, steps: Sequence[int]) -> int | None:
        if not self._protect_best:
            return None
        scored = [(self._ckpt_losses[s], s) for s in steps if s in self._ckpt_losses]
        return min(scored)[1] if scored else None

    def _retain(self) -> None:
        """Deletes checkpoints beyond the newest ``keep`` (and the best); no save in flight."""
        kept = self._kept()
        surplus = [s for s in self._manager.all_steps() if s not in kept]
        if surplus:
            self._delete(surplus)
        self._ckpt_losses = {s: v for s, v in self._ckpt_losses.items() if s in kept}

    def _read_record(self) -> dict[str, Any] | None:
        path = self.directory / _RECORD
        try:
            record = json.loads(path.read_text())
            int(record["rollbacks"]), int(record["target_step"]), int(record["data_index"])
            return record
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # ------------------------------------------------------------------------- rollback

    def _losses_before(self, step: int, n: int = 12) -> list[list[Any]]:
        out = [[s, loss, sk] for s, loss, sk in self._recent if s <= step]
        return [[s, loss if math.isfinite(loss) else str(loss), sk] for s, loss, sk in out[-n:]]

    def _diverged(self, triggers: Sequence[Detection]) -> TrainingDiverged:
        lines = [
            f"Training diverged: {self._rollbacks} rollback(s) (max_rollbacks="
            f"{self.max_rollbacks}) did not get past the trouble.",
            f"Now, at step {triggers[0].step}: " + "; ".join(d.reason for d in triggers),
            "Losses before it (step: loss, * = update skipped by a guard): "
            + ", ".join(
                f"{s}: {loss if isinstance(loss, str) else f'{loss:.4g}'}{'*' if sk else ''}"
                for s, loss, sk in self._losses_before(triggers[0].step)
            ),
        ]
        if self._history:
            lines.append("Rollbacks so far:")
            for i, h in enumerate(self._history, 1):
                losses = ", ".join(
                    f"{s}: {v if isinstance(v, str) else f'{v:.4g}'}" for s, v, _ in h["losses"]
                )
                lines.append(
                    f"  {i}. at step {h['detected']} (onset {h['onset']}) -> step "
                    f"{h['restored']}, skipped batches [{h['range'][0]}, {h['range'][1]}): "
                    f"{h['reason']}; losses before: {losses}"
                )
        total = sum(b - a for a, b in self._ranges)
        lines.append(f"Skipped data ranges: {self._ranges} ({total} batches).")
        lines.append(_ADVICE)
        return TrainingDiverged("\n".join(lines), self._history)

    def _rollback(self, triggers: Sequence[Detection]) -> Any:
        detected = max(d.step for d in triggers)
        if self._rollbacks >= self.max_rollbacks:
            err = self._diverged(triggers)
            self._log("diverged", detected, message=str(err))
            self._settle()
            raise err
        self._settle()
        self._retain()
        onsets = [d.onset for d in triggers]
        onsets += [o for o in (det.active_onset for det in self.detectors) if o is not None]
        onset = min(onsets)
        steps = sorted(self._manager.all_steps(), reverse=True)
        best = self._best(steps) if all(d.action == "rollback_best" for d in triggers) else None
        if best is not None:
            order = [best] + [s for s in steps if s < best]
            margin_met = True
        else:
            eligible = [s for s in steps if s <= onset - self.rollback_margin]
            margin_met = bool(eligible)
            order = eligible + sorted(s for s in steps if s not in eligible)
        restored, failed = None, []
        for target in order:
            restored = self._try(lambda t=target: self._restore(t, with_data=False), step=target)
            if restored is not None:
                break
            failed.append(target)
        for s in failed:
            self._set_aside(s)
        if restored is None:
            raise RuntimeError(
                f"rollback at step {detected}: no checkpoint in {self.directory} could be "
                f"restored (tried {order})"
            )
        new_state, meta = restored
        start = int(meta["data_index"])
        end = self._data.index + self.extra_skip
        length = end - start
        last = self._last_rollback
        consecutive = (
            last is not None and detected - int(last["restored"]) <= self.save_every * self.keep
        )
        if consecutive:
            length = max(length, 2 * int(last["length"]))
        end = start + length
        ranges = merge_ranges(self._ranges + [(start, end)])
        resume_at = first_allowed(end, ranges)
        entry = {
            "detected": detected,
            "onset": onset,
            "restored": target,
            "range": [start, end],
            "length": length,
            "doubled": bool(consecutive),
            "reason": "; ".join(d.reason for d in triggers),
            "losses": self._losses_before(detected),
        }
        history = (self._history + [entry])[-_HISTORY:]
        record = {
            "rollbacks": self._rollbacks + 1,
            "target_step": target,
            "data_index": resume_at,
            "skipped_ranges": [list(r) for r in ranges],
            "last_rollback": entry,
            "history": history,
            "time": time.time(),
        }
        if _is_primary():
            _atomic_write_json(self.directory / _RECORD, record)
        _barrier(f"rollback_record_{record['rollbacks']}")
        self._delete_newer_than(target)
        # The checkpoint's trajectory (detectors, EMA) comes back; the run ledger moves on.
        self._apply_meta(meta, trajectory=True, ledger=False)
        self._ranges, self._rollbacks = ranges, record["rollbacks"]
        self._last_rollback, self._history = entry, history
        self._data.skipped_ranges = ranges
        self._data.seek(resume_at)
        self._pending = None
        self._saved_at = target
        self._ckpt_losses = {s: v for s, v in self._ckpt_losses.items() if s <= target}
        self._log(
            "rollback",
            detected,
            onset=onset,
            restored_step=target,
            margin_met=margin_met,
            reason=entry["reason"],
            losses=entry["losses"],
            rollbacks=self._rollbacks,
        )
        self._log("skip", detected, range=[start, end], length=length, doubled=consecutive)
        self._log("restore", target, data_index=self._data.index, reason="rollback")
        return new_state

    def _log(self, kind: str, step: int, **details: Any) -> None:
        self.events.append(Event(kind, step, details=details))
