"""The checkpoint store: the one place a checkpoint is written, read, verified and deleted.

* Host helpers: reading device values (:func:`to_host`, :func:`host_scalars`) and
  agreeing across processes (:func:`all_agree`, :func:`try_everywhere`, :func:`barrier`),
  so every process decides the same thing without a coordinator.
* The meta item: the state's fingerprint (two wrap-around uint32 sums per leaf, on
  device), the meta item's own SHA-256 digest, and the resume checks
  (:func:`check_compatible`: leaves, tree structure and data config), so a changed model,
  optimizer or dtype is a :class:`~stabljax.control.errors.CheckpointMismatch`, never
  corruption.
* :class:`CheckpointStore`: one Orbax ``CheckpointManager`` (:class:`StepManager`) whose
  checkpoints are a ``Composite`` of the train state, the data position (Grain's own
  checkpoint, or JSON) and the JSON meta item. Commit, then log: a ``save`` event is
  written once the checkpoint has committed; a failed save is a ``save_failed`` event and
  a :class:`~stabljax.control.errors.CheckpointSaveError`.
* :class:`Saver`: when a checkpoint is taken (health gating, deferral), what it holds
  (captured on the training thread as of its step), and what is kept; it writes through
  :meth:`CheckpointStore.write`, here or on the store's worker thread
  (``background_save``).
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import hashlib
import json
import os
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.experimental import multihost_utils

from stabljax.control import policy
from stabljax.control.data import GrainDatasetIterator, GrainLoaderIterator
from stabljax.control.errors import CheckpointMismatch as CheckpointMismatch
from stabljax.control.errors import CheckpointSaveError as CheckpointSaveError

if TYPE_CHECKING:  # both import this module
    from stabljax.control.monitor import Monitor
    from stabljax.control.rollback import Ledger

# -------------------------------------------------------------------------------------------- host
# Host-side helpers of the controller: reading device values, and agreeing across hosts.


def to_host(x: Any) -> np.ndarray:
    """A numpy copy of ``x``; on several hosts the same value on every process."""
    if isinstance(x, jax.Array):
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def host_scalars(metrics: Mapping[str, Any], keys: frozenset[str] | None) -> dict[str, Any]:
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
    return {k: to_host(v).item() for k, v in wanted.items()}


def try_everywhere(fn: Callable[[], Any], log: Callable[..., None], step: int | None) -> Any:
    """``fn()``, or None (with a ``corrupt_checkpoint`` event) if it fails on any process."""
    try:
        result, ok, err = fn(), True, None
    except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
        result, ok, err = None, False, e
    if not all_agree(ok):
        if step is not None:
            reason = f"{type(err).__name__}: {err}"[:500] if err else "failed on another host"
            log("corrupt_checkpoint", step, reason=reason)
        return None
    return result


def is_primary() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"stabljax:{name}")


def all_agree(ok: bool) -> bool:
    """True when ``ok`` holds on every process (the same answer everywhere)."""
    if jax.process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.asarray(ok, np.int32))
    return bool(np.all(flags))


def atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    """Writes ``obj`` to a temporary file, fsyncs it, and renames it over ``path``."""
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


def check_state(state: Any) -> None:
    """Raises ``TypeError`` unless ``state`` has the ``step`` field checkpoints count by."""
    if not hasattr(state, "step"):
        raise TypeError(
            f"state must have a 'step' field (int32 scalar), got {type(state).__name__}"
        )


PROBE = ".stabljax-probe-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's process
        return True
    return True


def clean_probes(directory: pathlib.Path) -> None:
    """Removes probe files left by processes that died between writing and removing them.

    A pid that is dead here may be alive on another host sharing the directory; removing
    its probe is harmless, since the probe's writer removes it with ``missing_ok``.
    """
    for path in directory.glob(f"{PROBE}*-*"):
        try:
            pid = int(path.name[len(PROBE) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            path.unlink(missing_ok=True)


def check_directory(directory: pathlib.Path) -> None:
    """Creates ``directory`` (and its parents), checks that it can be written, and
    removes stale probe files."""
    probe = directory / f"{PROBE}{os.getpid()}-{jax.process_index()}"
    try:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(directory))
        directory.mkdir(parents=True, exist_ok=True)
        mode = directory.stat().st_mode
        if not mode & 0o222:  # root writes anywhere; respect the operator's intent anyway
            raise PermissionError(errno.EACCES, f"read-only (mode {oct(mode & 0o777)})")
        probe.write_text("ok")
        probe.unlink(missing_ok=True)
        clean_probes(directory)
    except OSError as e:
        raise OSError(
            e.errno,
            f"checkpoint directory {str(directory)!r} cannot be created or written "
            f"({type(e).__name__}: {e}); pass a writable directory",
        ) from e


# -------------------------------------------------------------------------------------------- meta
# A checkpoint's meta item: fingerprints, its digest, and the checks made on resume.


META_VERSION = 1


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
def fingerprint(tree: Any) -> jax.Array:
    """Two uint32 sums per leaf of ``tree`` (dispatched on device, read later)."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.concatenate([_leaf_fingerprint(x) for x in leaves])


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (a deep copy), or ``None``."""
    return None if value is None else json.loads(json.dumps(value))


def meta_digest(meta: Mapping[str, Any]) -> str:
    """SHA-256 of the meta item's canonical JSON, its own ``digest`` field left out."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def leaf_specs(abstract: Any) -> list[list[Any]]:
    """``[path, dtype, shape]`` of every leaf of ``abstract``, ``None`` leaves included."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: x is None)
    out = []
    for path, x in flat:
        dtype = getattr(x, "dtype", None)
        shape = getattr(x, "shape", None)
        out.append(
            [
                jax.tree_util.keystr(path),
                None if x is None else str(dtype if dtype is not None else type(x).__name__),
                None if shape is None else [int(d) for d in shape],
            ]
        )
    return out


def node_specs(abstract: Any) -> list[list[str]]:
    """``[path, type name]`` of every inner node of ``abstract`` (``None`` aside).

    Two states can have the same leaves and still differ in structure: ``optax.sgd``'s
    state and ``optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05))``'s hold no
    arrays at all, yet one is a pair of ``EmptyState`` and the other a pair whose second
    element is itself a pair. These lines tell them apart, with the NamedTuple type of
    each state.
    """
    out: list[list[str]] = []

    def walk(path: tuple[Any, ...], x: Any) -> None:
        if x is None:
            return
        children, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        if len(children) == 1 and children[0][0] == ():
            return  # a leaf: leaf_specs lists it
        out.append([jax.tree_util.keystr(path), type(x).__name__])
        for p, c in children:
            walk(path + tuple(p), c)

    walk((), abstract)
    return out


def describe_nodes(saved: Sequence[Sequence[str]], current: Sequence[Sequence[str]]) -> list[str]:
    """Lines naming each inner node of the state added, removed or of another type."""
    old, new = dict(map(tuple, saved)), dict(map(tuple, current))
    lines = []
    for p, t in new.items():
        if p not in old:
            lines.append(f"structure: {p or 'the state'} ({t}) is not in the checkpoint")
        elif old[p] != t:
            lines.append(f"structure: {p or 'the state'} is {old[p]} in the checkpoint, {t} now")
    lines += [
        f"structure: {p or 'the state'} ({t}) of the checkpoint is gone from the state"
        for p, t in old.items()
        if p not in new
    ]
    return lines


def describe_mismatch(
    saved: Sequence[Sequence[Any]], current: Sequence[Sequence[Any]]
) -> list[str]:
    """Lines naming each leaf that was added, removed, or changed dtype or shape."""
    old = {p: (d, s) for p, d, s in saved}
    new = {p: (d, s) for p, d, s in current}
    lines = []
    for p, (d, s) in new.items():
        if p not in old:
            lines.append(f"new leaf {p} ({d}{s if s is not None else ''}) not in the checkpoint")
        elif old[p][0] is None and d is not None:
            lines.append(f"leaf {p} is {d}{s} now but was None in the checkpoint")
        elif d is None and old[p][0] is not None:
            lines.append(f"leaf {p} is None now but was {old[p][0]}{old[p][1]} in the checkpoint")
        elif old[p][0] != d:
            lines.append(f"leaf {p}: dtype {old[p][0]} in the checkpoint, {d} now")
        elif old[p][1] != s:
            lines.append(f"leaf {p}: shape {old[p][1]} in the checkpoint, {s} now")
    lines += [f"leaf {p} of the checkpoint is gone from the state" for p in old if p not in new]
    return lines


def state_bytes(abstract: Any) -> int:
    """Bytes of the arrays in ``abstract`` (the size of one checkpoint, roughly)."""
    total = 0
    for x in jax.tree.leaves(abstract):
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is not None and dtype is not None:
            try:
                total += int(np.prod(shape)) * np.dtype(dtype).itemsize
            except TypeError:  # a PRNG key dtype
                total += int(np.prod(shape)) * 8
    return total


def check_compatible(
    meta: Mapping[str, Any], abstract: Any, data_config: Any, directory: pathlib.Path
) -> None:
    """Raises :class:`CheckpointMismatch` listing how the state or data config differs."""
    lines = []
    if meta.get("leaves") is not None:
        lines = describe_mismatch(meta["leaves"], leaf_specs(abstract))
    if meta.get("nodes") is not None:
        lines += describe_nodes(meta["nodes"], node_specs(abstract))
    saved = meta.get("data_config")
    if saved is not None and saved != data_config:
        lines.append(f"data config {saved} in the checkpoint, {data_config} now")
    if lines:
        raise CheckpointMismatch(
            f"cannot resume from checkpoint {meta['step']} in {str(directory)!r}: the train "
            "state's structure changed or the data config changed since it was written (a "
            "config change, not corruption):\n  " + "\n  ".join(lines) + "\nResume with the "
            "original model, optimizer, dtypes and data, or use a new directory."
        )


# ------------------------------------------------------------------------------------- checkpoints
# Orbax I/O for the rollback controller: save, restore, verify, retention, trash.


TRASH = "stabljax-trash"
CORRUPT = "stabljax-corrupt"


# ---------------------------------------------------------------------------------------
# Device copies and the data item.


def device_snapshot(tree: Any) -> Any:
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


def _grain_source(data: Any) -> Any:
    return data.source if isinstance(data, GrainDatasetIterator | GrainLoaderIterator) else None


def data_item(data: Any, *, restore: bool) -> Any:
    """Orbax args for the data item; a save holds the position as of this call."""
    source = _grain_source(data)
    if source is not None:
        if restore:
            return grain.checkpoint.CheckpointRestore(source)
        return grain.checkpoint.CheckpointSave(_FrozenState(source))
    if restore:
        return ocp.args.JsonRestore()
    return ocp.args.JsonSave(json.loads(json.dumps(data.get_state())))


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


class StepManager(ocp.CheckpointManager):
    """An Orbax ``CheckpointManager`` that leaves JAX's preemption sync point alone.

    Orbax's manager asks ``reached_preemption_sync_point(step)`` in ``should_save``,
    ``save`` and (on the primary host, possibly in a background thread) when it finalizes
    a save. JAX keeps one step id per process, the last one given, so those calls, with a
    save's step, possibly late, would move it under the controller's feet. The controller
    alone asks, once per step, with ``state.step``
    (:meth:`stabljax.control.controller.PreemptionWatch.should_stop`), and it saves on
    preemption itself.
    """

    def reached_preemption(self, step: int) -> bool:
        return False


def _is_disk_full(e: BaseException) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "No space left" in text or "ENOSPC" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


class CheckpointStore:
    """The checkpoints in one directory: write, read, verify, keep, delete.

    Args:
      directory: the checkpoint directory (checked and locked by the caller).
      async_save: let Orbax write in the background.
      log: ``log(kind, step, **details)`` records an event (from any thread).
      state_bytes: the size of one checkpoint, for the disk-full message.
      keep: the ``keep`` of the controller, for the disk-full message.
    """

    def __init__(
        self,
        directory: pathlib.Path,
        *,
        async_save: bool,
        log: Callable[..., None],
        keep: int,
    ):
        self.directory = directory
        self.async_save = async_save
        self.keep = keep
        self.state_bytes = 0
        self.log = log
        self.manager = StepManager(
            directory,
            item_names=("state", "data", "meta"),
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,
                todelete_subdir=TRASH,
                create=True,
            ),
        )
        # Scores (smoothed losses) and resume-only marks of the kept checkpoints; only
        # write() changes them while a save is in flight.
        self.scores: dict[int, float] = {}
        self.resume_only: set[int] = set()
        self._inflight: tuple[int, dict[str, Any]] | None = None
        self._sweeper = _Sweeper()
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._working: concurrent.futures.Future | None = None

    # ------------------------------------------------------------------ saves in flight

    def submit(self, write: Callable[[], None]) -> None:
        """Runs ``write`` on the background worker thread."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="stabljax-save"
            )
        self._working = self._worker.submit(write)

    def join_worker(self) -> None:
        """Waits for the background write, raising its error."""
        working, self._working = self._working, None
        if working is not None:
            working.result()

    def settle(self) -> None:
        """Waits for every save in flight (the worker's, then Orbax's) and logs commits."""
        self.join_worker()
        self.commit()

    def poll(self) -> None:
        """Logs a finished async save without waiting (one process; no worker)."""
        if self._inflight is not None and not self.manager.is_saving_in_progress():
            self.commit()

    def commit(self) -> None:
        """Waits for Orbax; logs the save in flight, or reports its failure."""
        inflight, self._inflight = self._inflight, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            if inflight is None:
                raise
            raise self._failed(inflight[0], e) from e
        if inflight is not None:
            self.log("save", inflight[0], **inflight[1])

    def _failed(self, step: int, e: BaseException) -> CheckpointSaveError:
        cause = f"{type(e).__name__}: {e}"[:400]
        self.log("save_failed", step, error=cause)
        if _is_disk_full(e):
            free = shutil.disk_usage(self.directory).free
            need = self.state_bytes
            msg = (
                f"disk full: no space left on device to save checkpoint {step} in "
                f"{str(self.directory)!r}: it needs about {need} bytes, {free} are free. "
                f"keep={self.keep} needs room for keep + 1 = {self.keep + 1} checkpoints "
                f"(about {(self.keep + 1) * need} bytes), since the oldest is deleted only "
                "once the next one has committed. The checkpoints before it are intact: free "
                f"some space and restart to resume. ({cause})"
            )
            return CheckpointSaveError(msg, step=step, directory=self.directory, code=errno.ENOSPC)
        code = getattr(e, "errno", None)
        msg = f"saving checkpoint {step} in {str(self.directory)!r} failed: {cause}"
        return CheckpointSaveError(msg, step=step, directory=self.directory, code=code)

    def write(
        self,
        step: int,
        state: Any,
        state_fingerprint: jax.Array | None,
        meta: dict[str, Any],
        data_item: Any,
        score: float | None,
        *,
        wait: bool,
        kept: Callable[[], list[int]],
        resume_only: bool,
    ) -> None:
        """Writes checkpoint ``step`` (any thread): retention first, then the save."""
        if (actual := int(to_host(state.step))) != step:
            raise ValueError(
                f"state.step is {actual} but the controller counted {step} steps: the train "
                "step must increment state.step by one on every call (skipped or not)"
            )
        self.commit()
        self.retain(kept())
        if score is not None and not resume_only:
            self.scores[step] = score
        if resume_only:
            self.resume_only.add(step)
        meta["ckpt_losses"] = {str(k): v for k, v in self.scores.items()}
        meta["resume_only"] = sorted(self.resume_only)
        meta["fingerprint"] = (
            None if state_fingerprint is None else [int(v) for v in to_host(state_fingerprint)]
        )
        if state_fingerprint is not None:
            meta["digest"] = meta_digest(meta)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=data_item,
            meta=ocp.args.JsonSave(meta),
        )
        try:
            saved = self.manager.save(step, args=args)
        except Exception as e:
            raise self._failed(step, e) from e
        if not saved:
            raise RuntimeError(
                f"Orbax refused to save step {step} in {self.directory} (existing steps "
                f"{sorted(self.manager.all_steps())})"
            )
        self._inflight = (step, {"data_index": meta["data_index"], "smoothed_loss": score})
        if resume_only:
            self._inflight[1]["reason"] = "preempted"
        if wait or not self.async_save:
            self.commit()

    # --------------------------------------------------------------------------- reads

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int) -> dict[str, Any]:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return self._check_meta(step, out["meta"])

    def _check_meta(self, step: int, meta: Any) -> dict[str, Any]:
        if not isinstance(meta, dict) or meta.get("version") != META_VERSION:
            raise ValueError(f"checkpoint {step} has no stabljax meta (version {META_VERSION})")
        if "digest" in meta and meta["digest"] != meta_digest(meta):
            raise ValueError(f"checkpoint {step}: meta digest mismatch (corrupted ledger)")
        return meta

    def restore(
        self, step: int, abstract: Any, data_item: Any, *, verify: bool
    ) -> tuple[Any, dict[str, Any], Any]:
        """Restores (and verifies) checkpoint ``step``: ``(state, meta, data state)``."""
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if data_item is not None:
            items["data"] = data_item
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        state, meta = out["state"], self._check_meta(step, out["meta"])
        if int(meta["step"]) != step or int(to_host(state.step)) != step:
            raise ValueError(f"checkpoint {step} holds step {meta['step']} / {state.step}")
        if verify and meta.get("fingerprint") is not None:
            got = [int(v) for v in to_host(fingerprint(state))]
            if got != meta["fingerprint"]:
                raise ValueError(f"checkpoint {step}: state fingerprint mismatch (corrupted data)")
        return state, meta, out.get("data") if data_item is not None else None

    def first_restorable(
        self, order: Sequence[int], restore: Callable[[int], Any]
    ) -> tuple[int, Any] | None:
        """The first of ``order`` that ``restore`` reads everywhere, as ``(step, result)``;
        the ones that fail before it are set aside as corrupt."""
        failed, found = [], None
        for s in order:
            result = try_everywhere(lambda s=s: restore(s), self.log, s)
            if result is not None:
                found = (s, result)
                break
            failed.append(s)
        for s in failed:
            self.set_aside(s)
        return found

    # ----------------------------------------------------------------------- retention

    def best(self, steps: Sequence[int]) -> int | None:
        return policy.best_step(steps, self.scores)

    def retain(self, kept: Sequence[int]) -> None:
        """Deletes every checkpoint not in ``kept``; no save in flight."""
        surplus = [s for s in self.manager.all_steps() if s not in kept]
        if surplus:
            self.delete(surplus)
        self.scores = {s: v for s, v in self.scores.items() if s in kept}
        self.resume_only &= set(kept)

    def delete(self, steps: Sequence[int]) -> None:
        existing = set(self.manager.all_steps())
        for s in sorted(steps, reverse=True):
            if s in existing:
                self.manager.delete(s)
        self._empty_trash()

    def delete_newer_than(self, step: int) -> None:
        self.settle()
        self.delete([s for s in self.manager.all_steps() if s > step])
        self.scores = {s: v for s, v in self.scores.items() if s <= step}
        self.resume_only = {s for s in self.resume_only if s <= step}

    def _empty_trash(self) -> None:
        """Removes deleted checkpoints off the training thread (primary host only).

        Orbax's delete only renames a step into ``stabljax-trash/``; removing its files
        can take seconds for a large checkpoint, so the trash is renamed aside (atomic)
        and removed by a background thread. A crash mid-way leaves a
        ``stabljax-trash.*`` folder, which :meth:`clean_leftovers` removes.
        """
        if not is_primary():
            return
        trash = self.directory / TRASH
        if trash.exists():
            doomed = trash.with_name(f"{TRASH}.{uuid.uuid4().hex}")
            os.replace(trash, doomed)
            self._sweeper.remove(doomed)

    def clean_leftovers(self, record_name: str) -> None:
        """Removes what a crash left: a half-written record, a trash sweep cut short."""
        self.settle()
        if is_primary():
            for tmp in self.directory.glob(f".{record_name}.tmp-*"):
                tmp.unlink(missing_ok=True)
            for doomed in self.directory.glob(f"{TRASH}.*"):
                self._sweeper.remove(doomed)
        self.manager.reload()

    def set_aside(self, step: int) -> None:
        """Moves a corrupt checkpoint to ``stabljax-corrupt/`` (kept for inspection)."""
        path = self.directory / str(step)
        if is_primary() and path.exists():
            dest = self.directory / CORRUPT
            dest.mkdir(exist_ok=True)
            os.replace(path, dest / f"{step}-{int(time.time())}")
        barrier(f"set_aside_{step}")
        self.manager.reload()

    def close(self) -> None:
        """Shuts the worker and Orbax down and waits for the trash sweeps."""
        try:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self.manager.close()
        finally:
            self._sweeper.join()


