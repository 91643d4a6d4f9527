"""Screening ahead after a rollback: where a bad window ends, measured instead of guessed.

When a detector fires, the controller knows where the trouble began, not where it ends.
PaLM skipped 200-500 batches blind; doubling the skip on each repeated rollback passes a
window of ``w`` batches in about ``log2(w)`` rollbacks (three for 20 garbage batches, as
seen in a real trainer). After the restore, :func:`screen_ahead` looks at the batches
ahead instead: each is run through the train step from a copy of the restored state (the
run's own state, optimizer state and data position are untouched) and the skip is
extended while their loss stays anomalous, up to ``max_skip`` batches. One rollback then
passes one bad window, and the skip event records the screened range and its losses.

Iterators that can fetch a batch by index (``batch_fn``, as
:class:`~stabljax.control.data.iterators.IndexedBatches`) or move back (``can_rewind``: seekable
Grain iterators) are screened in place and put back. The others (a plain iterator, a packed
or filtered Grain pipeline) are read ahead instead (``peek``): the anomalous batches are
consumed, as the skip would drain them anyway, and the first healthy one is held for the
next step; their reference is the restored checkpoint's smoothed loss, since the batches
before the onset cannot be read again.

Example:
  >>> import jax.numpy as jnp
  >>> from stabljax.control.data.iterators import IndexedBatches
  >>> from stabljax.control.diagnose.screen import screen_ahead
  >>> data = IndexedBatches(lambda i: jnp.float32(9.0 if 3 <= i < 7 else 1.0), start=3)
  >>> step = lambda state, batch: (state, {"loss": batch})
  >>> s = screen_ahead(step, 0, data, is_anomalous=lambda loss: loss > 2, max_skip=10)
  >>> s.end, s.losses, data.index
  (7, (9.0, 9.0, 9.0, 9.0, 1.0), 3)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax

from stabljax.control.checkpoint.items import device_snapshot
from stabljax.control.decide.policy import first_allowed
from stabljax.control.detect.monitor import EMA_DECAY
from stabljax.control.diagnose.triage import is_spike
from stabljax.control.hosts import all_agree, to_host
from stabljax.metrics import LOSS

SCREENED = (  # the skip event's keys
    "screened",
    "screened_indices",
    "screened_losses",
    "screen_capped",
    "screen_read_ahead",
)
REFERENCE = 8  # healthy batches screened for the restored state's own loss level


@dataclasses.dataclass(frozen=True)
class Screened:
    """What :func:`screen_ahead` found.

    Attributes:
      start: the first data index screened.
      end: one past the last anomalous batch of the run that starts at ``start``
        (``start`` when the first batch is healthy).
      indices: the data indices screened, in order (skipped ranges passed over).
      losses: their losses under the restored state.
      capped: the run reached ``max_skip`` batches and may go on.
      read_ahead: the data was read ahead (it cannot move back): it is at ``end`` now.
    """

    start: int
    end: int
    indices: tuple[int, ...]
    losses: tuple[float, ...]
    capped: bool = False
    read_ahead: bool = False

    def as_details(self) -> dict[str, Any]:
        """JSON-able, for the skip event."""
        return {
            "screened": [self.start, self.end],
            "screened_indices": list(self.indices),
            "screened_losses": [v if math.isfinite(v) else str(v) for v in self.losses],
            "screen_capped": self.capped,
            "screen_read_ahead": self.read_ahead,
        }


def can_screen(data: Any) -> bool:
    """Whether :func:`screen_ahead` can look ahead in ``data`` without losing a batch."""
    return callable(getattr(data, "batch_fn", None)) or bool(getattr(data, "can_rewind", False))


def can_read_ahead(data: Any) -> bool:
    """Whether :func:`screen_ahead` can read ``data`` ahead (``peek``), when it cannot
    screen it in place (:func:`can_screen`)."""
    return callable(getattr(data, "peek", None))


def screen_ahead(
    step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
    state: Any,
    data: Any,
    *,
    is_anomalous: Callable[[float], bool],
    max_skip: int,
    start: int | None = None,
    agree: Callable[[bool], bool] = bool,
) -> Screened:
    """Runs the batches ahead of ``data``'s position (or of ``start``) from copies of ``state``.

    Args:
      step_fn: the train step; it may donate its state (it gets a fresh copy each call).
      state: the restored state (not modified).
      data: a :class:`~stabljax.control.data.iterators.DataIterator` at the restored position; it is
        back there on return, or, read ahead (it cannot move back), at ``end`` with the
        first healthy batch held for :func:`next`.
      is_anomalous: ``loss -> bool``, the detector's verdict on a screened loss (a
        non-finite loss is always anomalous).
      max_skip: at most this many anomalous batches are screened.
      start: the first data index to screen (default: ``data.index``); ``data`` is moved
        there and back when it has no ``batch_fn``.
      agree: ``healthy -> healthy everywhere``: on several processes, the all-reduce that
        keeps every process screening (and stepping) in lockstep.

    Returns:
      A :class:`Screened`; ``end`` is where training should resume.

    Raises:
      ValueError: ``max_skip < 1``; ``data`` can be neither screened (:func:`can_screen`)
        nor read ahead (:func:`can_read_ahead`); or reading ahead would start behind it.
    """
    if isinstance(max_skip, bool) or int(max_skip) != max_skip or max_skip < 1:
        raise ValueError(f"max_skip must be an int >= 1, got {max_skip!r}")
    ahead = not can_screen(data)
    if ahead and not can_read_ahead(data):
        raise ValueError(
            f"{type(data).__name__} can neither fetch a batch by index, move back nor be "
            "read ahead (peek): it cannot be screened"
        )
    batch_fn = getattr(data, "batch_fn", None)
    ranges = data.skipped_ranges
    home = data.index
    start = home if start is None else int(start)
    if ahead and start < home:
        raise ValueError(f"reading ahead cannot start at {start}, behind the position {home}")
    indices: list[int] = []
    losses: list[float] = []
    end, capped, i = first_allowed(start, ranges), False, start
    try:
        if not callable(batch_fn):
            _move(data, start)
        while True:
            i = first_allowed(i, ranges)
            if callable(batch_fn):
                batch = batch_fn(i)
            else:  # honours the skipped ranges, as i does; read ahead: held until next()
                batch = data.peek() if ahead else next(data)
            _, metrics = step_fn(device_snapshot(state), batch)
            loss = float(to_host(metrics[LOSS]))
            indices.append(i)
            losses.append(loss)
            if agree(math.isfinite(loss) and not is_anomalous(loss)):
                break
            end = i + 1
            if ahead:
                next(data)  # the held batch: anomalous, so skipped
            if len(indices) >= max_skip:
                capped = True
                break
            i += 1
    except (StopIteration, IndexError):  # the data ended inside the window
        pass
    finally:
        if not callable(batch_fn) and not ahead:
            _move(data, home)
    return Screened(start, end, tuple(indices), tuple(losses), capped, ahead)


def losses_at(step_fn: Any, state: Any, data: Any, indices: list[int]) -> list[float]:
    """The loss of each batch in ``indices`` (allowed ones) from a copy of ``state``;
    ``data`` is back where it was on return."""
    batch_fn, home, out = getattr(data, "batch_fn", None), data.index, []
    try:
        for i in indices:
            if callable(batch_fn):
                batch = batch_fn(i)
            else:
                _move(data, i)
                batch = next(data)
            _, metrics = step_fn(device_snapshot(state), batch)
            out.append(float(to_host(metrics[LOSS])))
    except (StopIteration, IndexError):  # the data ended
        pass
    finally:
        if not callable(batch_fn):
            _move(data, home)
    return out


def _move(data: Any, index: int) -> None:
    if index < data.index:
        data.rewind(index)
    elif index > data.index:
        data.seek(index)


def extend_over_window(
    plan: Any,
    step_fn: Any,
    state: Any,
    data: Any,
    losses: Any,
    rule: Any,
    max_skip: int,
    ema: Any = None,
) -> Any:
    """The controller's use of :func:`screen_ahead`: ``plan`` (a
    :class:`~stabljax.control.decide.policy.RollbackPlan`) extended over the batches past its
    skip whose loss is a spike (triage's rule ``rule``) against the restored state's own
    losses on the batches before the onset (else the finite, unskipped ``losses``,
    ``[step, loss, skipped]``, before it). Data that cannot be screened in place is read
    ahead against the restored checkpoint's smoothed loss (its meta's ``ema``, bias-corrected;
    unchanged without one: an untrained state has no level to compare with). On several
    processes every process screens in lockstep."""
    level = float(ema[0]) / (1 - EMA_DECAY ** int(ema[1])) if ema and int(ema[1]) else None
    agree = all_agree if jax.process_count() > 1 else bool
    if not can_screen(data):
        if level is None or not can_read_ahead(data) or plan.resume_at < data.index:
            return plan
        found = screen_ahead(
            step_fn,
            state,
            data,
            is_anomalous=lambda loss: is_spike(loss, [level], rule),
            max_skip=max_skip,
            start=plan.resume_at,
            agree=agree,
        )
        return plan.extended_to(found.end, found.as_details())
    # The reference is the restored state's own loss on the healthy batches it was about to
    # train on (those fed before the onset): the run's losses before the onset come from a
    # later state, and a state far back (an untrained one) finds every batch "anomalous".
    indices, i = [], plan.skip.start
    for _ in range(max(0, min(REFERENCE, plan.onset - plan.target))):
        i = first_allowed(i, data.skipped_ranges)
        indices.append(i)
        i += 1
    reference = [v for v in losses_at(step_fn, state, data, indices) if math.isfinite(v)]
    if len(reference) < 3:  # no healthy batch between the checkpoint and the onset
        reference = [x[1] for x in losses if x[0] < plan.onset and not x[2]]
        reference = [v for v in reference if v is not None and math.isfinite(v)]
    found = screen_ahead(
        step_fn,
        state,
        data,
        is_anomalous=lambda loss: is_spike(loss, reference, rule),
        max_skip=max_skip,
        start=plan.resume_at,
        agree=agree,
    )
    return plan.extended_to(found.end, found.as_details())
