"""The divergence detector: a non-finite loss, a long skip streak, a stuck loss scale."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

from stabljax.control.detection import (
    Detection,
    WatchesMetric,
    int_at_least,
    one_of,
    value_of,
    was_skipped,
)
from stabljax.metrics import LOSS, LOSS_SCALE, OVERFLOW, SKIP_STREAK, SKIPPED
from stabljax.optim._base import validate


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
        (:class:`~stabljax.control.detection.WatchesMetric`).

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
