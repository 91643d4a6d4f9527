"""A divergence warning from leading indicators: CUSUM on standardised signals.

:class:`WarningDetector` watches the signals that move before the loss does (Wortsman et al.
2023b: spikes follow 1-8 steps after :math:`g^2` outruns Adam's second moment; Wortsman et
al. 2023: attention-logit growth and output-logit divergence; the update/weight ratio), each
standardised against its own recent past, and accumulates the evidence of a rise with
Page's one-sided CUSUM. It only warns: its :class:`~.detectors.Detection` has action
``"warn"`` (or ``"record"``), never a rollback, and :attr:`WarningDetector.engaged` says
whether a response (:class:`stabljax.control.decide.remedies.WarningResponse`: a lower
learning rate) should be in force now. Rollback stays the reactive detectors' job.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from stabljax.base import validate
from stabljax.control.detect.detectors import Detection, check_metric, int_at_least
from stabljax.metrics import ADAM_RMS, GRAD_NORM, LOG_Z, MAX_ATTN_LOGIT, UPDATE_RMS_RATIO

TRANSFORMS = ("log", "diff", "level")


@dataclasses.dataclass(frozen=True)
class Signal:
    r"""One watched metric and how it is turned into the value :math:`y_t` that is tested.

    Attributes:
      metric: the metrics key (a scalar the step writes).
      transform: ``"log"`` (:math:`y_t = \log x_t`, for positive scales: a rise by a
        factor; a zero, e.g. the update ratio of a skipped step, is not tested), ``"diff"``
        (:math:`y_t = x_t - x_{t-1}`, a growth rate per step) or ``"level"``
        (:math:`y_t = x_t`).
      two_sided: also test for a fall (a second CUSUM on :math:`-z`); for a drift whose
        sign is not known in advance (log Z).
    """

    metric: str
    transform: str = "log"
    two_sided: bool = False


#: The default signals: the update/param RMS ratio and Adam's RMS
#: (:func:`stabljax.telemetry.leading_signals`), the grad-norm level, the growth of the max
#: attention logit and the drift of log Z, each per step.
DEFAULT_SIGNALS = (
    Signal(UPDATE_RMS_RATIO, "log"),
    Signal(ADAM_RMS, "log"),
    Signal(GRAD_NORM, "log"),
    Signal(MAX_ATTN_LOGIT, "diff"),
    Signal(LOG_Z, "diff", two_sided=True),
)


class WarningDetector:
    r"""Warns when a leading indicator of a loss spike rises: CUSUM on standardised signals.

    For each :class:`Signal` with tested value :math:`y_t` (its transform of the metric):

    1. Warmup: the first ``warmup`` finite values give :math:`\mu` (their mean) and
       :math:`\sigma^2` (their population variance); nothing is tested.
    2. Then :math:`z_t = (y_t - \mu)/(\sigma + \epsilon)` with :math:`\epsilon = 10^{-12}`,
       clipped to :math:`[-c, c]` (``clamp``; a non-finite :math:`y_t` counts as
       :math:`z_t = c`), and Page's CUSUM
       :math:`S_t = \max(0, S_{t-1} + z_t - \kappa)` (``drift`` :math:`\kappa`); a
       two-sided signal also keeps :math:`S^-_t = \max(0, S^-_{t-1} - z_t - \kappa)`.
    3. The baseline follows slow change: with the winsorised
       :math:`\tilde y = \mu + \mathrm{clip}(z_t, -w, w)\,\sigma` (``winsor`` :math:`w`),
       :math:`\mu \leftarrow \alpha\mu + (1-\alpha)\tilde y`, then
       :math:`\sigma^2 \leftarrow \alpha\sigma^2 + (1-\alpha)(\tilde y - \mu)^2` with the new
       :math:`\mu` (ZClip's order), ``alpha`` :math:`\alpha`. A non-finite value does not
       move it.

    The detector is *engaged* from the first step where some :math:`S` exceeds
    ``threshold`` :math:`h` until ``calm`` consecutive steps have every :math:`S \le h`; a
    :class:`~stabljax.control.detect.detectors.Detection` (kind ``"warning"``) is returned on
    the step it engages, with onset the step where the firing statistic last left 0.
    Missing metrics are not tested (a model without attention has no ``max_attn_logit``).

    Calibration: :math:`h` sets the false-warning rate. ``experiments/bench/warning.py``
    calibrates it on healthy runs of the reference LM (d32, 2 layers; seeds separate from
    the evaluation seeds) as 1.25 times the largest CUSUM those runs reach after warmup.
    Eight calibration runs gave :math:`h` = 15.5 (400 steps) and 6.25 (300 steps): eight
    runs do not pin down a tail, and the default is the larger. ``warmup`` 60 is from the
    same runs (after a 30-step warmup the statistic peaked at steps 36-46, the baseline
    still catching up with early training); :math:`\kappa = 1`, :math:`c = 6`,
    :math:`w = 3`, :math:`\alpha = 0.97` were set before any run and not tuned. Measured
    (BUILD.md, "Divergence warning"): at :math:`h` = 6.25, 5.6 false warnings per
    :math:`10^4` held-out healthy steps and a warning at or before 7 of 23 divergences, none
    of them ahead by 5 steps. On another model or optimizer, recalibrate on a few healthy
    runs of yours.

    Args:
      signals: the :class:`Signal`\ s watched.
      threshold: :math:`h`, finite and > 0.
      drift: :math:`\kappa`, the per-step allowance, finite and >= 0.
      alpha: the baseline's EMA decay, in (0, 1).
      warmup: finite values per signal before testing, an int >= 2.
      clamp: :math:`c`, the largest :math:`|z|` one step contributes, > 0.
      winsor: :math:`w`, the largest :math:`|z|` that moves the baseline, > 0.
      calm: steps with every :math:`S \le h` before disengaging, an int >= 1.
      action: ``"warn"`` (a Python warning and an event) or ``"record"`` (an event).
      name: the key of this detector's state in a checkpoint.
      extra_keys: your own ``aux`` keys a signal may name.

    Example:
      >>> from stabljax.control.detect.warning import Signal, WarningDetector
      >>> det = WarningDetector([Signal("grad_norm", "level")], threshold=5.0, warmup=4)
      >>> for step, g in enumerate([1.0, 1.1, 0.9, 1.0, 1.05, 1.6, 2.2]):
      ...     d = det.update(step, {"grad_norm": g})
      >>> print(d.kind, d.step, d.onset, d.action, det.engaged)
      warning 6 5 warn True

    References:
      Page, `Continuous Inspection Schemes <https://doi.org/10.1093/biomet/41.1-2.100>`_,
      1954; Wortsman et al., `Small-scale proxies for large-scale Transformer training
      instabilities <https://arxiv.org/abs/2309.14322>`_, 2023; Wortsman et al., `Stable and
      low-precision training for large-scale vision-language models
      <https://arxiv.org/abs/2304.13013>`_, 2023.
    """

    def __init__(
        self,
        signals: Iterable[Signal] = DEFAULT_SIGNALS,
        *,
        threshold: float = 15.5,
        drift: float = 1.0,
        alpha: float = 0.97,
        warmup: int = 60,
        clamp: float = 6.0,
        winsor: float = 3.0,
        calm: int = 50,
        action: str = "warn",
        name: str = "warning",
        extra_keys: Iterable[str] = (),
    ):
        who = "WarningDetector"
        fin = np.isfinite
        self.signals = tuple(signals)
        if not self.signals or not all(isinstance(s, Signal) for s in self.signals):
            raise ValueError(f"{who}: `signals` must be a non-empty iterable of Signal")
        for s in self.signals:
            check_metric(who, s.metric, extra_keys)
            if s.transform not in TRANSFORMS:
                raise ValueError(f"{who}: transform must be one of {TRANSFORMS}, got {s!r}")
        validate(who, "threshold", threshold, lambda a: fin(a) & (a > 0), "finite and > 0")
        validate(who, "drift", drift, lambda a: fin(a) & (a >= 0), "finite and >= 0")
        validate(who, "alpha", alpha, lambda a: (a > 0) & (a < 1), "in (0, 1)")
        for arg, v in (("clamp", clamp), ("winsor", winsor)):
            validate(who, arg, v, lambda a: fin(a) & (a > 0), "finite and > 0")
        validate(who, "warmup", warmup, int_at_least(2), "an int >= 2")
        validate(who, "calm", calm, int_at_least(1), "an int >= 1")
        if action not in ("warn", "record"):
            raise ValueError(f"{who}: action must be 'warn' or 'record', got {action!r}")
        self.threshold, self.drift, self.alpha = float(threshold), float(drift), float(alpha)
        self.clamp, self.winsor = float(clamp), float(winsor)
        self.warmup, self.calm = int(warmup), int(calm)
        self.action, self.name = action, name
        self.keys = tuple(dict.fromkeys(s.metric for s in self.signals))
        self.set_state({})

    # ------------------------------------------------------------------ the statistics
    @property
    def engaged(self) -> bool:
        """Whether a warning is in force (from its step until ``calm`` quiet steps)."""
        return self._engaged

    @property
    def applied(self) -> bool:
        """Whether a response to the warning is in the train state (:meth:`mark_applied`)."""
        return self._applied

    def mark_applied(self, applied: bool) -> None:
        """Records that a response was put into (True) or taken out of (False) the state.

        The flag is part of the checkpointed state, so after a restore it says what the
        restored train state holds."""
        self._applied = bool(applied)

    @property
    def active_onset(self) -> int | None:
        # A warning never rolls back, so it never moves another detector's rollback target.
        return None

    @property
    def statistics(self) -> dict[str, float]:
        """The current CUSUM value of each signal (``metric`` and ``-metric`` for a fall)."""
        out = {}
        for s, st in zip(self.signals, self._st, strict=True):
            out[s.metric] = st["s_up"]
            if s.two_sided:
                out["-" + s.metric] = st["s_down"]
        return out

    def _value(self, s: Signal, st: dict[str, Any], metrics: Mapping[str, Any]) -> float | None:
        """The tested value of ``s`` this step, or None when there is none yet."""
        if s.metric not in metrics:
            return None
        x = float(metrics[s.metric])
        if s.transform == "diff":
            prev, st["prev"] = st["prev"], x if math.isfinite(x) else None
            if prev is None:
                return None if math.isfinite(x) else math.nan
            return x - prev
        if s.transform == "log":
            if x == 0.0:  # a skipped step's zero update: no evidence either way
                return None
            return math.log(x) if x > 0 and math.isfinite(x) else math.nan
        return x

    def _step_signal(self, s: Signal, st: dict[str, Any], y: float, step: int) -> None:
        """Warmup, or one CUSUM step and a baseline update, for one signal."""
        finite = math.isfinite(y)
        if st["n"] < self.warmup:
            if finite:  # Welford: the warmup's mean and population variance
                st["n"] += 1
                d = y - st["mu"]
                st["mu"] += d / st["n"]
                st["var"] += d * (y - st["mu"])
                if st["n"] == self.warmup:
                    st["var"] /= self.warmup
            return
        sd = math.sqrt(st["var"])
        z = (y - st["mu"]) / (sd + 1e-12) if finite else self.clamp
        z = min(max(z, -self.clamp), self.clamp)
        for key, zz in (("s_up", z), ("s_down", -z)) if s.two_sided else (("s_up", z),):
            was = st[key]
            st[key] = max(0.0, was + zz - self.drift)
            if was == 0.0 and st[key] > 0.0:
                st["start_" + key] = step
        if finite:
            yw = st["mu"] + min(max(z, -self.winsor), self.winsor) * sd
            st["mu"] = self.alpha * st["mu"] + (1 - self.alpha) * yw
            st["var"] = self.alpha * st["var"] + (1 - self.alpha) * (yw - st["mu"]) ** 2

    def update(self, step: int, metrics: Mapping[str, Any]) -> Detection | None:
        for s, st in zip(self.signals, self._st, strict=True):
            y = self._value(s, st, metrics)
            if y is not None:
                self._step_signal(s, st, y, step)
        stats = self.statistics
        worst = max(stats, key=stats.get)
        if stats[worst] <= self.threshold:
            self._quiet += 1
            if self._engaged and self._quiet >= self.calm:
                self._engaged = False
            return None
        self._quiet = 0
        if self._engaged:
            return None
        self._engaged = True
        st = self._st[[s.metric for s in self.signals].index(worst.lstrip("-"))]
        onset = st["start_s_down" if worst.startswith("-") else "start_s_up"]
        sign = "fall" if worst.startswith("-") else "rise"
        return Detection(
            kind="warning",
            step=step,
            onset=int(onset),
            action=self.action,  # type: ignore[arg-type]
            reason=(
                f"leading indicator: CUSUM of the {sign} of {worst.lstrip('-')} is "
                f"{stats[worst]:.3g} > {self.threshold:g} (since step {onset})"
            ),
            value=float(stats[worst]),
            details={"signal": worst, "cusum": {k: float(v) for k, v in stats.items()}},
        )

    # ------------------------------------------------------------------ checkpointing
    def get_state(self) -> dict[str, Any]:
        return {
            "signals": [dict(st) for st in self._st],
            "engaged": self._engaged,
            "applied": self._applied,
            "quiet": self._quiet,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        saved = list(state.get("signals", []))
        if saved and len(saved) != len(self.signals):
            raise ValueError(
                f"WarningDetector: the saved state has {len(saved)} signals, this detector "
                f"{len(self.signals)}"
            )
        blank = {"n": 0, "mu": 0.0, "var": 0.0, "s_up": 0.0, "s_down": 0.0, "prev": None}
        blank |= {"start_s_up": None, "start_s_down": None}
        self._st = [
            blank | dict(saved[i]) if saved else dict(blank) for i in range(len(self.signals))
        ]
        self._engaged = bool(state.get("engaged", False))
        self._applied = bool(state.get("applied", False))
        self._quiet = int(state.get("quiet", 0))
