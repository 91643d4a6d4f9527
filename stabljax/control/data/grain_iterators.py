r"""Grain's iterators as :class:`~stabljax.control.data.iterators.DataIterator`\ s, and
:func:`as_data_iterator`, which adapts whatever a training loop passes.

* :class:`GrainDatasetIterator` — a Grain ``MapDataset`` (or batched ``IterDataset``)
  iterator, moved with ``grain.experimental.set_next_index`` (O(1)).
* :class:`GrainLoaderIterator` — a Grain ``DataLoader`` iterator, moved by rewriting
  the ``last_seen_indices`` of its state (O(1)) when its operations are 1:1 maps and
  one ``Batch``; otherwise it is drained, with a warning.
"""

from __future__ import annotations

import json
from typing import Any

import grain

from stabljax.control.data.grain_state import (
    GrainState,
    advance_loader_state,
    loader_batches_read,
    loader_operations,
    loader_warnings,
    parse_grain_state,
)
from stabljax.control.data.iterators import DataIterator, PlainIterator
from stabljax.control.errors import warn as warn_user


class GrainDatasetIterator(DataIterator):
    """Wraps a Grain ``DatasetIterator`` (from ``iter(MapDataset)`` and friends).

    The position is Grain's own ``get_next_index`` (a batched ``MapDataset`` counts
    batches), and skipping is ``grain.experimental.set_next_index``: O(1), nothing is
    read. Iterators that cannot seek (filtered or packed ``IterDataset`` pipelines) are
    drained instead, with a warning. The checkpointed state is Grain's, saved with
    ``grain.checkpoint.CheckpointSave`` (one file per process).

    Args:
      iterator: a ``grain.DatasetIterator``.
      stacklevel: where the drain warning points, as :func:`warnings.warn`'s (1: the
        line constructing it).

    Example:
      >>> import grain
      >>> from stabljax.control.data.grain_iterators import GrainDatasetIterator
      >>> it = GrainDatasetIterator(iter(grain.MapDataset.range(100).batch(4)))
      >>> it.skip(10)
      >>> next(it).tolist(), it.index
      ([40, 41, 42, 43], 11)
    """

    def __init__(self, iterator: grain.DatasetIterator, *, stacklevel: int = 1):
        if not isinstance(iterator, grain.DatasetIterator):
            raise TypeError(f"expected a grain.DatasetIterator, got {type(iterator).__name__}")
        self.source = iterator
        try:
            start = int(grain.experimental.get_next_index(iterator))
            self._seekable = True
        except (NotImplementedError, ValueError):
            start, self._seekable = 0, False
        super().__init__(start=start)
        if not self._seekable:
            warn_user(
                f"{iterator} cannot seek (filter/packing): skipping will drain it.",
                stacklevel=stacklevel + 1,
            )

    @property
    def skip_is_cheap(self) -> bool:
        return self._seekable

    def _fetch(self) -> Any:
        return next(self.source)

    def _advance(self, n: int) -> None:
        if self._seekable:
            try:
                grain.experimental.set_next_index(self.source, self._index + n)
                return
            except (NotImplementedError, ValueError):
                self._seekable = False
        for _ in range(n):
            next(self.source)

    @property
    def can_rewind(self) -> bool:
        return self._seekable

    def _rewind(self, index: int) -> None:
        grain.experimental.set_next_index(self.source, index)

    def get_state(self) -> GrainState:
        """Grain's own state plus ``index``, the position (see :class:`GrainState`)."""
        self._check_not_held()
        return GrainState(self.source.get_state(), index=self._index)

    def set_state(self, state: Any) -> None:
        """Restores a :meth:`get_state` (or the raw Grain iterator's state, dict or JSON).

        The position is ``index`` when present, else Grain's next index.
        """
        state, self._held = parse_grain_state(state), None
        if "grain" in state and "index" in state:  # {"index", "grain"}: the store's form
            state = {**state["grain"], "index": state["index"]}
        index = state.pop("index", None)
        self.source.set_state(state)
        if index is None:
            if not self._seekable:
                raise ValueError(
                    "this Grain state has no index and the iterator cannot seek "
                    "(filter/packing), so its batch position is unknown: restore a state "
                    "that GrainDatasetIterator.get_state() wrote"
                )
            index = int(grain.experimental.get_next_index(self.source))
        index = int(index)
        if self._seekable:
            if int(grain.experimental.get_next_index(self.source)) != index:
                grain.experimental.set_next_index(self.source, index)
        self._index = index

    def start_prefetch(self) -> None:
        """Grain's ``start_prefetch`` (its Orbax handler calls it after a restore)."""
        start = getattr(self.source, "start_prefetch", None)
        if start is not None:
            start()

    def _set_index(self, index: int) -> None:
        self._index = index

    def __repr__(self) -> str:
        return f"GrainDatasetIterator(index={self._index}, source={self.source})"


