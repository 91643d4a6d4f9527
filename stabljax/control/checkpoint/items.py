"""What a checkpoint holds besides the meta item: device copies of the state, and the data item.

* :func:`device_snapshot`: the state copied on its devices, so the train step may donate
  the original while a save (or triage, or screening) reads the copy.
* :func:`data_item`: the Orbax args of the data position. Grain iterators are saved with
  Grain's own checkpoint handler (its state frozen when the save was decided) and read back
  into a :class:`GrainStateReader`, never into the live iterator: the data position has one
  writer (:meth:`~stabljax.control.data.iterators.DataIterator.restore`). Other data is JSON.
"""

from __future__ import annotations

import json
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
