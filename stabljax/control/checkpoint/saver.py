"""When a checkpoint is taken and what it holds: health gating, deferral, capture.

:class:`Saver` decides; :class:`~stabljax.control.checkpoint.store.CheckpointStore` writes, here or
on its worker thread (``background_save``).
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
from stabljax.control.checkpoint.items import data_item, device_snapshot
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
    ):
        self.store, self.monitor, self.log, self.keep, self.verify = (
            store,
            monitor,
            log,
            keep,
            verify,
        )
        self.background = background  # background_save
        self.data: Any = None  # the data iterator and the state's structure (bind)
        self.abstract: Any = None

    def bind(self, data: Any, abstract: Any) -> None:
        """Takes the run's data iterator and the state's structure (each restore_or_init)."""
        self.data, self.abstract = data, abstract

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
        data, abstract, log, store = self.data, self.abstract, self.log, self.store
        if store.saved_at == step:
            return
        blocker = policy.save_blocker(self.monitor.active_onsets(), self.monitor.last_loss)
        if blocker is not None:
            if store.defer(step):
                log("save_deferred", step, reason=blocker)
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
            resume_only=resume_only and store.deferred is None,
        )
        store.submit(job) if background else job()
        store.mark_saved(step)
