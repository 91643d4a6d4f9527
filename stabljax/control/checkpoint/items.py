"""What a checkpoint holds besides the meta item: device copies of the state, and the data item.

* :func:`device_snapshot`: the state copied on its devices, so the train step may donate
  the original while a save (or triage, or screening) reads the copy.
* :class:`FastTier`: the fast tier, host-RAM copies of recent states beside the persistent
  checkpoints, each with the meta item a checkpoint of its step would hold; a rollback to
  one reads nothing from the run directory.
* :func:`data_item`: the Orbax args of the data position. Grain iterators are saved with
  Grain's own checkpoint handler (its state frozen when the save was decided) and read back
  into a :class:`GrainStateReader`, never into the live iterator: the data position has one
  writer (:meth:`~stabljax.control.data.iterators.DataIterator.restore`). Other data is JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from stabljax.control.data.grain_iterators import GrainDatasetIterator, GrainLoaderIterator


def device_snapshot(tree: Any) -> Any:
    """``tree`` with every ``jax.Array`` copied on its devices (same shardings), async.

    The train step may donate the original buffers as soon as this returns.
    """
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
    copies = jax.device_put([leaves[i] for i in where], may_alias=False)
    out = [np.array(x, copy=True) if isinstance(x, np.ndarray) else x for x in leaves]
    for i, dup in zip(where, copies, strict=True):
        out[i] = dup
    return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class _HostKey:
    """A typed PRNG key array in host memory: its key data and implementation."""

    data: np.ndarray
    impl: Any


def _host_leaf(x: Any) -> Any:
    """A host copy of one leaf (blocks until the device computed it); never an alias."""
    if not isinstance(x, jax.Array):
        return copy.deepcopy(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return _HostKey(np.array(jax.random.key_data(x)), jax.random.key_impl(x))
    return np.array(x, copy=True)


def _device_leaf(host: Any, was_array: bool, spec: Any) -> Any:
    """``host`` back on the devices, with the sharding of ``spec`` (the state's structure)."""
    if not was_array:
        return copy.deepcopy(host)
    if isinstance(host, _HostKey):
        host = jax.random.wrap_key_data(host.data, impl=host.impl)
    return jax.device_put(host, getattr(spec, "sharding", None))


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """One state of the fast tier: the train state's leaves in host memory and the meta
    item (ledger, data position, detector state) a checkpoint of the same step would hold."""

    leaves: list[Any]
    arrays: list[bool]  # which leaves were jax.Arrays (restored onto the devices)
    treedef: Any
    meta: Mapping[str, Any]

    def restore(self, abstract: Any) -> tuple[Any, dict[str, Any], None]:
        """``(state, meta, None)`` as a checkpoint restore returns it, the state placed
        with ``abstract``'s shardings (one process: every shard is this host's)."""
        specs = self.treedef.flatten_up_to(abstract)
        leaves = map(_device_leaf, self.leaves, self.arrays, specs)
        return jax.tree.unflatten(self.treedef, list(leaves)), copy.deepcopy(dict(self.meta)), None


class FastTier:
    """The fast tier: a host-RAM copy of the state every ``every`` steps, the newest ``keep``.

    It lives as long as the controller (a restart resumes from the persistent checkpoints).
    ``every=None``: no fast tier.
    """

    def __init__(self, every: int | None, keep: int):
        self.every, self.keep = every, keep
        self.copies: dict[int, HostCopy] = {}  # step -> copy; a rollback's restore targets

    def due(self, step: int) -> bool:
        """Whether a copy of step ``step`` is due and not yet taken."""
        return self.every is not None and step % self.every == 0 and step not in self.copies

    def put(self, step: int, state: Any, meta: Mapping[str, Any]) -> None:
        """Copies ``state`` to host memory with its ``meta``; drops the oldest past ``keep``."""
        leaves, treedef = jax.tree.flatten(state)
        arrays = [isinstance(x, jax.Array) for x in leaves]
        host = [_host_leaf(x) for x in leaves]
        self.copies[step] = HostCopy(host, arrays, treedef, copy.deepcopy(dict(meta)))
        for old in sorted(self.copies)[: -self.keep]:
            del self.copies[old]

    def drop_newer_than(self, step: int) -> None:
        """Forgets the copies after ``step`` (a rollback abandoned their branch)."""
        self.copies = {s: c for s, c in self.copies.items() if s <= step}

    def clear(self) -> None:
        self.copies = {}


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


def grain_source(data: Any) -> Any:
    return data.source if isinstance(data, GrainDatasetIterator | GrainLoaderIterator) else None


class GrainStateReader:
    """Stands in for a Grain iterator in a restore: it takes the saved state instead of the
    live iterator, so the data position has one writer
    (:meth:`~stabljax.control.data.iterators.DataIterator.restore`).

    Grain's handler calls ``set_state(bytes)`` for anything that is not a
    ``DatasetIterator``, then ``start_prefetch()``.
    """

    def __init__(self) -> None:
        self.saved: bytes | None = None

    def set_state(self, state: bytes) -> None:
        self.saved = bytes(state)

    def start_prefetch(self) -> None:
        pass

    def state_for(self, data: Any, index: int) -> dict[str, Any]:
        """``data.get_state()``'s form of what was saved, at data index ``index``."""
        if self.saved is None:
            raise ValueError("no Grain state was read")
        if isinstance(grain_source(data), grain.DatasetIterator):
            return {"index": index, "grain": json.loads(self.saved)}
        return {"index": index, "grain": self.saved.decode()}


def data_item(data: Any, *, restore: bool) -> Any:
    """Orbax args for the data item; a save holds the position as of this call.

    A restore reads it without touching ``data``: Grain's state lands in a
    :class:`GrainStateReader`, any other data's is returned as JSON.
    """
    source = grain_source(data)
    if source is not None:
        if restore:
            return grain.checkpoint.CheckpointRestore(GrainStateReader())
        return grain.checkpoint.CheckpointSave(_FrozenState(source))
    if restore:
        return ocp.args.JsonRestore()
    return ocp.args.JsonSave(json.loads(json.dumps(data.get_state())))
