"""Detectors: what the controller watches, each with checkpointable state.

* :class:`Detection` (what a detector found: kind, step, onset, action) and the
  :class:`Detector` protocol; :class:`WatchesMetric` checks at construction that the metric
  a detector reads is one the step writes.
* :class:`SpikeDetector`: a loss above a robust (median/MAD) threshold of recent values.
* :class:`DivergenceDetector`: non-finite losses, skip streaks, a stuck fp16 loss scale.
* :class:`SlowDivergenceDetector` over the trend tests :func:`mann_kendall`,
  :func:`mann_kendall_hamed_rao` and :func:`sen_slope`.
* :func:`default_detectors`.

A detector only reports; whether a detection rolls back is its ``action``
(:attr:`Detection.rolls_back`), and the controller acts on it in one place
(:meth:`~stabljax.control.controller.RollbackController._process`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from stabljax.control.policy import Action as Action
from stabljax.metrics import LOSS, LOSS_SCALE, OVERFLOW, SKIP_STREAK, SKIPPED, check_key
from stabljax.optim._base import validate

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
    """A :func:`~stabljax.optim._base.validate` predicate: an integer scalar >= ``low``."""
    return lambda a: a.ndim == 0 and a.dtype.kind in "iu" and a >= low


def one_of(*choices: str):
    """A :func:`~stabljax.optim._base.validate` predicate: one of ``choices``."""
    return lambda a: a.ndim == 0 and a.dtype.kind == "U" and str(a) in choices


# ------------------------------------------------------------------------------------------- trend
# Trend statistics for :class:`~SlowDivergenceDetector`.


def mann_kendall(x: Any) -> tuple[float, float, float]:
    r"""The Mann–Kendall trend statistic of a series, with the tie-corrected variance.

    .. math::
        S = \sum_{i<j} \operatorname{sgn}(x_j - x_i), \qquad
        \operatorname{Var} S = \frac{n(n-1)(2n+5) - \sum_t t(t-1)(2t+5)}{18},

    the sum over groups of :math:`t` tied values, and the continuity-corrected
    :math:`z = (S - \operatorname{sgn} S) / \sqrt{\operatorname{Var} S}` (0 when
    :math:`S = 0`), approximately standard normal without a trend.

    Args:
      x: a 1-D sequence of at least 3 finite numbers.

    Returns:
      ``(S, Var S, z)`` as floats.

    Example:
      >>> from stabljax.control.detectors import mann_kendall
      >>> s, var, z = mann_kendall([1.0, 2.0, 3.0, 4.0])
      >>> print(s, round(var, 4), round(z, 4))
      6.0 8.6667 1.6984

    References:
      Mann, `Nonparametric tests against trend <https://doi.org/10.2307/1907187>`_, 1945;
      Kendall, Rank Correlation Methods, 1975.
    """
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    if x.ndim != 1 or n < 3:
        raise ValueError(f"need a 1-D series of >= 3 values, got shape {x.shape}")
    diff = x[None, :] - x[:, None]
    s = float(np.sign(diff[np.triu_indices(n, 1)]).sum())
    _, counts = np.unique(x, return_counts=True)
    ties = float(np.sum(counts * (counts - 1.0) * (2.0 * counts + 5.0)))
    var = (n * (n - 1.0) * (2.0 * n + 5.0) - ties) / 18.0
    if s == 0 or var <= 0:
        return s, var, 0.0
    return s, var, (s - math.copysign(1.0, s)) / math.sqrt(var)


def sen_slope(x: Any) -> float:
    r"""Sen's slope: the median of :math:`(x_j - x_i)/(j - i)` over all :math:`i < j`.

    Args:
      x: a 1-D sequence of at least 2 numbers.

    Returns:
      The slope per element, as a float.

    Example:
      >>> from stabljax.control.detectors import sen_slope
      >>> print(sen_slope([0.0, 1.0, 2.0, 3.0, 30.0]))
      1.0
    """
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    if x.ndim != 1 or n < 2:
        raise ValueError(f"need a 1-D series of >= 2 values, got shape {x.shape}")
    i, j = np.triu_indices(n, 1)
    return float(np.median((x[j] - x[i]) / (j - i)))


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their mean rank (as ``scipy.stats.rankdata``)."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    # first and last position of each run of equal values, in sorted order
    edges = np.flatnonzero(np.diff(xs)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [x.size]])
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def rank_acf(x: np.ndarray) -> np.ndarray:
    """Autocorrelations (lags 0..n-1) of the ranks of ``x`` minus its Sen's-slope trend."""
    n = x.shape[0]
    i, j = np.triu_indices(n, 1)
    slope = float(np.median((x[j] - x[i]) / (j - i)))
    # Times 1..n as pymannkendall has them: which detrended values tie is a matter of
    # rounding, and the same arithmetic gives the same ties.
    r = _ranks(x - slope * np.arange(1, n + 1))
    y = r - r.mean()
    acov = np.correlate(y, y, "full")[n - 1 :] / n
    if acov[0] == 0:
        return np.zeros(n)
    return acov / acov[0]