# ------------------------------------------------------------------------------------------ saving
# When a checkpoint is taken and what it holds: health gating, deferral, capture.


class Saver:
    """The save decisions and captures of one run."""

    def __init__(
        self,
        store: CheckpointStore,
        monitor: Monitor,
        log: Callable[..., None],
        *,
        keep: int,
        verify: bool,
    ):
        self.store, self.monitor, self.log, self.keep, self.verify = (
            store,
            monitor,
            log,
            keep,
            verify,
        )
        self.background = False  # background_save
        self.data: Any = None  # the data iterator and the state's structure, set on resume
        self.abstract: Any = None
        self.saved_at: int | None = None  # the step of the newest checkpoint
        self.deferred: int | None = None  # a due save waiting for a healthy state

    def kept(self) -> list[int]:
        steps = self.store.steps()
        best = self.store.best(steps) if self.monitor.rolls_back_to_best else None
        return policy.kept_steps(
            steps, keep=self.keep, best=best, resume_only=self.store.resume_only
        )

    def retain(self) -> None:
        self.store.retain(self.kept())

    def restore(self, step: int, *, with_data: bool = False) -> tuple[Any, dict[str, Any], Any]:
        """Reads and verifies checkpoint ``step`` into the run's structure.

        Returns ``(state, meta, data state)``. With ``with_data`` the data item is read
        too: Orbax restores a Grain iterator in place (the data state is then ``None``);
        any other data's JSON state is returned for
        :func:`~stabljax.control.rollback.place` to apply.
        """
        item = data_item(self.data, restore=True) if with_data else None
        state, meta, saved = self.store.restore(step, self.abstract, item, verify=self.verify)
        if not with_data or _grain_source(self.data) is not None:
            return state, meta, None
        if int(saved["index"]) != int(meta["data_index"]):
            raise ValueError(f"checkpoint {step}: data position disagrees with meta")
        return state, meta, dict(saved)

    def load(self, meta: Mapping[str, Any]) -> int:
        """Takes a checkpoint's trajectory (detectors, EMA, kept scores); returns its step."""
        self.monitor.load(meta)
        self.store.scores = {int(k): float(v) for k, v in meta["ckpt_losses"].items()}
        self.store.resume_only = set(meta.get("resume_only", []))
        self.saved_at, self.deferred = int(meta["step"]), None
        return self.saved_at

    def maybe_save(
        self,
        step: int,
        state: Any,
        ledger: Ledger,
        data_config: Any,
        *,
        sync: bool = False,
        resume_only: bool = False,
    ) -> None:
        """Saves ``state`` as checkpoint ``step`` if healthy; else defers (one event).

        The store writes it (:meth:`CheckpointStore.write`), here or on its worker thread.
        """
        data, abstract, log = self.data, self.abstract, self.log
        if self.saved_at == step:
            return
        blocker = policy.save_blocker(self.monitor.active_onsets(), self.monitor.last_loss)
        if blocker is not None:
            if self.deferred is None:
                log("save_deferred", step, reason=blocker)
                self.deferred = step
            return
        self.store.join_worker()
        background = self.background and not sync
        state = device_snapshot(state) if background else state
        digest = fingerprint(state) if self.verify else None  # dispatched, read later
        meta = {"version": META_VERSION, "step": step, "data_index": data.index}
        meta |= ledger.to_meta() | self.monitor.to_meta()
        meta |= {"leaves": leaf_specs(abstract), "nodes": node_specs(abstract)}
        meta |= {"data_config": data_config}
        meta = json.loads(json.dumps(meta))  # a deep copy: the loop runs on meanwhile
        item = data_item(data, restore=False)
        job = functools.partial(
            self.store.write,
            step,
            state,
            digest,
            meta,
            item,
            self.monitor.smoothed_loss,
            wait=sync or background,
            kept=self.kept,
            resume_only=resume_only and self.deferred is None,
        )
        self.store.submit(job) if background else job()
        self.saved_at, self.deferred = step, None