class GrainLoaderIterator(DataIterator):
    """Wraps a Grain ``DataLoader`` iterator (``iter(grain.DataLoader(...))``).

    Grain records a DataLoader's position as the last record index each worker has
    seen (``last_seen_indices``, global across shards) and the worker that produced the
    last batch. When the loader's operations are 1:1 transforms and one ``Batch`` (no
    ``Filter`` or packing), skipping is exact state arithmetic
    (:func:`~stabljax.control.data.grain_state.advance_loader_state`); otherwise the
    iterator is drained, with a warning, and a packing operation warns that a resume is
    not bit-exact. The position (``index``) counts batches yielded; Grain saves its own
    state per process.

    Args:
      iterator: a ``grain.DataLoaderIterator``.
      loader: the ``grain.DataLoader`` it came from (read for the batch size); taken
        from the iterator when omitted.
      start: the index of the next batch (the number already consumed); by default
        derived from Grain's state when the operations allow it (else 0), so an iterator
        restored from the trainer's own checkpoint before wrapping keeps its position.
      stacklevel: where the drain warning points, as :func:`warnings.warn`'s (1: the
        line constructing it).

    Example:
      >>> import grain
      >>> from stabljax.control.data.grain_iterators import GrainLoaderIterator
      >>> loader = grain.DataLoader(
      ...     data_source=list(range(64)),
      ...     sampler=grain.samplers.IndexSampler(64, num_epochs=1, shuffle=False),
      ...     operations=[grain.transforms.Batch(4)],
      ...     worker_count=0,
      ... )
      >>> it = GrainLoaderIterator(iter(loader))
      >>> it.skip(3)
      >>> next(it).tolist(), it.index
      ([12, 13, 14, 15], 4)
    """

    def __init__(
        self,
        iterator: grain.DataLoaderIterator,
        *,
        loader: Any = None,
        start: int | None = None,
        stacklevel: int = 1,
    ):
        if not isinstance(iterator, grain.DataLoaderIterator):
            raise TypeError(f"expected a grain.DataLoaderIterator, got {type(iterator).__name__}")
        super().__init__(start=0 if start is None else start)
        self.source = iterator
        loader = loader if loader is not None else getattr(iterator, "_data_loader", None)
        self._batch, self._draining = (
            loader_operations(loader) if loader is not None else (None, ["unknown operations"])
        )
        shard = getattr(loader, "_shard_options", None)
        self._shards = int(getattr(shard, "shard_count", 1) or 1)
        self._shard_index = int(getattr(shard, "shard_index", 0) or 0)
        for message in loader_warnings(loader, self._draining):
            warn_user(message, stacklevel=stacklevel + 1)
        if self._batch is not None and start is None:  # restored or advanced before wrapped
            self._index = self._batches_consumed()

    @property
    def skip_is_cheap(self) -> bool:
        return self._batch is not None

    def _fetch(self) -> Any:
        return next(self.source)

    def _advance(self, n: int) -> None:
        if self._batch is None:
            for _ in range(n):
                next(self.source)
            return
        st = advance_loader_state(json.loads(self.source.get_state()), n, self._batch, self._shards)
        self.source.set_state(json.dumps(st, indent=4).encode())

    @property
    def can_rewind(self) -> bool:
        return self._batch is not None

    def _rewind(self, index: int) -> None:
        # Floor division and a non-negative modulo make the arithmetic of _advance exact
        # for n < 0: |n| // W whole cycles back, then the remainder forward.
        self._advance(index - self._index)

    def get_state(self) -> GrainState:
        """Grain's own state plus ``index``, the position (see :class:`GrainState`)."""
        self._check_not_held()
        return GrainState(json.loads(self.source.get_state()), index=self._index)

    def set_state(self, state: Any) -> None:
        """Restores a :meth:`get_state` (or the raw Grain iterator's state, dict or JSON).

        The position is ``index`` when present, else derived from Grain's state
        (exact for 1:1 operations and one ``Batch``).
        """
        state, self._held = parse_grain_state(state), None
        if "grain" in state and "index" in state:  # {"index", "grain"}: the store's form
            state = {**json.loads(state["grain"]), "index": state["index"]}
        index = state.pop("index", None)
        self.source.set_state(json.dumps(state, indent=4).encode())
        if index is None:
            index = self._batches_consumed()
            if index is None:
                raise ValueError(
                    "this Grain state has no index and the loader's operations "
                    f"({', '.join(self._draining) or 'several batches'}) change the number "
                    "of records, so its batch position is unknown: restore a state that "
                    "GrainLoaderIterator.get_state() wrote"
                )
        self._index = int(index)

    def _batches_consumed(self) -> int | None:
        """Batches this process has read, from Grain's state (1:1 operations and one Batch)."""
        if self._batch is None:
            return None
        st = json.loads(self.source.get_state())
        return loader_batches_read(st, self._batch, self._shards, self._shard_index)

    def start_prefetch(self) -> None:
        """Grain's ``start_prefetch`` (its Orbax handler calls it after a restore)."""
        self.source.start_prefetch()

    def _set_index(self, index: int) -> None:
        self._index = index

    def __repr__(self) -> str:
        return f"GrainLoaderIterator(index={self._index})"


