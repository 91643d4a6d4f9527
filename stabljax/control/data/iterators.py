"""Data iterators with a position, O(1) skipping and a JSON-able state.

The rollback controller needs from the data the index of the next batch (``index``), a way
forward past bad batches (``skip``, ``seek``) or ahead (``peek``), a way back to a restored
checkpoint's position (``rewind``, where ``can_rewind``), and a state to checkpoint with the
model. :class:`DataIterator` is that interface; its subclasses adapt what people train on:

* :class:`IndexedBatches` — ``batch_fn(i)`` for i = 0, 1, …; skipping is free.
* the Grain iterators, in :mod:`~stabljax.control.data.grain_iterators`, with
  :func:`~stabljax.control.data.grain_iterators.as_data_iterator`, which adapts whatever
  a loop passes.
* :class:`PlainIterator` — any Python iterator; skipping drains it (warned once).

Every iterator also honours ``skipped_ranges``: half-open index ranges ``[a, b)`` it
never yields. When the position reaches ``a`` it jumps to ``b`` before fetching, so a
range recorded by a rollback is honoured after a restart too, even when the position
passes through it later.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from stabljax.control.decide.policy import first_allowed, merge_ranges
from stabljax.control.errors import warn as warn_user


class DataIterator(Iterator[Any]):
    """An iterator of batches with a position, forward skipping and a JSON-able state.

    Subclasses implement ``_fetch()`` (the batch at the current position) and
    ``_advance(n)`` (move the underlying source ``n`` batches forward without
    yielding). ``index`` is the index of the next batch to be yielded; it only grows.

    Attributes:
      skipped_ranges: merged half-open ranges never yielded (set by the controller).
      config: JSON-able description of the data (batch size, sequence length, corpus
        identity) or ``None``; the controller records it and refuses to resume with
        another one.
    """

    config: Any = None

    def __init__(self, *, start: int = 0):
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self._index = int(start)
        self._ranges: list[tuple[int, int]] = []
        self._held: Any = None  # (index, batch): read by peek, not yet yielded

    @property
    def index(self) -> int:
        """The index of the next batch (before ``skipped_ranges`` are applied)."""
        return self._index

    @property
    def next_index(self) -> int:
        """The index of the batch ``next()`` yields: ``index``, moved past a skipped range."""
        return first_allowed(self._index, self._ranges)

    @property
    def skipped_ranges(self) -> list[tuple[int, int]]:
        return list(self._ranges)

    @skipped_ranges.setter
    def skipped_ranges(self, ranges: Iterable[Sequence[int]]) -> None:
        self._ranges = merge_ranges(ranges)

    @property
    def skip_is_cheap(self) -> bool:
        """Whether :meth:`skip` is O(1) (False: it consumes the skipped batches)."""
        return True

    def skip(self, n: int) -> None:
        """Moves ``n >= 0`` batches forward without yielding them."""
        n = int(n)
        if n < 0:
            raise ValueError(f"can only skip forward, got n={n}")
        n -= self._drop_held() if n else 0  # the source is past a held batch already
        if n:
            self._advance(n)
            self._index += n

    def peek(self) -> Any:
        """The batch :meth:`next` yields next, read now and held until then: any iterator can
        so be read ahead (``screen_ahead``). The position does not move; the source is one
        batch ahead until ``next``, so :meth:`get_state` refuses.

        Example:
          >>> from stabljax.control.data.iterators import IndexedBatches
          >>> it = IndexedBatches(lambda i: i * 10)
          >>> it.peek(), it.index, next(it), next(it), it.index
          (0, 0, 0, 10, 2)
        """
        if self._held is None:
            if self._ranges:
                self.seek(self.next_index)
            self._held = (self._index, self._fetch())
        return self._held[1]

    def _drop_held(self) -> int:
        """Forgets a held batch (the source is past it): the position moves over it."""
        if self._held is None:
            return 0
        self._held, self._index = None, self._index + 1
        return 1

    def _check_not_held(self) -> None:
        if self._held is not None:
            raise RuntimeError(f"batch {self._held[0]} was read ahead (peek): call next() first")

    def seek(self, index: int) -> None:
        """Moves forward to ``index`` (``>= self.index``); :meth:`rewind` goes back."""
        if index < self._index:
            raise ValueError(f"cannot move back from batch {self._index} to {index}")
        self.skip(index - self._index)

    @property
    def can_rewind(self) -> bool:
        """Whether :meth:`rewind` can move this iterator back (a narrowed skip needs it)."""
        return False

    def rewind(self, index: int) -> None:
        """Moves back to ``index`` (``<= self.index``), so the next batch is batch ``index``.

        Raises ``ValueError`` when this kind of iterator cannot go back (``can_rewind``).
        """
        index = int(index)
        if index > self._index:
            raise ValueError(f"rewind moves back, got {index} > index {self._index}")
        if index == self._index and self._held is None:
            return
        self._drop_held()  # the source is one batch past the position
        if not self.can_rewind or index < 0:
            raise ValueError(
                f"{type(self).__name__} cannot move back from batch {self._index} to {index}: "
                "use IndexedBatches or a seekable Grain iterator"
            )
        self._rewind(index)
        self._index = index

    def _rewind(self, index: int) -> None:
        raise NotImplementedError

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> Any:
        if self._ranges:
            self.seek(self.next_index)
        if self._held is not None:
            (_, batch), self._held = self._held, None
        else:
            batch = self._fetch()
        self._index += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        """A JSON-able state: ``{"index": ...}`` plus what the source needs."""
        self._check_not_held()
        return {"index": self._index}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores :meth:`get_state`'s output."""
        self._drop_held()  # the source is one batch past the position
        self._set_index(int(state["index"]))

    def restore(
        self,
        index: int,
        skipped_ranges: Iterable[Sequence[int]],
        state: dict[str, Any] | None = None,
    ) -> None:
        """Sets the position after a checkpoint is read: the one writer of it.

        The controller calls it once after every restore (resume and rollback). ``state``
        (a checkpoint's :meth:`get_state`, Grain's saved state included) is applied
        first; then ``skipped_ranges`` replace this iterator's; then it moves to
        ``index``, forward (:meth:`seek`) or back (:meth:`rewind`, a narrowed skip).

        Raises:
          StopIteration: the data ended before ``index``.
          ValueError: ``index`` is behind and this iterator cannot move back.

        Example:
          >>> from stabljax.control.data.iterators import IndexedBatches
          >>> it = IndexedBatches(lambda i: i, start=9)
          >>> it.restore(4, [(5, 7)], state={"index": 2})
          >>> it.index, [next(it) for _ in range(3)]
          (4, [4, 7, 8])
        """
        if state is not None:
            self.set_state(state)
        self._ranges = merge_ranges(skipped_ranges)
        index = int(index)
        if index < self._index:
            self.rewind(index)
        else:
            self.seek(index)

    def _set_index(self, index: int) -> None:
        raise NotImplementedError

    def _fetch(self) -> Any:
        raise NotImplementedError

    def _advance(self, n: int) -> None:
        raise NotImplementedError


