"""Detectors of divergence: :class:`DivergenceDetector` (non-finite losses, skip streaks, a
stuck fp16 loss scale) and :class:`SlowDivergenceDetector` (a trend test on block means,
:mod:`~stabljax.control.detect.trends`); and :func:`default_detectors`.

They share :class:`~stabljax.control.detect.detectors.WatchesMetric` and
:class:`~stabljax.control.detect.detectors.Detection` with the spike detector.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

from stabljax.base import validate
from stabljax.control.detect.detectors import (
    Detection,
    Detector,
    SpikeDetector,
    WatchesMetric,
    int_at_least,
    one_of,
    value_of,
    was_skipped,
)
from stabljax.control.detect.trends import (
    mann_kendall,
    normal_quantile,
    rank_acf,
    sen_slope,
    variance_ratio,
)
from stabljax.metrics import LOSS, LOSS_SCALE, OVERFLOW, SKIP_STREAK, SKIPPED

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
        (:class:`~stabljax.control.detect.detectors.WatchesMetric`).

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
        (:class:`~stabljax.control.detect.detectors.WatchesMetric`).

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


def default_detectors() -> list[Detector]:
    """The controller's default: spike, divergence and (warn-only) slow divergence."""
    return [SpikeDetector(), DivergenceDetector(), SlowDivergenceDetector()]
