"""When a checkpoint is taken and what it holds: health gating, deferral, capture.

:class:`Saver` decides; :class:`~stabljax.control.checkpoint.store.CheckpointStore` writes, here or
on its worker thread (``background_save``); the fast tier's host copies
(:class:`~stabljax.control.checkpoint.items.FastTier`, ``fast_every``) are taken here too, under
the same health gate, with the same meta item.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, Protocol

from stabljax.control.checkpoint.integrity import (
    META_VERSION,
    fingerprint,
    leaf_specs,
    node_specs,
)
from stabljax.control.checkpoint.items import FastTier, data_item, device_snapshot
from stabljax.control.checkpoint.store import CheckpointStore
from stabljax.control.decide import policy
from stabljax.control.decide.policy import Ledger


class Trajectory(Protocol):
    """What a save reads of the detectors' side
    (:class:`~stabljax.control.detect.monitor.Monitor` has it)."""

    rolls_back_to_best: bool
    last_loss: float | None
    smoothed_loss: float | None

    def active_onsets(self) -> list[int | None]: ...

    def to_meta(self) -> dict[str, Any]: ...


class Saver:
    """The save decisions and captures of one run.

    The store's :attr:`~CheckpointStore.seal` (``verify`` and ``STABLJAX_CHECKPOINT_KEY``:
    what saves carry) is given to the store when it is built
    (``Seal.from_env(verify)``).
    """

    def __init__(
        self,
        store: CheckpointStore,
        monitor: Trajectory,
        log: Callable[..., None],
        *,
        keep: int,
        verify: bool | str,
        background: bool = False,
        fast_every: int | None = None,
    ):
        self.store, self.monitor, self.log, self.keep, self.verify = (
            store,
            monitor,
            log,
            keep,
            verify,
        )
        self.background = background  # background_save
        self.fast = FastTier(fast_every, keep)  # host-RAM copies (fast_every)
        self.data: Any = None  # the data iterator and the state's structure (bind)
        self.abstract: Any = None

    def bind(self, data: Any, abstract: Any) -> None:
        """Takes the run's data iterator and the state's structure (each restore_or_init)."""
        self.data, self.abstract = data, abstract
        self.fast.clear()  # the state restored (or given) is the new branch

    def maybe_save(
        self,
        step: int,
        state: Any,
        ledger: Ledger,
        data_config: Any,
        *,
        sync: bool = False,
        resume_only: bool = False,
        persist: bool = True,
    ) -> None:
        """Saves ``state`` as checkpoint ``step`` if healthy; else defers (one event).

        The store writes it (:meth:`CheckpointStore.write`), here or on its worker thread.
        A fast-tier copy due at ``step`` is taken first, if healthy (never deferred);
        ``persist=False``: only that.
        """
        data, log, store = self.data, self.log, self.store
        persist = persist and store.saved_at != step
        fast = self.fast.due(step) and not resume_only  # a preemption's save: resume only
        if not persist and not fast:
            return
        blocker = policy.save_blocker(self.monitor.active_onsets(), self.monitor.last_loss)
        if blocker is not None:
            if persist and store.defer(step):
                log("save_deferred", step, reason=blocker)
            return
        meta = self._meta(step, ledger, data_config)
        self.store.join_worker()  # its write may change the scores the fast copy reads
        if fast:
            self.fast.put(step, state, meta | self._bookkeeping(step, persist))
        if not persist:
            return
        background = self.background and not sync
        state = device_snapshot(state) if background else state
        digest = fingerprint(state) if self.verify else None  # dispatched, read later
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
            resume_only=resume_only and store.deferred is None,
        )
        store.submit(job) if background else job()
        store.mark_saved(step)

    def _meta(self, step: int, ledger: Ledger, data_config: Any) -> dict[str, Any]:
        """The meta item of a save at ``step`` (the store adds its bookkeeping and seal)."""
        meta = {"version": META_VERSION, "step": step, "data_index": self.data.index}
        meta |= ledger.to_meta() | self.monitor.to_meta()
        meta |= {"leaves": leaf_specs(self.abstract), "nodes": node_specs(self.abstract)}
        meta |= {"data_config": data_config}
        return json.loads(json.dumps(meta))  # a deep copy: the loop runs on meanwhile

    def _bookkeeping(self, step: int, persist: bool) -> dict[str, Any]:
        """What :meth:`CheckpointStore.write` adds to a checkpoint's meta at ``step`` (the
        kept checkpoints' scores and resume-only marks), for a fast-tier copy of that step:
        a rollback to it takes them back as a rollback to that checkpoint would."""
        scores = dict(self.store.scores)
        if persist and self.monitor.smoothed_loss is not None:
            scores[step] = self.monitor.smoothed_loss
        losses = {str(k): v for k, v in scores.items()}
        resume_only = sorted(self.store.resume_only)
        return {"ckpt_losses": losses, "resume_only": resume_only, "tier": "fast"}