def as_data_iterator(data: Any, *, stacklevel: int = 1) -> DataIterator:
    """Adapts ``data`` to a :class:`DataIterator`.

    A :class:`DataIterator` is returned as is; a Grain ``DatasetIterator`` or
    ``DataLoaderIterator`` is wrapped in :class:`GrainDatasetIterator` /
    :class:`GrainLoaderIterator`; a ``grain.MapDataset`` or ``grain.DataLoader``
    (iterable, not an iterator) gets ``iter()`` first; any other iterable becomes a
    :class:`PlainIterator`, with a warning that skipping drains it.

    Args:
      data: the training data.
      stacklevel: where a drain warning points, as :func:`warnings.warn`'s (1: the line
        calling this).

    Returns:
      A :class:`DataIterator`.

    Example:
      >>> import grain
      >>> from stabljax.control.data.grain_iterators import as_data_iterator
      >>> type(as_data_iterator(grain.MapDataset.range(8).batch(2))).__name__
      'GrainDatasetIterator'
    """
    if isinstance(data, DataIterator):
        return data
    if isinstance(data, grain.DataLoader):
        return GrainLoaderIterator(iter(data), loader=data, stacklevel=stacklevel + 1)
    if isinstance(data, grain.DataLoaderIterator):
        return GrainLoaderIterator(data, stacklevel=stacklevel + 1)
    if isinstance(data, grain.MapDataset | grain.IterDataset):
        return GrainDatasetIterator(iter(data), stacklevel=stacklevel + 1)
    if isinstance(data, grain.DatasetIterator):
        return GrainDatasetIterator(data, stacklevel=stacklevel + 1)
    if callable(data) and not hasattr(data, "__iter__"):
        raise TypeError(
            "data is a function: wrap it as IndexedBatches(batch_fn) to train on batch_fn(i)"
        )
    if not hasattr(data, "__iter__"):
        raise TypeError(f"data must be an iterable of batches, got {type(data).__name__}")
    return PlainIterator(data, stacklevel=stacklevel + 1)
