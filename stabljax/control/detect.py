"""Host-side detectors of loss spikes, divergence and slow divergence.

Each detector sees one observation per training step, in order: the step and a dict
of host scalars (``loss``, and the train step's ``skipped`` / ``skip_streak`` when
present). It keeps O(1) state (the slow-divergence detector a fixed window), returns a
:class:`Detection` or ``None``, and has JSON-able ``get_state`` / ``set_state`` so the
rollback controller checkpoints it with the model and restores it on a rollback.

Actions: ``"record"`` (an event only), ``"warn"`` (an event and a warning),
``"rollback"`` (go back to the newest checkpoint at least ``rollback_margin`` steps
before the onset), ``"rollback_best"`` (go back to the checkpoint with the lowest
smoothed loss).

The rule for guarded steps: a spike or a NaN whose update a guard already skipped
in-graph (``skipped``) did no harm, so it is only recorded; it causes a rollback when
the loss stays anomalous for ``patience`` steps or the skip streak passes its limit. An
anomaly whose update was applied rolls back at once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

Action = Literal["record", "warn", "rollback", "rollback_best"]


@dataclasses.dataclass(frozen=True)
class Detection:
    """What a detector found at one step.

    Attributes:
      kind: ``"spike"``, ``"divergence"`` or ``"slow_divergence"``.
      step: the step whose observation triggered it.
      onset: the first step of the episode (``<= step``).
      action: ``"record"``, ``"warn"``, ``"rollback"`` or ``"rollback_best"``.
      reason: a human-readable sentence.
      value: the observed value (usually the loss).
      details: JSON-able numbers behind the decision (mean, std, z-score, ...).
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


def _value(metrics: Mapping[str, Any], key: str) -> float:
    if key not in metrics:
        raise ValueError(f"metrics has no {key!r}; keys: {sorted(metrics)}")
    return float(metrics[key])


