"""Orbax I/O for the rollback controller: save, restore, verify, retention, trash.

:class:`CheckpointStore` wraps one ``ocp.CheckpointManager`` whose checkpoints are a
``Composite`` of the train state (``StandardSave``), the data position (Grain's own
checkpoint, or JSON) and a JSON ``meta`` item (ledger, detector state, the leaves of the
state, the data config, fingerprints). It knows nothing of detectors or policy: the
controller tells it which steps to keep and which to restore.

* **Commit, then log.** A ``save`` event is written once the checkpoint has committed
  (Orbax's final rename): at once for a synchronous save, otherwise when a later call
  (the next save, :meth:`CheckpointStore.poll`, :meth:`CheckpointStore.settle`) sees it
  finished. A save that fails is a ``save_failed`` event and a
  :class:`CheckpointSaveError` naming the step and the directory, with the space needed
  when the disk is full.
* **Fingerprints and resume checks** (in :mod:`stabljax.control.meta`). The state's
  fingerprint is two wrap-around uint32 sums per leaf, computed on device; the meta item
  carries a SHA-256 digest of itself, so a changed ledger or detector state is caught like
  corrupted tensor data. The meta item lists every leaf of the state;
  :func:`~stabljax.control.meta.check_compatible` compares it with the state given on
  resume, so a changed model, optimizer or dtype is reported as such, never restored
  partially.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from stabljax.control import policy
from stabljax.control.data import GrainDatasetIterator, GrainLoaderIterator

# So are the host reads and the agreement across hosts, in host.py.
from stabljax.control.host import all_agree as all_agree
from stabljax.control.host import atomic_write_json as atomic_write_json
from stabljax.control.host import barrier as barrier
from stabljax.control.host import check_directory as check_directory
from stabljax.control.host import check_state as check_state
from stabljax.control.host import host_scalars as host_scalars
from stabljax.control.host import is_primary as is_primary
from stabljax.control.host import to_host as to_host
from stabljax.control.host import try_everywhere as try_everywhere

# The meta item's contents and checks live in meta.py; their names stay importable here.
from stabljax.control.meta import META_VERSION as META_VERSION
from stabljax.control.meta import CheckpointMismatch as CheckpointMismatch
from stabljax.control.meta import check_compatible as check_compatible
from stabljax.control.meta import describe_mismatch as describe_mismatch
from stabljax.control.meta import fingerprint as fingerprint
from stabljax.control.meta import from_legacy, legacy_view, written_before_rename
from stabljax.control.meta import jsonable as jsonable
from stabljax.control.meta import leaf_specs as leaf_specs
from stabljax.control.meta import meta_digest as meta_digest
from stabljax.control.meta import node_specs as node_specs
from stabljax.control.meta import state_bytes as state_bytes

TRASH = "stabljax-trash"
CORRUPT = "stabljax-corrupt"


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; ``step`` and ``directory`` say which.

    ``errno`` is the cause's (``errno.ENOSPC`` when the disk is full). The checkpoints
    committed before it are intact, and no ``save`` event claims the failed one.
    """

    def __init__(self, message: str, *, step: int, directory: os.PathLike, code: int | None):
        super().__init__(code, message)
        self.step, self.directory = int(step), pathlib.Path(directory)

    def __str__(self) -> str:
        return str(self.strerror)


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
    (:meth:`stabljax.control.lifecycle.PreemptionWatch.should_stop`), and it saves on
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
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
        except ValueError:
            if not written_before_rename(self.read_meta(step), abstract):
                raise
            # written before a state field was renamed: read it under the old names
            items["state"] = ocp.args.StandardRestore(legacy_view(abstract))
            out = self.manager.restore(step, args=ocp.args.Composite(**items))
            out = {**out, "state": from_legacy(out["state"])}
        state, meta = out["state"], self._check_meta(step, out["meta"])
        if int(meta["step"]) != step or int(to_host(state.step)) != step:
            raise ValueError(f"checkpoint {step} holds step {meta['step']} / {state.step}")
        if verify and meta.get("fingerprint") is not None:
            got = [int(v) for v in to_host(fingerprint(state))]
            if got != meta["fingerprint"]:
                raise ValueError(f"checkpoint {step}: state fingerprint mismatch (corrupted data)")
        return state, meta, out.get("data") if data_item is not None else None

    def restore_into(
        self, step: int, abstract: Any, data: Any, *, with_data: bool, verify: bool
    ) -> tuple[Any, dict[str, Any]]:
        """Restores checkpoint ``step``; with ``with_data`` also moves ``data`` to its position."""
        item = data_item(data, restore=True) if with_data else None
        state, meta, data_state = self.restore(step, abstract, item, verify=verify)
        if with_data and _grain_source(data) is not None:
            data._set_index(int(meta["data_index"]))
        elif with_data:
            if int(data_state["index"]) != int(meta["data_index"]):
                raise ValueError(f"checkpoint {step}: data position disagrees with meta")
            data.set_state(dict(data_state))
        return state, meta

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
