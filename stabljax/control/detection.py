"""What every detector shares: :class:`Detection`, the :class:`Detector` protocol, helpers.

The detectors read the train step's metrics by the keys in :mod:`stabljax.metrics`, and
check the key they watch when they are built (:func:`check_metric`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from stabljax.control.policy import Action as Action
from stabljax.metrics import OVERFLOW, SKIPPED, check_key


@dataclasses.dataclass(frozen=True)
class Detection:
    """What a detector found at one step.

    Attributes:
      kind: ``"spike"``, ``"divergence"`` or ``"slow_divergence"``.
      step: the step whose observation triggered it.
      onset: the first step of the episode (``<= step``).
      action: ``"record"``, ``"warn"``, ``"rollback"``, ``"rollback_best"`` or
        ``"raise"``.
      reason: a human-readable sentence.
      value: the observed value (usually the loss).
      details: JSON-able numbers behind the decision (median, scale, z-score, ...).
    """

    kind: str
    step: int
    onset: int
    action: Action
    reason: str
    value: float
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def rolls_back(self) -> bool:
        return self.action in ("rollback", "rollback_best")

    @property
    def raises(self) -> bool:
        """The controller must raise ``TrainingDiverged`` (action ``"raise"``)."""
        return self.action == "raise"


@runtime_checkable
class Detector(Protocol):
    """The interface the rollback controller expects of a detector.

    ``update`` is called once per step, in step order, with host scalars; it must not
    raise on a non-finite value. An optional ``keys`` attribute (a tuple of metric
    names) limits the metrics the controller fetches from the device for it; without
    one, every scalar metric is fetched. ``active_onset`` is the onset of an episode in
    progress (``None`` when there is none), so the controller can roll back to before
    it when another detector fires. ``get_state`` returns JSON-able data that
    ``set_state`` accepts.
    """

    name: str

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None: ...

    @property
    def active_onset(self) -> int | None: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: Mapping[str, Any]) -> None: ...


def value_of(metrics: Mapping[str, Any], key: str) -> float:
    """``float(metrics[key])``, or a ``ValueError`` naming the key and the keys there are."""
    if key not in metrics:
        raise ValueError(f"metrics has no {key!r}; keys: {sorted(metrics)}")
    return float(metrics[key])


def was_skipped(metrics: Mapping[str, Any]) -> bool:
    """A guard skipped the step's update, or a float16 overflow did (the same to us)."""
    return bool(metrics.get(SKIPPED, False)) or bool(metrics.get(OVERFLOW, False))


def check_metric(owner: str, metric: str, extra_keys: Iterable[str]) -> tuple[str, ...]:
    """Checks a detector's ``metric`` against the keys the step writes (and ``extra_keys``).

    Returns ``extra_keys`` as a tuple of strings; raises ``ValueError`` naming the metric
    when nobody writes it, so a typo fails when the detector is built, not at every step.
    """
    ok = isinstance(extra_keys, Iterable) and not isinstance(extra_keys, str)
    extra = tuple(extra_keys) if ok else ()
    if not ok or not all(isinstance(k, str) for k in extra):
        raise ValueError(f"{owner}: `extra_keys` must be an iterable of str; got {extra_keys!r}.")
    check_key(owner, "metric", metric, extra)
    return extra


class WatchesMetric:
    """What the built-in detectors share: the metric they watch and their state's name.

    ``metric`` must be a key of :mod:`stabljax.metrics` or one of ``extra_keys``, the keys
    a custom step writes (``aux`` entries of your ``loss_fn``); :meth:`_watch` checks it
    when the detector is built. :attr:`keys` is what the controller fetches for it.
    """

    #: the keys read besides ``metric``
    reads: tuple[str, ...] = (SKIPPED, OVERFLOW)
    metric: str
    name: str
    extra_keys: tuple[str, ...]

    def _watch(self, owner: str, metric: str, name: str, extra_keys: Iterable[str]) -> None:
        self.extra_keys = check_metric(owner, metric, extra_keys)
        self.metric = metric
        self.name = name

    @property
    def keys(self) -> tuple[str, ...]:
        """The metrics this detector reads."""
        return (self.metric, *self.reads)


def int_at_least(low: int):
    """A :func:`~stabljax.optim._base.validate` predicate: an integer scalar >= ``low``."""
    return lambda a: a.ndim == 0 and a.dtype.kind in "iu" and a >= low


def one_of(*choices: str):
    """A :func:`~stabljax.optim._base.validate` predicate: one of ``choices``."""
    return lambda a: a.ndim == 0 and a.dtype.kind == "U" and str(a) in choices
