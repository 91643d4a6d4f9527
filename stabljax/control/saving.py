"""When a checkpoint is taken and what it holds: health gating, deferral, capture.

:class:`Saver` decides, at a due save step, whether the state may be saved
(:func:`~stabljax.control.policy.save_blocker`: no episode open, last loss finite) and if
not, defers the save to the first healthy step after it, with one ``save_deferred`` event;
so the newest checkpoint is always one the detectors called healthy. A save captures, on
the training thread and as of its step, the meta item (step, data position, ledger,
detector state, loss EMA, the state's leaves, the data config) and the data position, and
hands the write to the :class:`~stabljax.control.checkpoints.CheckpointStore`, here or on
its worker thread (``background_save``: an on-device copy of the state, so the step may
donate it). It also owns what to keep (:func:`~stabljax.control.policy.kept_steps`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

from stabljax.control import checkpoints as ck
from stabljax.control import policy
from stabljax.control.ledger import Ledger
from stabljax.control.monitor import Monitor


class Saver:
    """The save decisions and captures of one run."""

    def __init__(
        self,
        store: ck.CheckpointStore,
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
        write: Callable[..., None],
        sync: bool = False,
        resume_only: bool = False,
    ) -> None:
        """Saves ``state`` as checkpoint ``step`` if healthy; else defers (one event).

        ``write(step, state, fingerprint, meta, data_item, score, *, wait, resume_only)``
        does the writing (the controller's, which hands it to the store).
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
        state = ck.device_snapshot(state) if background else state
        fingerprint = ck.fingerprint(state) if self.verify else None  # dispatched, read later
        meta = {"version": ck.META_VERSION, "step": step, "data_index": data.index}
        meta |= ledger.to_meta() | self.monitor.to_meta()
        meta |= {"leaves": ck.leaf_specs(abstract), "nodes": ck.node_specs(abstract)}
        meta |= {"data_config": data_config}
        meta = json.loads(json.dumps(meta))  # a deep copy: the loop runs on meanwhile
        item = ck.data_item(data, restore=False)
        job = functools.partial(
            write,
            step,
            state,
            fingerprint,
            meta,
            item,
            self.monitor.smoothed_loss,
            wait=sync or background,
            resume_only=resume_only and self.deferred is None,
        )
        self.store.submit(job) if background else job()
        self.saved_at, self.deferred = step, None
