"""Grain's side of the data iterators: its checkpoint format and its loaders' operations.

* :class:`GrainState`: the state the Grain wrappers of :mod:`stabljax.control.data.iterators` give,
  Grain's own plus ``index`` (the batch position), in a form Grain's Orbax handler writes.
* :func:`parse_grain_state`: a Grain state from a dict, JSON text or JSON bytes.
* :func:`loader_operations`: whether a ``grain.DataLoader`` can be moved by state
  arithmetic (1:1 operations and one batch), and if not, which operations stop it.
* :func:`inexact_operations`: the operations whose buffers Grain's checkpoint of a
  ``DataLoader`` does not hold (packing), so that a resume is not bit-exact.
* :func:`advance_loader_state` and :func:`loader_batches_read`: a ``DataLoader``'s state
  moved by ``n`` batches, and the batches it says were read (1:1 operations, one batch).
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
    one_to_one, batches = _one_to_one(), _batches()
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


def inexact_operations(loader: Any) -> list[str]:
    """The operations of a ``grain.DataLoader`` that a resume from its state does not redo.

    Grain checkpoints a DataLoader as the last record index each worker has read. An
    operation that emits one output per input (a map), drops inputs (``Filter``) or groups
    them into one output (``Batch``) is resumed exactly from that; one that carries records
    over from one output to the next (``PackAndBatchOperation``: the parts of records not
    yet packed) holds a buffer that state lacks, so the resumed stream differs from the
    uninterrupted one (upstream Grain behaves the same). Those are named.

    Example:
      >>> import grain
      >>> from stabljax.control.data.grain_state import inexact_operations
      >>> ops = [grain.experimental.PackAndBatchOperation({"t": 8}, batch_size=2)]
      >>> loader = grain.DataLoader(data_source=[{"t": [1]}] * 4, operations=ops,
      ...     sampler=grain.samplers.IndexSampler(4, num_epochs=1), worker_count=0)
      >>> inexact_operations(loader)
      ['PackAndBatchOperation']
    """
    ops = getattr(loader, "_operations", None)
    if ops is None:
        return ["unknown operations"]
    exact = _one_to_one() + _batches() + _filters()
    return [type(op).__name__ for op in ops if not isinstance(op, exact)]


def _one_to_one() -> tuple[type, ...]:
    return tuple(
        getattr(grain.transforms, n)
        for n in ("Map", "RandomMap", "MapWithIndex", "TfRandomMap")
        if hasattr(grain.transforms, n)
    ) + tuple(
        getattr(grain_legacy, n)
        for n in ("MapOperation", "RandomMapOperation")
        if hasattr(grain_legacy, n)
    )


def _batches() -> tuple[type, ...]:
    return (grain.transforms.Batch,) + tuple(
        getattr(grain_legacy, n) for n in ("BatchOperation",) if hasattr(grain_legacy, n)
    )


def _filters() -> tuple[type, ...]:
    return tuple(
        getattr(m, n)
        for m, n in ((grain.transforms, "Filter"), (grain_legacy, "FilterOperation"))
        if hasattr(m, n)
    )


def loader_warnings(loader: Any, draining: list[str]) -> list[str]:
    """What a ``DataLoader``'s operations cost: skipping drains it (``draining``, from
    :func:`loader_operations`), and a resume is not bit-exact (:func:`inexact_operations`)."""
    out = []
    if draining:
        out.append(
            f"this grain.DataLoader's operations {', '.join(draining)} change the number of "
            "records: skipping will drain it."
        )
    if inexact := inexact_operations(loader):  # None: unknown operations
        out.append(
            f"this grain.DataLoader's operations {', '.join(inexact)} keep records between "
            "batches that Grain's checkpoint does not hold: a resume (a restart or a rollback) "
            "will not be bit-exact, the batches after it differ from an uninterrupted run's."
        )
    return out


def advance_loader_state(st: dict[str, Any], n: int, batch: int, shards: int) -> dict[str, Any]:
    """A ``DataLoader`` state (as a dict) moved ``n`` batches (``n < 0``: back).

    Batches go round-robin over the :math:`W` workers (1 when ``worker_count`` is 0), so
    worker :math:`w` gets :math:`\\lfloor n/W \\rfloor` batches, plus one if it is among the
    next :math:`n \\bmod W` in the cycle, and its last seen index moves by :math:`B W S` per
    batch (batch size :math:`B`, :math:`S` shards). Floor division and a non-negative
    modulo keep it exact for ``n < 0``.

    Example:
      >>> from stabljax.control.data.grain_state import advance_loader_state
      >>> st = {"worker_count": 0, "last_worker_index": -1, "last_seen_indices": {"0": 7}}
      >>> advance_loader_state(st, 3, batch=4, shards=1)["last_seen_indices"]
      {'0': 19}
    """
    st = json.loads(json.dumps(st))
    workers = max(int(st["worker_count"]), 1)
    cycle = (int(st["last_worker_index"]) + 1) % workers
    for w in range(workers):
        k = n // workers + (1 if (w - cycle) % workers < n % workers else 0)
        st["last_seen_indices"][str(w)] += k * batch * workers * shards
    st["last_worker_index"] = (cycle + n) % workers - 1
    return st


def loader_batches_read(st: dict[str, Any], batch: int, shards: int, shard_index: int) -> int:
    """The batches a ``DataLoader`` state (as a dict) says this process has read.

    Grain stores, per worker ``w`` of ``W`` and shard ``s`` of ``S``, the last record index
    seen, ``s - W S + w S + n_w W S`` where ``n_w`` is the records worker ``w`` has read;
    the batches read are ``sum(n_w) / B``.

    Example:
      >>> from stabljax.control.data.grain_state import loader_batches_read
      >>> st = {"worker_count": 0, "last_seen_indices": {"0": 19}}
      >>> loader_batches_read(st, batch=4, shards=1, shard_index=0)
      5
    """
    workers = max(int(st["worker_count"]), 1)
    seen, g = st["last_seen_indices"], workers * shards
    records = sum((int(seen[str(w)]) - shard_index + g - w * shards) // g for w in range(workers))
    return records // batch
