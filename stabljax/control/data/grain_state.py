"""Grain's side of the data iterators: its checkpoint format and its loaders' operations.

* :class:`GrainState`: the state the Grain wrappers of :mod:`stabljax.control.data.iterators` give,
  Grain's own plus ``index`` (the batch position), in a form Grain's Orbax handler writes.
* :func:`parse_grain_state`: a Grain state from a dict, JSON text or JSON bytes.
* :func:`loader_operations`: whether a ``grain.DataLoader`` can be moved by state
  arithmetic (1:1 operations and one batch), and if not, which operations stop it.
"""

from __future__ import annotations

import json
from typing import Any

import grain

try:  # the legacy operations (MapOperation, BatchOperation, ...)
    import grain.python as grain_legacy
except ImportError:  # pragma: no cover - a Grain without them
    grain_legacy = None


class GrainState(dict):
    """A Grain iterator's own state (a dict) plus ``index``, the wrapper's batch position.

    Grain's Orbax handler (``grain.checkpoint.CheckpointSave``) writes
    ``json.dumps(get_state())`` for a ``grain.DatasetIterator`` and ``get_state().decode()``
    for anything else, and restores with ``set_state`` of the text it read, encoded. This
    dict's :meth:`decode` gives its JSON, so a trainer's own Orbax checkpoint of a stabljax
    Grain wrapper works, and the file holds Grain's own state: the raw Grain iterator can
    restore it too (Grain ignores the extra key), and the wrapper can restore a file the raw
    iterator wrote.
    """

    def decode(self, *args: Any) -> str:
        return json.dumps(self, indent=4)


def parse_grain_state(state: Any) -> dict[str, Any]:
    """Grain's state as a dict, from a dict, JSON text or JSON bytes."""
    if isinstance(state, bytes | bytearray):
        state = state.decode()
    if isinstance(state, str):
        state = json.loads(state)
    if not isinstance(state, dict):
        raise TypeError(f"a Grain iterator state is a dict or its JSON, got {type(state).__name__}")
    return dict(state)


def loader_operations(loader: Any) -> tuple[int | None, list[str]]:
    """``(records per batch, the operations that stop O(1) skipping)`` of a DataLoader.

    Skipping is exact state arithmetic when every operation maps one record to one record
    (``grain.transforms.Map``, ``RandomMap``, ``MapWithIndex``, ``TfRandomMap``, and the
    legacy ``MapOperation`` / ``RandomMapOperation``) and one of them batches
    (``grain.transforms.Batch`` or the legacy ``BatchOperation``). The others (``Filter``,
    ``FlatMap``, packing, a second batch) change the number of records and are named.
    """
    ops = getattr(loader, "_operations", None)
    if ops is None:
        return None, ["unknown operations"]
    legacy = grain_legacy
    one_to_one = tuple(
        getattr(grain.transforms, n)
        for n in ("Map", "RandomMap", "MapWithIndex", "TfRandomMap")
        if hasattr(grain.transforms, n)
    ) + tuple(
        getattr(legacy, n) for n in ("MapOperation", "RandomMapOperation") if hasattr(legacy, n)
    )
    batches = (grain.transforms.Batch,) + tuple(
        getattr(legacy, n) for n in ("BatchOperation",) if hasattr(legacy, n)
    )
    batch, draining = None, []
    for op in ops:
        if isinstance(op, batches):
            if batch is not None:
                draining.append(f"a second {type(op).__name__}")
            batch = int(op.batch_size)
        elif not isinstance(op, one_to_one):
            draining.append(type(op).__name__)
    if draining:
        return None, draining
    return (batch if batch is not None else 1), []