def variance_ratio(rho: np.ndarray, n: int, keep: np.ndarray) -> float:
    r"""Hamed and Rao's :math:`n/n^*` from the autocorrelations ``rho[1:]`` marked ``keep``."""
    k = np.arange(1, keep.size + 1, dtype=np.float64)
    w = (n - k) * (n - k - 1) * (n - k - 2)
    return float(
        1.0 + 2.0 / (n * (n - 1.0) * (n - 2.0)) * np.sum((w * rho[1 : keep.size + 1])[keep])
    )


def normal_quantile(p: float) -> float:
    """The standard normal quantile, by bisection on ``math.erf`` (no scipy needed)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mann_kendall_hamed_rao(
    x: Any, *, alpha: float = 0.05, max_lag: int | None = None
) -> tuple[float, float, float, float]:
    r"""Mann–Kendall with Hamed and Rao's variance correction for autocorrelated data.

    Serial correlation inflates the variance of Mann–Kendall's :math:`S`; Hamed and Rao
    correct it with an effective sample size:

    .. math::
        \operatorname{Var}^* S = \operatorname{Var} S \cdot \frac{n}{n^*}, \qquad
        \frac{n}{n^*} = 1 + \frac{2}{n(n-1)(n-2)}
        \sum_{k=1}^{n-1} (n-k)(n-k-1)(n-k-2)\,\rho_k,

    with :math:`\rho_k` the lag-:math:`k` autocorrelation of the ranks of the series
    after its Sen's-slope trend is removed, summed over the significant lags only
    (:math:`|\rho_k| > \Phi^{-1}(1-\alpha/2)/\sqrt{n}`), and
    :math:`z = (S - \operatorname{sgn} S)/\sqrt{\operatorname{Var}^* S}`. This is
    ``pymannkendall.hamed_rao_modification_test``'s statistic (``lag`` there is
    ``max_lag`` here); :math:`n/n^*` is returned as computed, which can be below 1.

    Args:
      x: a 1-D sequence of at least 3 finite numbers.
      alpha: significance level of the lags kept; in (0, 1).
      max_lag: the largest lag summed, in [1, n-1]; ``None`` for n-1.

    Returns:
      ``(S, Var* S, n/n*, z)`` as floats.

    Example:
      >>> from stabljax.control.detectors import mann_kendall_hamed_rao
      >>> import math
      >>> x = [0.1 * t + math.sin(t / 2) for t in range(20)]  # a trend and a slow wave
      >>> s, var, ratio, z = mann_kendall_hamed_rao(x)
      >>> print(s, round(var, 1), round(ratio, 3), round(z, 3))
      80.0 1877.7 1.977 1.823
      >>> print(round(mann_kendall(x)[2], 3))  # without the correction
      2.563

    References:
      Hamed and Rao, `A modified Mann-Kendall trend test for autocorrelated data
      <https://doi.org/10.1016/S0022-1694(97)00125-X>`_, Journal of Hydrology 204,
      1998.
    """
    s, var, _ = mann_kendall(x)
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    who = "mann_kendall_hamed_rao"
    validate(who, "alpha", alpha, lambda a: (a > 0) & (a < 1), "in (0, 1)")
    lag = n - 1 if max_lag is None else max_lag
    ok = int_at_least(1)
    validate(who, "max_lag", lag, lambda a: ok(a) and a <= n - 1, f"an int in [1, {n - 1}]")
    rho = rank_acf(x)[: lag + 1]
    keep = np.abs(rho[1:]) > normal_quantile(1 - alpha / 2) / math.sqrt(n)
    ratio = variance_ratio(rho, n, keep)
    var_star = var * ratio
    if s == 0 or var_star <= 0:
        return s, var_star, ratio, 0.0
    return s, var_star, ratio, (s - math.copysign(1.0, s)) / math.sqrt(var_star)


# ------------------------------------------------------------------------------------------- spike
# The loss-spike detector: a robust z-score against a window of recent accepted values.


# 1 / Phi^-1(3/4): the MAD of a normal sample times this is its standard deviation.
_MAD_TO_STD = 1.482602218505602


def _median(a: np.ndarray) -> float:
    """``np.median`` of a 1-D array by partial sort (no full sort: it runs every step)."""
    k = a.size // 2
    if a.size % 2:
        return float(np.partition(a, k)[k])
    b = np.partition(a, (k - 1, k))
    return float((b[k - 1] + b[k]) / 2)


class SpikeDetector(WatchesMetric):
    r"""Flags values far above the median of a window of recent accepted values.

    With :math:`m` the median and :math:`s = 1.4826\,\mathrm{MAD}` the robust scale (the
    standard deviation for normal data) of the last ``window`` accepted values, after
    ``warmup`` of them a value :math:`x` is anomalous when

    .. math::
        x - m > \max(\text{threshold}\cdot s,\ \text{rel\_floor}\cdot|m|,\ \text{abs\_floor}),

    one-sided (a falling loss is welcome). Median and MAD are not moved by the rare huge
    values of a heavy-tailed but healthy loss, as a mean and a variance are, and the
    floors are what keeps such tails quiet: on Student-t noise (3 degrees of freedom,
    scale 5 % of the level), values 1.5 levels above the median come about 4·10⁻⁵ of the
    steps, whatever a scale estimate says; on lognormal noise (σ = 0.3), 8 robust scales
    are 2.4 medians, which a value exceeds in 2·10⁻⁵ of the steps.
    ``experiments/bench/detectors.py`` measures the false-rollback rate on both (figures
    in BUILD.md), and a 5× one-step spike (4 levels above) is still caught on both. The
    price: by default a spike needs to be 2.5× the median; on a known low-noise run pass a
    smaller ``rel_floor`` (OLMo-core's monitor is 6σ with no floor, LLM Foundry's 2× the
    mean).
    The absolute floor keeps a loss at 0 (where :math:`m = s = 0`) from flagging 1e-7.

    Anomalous, non-finite and skipped-and-anomalous values never enter the window
    (non-finite ones are :class:`DivergenceDetector`'s). Consecutive anomalous values
    form an episode; its onset is the first of the run of values just before it that
    were already above :math:`m + \text{onset\_threshold}\cdot s` (the rise), else its
    first anomalous value. The first anomalous value of an episode is reported; an
    episode whose updates were all skipped (by a guard, or by a float16 overflow) is
    recorded only until it lasts ``patience`` values, then rolls back; an anomalous value
    whose update was applied rolls back at once.

    Args:
      threshold: robust scales above the median; > 0.
      rel_floor: minimum excess as a fraction of :math:`|m|`; >= 0.
      abs_floor: minimum excess in the metric's units; >= 0.
      window: accepted values the median and MAD are taken over; >= 3.
      warmup: accepted values gathered before testing; in [1, window].
      onset_threshold: robust scales marking the rise before a spike; in
        (0, threshold].
      patience: consecutive skipped anomalous values tolerated; >= 1.
      metric: the metrics key watched.
      name: the key of this detector's state in a checkpoint.
      extra_keys: your own ``aux`` keys that ``metric`` may name
        (:class:`~stabljax.control.detectors.WatchesMetric`).

    Example:
      >>> from stabljax.control import SpikeDetector
      >>> det = SpikeDetector(warmup=5)
      >>> for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 2.05, 2.02, 9.0]):
      ...     d = det.update(step, {"loss": loss})
      >>> print(d.kind, d.step, d.onset, d.action, round(d.details["z"], 1))
      spike 6 6 rollback 188.6

    References:
      Rousseeuw and Croux, `Alternatives to the Median Absolute Deviation
      <https://doi.org/10.1080/01621459.1993.10476408>`_, 1993.
    """

    def __init__(
        self,
        threshold: float = 8.0,
        *,
        rel_floor: float = 1.5,
        abs_floor: float = 1e-3,
        window: int = 128,
        warmup: int = 20,
        onset_threshold: float = 3.0,
        patience: int = 10,
        metric: str = LOSS,
        name: str = "spike",
        extra_keys: Iterable[str] = (),
    ):
        who = "SpikeDetector"
        validate(who, "threshold", threshold, lambda a: a > 0, "> 0")
        validate(who, "rel_floor", rel_floor, lambda a: a >= 0, ">= 0")
        validate(who, "abs_floor", abs_floor, lambda a: a >= 0, ">= 0")
        validate(who, "window", window, int_at_least(3), "an int >= 3")
        ok = int_at_least(1)
        validate(who, "warmup", warmup, lambda a: ok(a) and a <= window, "an int in [1, window]")
        ok = lambda a: (a > 0) & (a <= threshold)
        validate(who, "onset_threshold", onset_threshold, ok, "in (0, threshold]")
        validate(who, "patience", patience, int_at_least(1), "an int >= 1")
        self.threshold = float(threshold)
        self.rel_floor = float(rel_floor)
        self.abs_floor = float(abs_floor)
        self.window = int(window)
        self.warmup = int(warmup)
        self.onset_threshold = float(onset_threshold)
        self.patience = int(patience)
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
        if not self._values:
            return 0.0, 0.0
        v = np.asarray(self._values, np.float64)
        m = _median(v)
        return m, _MAD_TO_STD * _median(np.abs(v - m))

    def _accept(self, x: float) -> None:
        self._n += 1
        self._values.append(x)
        if len(self._values) > self.window:
            del self._values[0]

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        """Feeds the value of ``step``; returns a detection or ``None``."""
        x = value_of(metrics, self.metric)
        skipped = was_skipped(metrics)
        if not math.isfinite(x):
            return None
        if len(self._values) < self.warmup:
            self._accept(x)
            return None
        median, scale = self._stats()
        excess = x - median
        need = max(self.threshold * scale, self.rel_floor * abs(median), self.abs_floor)
        if excess > need:
            first = self._onset is None
            if first:
                self._onset = self._rise if self._rise is not None else int(step)
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
            reason = (
                f"{self.metric} {x:.6g} at step {step} is {excess:.3g} above its running "
                f"median {median:.6g} (robust scale {scale:.3g}, needs > {need:.3g}); {why}"
            )
            return Detection("spike", int(step), self._onset, action, reason, x, details)
        self._onset = None
        self._streak = 0
        if excess > self.onset_threshold * scale:
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
            "onset": self._onset,
            "rise": self._rise,
            "streak": self._streak,
            "applied": self._applied,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._n = int(state.get("n", 0))
        self._values = [float(v) for v in state.get("values", [])][-self.window :]
        self._onset = state.get("onset")
        self._rise = state.get("rise")
        self._streak = int(state.get("streak", 0))
        self._applied = bool(state.get("applied", False))

    def __repr__(self) -> str:
        return (
            f"SpikeDetector(threshold={self.threshold}, rel_floor={self.rel_floor}, "
            f"abs_floor={self.abs_floor}, window={self.window}, warmup={self.warmup}, "
            f"patience={self.patience})"
        )


# -------------------------------------------------------------------------------------- divergence
# The divergence detector: a non-finite loss, a long skip streak, a stuck loss scale.


class DivergenceDetector(WatchesMetric):
    """Flags a non-finite loss, a long run of skipped steps and a stuck loss scale.

    A non-finite value whose update was applied (neither ``skipped`` nor ``overflow``)
    rolls back at once; one a guard or a float16 overflow skipped is recorded (once per
    run of them). A skip streak longer than ``max_skip_streak`` rolls back, with the
    onset at the first skipped step of the streak. The streak is the longer of
    the ``skip_streak`` metric (the train step's longest guard streak, when present) and
    the detector's own count of consecutive skipped steps, overflows included: an
    overflowed step is a skipped step.

    Float16 loss scaling can also stop a run without a NaN ever being applied: a scale
    that reached ``min_scale`` and still overflows skips every step, the loss stays flat
    and training makes no progress. Two checks make that an event and then
    ``on_stuck`` (``"rollback"``, or ``"raise"`` when going back would only repeat it):

    - more than ``max_overflow_streak`` consecutive overflowed steps (default
      ``max_skip_streak``, so a pure overflow streak ends as ``on_stuck`` where a guard
      streak would roll back; a streak of overflows alone is judged by this limit, not
      by ``max_skip_streak``); the scaler's own backoff from ``initial_scale`` overflows
      about ``log2(initial_scale / needed scale)`` steps in a row, 15 at most with
      ``Precision.fp16()``'s defaults, so keep the limit above that;
    - ``max_floor_steps`` consecutive steps run at ``loss_scale <= min_scale``, counted
      from an overflow at the floor (a scale there that stops overflowing grows again
      after ``growth_interval`` clean steps, so keep ``max_floor_steps`` above the
      scaler's ``growth_interval``). Without loss scaling ``overflow`` is never true, so
      this never arms. The first overflow at the floor is recorded.

    Args:
      max_skip_streak: consecutive skipped steps tolerated; >= 1.
      max_overflow_streak: consecutive overflowed steps tolerated; >= 1 or ``None``
        (``max_skip_streak``).
      max_floor_steps: consecutive steps tolerated at the scale floor after an overflow
        there; >= 1, or ``None`` to turn the check off.
      min_scale: the loss scaler's ``min_scale`` (``DynamicLossScale``'s default 1.0);
        > 0.
      on_stuck: ``"rollback"`` or ``"raise"``, the action of the two checks above.
      metric: the metrics key watched for non-finite values.
      name: the key of this detector's state in a checkpoint.
      extra_keys: your own ``aux`` keys that ``metric`` may name
        (:class:`~stabljax.control.detectors.WatchesMetric`).

    Example:
      >>> from stabljax.control import DivergenceDetector
      >>> det = DivergenceDetector(max_skip_streak=2)
      >>> print(det.update(0, {"loss": float("nan"), "skipped": True}).action)
      record
      >>> print(det.update(1, {"loss": 3.0, "skipped": True}))
      None
      >>> d = det.update(2, {"loss": 3.0, "skipped": True})
      >>> print(d.kind, d.onset, d.action)
      divergence 0 rollback
      >>> print(DivergenceDetector().update(5, {"loss": float("inf")}).action)
      rollback
      >>> print(DivergenceDetector().update(5, {"loss": float("inf"), "overflow": True}).action)
      record
    """

    reads = (SKIPPED, SKIP_STREAK, OVERFLOW, LOSS_SCALE)

    def __init__(
        self,
        max_skip_streak: int = 20,
        *,
        max_overflow_streak: int | None = None,
        max_floor_steps: int | None = 2000,
        min_scale: float = 1.0,
        on_stuck: Literal["rollback", "raise"] = "rollback",
        metric: str = LOSS,
        name: str = "divergence",
        extra_keys: Iterable[str] = (),
    ):
        who = "DivergenceDetector"
        validate(who, "max_skip_streak", max_skip_streak, int_at_least(1), "an int >= 1")
        optional = {"max_overflow_streak": max_overflow_streak, "max_floor_steps": max_floor_steps}
        for arg, value in optional.items():
            if value is not None:
                validate(who, arg, value, int_at_least(1), "an int >= 1 or None")
        validate(who, "min_scale", min_scale, lambda a: np.isfinite(a) & (a > 0), "finite and > 0")
        validate(who, "on_stuck", on_stuck, one_of("rollback", "raise"), "'rollback' or 'raise'")
        self.max_skip_streak = int(max_skip_streak)
        self.max_overflow_streak = (
            self.max_skip_streak if max_overflow_streak is None else int(max_overflow_streak)
        )
        self.max_floor_steps = None if max_floor_steps is None else int(max_floor_steps)
        self.min_scale = float(min_scale)
        self.on_stuck = on_stuck
        self._watch(who, metric, name, extra_keys)
        self.set_state({})

    @property
    def active_onset(self) -> int | None:
        return self._nonfinite_onset

    def _floor(self, step: int, metrics: Mapping[str, Any], overflow: bool) -> bool:
        """Advances the scale-floor count; True on the step that arms it."""
        scale = metrics.get(LOSS_SCALE)
        if scale is None or not math.isfinite(float(scale)):
            return False
        # float32 holds min_scale exactly only up to rounding: compare with a margin.
        if float(scale) > self.min_scale * (1 + 1e-6):
            self._floor_onset, self._floor_steps = None, 0
            return False
        if self._floor_onset is None:
            if not overflow:
                return False
            self._floor_onset, self._floor_steps = int(step), 1
            return True
        self._floor_steps += 1
        return False

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        """Feeds the value of ``step``; returns a detection or ``None``."""
        x = value_of(metrics, self.metric)
        overflow = bool(metrics.get(OVERFLOW, False))
        skipped = was_skipped(metrics)
        self._own_streak = self._own_streak + 1 if skipped else 0
        self._overflow_streak = self._overflow_streak + 1 if overflow else 0
        armed = self._floor(step, metrics, overflow)
        # Nested guards restore each other's counters (skip_nonfinite(skip_spikes(...))
        # resets the inner spike_streak on a NaN step), so the guards' streak can be shorter
        # than the run of skipped steps: take the longer of the two.
        streak = max(int(metrics.get(SKIP_STREAK, 0)), self._own_streak)
        finite = math.isfinite(x)
        new_nonfinite = not finite and self._nonfinite_onset is None
        if finite:
            self._nonfinite_onset = None
        elif new_nonfinite:
            self._nonfinite_onset = int(step)
        details = {
            SKIPPED: skipped,
            OVERFLOW: overflow,
            SKIP_STREAK: streak,
            "overflow_streak": self._overflow_streak,
            "floor_steps": self._floor_steps,
        }
        if LOSS_SCALE in metrics:
            details[LOSS_SCALE] = float(metrics[LOSS_SCALE])
        if not finite and not skipped:
            reason = f"{self.metric} is {x} at step {step} and its update was applied"
            onset = self._nonfinite_onset
            return Detection("divergence", int(step), onset, "rollback", reason, x, details)
        if self._overflow_streak > self.max_overflow_streak:
            onset = int(step) - self._overflow_streak + 1
            reason = (
                f"{self._overflow_streak} consecutive float16 overflows up to step {step} "
                f"(limit {self.max_overflow_streak}): every update is skipped and the run "
                f"makes no progress"
            )
            details["cause"] = "overflow_streak"
            return Detection("divergence", int(step), onset, self.on_stuck, reason, x, details)
        if self.max_floor_steps is not None and self._floor_steps >= self.max_floor_steps:
            onset = self._floor_onset
            reason = (
                f"the loss scale has been at its floor min_scale={self.min_scale:g} for "
                f"{self._floor_steps} steps since an overflow there at step {onset} "
                f"(limit {self.max_floor_steps})"
            )
            details["cause"] = "loss_scale_floor"
            self._floor_onset, self._floor_steps = None, 0
            return Detection("divergence", int(step), onset, self.on_stuck, reason, x, details)
        # A streak made only of overflows is max_overflow_streak's (above) to judge.
        if streak > self.max_skip_streak and streak > self._overflow_streak:
            onset = int(step) - streak + 1
            reason = (
                f"{streak} consecutive steps skipped by a guard or an overflow up to step "
                f"{step} (limit {self.max_skip_streak})"
            )
            return Detection("divergence", int(step), onset, "rollback", reason, x, details)
        reasons = []
        if new_nonfinite:
            reasons.append(f"{self.metric} is {x} at step {step}; its update was skipped")
        if armed:
            details["cause"] = "loss_scale_floor"
            reasons.append(
                f"step {step} overflowed at the loss scale's floor min_scale={self.min_scale:g}"
            )
        if reasons:
            return Detection(
                "divergence", int(step), int(step), "record", "; ".join(reasons), x, details
            )
        return None

    def get_state(self) -> dict[str, Any]:
        return {
            "own_streak": self._own_streak,
            "nonfinite_onset": self._nonfinite_onset,
            "overflow_streak": self._overflow_streak,
            "floor_onset": self._floor_onset,
            "floor_steps": self._floor_steps,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._own_streak = int(state.get("own_streak", 0))
        self._nonfinite_onset = state.get("nonfinite_onset")
        self._overflow_streak = int(state.get("overflow_streak", 0))
        self._floor_onset = state.get("floor_onset")
        self._floor_steps = int(state.get("floor_steps", 0))

    def __repr__(self) -> str:
        return (
            f"DivergenceDetector(max_skip_streak={self.max_skip_streak}, "
            f"max_overflow_streak={self.max_overflow_streak}, "
            f"max_floor_steps={self.max_floor_steps}, min_scale={self.min_scale}, "
            f"on_stuck={self.on_stuck!r})"
        )


# -------------------------------------------------------------------------------------------- slow
# The slow-divergence detector: a trend test on block means, corrected for autocorrelation.


# The stretch before a slow-divergence window is not used to estimate the noise's
# autocorrelation when its own corrected trend z is above this (one-sided p = 0.023).
_HISTORY_RISING_Z = 2.0


class SlowDivergenceDetector(WatchesMetric):
    r"""A one-sided Mann–Kendall trend test on block means, corrected for autocorrelation.

    The loss is smoothed by averaging blocks of ``block`` consecutive finite values of
    steps whose update was applied (a guard-skipped or overflowed step's loss is left out,
    as every detector leaves anomalous values out of its statistics); the last
    ``(history + 1) * window`` block means are kept. Each new block tests the last
    ``window`` of them: the detector fires when the rise Sen's slope gives over the window
    is at least ``min_rise`` times the window's median (a statistically clear but
    negligible drift does not count) and Mann–Kendall's
    :math:`z = (S - \operatorname{sgn} S)/\sqrt{\operatorname{Var} S \cdot n/n^*}`
    exceeds ``z_threshold``.

    A training loss is autocorrelated, and so are its block means; treated as
    independent, their Mann–Kendall test raises false alarms on a flat loss with AR(1)
    noise (φ = 0.99). :math:`n/n^*` is Hamed and Rao's variance
    correction (:func:`mann_kendall_hamed_rao`), with the autocorrelations of detrended
    ranks estimated three ways, and the largest :math:`n/n^*` (at least 1) taken:

    1. the window's own significant lags (Hamed and Rao's rule);
    2. the ``history * window`` block means before the window, minus a running mean of
       half a window (a high-pass);
    3. the same stretch minus one Sen line, unless it is rising itself (its own
       corrected z above 2).

    2 and 3 sum the lags from 1 up to the first whose autocorrelation is not positive.
    Why: within one window a wander as slow as the window looks like a trend, so the
    window's own ranks underestimate the correlation, and Hamed and Rao's significance
    cut drops the long tail of a strong one (φ = 0.99 gives block means with
    :math:`\rho_1 \approx 0.8`).
    The stretch before the window is three times longer and does not hold the rise
    being tested. A single line through a stretch that does hold a rise (a long or an
    accelerating one) leaves a bend that reads as correlation and hides the rise, hence
    the rising check in 3 and the high-pass in 2, which keeps the short lags a trend
    test needs. BUILD.md has the false-alarm counts of each variant.

    The defaults (1500-step window of 75 means of 20 steps, 4500 steps of history,
    :math:`z > 4`, a 2 % rise) are tuned on ``experiments/bench/detectors.py`` (flat loss
    with iid or AR(1) noise up to φ = 0.99, and a 10 % rise over 5000 steps; its figures
    are in BUILD.md). A 4.0 threshold, not 3.5, because the test runs at every block on
    overlapping windows (3.5 raised alarms at φ = 0.9); 2 % because a window of 1500
    steps sees only 3 % of a 10 %-per-5k rise, too close to the old 3 %. Under strongly
    autocorrelated noise a slow rise is caught later or not at all: with φ = 0.99 and
    std 0.05, 2000 steps of a 10 %-per-5k rise carry only z ≈ 1.5 of evidence for any
    test (the least-squares slope's own error), so the correction is what makes the
    detector quiet there, and a rise must be larger to be seen.

    Testing starts once one window of history is there, after ``2 * window * block``
    steps; after firing everything starts empty, so one episode gives one alarm. Memory is
    ``(history + 1) * window`` floats.

    Args:
      window: block means in the test; >= 8.
      block: losses per block; >= 1.
      history: windows of block means before the tested one over which the
        autocorrelation is estimated; >= 1.
      z_threshold: corrected Mann–Kendall z to fire; > 0.
      min_rise: minimum relative rise over the window; >= 0.
      action: ``"warn"`` (an event and a warning, the default) or ``"rollback_best"``
        (roll back to the checkpoint with the lowest smoothed loss).
      metric: the metrics key watched.
      name: the key of this detector's state in a checkpoint.
      extra_keys: your own ``aux`` keys that ``metric`` may name
        (:class:`~stabljax.control.detectors.WatchesMetric`).

    Example:
      >>> from stabljax.control import SlowDivergenceDetector
      >>> det = SlowDivergenceDetector(window=12, block=2, history=1)
      >>> out = [det.update(s, {"loss": 2.0 + 0.01 * s + 0.001 * (-1) ** s}) for s in range(48)]
      >>> d = next(d for d in out if d is not None)
      >>> print(d.kind, d.step, d.onset, d.action, round(d.details["z"], 2))
      slow_divergence 47 24 warn 4.46

    References:
      Hamed and Rao, `A modified Mann-Kendall trend test for autocorrelated data
      <https://doi.org/10.1016/S0022-1694(97)00125-X>`_, Journal of Hydrology 204,
      1998; Sen, `Estimates of the regression coefficient based on Kendall's tau
      <https://doi.org/10.1080/01621459.1968.10480934>`_, 1968.
    """

    def __init__(
        self,
        window: int = 75,
        *,
        block: int = 20,
        history: int = 3,
        z_threshold: float = 4.0,
        min_rise: float = 0.02,
        action: Literal["warn", "rollback_best"] = "warn",
        metric: str = LOSS,
        name: str = "slow_divergence",
        extra_keys: Iterable[str] = (),
    ):
        who = "SlowDivergenceDetector"
        validate(who, "window", window, int_at_least(8), "an int >= 8")
        validate(who, "block", block, int_at_least(1), "an int >= 1")
        validate(who, "history", history, int_at_least(1), "an int >= 1")
        validate(who, "z_threshold", z_threshold, lambda a: a > 0, "> 0")
        validate(who, "min_rise", min_rise, lambda a: a >= 0, ">= 0")
        ok = one_of("warn", "rollback_best")
        validate(who, "action", action, ok, "'warn' or 'rollback_best'")
        self.window = int(window)
        self.block = int(block)
        self.history = int(history)
        self.z_threshold = float(z_threshold)
        self.min_rise = float(min_rise)
        self.action = action
        self._watch(who, metric, name, extra_keys)
        self._sig = normal_quantile(1 - 0.05 / 2)
        self.set_state({})

    @property
    def active_onset(self) -> int | None:
        return None

    def _test(self, step: int, x: float) -> Detection | None:
        n = self.window
        means = np.asarray(self._means, np.float64)
        w = means[-n:]
        median = float(np.median(w))
        slope = sen_slope(w)
        rise = slope * (n - 1) / abs(median) if median != 0 else math.inf
        if rise < self.min_rise:
            return None
        s, var, z_iid = mann_kendall(w)
        if z_iid <= self.z_threshold:  # the correction only lowers z
            return None
        rho_w = rank_acf(w)
        ratio_w = variance_ratio(rho_w, n, np.abs(rho_w[1:]) > self._sig / math.sqrt(n))
        # The stretch before the window calibrates the noise, twice: high-passed (minus a
        # running mean of half a window, which keeps the short lags a trend test needs and
        # drops a long or accelerating rise), and minus one Sen line, unless it is rising
        # itself (then it belongs to the episode and its bend would read as correlation).
        hist = means[:-n]
        width = max(3, n // 2)
        smooth = np.convolve(hist, np.full(width, 1.0 / width), "valid")
        rho_p = rank_acf(hist[width // 2 : width // 2 + smooth.size] - smooth)[:n]
        ratio_p = variance_ratio(rho_p, n, np.cumprod(rho_p[1:] > 0).astype(bool))
        m = hist.shape[0]
        rho_h = rank_acf(hist)
        positive = np.cumprod(rho_h[1:] > 0).astype(bool)
        s_h, var_h, _ = mann_kendall(hist)
        ratio_hh = max(1.0, variance_ratio(rho_h, m, positive))
        z_h = (s_h - math.copysign(1.0, s_h)) / math.sqrt(var_h * ratio_hh) if s_h else 0.0
        used = z_h <= _HISTORY_RISING_Z
        ratio_h = variance_ratio(rho_h[:n], n, positive[: n - 1]) if used else 1.0
        ratio = max(1.0, ratio_w, ratio_p, ratio_h)
        z = (s - 1.0) / math.sqrt(var * ratio)
        if z <= self.z_threshold:
            return None
        onset = self._starts[-n]
        details = {
            "s": s,
            "var_s": var,
            "variance_ratio": ratio,
            "variance_ratio_window": ratio_w,
            "variance_ratio_history": ratio_h,
            "variance_ratio_highpass": ratio_p,
            "history_z": z_h,
            "history_used": used,
            "z": z,
            "z_uncorrected": z_iid,
            "sen_slope_per_block": slope,
            "rel_rise": rise,
        }
        reason = (
            f"{self.metric} rose {100 * rise:.3g}% over steps {onset}..{step} "
            f"(Mann-Kendall z = {z:.2f} > {self.z_threshold}, variance x{ratio:.3g} for "
            f"autocorrelation)"
        )
        self._means, self._starts = [], []
        return Detection("slow_divergence", int(step), onset, self.action, reason, x, details)

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        """Feeds the value of ``step``; returns a detection or ``None``."""
        x = value_of(metrics, self.metric)
        if not math.isfinite(x) or was_skipped(metrics):
            return None
        if self._count == 0:
            self._block_start = int(step)
        self._sum += x
        self._count += 1
        if self._count < self.block:
            return None
        self._means.append(self._sum / self._count)
        self._starts.append(self._block_start)
        self._sum, self._count = 0.0, 0
        keep = (self.history + 1) * self.window
        if len(self._means) > keep:
            del self._means[: len(self._means) - keep], self._starts[: len(self._starts) - keep]
        if len(self._means) < 2 * self.window:
            return None
        return self._test(step, x)

    def get_state(self) -> dict[str, Any]:
        return {
            "means": list(self._means),
            "starts": list(self._starts),
            "sum": self._sum,
            "count": self._count,
            "block_start": self._block_start,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._means = [float(v) for v in state.get("means", [])]
        self._starts = [int(v) for v in state.get("starts", [])]
        self._sum = float(state.get("sum", 0.0))
        self._count = int(state.get("count", 0))
        self._block_start = int(state.get("block_start", 0))

    def __repr__(self) -> str:
        return (
            f"SlowDivergenceDetector(window={self.window}, block={self.block}, "
            f"history={self.history}, z_threshold={self.z_threshold}, "
            f"min_rise={self.min_rise}, action={self.action!r})"
        )


# ------------------------------------------------------------------------------------------ detect
# Host-side detectors of loss spikes, divergence and slow divergence.


__all__ = (
    "Action",
    "Detection",
    "Detector",
    "DivergenceDetector",
    "SlowDivergenceDetector",
    "SpikeDetector",
    "default_detectors",
    "mann_kendall",
    "mann_kendall_hamed_rao",
    "sen_slope",
)


def default_detectors() -> list[Detector]:
    """The controller's default: spike, divergence and (warn-only) slow divergence."""
    return [SpikeDetector(), DivergenceDetector(), SlowDivergenceDetector()]
