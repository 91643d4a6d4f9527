"""Detectors: what the controller watches, each with checkpointable state.

* :class:`Detection` (what a detector found: kind, step, onset, action) and the
  :class:`Detector` protocol; :class:`WatchesMetric` checks at construction that the metric
  a detector reads is one the step writes.
* :class:`SpikeDetector`: a loss above a robust (median/MAD) threshold of recent values.

:mod:`~stabljax.control.detect.drift` has the divergence detectors (``DivergenceDetector``,
``SlowDivergenceDetector``) and ``default_detectors``; :mod:`~stabljax.control.detect.trends` the
trend tests they use.

A detector only reports; whether a detection rolls back is its ``action``
(:attr:`Detection.rolls_back`), and the controller acts on it in one place
(:meth:`~stabljax.control.controller.RollbackController._process`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from stabljax.base import validate
from stabljax.control.decide.policy import Action
from stabljax.metrics import LOSS, OVERFLOW, SKIPPED, check_key

# --------------------------------------------------------------------------------------- detection
# What every detector shares: :class:`Detection`, the :class:`Detector` protocol, helpers.


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
    """A :func:`~stabljax.base.validate` predicate: an integer scalar >= ``low``."""
    return lambda a: a.ndim == 0 and a.dtype.kind in "iu" and a >= low


def one_of(*choices: str):
    """A :func:`~stabljax.base.validate` predicate: one of ``choices``."""
    return lambda a: a.ndim == 0 and a.dtype.kind == "U" and str(a) in choices


# ------------------------------------------------------------------------------------------- spike
# The loss-spike detector: a robust z-score against a window of recent accepted values.


# 1 / Phi^-1(3/4): the MAD of a normal sample times this is its standard deviation.
_MAD_TO_STD = 1.482602218505602


def _median(s: Sequence[float]) -> float:
    """The median of a sorted sequence, as ``np.median`` computes it in float64."""
    k = len(s) // 2
    return float(s[k]) if len(s) % 2 else (s[k - 1] + s[k]) / 2


def _mad(s: Sequence[float], m: float) -> float:
    """The median of ``|s - m|`` for a sorted ``s`` and its median ``m``, in O(log n).

    The deviations are two sorted runs: ``m - s[p - 1 - t]`` below the median and
    ``s[p + t] - m`` from it on; each order statistic is found by bisecting how many of
    the first run it takes (``a - b == -(b - a)`` in floating point, so the values are
    bitwise those of ``np.abs(s - m)``).
    """
    n, p = len(s), bisect.bisect_left(s, m)
    low, high = p, n - p

    def kth(k: int) -> float:  # the k-th smallest deviation, 0-based
        lo, hi = max(0, k + 1 - high), min(k + 1, low)
        while lo < hi:
            i = (lo + hi) // 2
            if m - s[p - 1 - i] < s[p + k - i] - m:
                lo = i + 1
            else:
                hi = i
        j = k + 1 - lo
        below = m - s[p - lo] if lo else -math.inf
        return max(below, s[p + j - 1] - m if j else -math.inf)

    k = n // 2
    return kth(k) if n % 2 else (kth(k - 1) + kth(k)) / 2


class SpikeDetector(WatchesMetric):
    r"""Flags values far above the median of a window of recent accepted values, and
    smaller rises that last.

    With :math:`m` the median and :math:`s = 1.4826\,\mathrm{MAD}` the robust scale (the
    standard deviation for normal data) of the last ``window`` accepted values, after
    ``warmup`` of them a value :math:`x` is anomalous when

    .. math::
        x - m > \max(\text{threshold}\cdot s,\ \text{rel\_floor}\cdot|m|,\ \text{abs\_floor}),

    one-sided (a falling loss is welcome), or when, for some :math:`(k, c)` in
    ``sustained``, the median :math:`m_k` of the last :math:`k` values (those not anomalous
    on their own; accepted or not) is

    .. math::
        m_k - m > \max(c\cdot s,\ \text{sustained\_floor}\cdot|m|,\ \text{abs\_floor}).

    Median and MAD are not moved by the rare huge values of a heavy-tailed but healthy loss,
    as a mean and a variance are, and the floors are what keeps such tails quiet: on
    Student-t noise (3 degrees of freedom, scale 5 % of the level), values 1.5 levels above
    the median come about 4·10⁻⁵ of the steps and 3 levels above about 8× fewer (the tail
    falls as :math:`x^{-3}`), whatever a scale estimate says. So a single step must be 4.5×
    the median by default (``rel_floor`` 3.5: 0.6 false rollbacks per 10⁵ steps there,
    measured on 10⁶ steps, where 3 gave 1.4; a 5× spike is still caught):
    no test on one value can tell a +1 nat spike from such a tail. A rise that lasts can:
    the median of :math:`k` values exceeds a level only when more than half of them do,
    which heavy-tailed noise almost never gives (about :math:`\binom{k}{\lceil k/2\rceil}
    p^{\lceil k/2\rceil}` for a per-step tail probability :math:`p`), so the ``sustained``
    tests use lower thresholds and a 10 % floor: by default a rise of 6 robust scales
    lasting 3 of 5 steps, or of 2.5 robust scales lasting 11 of 20.
    ``experiments/bench/detectors.py`` measures the false rollbacks on healthy streams and
    the detection rate and delay of spikes by size and length (figures in BUILD.md).
    The absolute floor keeps a loss at 0 (where :math:`m = s = 0`) from flagging 1e-7.

    Anomalous, non-finite and skipped-and-anomalous values never enter the window
    (non-finite ones are :class:`DivergenceDetector`'s). Consecutive anomalous values
    form an episode; its onset is the first of the run of values just before it that
    were already above :math:`m + \text{onset\_threshold}\cdot s` (the rise), else its
    first anomalous value (for a sustained rise, the first of its :math:`k` values). The
    first anomalous value of an episode is reported; an episode whose updates were all
    skipped (by a guard, or by a float16 overflow) is recorded only until it lasts
    ``patience`` values, then rolls back; an anomalous value whose update was applied
    rolls back at once.

    Args:
      threshold: robust scales above the median for one value; finite, > 0.
      rel_floor: minimum excess of one value as a fraction of :math:`|m|`; finite, >= 0.
      abs_floor: minimum excess in the metric's units; finite, >= 0.
      window: accepted values the median and MAD are taken over; >= 3.
      warmup: accepted values gathered before testing; in [1, window].
      onset_threshold: robust scales marking the rise before a spike; in
        (0, threshold].
      patience: consecutive skipped anomalous values tolerated; >= 1.
      sustained: ``(k, c)`` pairs: the median of the last ``k`` values (an int >= 2) more
        than ``c`` robust scales (finite, > 0) above :math:`m`; ``()`` turns the test off.
      sustained_floor: minimum excess of a sustained median as a fraction of :math:`|m|`;
        finite, >= 0.
      metric: the metrics key watched.
      name: the key of this detector's state in a checkpoint.
      extra_keys: your own ``aux`` keys that ``metric`` may name
        (:class:`~stabljax.control.detect.detectors.WatchesMetric`).

    Example:
      >>> from stabljax.control import SpikeDetector
      >>> det = SpikeDetector(warmup=5)
      >>> for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 2.05, 2.02, 10.0]):
      ...     d = det.update(step, {"loss": loss})
      >>> print(d.kind, d.step, d.onset, d.action, round(d.details["z"], 1))
      spike 6 6 rollback 215.6
      >>> det = SpikeDetector(warmup=5)  # +1 (half the level) for 3 steps: sustained
      >>> for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 2.05, 2.02, 3.0, 3.1, 3.0]):
      ...     d = det.update(step, {"loss": loss})
      >>> print(d.step, d.onset, d.details["rule"])
      8 6 sustained 5

    References:
      Rousseeuw and Croux, `Alternatives to the Median Absolute Deviation
      <https://doi.org/10.1080/01621459.1993.10476408>`_, 1993.
    """

    def __init__(
        self,
        threshold: float = 8.0,
        *,
        rel_floor: float = 3.5,
        abs_floor: float = 1e-3,
        window: int = 128,
        warmup: int = 20,
        onset_threshold: float = 3.0,
        patience: int = 10,
        sustained: Iterable[tuple[int, float]] = ((5, 6.0), (20, 2.5)),
        sustained_floor: float = 0.1,
        metric: str = LOSS,
        name: str = "spike",
        extra_keys: Iterable[str] = (),
    ):
        who = "SpikeDetector"
        finite = np.isfinite
        validate(who, "threshold", threshold, lambda a: finite(a) & (a > 0), "finite and > 0")
        for arg, v in (("rel_floor", rel_floor), ("abs_floor", abs_floor)):
            validate(who, arg, v, lambda a: finite(a) & (a >= 0), "finite and >= 0")
        validate(who, "window", window, int_at_least(3), "an int >= 3")
        ok = int_at_least(1)
        validate(who, "warmup", warmup, lambda a: ok(a) and a <= window, "an int in [1, window]")
        ok = lambda a: (a > 0) & (a <= threshold)
        validate(who, "onset_threshold", onset_threshold, ok, "in (0, threshold]")
        validate(who, "patience", patience, int_at_least(1), "an int >= 1")
        pairs = self._pairs(sustained)
        ok = lambda a: finite(a) & (a >= 0)
        validate(who, "sustained_floor", sustained_floor, ok, "finite and >= 0")
        self.threshold = float(threshold)
        self.rel_floor = float(rel_floor)
        self.abs_floor = float(abs_floor)
        self.window = int(window)
        self.warmup = int(warmup)
        self.onset_threshold = float(onset_threshold)
        self.patience = int(patience)
        self.sustained = pairs
        self.sustained_floor = float(sustained_floor)
        self._keep = max((k for k, _ in pairs), default=0)
        self._watch(who, metric, name, extra_keys)
        self.set_state({})

    @property
    def median(self) -> float:
        """The median of the window (0 when it is empty)."""
        return self._stats()[0]

    @property
    def scale(self) -> float:
        """1.4826 times the window's median absolute deviation from its median."""
        return self._stats()[1]

    @property
    def count(self) -> int:
        """Values accepted so far (the window holds the last ``window`` of them)."""
        return self._n

    @property
    def active_onset(self) -> int | None:
        return self._onset

    def _stats(self) -> tuple[float, float]:
        if not self._sorted:
            return 0.0, 0.0
        m = _median(self._sorted)
        return m, _MAD_TO_STD * _mad(self._sorted, m)

    def _accept(self, x: float) -> None:
        self._n += 1
        self._values.append(x)
        bisect.insort(self._sorted, x)
        if len(self._values) > self.window:
            old = self._values.pop(0)
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def _remember(self, x: float) -> None:
        if self._keep:
            self._recent = [*self._recent[-(self._keep - 1) :], x]

    def _test(self, x: float, median: float, scale: float) -> tuple[float, float, str] | None:
        """``(excess, required, rule)`` of the first rule ``x`` breaks, else None."""
        need = max(self.threshold * scale, self.rel_floor * abs(median), self.abs_floor)
        if x - median > need:
            return x - median, need, "single"
        self._remember(x)  # a value anomalous on its own is left out of the sustained tests
        floor = max(self.sustained_floor * abs(median), self.abs_floor)
        for k, c in self.sustained:
            if len(self._recent) < k:
                continue
            excess = _median(sorted(self._recent[-k:])) - median
            need = max(c * scale, floor)
            if excess > need:
                return excess, need, f"sustained {k}"
        return None

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        """Feeds the value of ``step``; returns a detection or ``None``."""
        x = value_of(metrics, self.metric)
        skipped = was_skipped(metrics)
        if not math.isfinite(x):
            return None
        if len(self._values) < self.warmup:
            self._remember(x)
            self._accept(x)
            return None
        median, scale = self._stats()
        broken = self._test(x, median, scale)
        if broken is not None:
            excess, need, rule = broken
            first = self._onset is None
            if first:
                back = int(step) if rule == "single" else int(step) - int(rule.split()[1]) + 1
                self._onset = self._rise if self._rise is not None else back
                self._streak = 0
                self._applied = False
            self._streak += 1
            self._applied = self._applied or not skipped
            z = excess / scale if scale > 0 else math.inf
            details = {
                "median": median,
                "scale": scale,
                "z": z,
                "excess": excess,
                "required": need,
                "rule": rule,
                SKIPPED: skipped,
                OVERFLOW: bool(metrics.get(OVERFLOW, False)),
                "streak": self._streak,
            }
            if not skipped:
                action, why = "rollback", "its update was applied"
            elif self._streak >= self.patience:
                action, why = "rollback", f"it lasted {self._streak} steps (patience)"
            elif first:
                action, why = "record", "a guard or an overflow skipped its update"
            else:
                return None
            what = f"{self.metric} {x:.6g} at step {step}"
            if rule != "single":
                k = rule.split()[1]
                what = f"the median of the last {k} {self.metric} values at step {step}"
            reason = (
                f"{what} is {excess:.3g} above its running median {median:.6g} (robust "
                f"scale {scale:.3g}, needs > {need:.3g}); {why}"
            )
            return Detection("spike", int(step), self._onset, action, reason, x, details)
        self._onset = None
        self._streak = 0
        if x - median > self.onset_threshold * scale:
            if self._rise is None:
                self._rise = int(step)
        else:
            self._rise = None
        self._accept(x)
        return None

    def get_state(self) -> dict[str, Any]:
        return {
            "n": self._n,
            "values": list(self._values),
            "recent": list(self._recent),
            "onset": self._onset,
            "rise": self._rise,
            "streak": self._streak,
            "applied": self._applied,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._n = int(state.get("n", 0))
        self._values = [float(v) for v in state.get("values", [])][-self.window :]
        self._sorted = sorted(self._values)  # the window, sorted: median and MAD in O(log n)
        keep = self._keep
        self._recent = [float(v) for v in state.get("recent", [])][-keep:] if keep else []
        self._onset = state.get("onset")
        self._rise = state.get("rise")
        self._streak = int(state.get("streak", 0))
        self._applied = bool(state.get("applied", False))

    @staticmethod
    def _pairs(sustained: Any) -> tuple[tuple[int, float], ...]:
        """SpikeDetector's ``sustained`` as a tuple of ``(k, c)``, each checked."""
        try:
            pairs = tuple((k, c) for k, c in sustained)
        except (TypeError, ValueError):
            raise ValueError(
                f"SpikeDetector: `sustained` must be (k, c) pairs; got {sustained!r}."
            ) from None
        for k, c in pairs:
            validate(
                "SpikeDetector",
                "sustained",
                k,
                int_at_least(2),
                "(k, c) pairs with k an int >= 2",
            )
            ok = lambda a: np.isfinite(a) & (a > 0)
            validate("SpikeDetector", "sustained", c, ok, "(k, c) pairs with c finite and > 0")
        return tuple((int(k), float(c)) for k, c in pairs)

    def __repr__(self) -> str:
        return (
            f"SpikeDetector(threshold={self.threshold}, rel_floor={self.rel_floor}, "
            f"abs_floor={self.abs_floor}, window={self.window}, warmup={self.warmup}, "
            f"patience={self.patience}, sustained={self.sustained}, "
            f"sustained_floor={self.sustained_floor})"
        )


__all__ = (
    "Action",
    "Detection",
    "Detector",
    "SpikeDetector",
    "WatchesMetric",
)
