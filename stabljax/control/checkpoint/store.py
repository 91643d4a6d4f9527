"""The checkpoint store: the one place a checkpoint is written, read, verified and deleted.

* Host helpers: reading device values (:func:`to_host`, :func:`host_scalars`) and
  agreeing across processes (:func:`all_agree`, :func:`try_everywhere`, :func:`barrier`),
  so every process decides the same thing without a coordinator.
* The meta item's checks live in :mod:`~stabljax.control.checkpoint.integrity` (fingerprints, the
  meta digest, the resume checks).
* :class:`CheckpointStore`: one Orbax ``CheckpointManager`` (:class:`StepManager`) whose
  checkpoints are a ``Composite`` of the train state, the data position (Grain's own
  checkpoint, or JSON) and the JSON meta item. Commit, then log: a ``save`` event is
  written once the checkpoint has committed; a failed save is a ``save_failed`` event and
  a :class:`~stabljax.control.errors.CheckpointSaveError`. Orbax deletes what the
  store's :class:`~stabljax.control.checkpoint.retention.Retention` (its preservation policy) does
  not keep; the store adds what Orbax lacks: the composite item, the fingerprint and digest
  checks, and never claiming a folder that is not a checkpoint.
* When a checkpoint is taken and what it holds is :class:`~.saver.Saver`'s
  decision; it writes through :meth:`CheckpointStore.write`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import json
import os
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp

from stabljax.control.checkpoint.fsutil import RunFiles
from stabljax.control.checkpoint.integrity import CheckpointKeyError, Seal
from stabljax.control.checkpoint.items import GrainStateReader, data_item
from stabljax.control.checkpoint.jsonio import read_meta
from stabljax.control.checkpoint.retention import Retention
from stabljax.control.decide import policy
from stabljax.control.errors import CheckpointSaveError, warn
from stabljax.control.hosts import all_agree, barrier, is_primary, to_host

# -------------------------------------------------------------------------------------------- host
# Host-side helpers of the controller: reading device values, and agreeing across hosts.


def try_everywhere(fn: Callable[[], Any], log: Callable[..., None], step: int | None) -> Any:
    """``fn()``, or None (with a ``corrupt_checkpoint`` event) if it fails on any process.

    A :class:`~.integrity.CheckpointKeyError` (a key to set, not corruption)
    propagates."""
    try:
        result, ok, err = fn(), True, None
    except CheckpointKeyError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
        result, ok, err = None, False, e
    if not all_agree(ok):
        if step is not None:
            reason = f"{type(err).__name__}: {err}"[:500] if err else "failed on another host"
            log("corrupt_checkpoint", step, reason=reason)
        return None
    return result


# ------------------------------------------------------------------------------------- checkpoints
# Orbax I/O for the rollback controller: save, restore, verify, retention, trash.


TRASH = "stabljax-trash"
RECORD = "stabljax-rollback.json"  # the rollback record (crash safety), beside the steps
COMMIT_MARKER = "_CHECKPOINT_METADATA"  # what Orbax writes into a step once it committed
CORRUPT = "stabljax-corrupt"


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
    (:meth:`stabljax.control.session.PreemptionWatch.should_stop`), and it saves on
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


def _half_written(step_dir: Any) -> bool:
    """An object store's step folder holding this run's items but no commit file (on an
    object store Orbax writes in place and marks a finished step with one)."""
    if (step_dir / "commit_success.txt").exists():
        return False
    return any((step_dir / item).exists() for item in ("state", "meta", "data"))


class CheckpointStore:
    """The checkpoints in one directory: write, read, verify, keep, delete.

    Args:
      files: the run directory's owner, or the directory itself (checked and locked by
        the caller); the checkpoints go to ``files.path`` (a local path or an object
        store's).
      async_save: let Orbax write in the background.
      log: ``log(kind, step, **details)`` records an event (from any thread).
      keep: the ``keep`` of the controller, for the disk-full message.
      keeps_best: the best checkpoint is kept too (a ``rollback_best`` detector).
      seal: what the meta item carries to prove it and the state (``verify``).
    """

    def __init__(
        self,
        files: RunFiles | str | os.PathLike,
        *,
        async_save: bool,
        log: Callable[..., None],
        keep: int,
        keeps_best: bool = False,
        seal: Seal | None = None,
    ):
        self.files = files if isinstance(files, RunFiles) else RunFiles(files)
        self.directory = self.files.path
        self.async_save = async_save
        self.keep = keep
        self.keeps_best = keeps_best
        self.seal = Seal() if seal is None else seal
        self.state_bytes = 0  # the size of one checkpoint, for the disk-full message
        self.log = log
        self.retention = Retention(self)  # Orbax applies it at every save
        self.manager = StepManager(
            self.directory,
            item_names=("state", "data", "meta"),
            options=ocp.CheckpointManagerOptions(
                preservation_policy=self.retention,
                enable_async_checkpointing=async_save,
                # On an object store Orbax's clean-up deletes every folder of the directory
                # without its commit file: the logs' parts, stabljax-corrupt/ and a user's
                # folders too. There clean_leftovers removes only half-written steps.
                cleanup_tmp_directories=not self.files.remote,
                todelete_subdir=TRASH,
                create=True,
            ),
        )
        # Scores (smoothed losses) and resume-only marks of the kept checkpoints, which
        # retention reads; only write() changes them while a save is in flight.
        self.scores: dict[int, float] = {}
        self.resume_only: set[int] = set()
        self.saved_at: int | None = None  # the step of the newest checkpoint (mark_saved)
        self.deferred: int | None = None  # a due save waiting for a healthy state (defer)
        self._inflight: tuple[int, dict[str, Any]] | None = None
        self._writing: int | None = None  # the step inside manager.save (not on disk yet)
        self._warned: set[int] = set()  # foreign folders already warned about
        # The steps as of the last listing, with this process's own saves and deletes since
        # (steps(known=True)); and those a fast-tier rollback abandoned, deleted at the next
        # write (abandon_newer_than).
        self._known: set[int] = set()
        self._abandoned: set[int] = set()
        self._known_only = False  # holds() answers from _known (retain(known=True))
        self._sweeper = _Sweeper()
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._working: concurrent.futures.Future | None = None

    # ------------------------------------------------------------------ saves in flight

    def expect_size(self, nbytes: int) -> None:
        """Records the size of one checkpoint (for the disk-full message)."""
        self.state_bytes = int(nbytes)

    def defer(self, step: int) -> bool:
        """Marks the save due at ``step`` as deferred; whether it was not already."""
        if self.deferred is not None:
            return False
        self.deferred = step
        return True

    def mark_saved(self, step: int) -> None:
        """Records that checkpoint ``step`` is written (or on its way) and nothing waits."""
        self.saved_at, self.deferred = step, None

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
        self._empty_trash()  # what retention dropped when the save committed
        if inflight is not None:
            self._known.add(inflight[0])
            self.log("save", inflight[0], **inflight[1])

    def _failed(self, step: int, e: BaseException) -> CheckpointSaveError:
        cause = f"{type(e).__name__}: {e}"[:400]
        self.log("save_failed", step, error=cause)
        if _is_disk_full(e) and not self.files.remote:
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
        resume_only: bool,
    ) -> None:
        """Writes checkpoint ``step`` (any thread). Orbax drops what :attr:`retention` does
        not preserve, the new step counted, once it has committed."""
        if (actual := int(to_host(state.step))) != step:
            raise ValueError(
                f"state.step is {actual} but the controller counted {step} steps: the train "
                "step must increment state.step by one on every call (skipped or not)"
            )
        self.commit()
        self._drop_abandoned()  # Orbax saves only past its newest step
        self.retain()  # catches up with a load (rollback, resume) since the last save
        if score is not None and not resume_only:
            self.scores[step] = score
        if resume_only:
            self.resume_only.add(step)
        meta["ckpt_losses"] = {str(k): v for k, v in self.scores.items()}
        meta["resume_only"] = sorted(self.resume_only)
        words = None if state_fingerprint is None else [int(v) for v in to_host(state_fingerprint)]
        self.seal.seal(meta, state, words)  # the leaf digests read the state here
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=data_item,
            meta=ocp.args.JsonSave(meta),
        )
        self._writing = step
        try:
            saved = self.manager.save(step, args=args)
        except Exception as e:
            raise self._failed(step, e) from e
        finally:
            self._writing = None
        if not saved:
            foreign = [s for s in self.foreign() if s >= step]
            hint = (
                f": the folder(s) {foreign} are named like steps but hold no checkpoint of "
                "stabljax's, and Orbax saves only past its newest step; move them out"
                if foreign
                else ""
            )
            raise RuntimeError(
                f"Orbax refused to save step {step} in {self.directory} (existing steps "
                f"{sorted(self.manager.all_steps())}){hint}"
            )
        self._inflight = (step, {"data_index": meta["data_index"], "smoothed_loss": score})
        if resume_only:
            self._inflight[1]["reason"] = "preempted"
        if wait or not self.async_save:
            self.commit()

    def load(self, meta: Mapping[str, Any]) -> int:
        """Takes the save bookkeeping of a restored checkpoint's meta item (the kept
        checkpoints' scores and resume-only marks, its step as the newest); returns its step.
        A fast-tier copy's step is not in the directory: nothing is marked saved."""
        self.scores = {int(k): float(v) for k, v in meta["ckpt_losses"].items()}
        self.resume_only = set(meta.get("resume_only", []))
        step = int(meta["step"])
        self.saved_at, self.deferred = None if meta.get("tier") == "fast" else step, None
        return step

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Writes the rollback record (:data:`RECORD`; the primary host, whole or not at
        all: :meth:`RunFiles.write`) and waits until every process is past it, so no
        process deletes before it is written."""
        if is_primary():
            self.files.write(RECORD, json.dumps(dict(record), allow_nan=False).encode())
        barrier(f"rollback_record_{record['rollbacks']}")

    # --------------------------------------------------------------------------- reads

    def steps(self, *, known: bool = False) -> list[int]:
        """The checkpoints of this run: Orbax's steps that Orbax committed (its
        ``_CHECKPOINT_METADATA`` marker) or that hold stabljax's ``meta`` item, and the
        save in flight. Another all-digit folder is not a step: it is never read, moved
        or deleted (:meth:`foreign`). A step a rollback abandoned is not one either.

        With ``known``, the directory is not asked: the steps of the last listing, with
        this process's commits and deletes since. Only for a run of one process, the
        directory's only writer (it holds the run's lock), and with no save in flight.
        """
        if known:
            return sorted(self._known - self._abandoned)
        self.files.refresh()  # what another host wrote since (an object store's listings)
        found = [s for s in self.manager.all_steps() if self.holds(s)]
        self._known = set(found)
        return sorted(s for s in found if s not in self._abandoned)

    def settled_steps(self, *, known: bool = False) -> list[int]:
        """A rollback's first look: waits for the saves in flight (:meth:`settle`), applies
        retention (:meth:`retain`) and returns :meth:`steps` (``known``: as there)."""
        self.settle()
        self.retain(known=known)
        return self.steps(known=known)

    def holds(self, step: int) -> bool:
        """Whether Orbax's step ``step`` is a checkpoint of this run (:meth:`steps`)."""
        if step == self._writing or (self._inflight is not None and step == self._inflight[0]):
            return True
        if self._known_only:
            return step in self._known and step not in self._abandoned
        path = self.directory / str(step)
        return (path / COMMIT_MARKER).is_file() or (path / "meta").is_dir()

    def foreign(self) -> list[int]:
        """All-digit folders that are not checkpoints (:meth:`steps`): left in place."""
        return sorted(s for s in self.manager.all_steps() if not self.holds(s))

    def warn_foreign(self, *, refuse_if_no_run: bool = False) -> None:
        """Warns once per folder that looks like a step but is not a checkpoint. With
        ``refuse_if_no_run`` (a run's start), a directory holding no run of stabljax's (no
        checkpoint, no ``events.jsonl``) whose step-like folders are someone else's is a
        ``RuntimeError``, before anything is moved or written."""
        foreign = self.foreign()
        if refuse_if_no_run and foreign and not self.steps():
            if not self.files.exists("events.jsonl", log=True):
                raise RuntimeError(
                    f"{self.directory} holds no stabljax run, but folders named like steps "
                    f"that are not checkpoints ({', '.join(map(str, foreign[:5]))}): it looks "
                    "like someone else's data. Point the controller at an empty or new "
                    "directory, or at one of its own runs; nothing was moved or written."
                )
        for s in foreign:
            if s not in self._warned:
                self._warned.add(s)
                warn(
                    f"{self.directory / str(s)} is named like a checkpoint step but holds "
                    "none of stabljax's (no Orbax commit marker, no meta item): it is left "
                    "in place, never read, moved or deleted",
                    stacklevel=3,  # warn_foreign < ctl.restore_or_init < the user
                )

    def read_meta(self, step: int) -> dict[str, Any]:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return self._check_meta(step, out["meta"])

    def _check_meta(self, step: int, meta: Any) -> dict[str, Any]:
        """The meta item read strictly (:func:`~.jsonio.read_meta`), its digest
        checked (:meth:`~stabljax.control.checkpoint.integrity.Seal.check_meta`)."""
        if not isinstance(meta, dict):
            raise ValueError(f"checkpoint {step} has no stabljax meta (got {type(meta).__name__})")
        meta = read_meta(meta, what=f"checkpoint {step}'s meta in {str(self.directory)!r}")
        return self.seal.check_meta(step, meta, str(self.directory))

    def restore(
        self, step: int, abstract: Any, data: Any = None, *, verify: bool | str
    ) -> tuple[Any, dict[str, Any], dict[str, Any] | None]:
        """Restores (and verifies) checkpoint ``step``: ``(state, meta, data state)``.

        With ``data`` (the run's :class:`~stabljax.control.data.iterators.DataIterator`) the data
        item is read too, in ``data.get_state()``'s form (Grain's saved state included),
        for :meth:`~stabljax.control.data.iterators.DataIterator.restore`; ``data`` itself is not
        touched. Without it the data state is ``None``.
        """
        items = {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}
        if data is not None:
            items["data"] = data_item(data, restore=True)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        state, meta = out["state"], self._check_meta(step, out["meta"])
        if int(meta["step"]) != step or int(to_host(state.step)) != step:
            raise ValueError(f"checkpoint {step} holds step {meta['step']} / {state.step}")
        if verify:
            self.seal.check_state(step, meta, state)
        if data is None:
            return state, meta, None
        saved, index = out["data"], int(meta["data_index"])
        if isinstance(saved, GrainStateReader):
            return state, meta, saved.state_for(data, index)
        if int(saved["index"]) != index:
            raise ValueError(f"checkpoint {step}: data position disagrees with meta")
        return state, meta, dict(saved)

    def first_restorable(
        self,
        order: Sequence[int],
        abstract: Any,
        *,
        verify: bool | str,
        data: Any = None,
        fast: Mapping[int, Any] | None = None,
    ) -> tuple[int, tuple[Any, dict[str, Any], Any]] | None:
        """The first of ``order`` that :meth:`restore` reads everywhere, as
        ``(step, (state, meta, data state))``; the ones that fail before it are set aside
        as corrupt. A step in ``fast`` (the fast tier's host copies,
        :class:`~stabljax.control.checkpoint.items.FastTier`) comes from host memory: nothing
        is read from the directory."""
        failed, found = [], None
        for s in order:
            if fast and s in fast:
                found = (s, fast[s].restore(abstract))
                break
            read = functools.partial(self.restore, s, abstract, data, verify=verify)
            result = try_everywhere(read, self.log, s)
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

    def retain(self, *, known: bool = False) -> None:
        """Applies :attr:`retention` now, between saves (no save in flight): deletes the
        checkpoints it does not preserve and forgets their scores and marks. ``known``:
        as for :meth:`steps` (no listing; a deletion still asks the directory)."""
        self._known_only = known
        try:
            kept = self.retention.kept(self.manager.all_steps())
            surplus = [s for s in self.steps(known=known) if s not in kept]
        finally:
            self._known_only = False
        if surplus:
            self.delete(surplus)
        self.scores = {s: v for s, v in self.scores.items() if s in kept}
        self.resume_only &= set(kept)

    def delete(self, steps: Sequence[int]) -> None:
        existing = set(self.steps()) | self._abandoned
        for s in sorted(steps, reverse=True):
            if s in existing:
                self.manager.delete(s)
                self._known.discard(s)
                self._abandoned.discard(s)
        self._empty_trash()

    def delete_newer_than(self, step: int, *, later: bool = False) -> None:
        """Deletes the checkpoints after ``step`` (a rollback abandoned their branch).

        With ``later`` (one process, as :meth:`steps`'s ``known``), they only leave
        :meth:`steps` now and are deleted at the next :meth:`write`, so a rollback to a
        fast-tier copy asks nothing of the directory. The rollback record written before
        this makes a restart in between delete them too (:func:`~stabljax.control.resume.resume`).
        """
        self.settle()
        newer = [s for s in self.steps(known=later) if s > step]
        if later:
            self._abandoned.update(newer)
        else:
            self.delete(newer)
        self.scores = {s: v for s, v in self.scores.items() if s <= step}
        self.resume_only = {s for s in self.resume_only if s <= step}

    def _drop_abandoned(self) -> None:
        if self._abandoned:
            self.delete(sorted(self._abandoned))

    def _empty_trash(self) -> None:
        """Removes deleted checkpoints off the training thread (primary host only).

        Orbax's delete only renames a step into ``stabljax-trash/``; removing its files
        can take seconds for a large checkpoint, so the trash is renamed aside (atomic)
        and removed by a background thread. A crash mid-way leaves a
        ``stabljax-trash.*`` folder, which :meth:`clean_leftovers` removes.
        """
        if not is_primary() or self.files.remote:
            return  # on an object store Orbax deletes at once (no rename, no trash)
        trash = self.directory / TRASH
        if trash.exists():
            doomed = trash.with_name(f"{TRASH}.{uuid.uuid4().hex}")
            os.replace(trash, doomed)
            self._sweeper.remove(doomed)

    def clean_leftovers(self) -> None:
        """Removes what a crash left: a half-written record, a trash sweep cut short; on an
        object store, a step folder of this run's items that Orbax never committed."""
        self.settle()
        if self.files.remote:
            for path in self.directory.iterdir() if is_primary() else ():
                if path.name.isdigit() and _half_written(path):
                    self.files.remove(path.name)
            barrier("clean_leftovers")  # every host reads the steps after the removal,
            self.files.refresh()  # and not from a stale listing
        elif is_primary():
            for tmp in self.directory.glob(f".{RECORD}.tmp-*"):
                tmp.unlink(missing_ok=True)
            for doomed in self.directory.glob(f"{TRASH}.*"):
                self._sweeper.remove(doomed)
        self.manager.reload()

    def set_aside(self, step: int) -> None:
        """Moves a corrupt checkpoint to ``stabljax-corrupt/`` (kept for inspection)."""
        if is_primary() and self.files.exists(str(step)):
            self.files.move(str(step), f"{CORRUPT}/{step}-{int(time.time())}")
        barrier(f"set_aside_{step}")
        self._known.discard(step)
        self.manager.reload()

    def close(self) -> None:
        """Shuts the worker and Orbax down and waits for the trash sweeps."""
        try:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            self.manager.close()
            self._empty_trash()
        finally:
            self._sweeper.join()