class IndexedBatches(DataIterator):
    """Iterates ``batch_fn(i)`` for i = ``start``, ``start + 1``, …

    The batch is a pure function of its index, so skipping and restoring are free and
    exact: the iterator behind the ledger-honesty guarantee of the rollback controller.
    A finite ``batch_fn`` ends the data by raising ``IndexError`` (as a sequence does),
    which becomes ``StopIteration``.

    Args:
      batch_fn: a function of a non-negative int returning a batch (e.g.
        :func:`stabljax.reference.lm_batch_fn`).
      start: the first index.
      config: JSON-able description of the data (e.g. ``{"batch_size": 8, "seq_len":
        64, "corpus": "sha256:..."}``), recorded in every checkpoint and compared on
        resume.

    Example:
      >>> from stabljax.control import IndexedBatches
      >>> it = IndexedBatches(lambda i: i * 10)
      >>> next(it), next(it)
      (0, 10)
      >>> it.skip(3)
      >>> it.skipped_ranges = [(6, 8)]
      >>> next(it), next(it), it.index
      (50, 80, 9)
      >>> state = it.get_state()
      >>> state
      {'index': 9}
      >>> it2 = IndexedBatches(lambda i: i * 10)
      >>> it2.set_state(state)
      >>> next(it2)
      90
    """

    def __init__(self, batch_fn: Callable[[int], Any], *, start: int = 0, config: Any = None):
        if not callable(batch_fn):
            raise TypeError(f"batch_fn must be callable, got {type(batch_fn).__name__}")
        super().__init__(start=start)
        self.batch_fn = batch_fn
        self.config = None if config is None else json.loads(json.dumps(config))

    def _fetch(self) -> Any:
        try:
            return self.batch_fn(self._index)
        except IndexError as e:
            raise StopIteration(f"batch_fn({self._index}) raised IndexError: {e}") from e

    def _advance(self, n: int) -> None:
        pass

    @property
    def can_rewind(self) -> bool:
        return True

    def _rewind(self, index: int) -> None:
        pass

    def _set_index(self, index: int) -> None:
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        self._index = index

    def __repr__(self) -> str:
        return f"IndexedBatches(index={self._index}, skipped_ranges={self._ranges})"


class PlainIterator(DataIterator):
    """Wraps any Python iterator; skipping and restoring drain it (warned once).

    A plain iterator cannot move without producing the batches it passes, and it cannot
    go back: restoring a state at index ``k`` on a fresh iterator consumes ``k``
    batches. Use :class:`IndexedBatches` or a Grain iterator to skip in O(1).

    Args:
      iterator: any iterable; ``iter()`` is called on it.
      start: the index of its first batch.
      warn: emit the "skipping drains" warning on construction.
      stacklevel: where the warning points, as :func:`warnings.warn`'s (1: the line
        constructing it).

    Example:
      >>> import warnings
      >>> from stabljax.control.data.iterators import PlainIterator
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore")
      ...     it = PlainIterator(iter(range(100)))
      >>> it.skip(5)
      >>> next(it), it.index
      (5, 6)
    """

    def __init__(
        self, iterator: Iterable[Any], *, start: int = 0, warn: bool = True, stacklevel: int = 1
    ):
        super().__init__(start=start)
        self.source = iterator
        self._it = iter(iterator)
        if warn:
            warn_user(
                f"{type(iterator).__name__} is a plain iterator: skipping bad batches and "
                "restoring the data position will consume (drain) every batch passed. Use "
                "stabljax.control.IndexedBatches or a Grain iterator to skip in O(1).",
                stacklevel=stacklevel + 1,
            )

    @property
    def skip_is_cheap(self) -> bool:
        return False

    def _fetch(self) -> Any:
        return next(self._it)

    def _advance(self, n: int) -> None:
        for _ in range(n):
            next(self._it)

    def _set_index(self, index: int) -> None:
        self.seek(index)