def _check(name: str, ok: bool, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


class SpikeDetector:
    r"""Flags values far above their bias-corrected exponential moving average.

    With decay :math:`d` and :math:`n` the number of accepted values, the mean
    :math:`\mu` and variance :math:`\sigma^2` are the mean and population variance of the
    accepted values weighted by :math:`d^{\,n-k}` (Adam's bias-corrected EMA), kept by
    West's weighted recursion, which has no cancellation:

    .. math::
        a = \frac{1-d}{1-d^{\,n}}, \quad \delta = x - \mu, \quad
        \mu \leftarrow \mu + a\delta, \quad \sigma^2 \leftarrow (1-a)(\sigma^2 + a\delta^2).

    After ``warmup`` accepted values, a value :math:`x` is anomalous when

    .. math::
        x - \mu > \max(\text{threshold}\cdot\sigma,\ \text{rel\_floor}\cdot|\mu|),

    one-sided (a falling loss is welcome); the relative floor keeps a low-variance
    plateau, where :math:`\sigma \to 0`, from flagging every wiggle. Anomalous and
    non-finite values never enter the statistics (non-finite ones are
    :class:`DivergenceDetector`'s). Consecutive anomalous values form an episode; its
    onset is the first of the run of values just before it that were already above
    :math:`\mu + \text{onset\_threshold}\cdot\sigma` (the rise), else its first
    anomalous value. The first anomalous value of an episode is reported; an episode
    whose updates were all skipped by a guard is recorded only until it lasts
    ``patience`` values, then rolls back; an anomalous value whose update was applied
    rolls back at once.

    Defaults follow OLMo-core's stability monitor (6σ) with a window of about
    :math:`1/(1-d) = 100` steps.

    Args:
      threshold: standard deviations above the mean; > 0.
      rel_floor: minimum excess as a fraction of :math:`|\mu|`; >= 0.
      ema_decay: :math:`d` in (0, 1).
      warmup: accepted values gathered before testing; >= 1.
      onset_threshold: standard deviations marking the rise before a spike; in
        (0, threshold].
      patience: consecutive skipped anomalous values tolerated; >= 1.
      metric: the metrics key watched.
      name: the key of this detector's state in a checkpoint.

    Example:
      >>> from stabljax.control import SpikeDetector
      >>> det = SpikeDetector(warmup=5)
      >>> for step, loss in enumerate([2.0, 2.1, 1.9, 2.0, 2.05, 2.02, 9.0]):
      ...     d = det.update(step, {"loss": loss})
      >>> print(d.kind, d.step, d.onset, d.action, round(d.details["z"], 1))
      spike 6 6 rollback 115.6
    """

    def __init__(
        self,
        threshold: float = 6.0,
        *,
        rel_floor: float = 0.1,
        ema_decay: float = 0.99,
        warmup: int = 20,
        onset_threshold: float = 3.0,
        patience: int = 10,
        metric: str = "loss",
        name: str = "spike",
    ):
        _check("threshold", threshold > 0, "> 0", threshold)
        _check("rel_floor", rel_floor >= 0, ">= 0", rel_floor)
        _check("ema_decay", 0 < ema_decay < 1, "in (0, 1)", ema_decay)
        _check("warmup", int(warmup) == warmup and warmup >= 1, "an int >= 1", warmup)
        _check(
            "onset_threshold",
            0 < onset_threshold <= threshold,
            "in (0, threshold]",
            onset_threshold,
        )
        _check("patience", int(patience) == patience and patience >= 1, "an int >= 1", patience)
        self.threshold = float(threshold)
        self.rel_floor = float(rel_floor)
        self.ema_decay = float(ema_decay)
        self.warmup = int(warmup)
        self.onset_threshold = float(onset_threshold)
        self.patience = int(patience)
        self.metric = metric
        self.name = name
        self.set_state({})

    @property
    def mean(self) -> float:
        return self._mean

    @property
    def std(self) -> float:
        return math.sqrt(self._var)

    @property
    def count(self) -> int:
        return self._n

    @property
    def keys(self) -> tuple[str, ...]:
        """The metrics this detector reads."""
        return (self.metric, "skipped")

    @property
    def active_onset(self) -> int | None:
        return self._onset

    def _accept(self, x: float) -> None:
        self._n += 1
        a = (1 - self.ema_decay) / (1 - self.ema_decay**self._n)
        delta = x - self._mean
        self._mean += a * delta
        self._var = (1 - a) * (self._var + a * delta * delta)

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        """Feeds the value of ``step``; returns a detection or ``None``."""
        x = _value(metrics, self.metric)
        skipped = bool(metrics.get("skipped", False))
        if not math.isfinite(x):
            return None
        if self._n < self.warmup:
            self._accept(x)
            return None
        std = math.sqrt(self._var)
        excess = x - self._mean
        need = max(self.threshold * std, self.rel_floor * abs(self._mean))
        if excess > need:
            first = self._onset is None
            if first:
                self._onset = self._rise if self._rise is not None else int(step)
                self._streak = 0
                self._applied = False
            self._streak += 1
            self._applied = self._applied or not skipped
            z = excess / std if std > 0 else math.inf
            details = {
                "mean": self._mean,
                "std": std,
                "z": z,
                "excess": excess,
                "required": need,
                "skipped": skipped,
                "streak": self._streak,
            }
            if not skipped:
                action, why = "rollback", "its update was applied"
            elif self._streak >= self.patience:
                action, why = "rollback", f"it lasted {self._streak} steps (patience)"
            elif first:
                action, why = "record", "a guard skipped its update"
            else:
                return None
            reason = (
                f"{self.metric} {x:.6g} at step {step} is {excess:.3g} above its running mean "
                f"{self._mean:.6g} (std {std:.3g}, needs > {need:.3g}); {why}"
            )
            return Detection("spike", int(step), self._onset, action, reason, x, details)
        self._onset = None
        self._streak = 0
        if excess > self.onset_threshold * std:
            if self._rise is None:
                self._rise = int(step)
        else:
            self._rise = None
        self._accept(x)
        return None

    def get_state(self) -> dict[str, Any]:
        return {
            "n": self._n,
            "mean": self._mean,
            "var": self._var,
            "onset": self._onset,
            "rise": self._rise,
            "streak": self._streak,
            "applied": self._applied,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._n = int(state.get("n", 0))
        self._mean = float(state.get("mean", 0.0))
        self._var = float(state.get("var", 0.0))
        self._onset = state.get("onset")
        self._rise = state.get("rise")
        self._streak = int(state.get("streak", 0))
        self._applied = bool(state.get("applied", False))

    def __repr__(self) -> str:
        return (
            f"SpikeDetector(threshold={self.threshold}, rel_floor={self.rel_floor}, "
            f"ema_decay={self.ema_decay}, warmup={self.warmup}, patience={self.patience})"
        )


class DivergenceDetector:
    """Flags a non-finite loss and a long run of skipped steps.

    A non-finite value whose update was applied (``skipped`` false or absent) rolls
    back at once; one a guard skipped is recorded (once per run of them). A skip streak
    longer than ``max_skip_streak`` rolls back, with the onset at the first skipped
    step of the streak. The streak is the longer of ``metrics["skip_streak"]`` (the train
    step's longest guard streak, when present) and the detector's own count of
    consecutive ``skipped`` steps.

    Args:
      max_skip_streak: consecutive skipped steps tolerated; >= 1.
      metric: the metrics key watched for non-finite values.
      name: the key of this detector's state in a checkpoint.

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
    """

    def __init__(
        self, max_skip_streak: int = 20, *, metric: str = "loss", name: str = "divergence"
    ):
        _check(
            "max_skip_streak",
            int(max_skip_streak) == max_skip_streak and max_skip_streak >= 1,
            "an int >= 1",
            max_skip_streak,
        )
        self.max_skip_streak = int(max_skip_streak)
        self.metric = metric
        self.name = name
        self.set_state({})

    @property
    def keys(self) -> tuple[str, ...]:
        """The metrics this detector reads."""
        return (self.metric, "skipped", "skip_streak")

    @property
    def active_onset(self) -> int | None:
        return self._nonfinite_onset

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        """Feeds the value of ``step``; returns a detection or ``None``."""
        x = _value(metrics, self.metric)
        skipped = bool(metrics.get("skipped", False))
        self._own_streak = self._own_streak + 1 if skipped else 0
        # Nested guards restore each other's counters (skip_nonfinite(skip_spikes(...))
        # resets the inner spike_streak on a NaN step), so the guards' streak can be shorter
        # than the run of skipped steps: take the longer of the two.
        streak = max(int(metrics.get("skip_streak", 0)), self._own_streak)
        finite = math.isfinite(x)
        new_nonfinite = not finite and self._nonfinite_onset is None
        if finite:
            self._nonfinite_onset = None
        elif new_nonfinite:
            self._nonfinite_onset = int(step)
        details = {"skipped": skipped, "skip_streak": streak}
        if not finite and not skipped:
            reason = f"{self.metric} is {x} at step {step} and its update was applied"
            onset = self._nonfinite_onset
            return Detection("divergence", int(step), onset, "rollback", reason, x, details)
        if streak > self.max_skip_streak:
            onset = int(step) - streak + 1
            reason = (
                f"{streak} consecutive steps skipped by a guard up to step {step} "
                f"(limit {self.max_skip_streak})"
            )
            return Detection("divergence", int(step), onset, "rollback", reason, x, details)
        if new_nonfinite:
            reason = f"{self.metric} is {x} at step {step}; a guard skipped its update"
            return Detection("divergence", int(step), int(step), "record", reason, x, details)
        return None

    def get_state(self) -> dict[str, Any]:
        return {"own_streak": self._own_streak, "nonfinite_onset": self._nonfinite_onset}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._own_streak = int(state.get("own_streak", 0))
        self._nonfinite_onset = state.get("nonfinite_onset")

    def __repr__(self) -> str:
        return f"DivergenceDetector(max_skip_streak={self.max_skip_streak})"


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
      >>> from stabljax.control.detect import mann_kendall
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
      >>> from stabljax.control.detect import sen_slope
      >>> print(sen_slope([0.0, 1.0, 2.0, 3.0, 30.0]))
      1.0
    """
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    if x.ndim != 1 or n < 2:
        raise ValueError(f"need a 1-D series of >= 2 values, got shape {x.shape}")
    i, j = np.triu_indices(n, 1)
    return float(np.median((x[j] - x[i]) / (j - i)))


class SlowDivergenceDetector:
    r"""A one-sided Mann–Kendall trend test on block means of the loss.

    The loss is smoothed by averaging blocks of ``block`` consecutive finite values
    (block means of independent noise stay independent, unlike an EMA, whose
    autocorrelation would break the test); the last ``window`` block means are kept.
    When the window is full, each new block runs :func:`mann_kendall` on it; the
    detector fires when :math:`z >` ``z_threshold`` (a rising trend; one-sided
    p ≈ 2·10⁻⁴ for 3.5, strict because the test runs at every block) and the rise
    Sen's slope gives over the window is at least ``min_rise`` times the window's
    median (a statistically clear but negligible drift does not
    count). This catches the slow climb of a run going bad, which a spike detector,
    tracking a moving mean, follows without alarm. After firing the window starts
    empty, so one episode gives one alarm. Memory is ``window`` floats.

    Args:
      window: block means in the test; >= 8.
      block: losses per block; >= 1.
      z_threshold: Mann–Kendall z to fire; > 0.
      min_rise: minimum relative rise over the window; >= 0.
      action: ``"warn"`` (an event and a warning, the default) or ``"rollback_best"``
        (roll back to the checkpoint with the lowest smoothed loss).
      metric: the metrics key watched.
      name: the key of this detector's state in a checkpoint.

    Example:
      >>> from stabljax.control import SlowDivergenceDetector
      >>> det = SlowDivergenceDetector(window=10, block=2)
      >>> out = [det.update(s, {"loss": 2.0 + 0.01 * s + 0.001 * (-1) ** s}) for s in range(20)]
      >>> d = out[-1]
      >>> print(d.kind, d.onset, d.action, round(d.details["z"], 2))
      slow_divergence 0 warn 3.94
    """

    def __init__(
        self,
        window: int = 50,
        *,
        block: int = 20,
        z_threshold: float = 3.5,
        min_rise: float = 0.03,
        action: Literal["warn", "rollback_best"] = "warn",
        metric: str = "loss",
        name: str = "slow_divergence",
    ):
        _check("window", int(window) == window and window >= 8, "an int >= 8", window)
        _check("block", int(block) == block and block >= 1, "an int >= 1", block)
        _check("z_threshold", z_threshold > 0, "> 0", z_threshold)
        _check("min_rise", min_rise >= 0, ">= 0", min_rise)
        _check("action", action in ("warn", "rollback_best"), "'warn' or 'rollback_best'", action)
        self.window = int(window)
        self.block = int(block)
        self.z_threshold = float(z_threshold)
        self.min_rise = float(min_rise)
        self.action = action
        self.metric = metric
        self.name = name
        self.set_state({})

    @property
    def keys(self) -> tuple[str, ...]:
        """The metrics this detector reads."""
        return (self.metric,)

    @property
    def active_onset(self) -> int | None:
        return None

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        """Feeds the value of ``step``; returns a detection or ``None``."""
        x = _value(metrics, self.metric)
        if not math.isfinite(x):
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
        if len(self._means) > self.window:
            del self._means[0], self._starts[0]
        if len(self._means) < self.window:
            return None
        s, var, z = mann_kendall(self._means)
        slope = sen_slope(self._means)
        median = float(np.median(self._means))
        rise = slope * (self.window - 1) / abs(median) if median != 0 else math.inf
        if z <= self.z_threshold or rise < self.min_rise:
            return None
        onset = self._starts[0]
        details = {"s": s, "var_s": var, "z": z, "sen_slope_per_block": slope, "rel_rise": rise}
        reason = (
            f"{self.metric} rose {100 * rise:.3g}% over steps {onset}..{step} "
            f"(Mann-Kendall z = {z:.2f} > {self.z_threshold})"
        )
        self._means, self._starts = [], []
        return Detection("slow_divergence", int(step), onset, self.action, reason, x, details)

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
            f"z_threshold={self.z_threshold}, min_rise={self.min_rise}, action={self.action!r})"
        )


def default_detectors() -> list[Detector]:
    """The controller's default: spike, divergence and (warn-only) slow divergence."""
    return [SpikeDetector(), DivergenceDetector(), SlowDivergenceDetector()]
