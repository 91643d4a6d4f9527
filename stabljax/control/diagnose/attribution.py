"""Attribution at a spike's onset: which signals moved, and what stabljax offers for each.

Pure functions of host metrics (plain dicts of Python numbers, nested as the train step
writes them: ``{"loss": ..., "layers": {"grad_norm": {path: ...}}}``), so each rule can
be tested on a constructed case. :func:`attribute` takes the steps before the onset (the
baseline) and the onset step itself and returns:

* ``first_jump``: the first parameter path (in the step's own order, the parameters'
  pytree order) whose gradient norm jumped at least :data:`JUMP_FACTOR` times over its
  baseline median, and the path with the largest jump;
* ``hints``: one entry per rule that fires, each with the cause it points to, the remedy
  stabljax offers and the numbers behind it. These are hints, never certainties:

  ``attention_logit_growth``: the max attention logit is at least ``ATTN_LOGIT_MIN`` and
  ``ATTN_GROWTH`` × its baseline median → qk-layernorm.
  ``log_z_drift``: ``|log Z − baseline median| ≥ LOG_Z_DRIFT`` or ``|log Z| ≥ LOG_Z_HIGH``
  → z-loss.
  ``eps_dominated``: in some layer, at least ``EPS_FRACTION`` of the Adam coordinates
  have sqrt(v̂) < eps → eps=0 / adamw_atan2.
  ``single_batch_outlier``: the grad norm is ``OUTLIER_RATIO`` × its baseline median and
  above it by ``OUTLIER_Z`` robust σ → skip the data.
  ``rising_trend``: the baseline grad norm's OLS line rises ``TREND_RISE`` × over the
  window with slope t ≥ ``TREND_T`` → lower the LR or lengthen warmup.

* ``signals``: the onset's guard, overflow and clip counters and loss scale.

The metric key names come from :mod:`stabljax.metrics` (the step's contract);
:data:`EPS_DOMINATED` is the one signal computed on the host (from the optimizer state).

References:
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023; Molybog et al., `A Theory on Adam
  Instability in Large-Scale Machine Learning <https://arxiv.org/abs/2304.09871>`_, 2023.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from stabljax.metrics import (
    GRAD_NORM,
    LAYER_GRAD_NORM,
    LAYERS,
    LOG_Z,
    LOSS_SCALE,
    MAX_ATTN_LOGIT,
    OVERFLOW,
    SKIP_STREAK,
    SKIPPED,
)

EPS_DOMINATED = "eps_dominated"  # host-side: {path: fraction of sqrt(v_hat) < eps}
CLIP_KEYS = (
    "zclip_clipped",
    "spam_clipped_coords",
    "adagc_clipped_tensors",
)  # if a step reports them

JUMP_FACTOR = 10.0
ATTN_LOGIT_MIN = 10.0
ATTN_GROWTH = 1.5
LOG_Z_DRIFT = 2.0
LOG_Z_HIGH = 5.0
EPS_FRACTION = 0.5
OUTLIER_RATIO = 3.0
OUTLIER_Z = 6.0
TREND_RISE = 1.5
TREND_T = 3.0
MIN_BASELINE = 4  # trend: fewer baseline steps than this never fire

REMEDY = {
    "attention_logit_growth": "qk-layernorm (TransformerConfig(qk_norm=True))",
    "log_z_drift": "z-loss (stabljax.lm_loss(apply_fn, z_loss_weight=1e-4))",
    "eps_dominated": "Adam eps=0 (stabljax.safe_adamw) or adamw_atan2",
    "single_batch_outlier": "skip the data (the rollback's skip; TriageConfig(narrow_skip=True))",
    "rising_trend": "lower the learning rate or lengthen warmup",
}


def _finite(values: Sequence[Any]) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, bool) or v is None:
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out.append(f)
    return out


def _series(history: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return _finite([m.get(key) for m in history])


def _median(values: Sequence[float]) -> float | None:
    return float(np.median(values)) if len(values) else None


def first_jump(
    history: Sequence[Mapping[str, Any]], onset: Mapping[str, Any], factor: float = JUMP_FACTOR
) -> dict[str, Any] | None:
    """The first layer whose grad norm is ``factor`` × its baseline median, and the largest.

    Example:
      >>> from stabljax.control.diagnose.attribution import first_jump
      >>> base = [{"layers": {"grad_norm": {"a": 1.0, "b": 1.0, "c": 1.0}}}] * 3
      >>> spike = {"layers": {"grad_norm": {"a": 1.2, "b": 30.0, "c": 80.0}}}
      >>> j = first_jump(base, spike)
      >>> j["layer"], j["ratio"], j["largest"]
      ('b', 30.0, 'c')
    """
    now = onset.get(LAYERS, {}).get(LAYER_GRAD_NORM, {})
    ratios = []
    for path, value in now.items():
        past = _finite([m.get(LAYERS, {}).get(LAYER_GRAD_NORM, {}).get(path) for m in history])
        base = _median(past)
        v = _finite([value])
        if base is None or not v:
            ratio = math.inf if value is not None and not v else None  # non-finite now
        else:
            ratio = v[0] / base if base > 0 else (math.inf if v[0] > 0 else 1.0)
        if ratio is not None:
            ratios.append((path, value, base, ratio))
    jumped = [r for r in ratios if r[3] >= factor]
    if not jumped:
        return None
    path, value, base, ratio = jumped[0]
    largest = max(jumped, key=lambda r: r[3])[0]
    return {"layer": path, "grad_norm": value, "baseline": base, "ratio": ratio, "largest": largest}


def _hint(cause: str, evidence: str, **numbers: Any) -> dict[str, Any]:
    return {"cause": cause, "remedy": REMEDY[cause], "evidence": evidence, **numbers}


def attention_hint(history, onset) -> dict[str, Any] | None:
    """Attention-logit growth → qk-layernorm (Wortsman et al.)."""
    now = _finite([onset.get(MAX_ATTN_LOGIT)])
    base = _median(_series(history, MAX_ATTN_LOGIT))
    if not now or base is None or base <= 0:
        return None
    growth = now[0] / base
    if now[0] >= ATTN_LOGIT_MIN and growth >= ATTN_GROWTH:
        text = f"max attention logit {now[0]:.4g}, {growth:.3g}x its baseline median {base:.4g}"
        return _hint("attention_logit_growth", text, value=now[0], baseline=base, growth=growth)
    return None


def log_z_hint(history, onset) -> dict[str, Any] | None:
    """Output-logit (log Z) drift → z-loss (PaLM; Wortsman et al.)."""
    now = _finite([onset.get(LOG_Z)])
    if not now:
        return None
    base = _median(_series(history, LOG_Z))
    drift = None if base is None else now[0] - base
    if abs(now[0]) >= LOG_Z_HIGH or (drift is not None and abs(drift) >= LOG_Z_DRIFT):
        shown = "" if drift is None else f", drift {drift:+.3g} from baseline median {base:.4g}"
        text = f"mean log Z {now[0]:.4g}{shown}"
        return _hint("log_z_drift", text, value=now[0], baseline=base, drift=drift)
    return None


def eps_hint(onset, eps_fraction: Mapping[str, float] | None) -> dict[str, Any] | None:
    """Updates set by Adam's eps, not by the gradients → eps=0 / atan2 (Molybog et al.)."""
    fractions = dict(eps_fraction or {})
    reported = onset.get(EPS_DOMINATED)
    if isinstance(reported, Mapping):
        fractions.update(reported)
    elif _finite([reported]):
        fractions["(all)"] = float(reported)
    fractions = {k: float(v) for k, v in fractions.items() if _finite([v])}
    if not fractions:
        return None
    path, frac = max(fractions.items(), key=lambda kv: kv[1])
    if frac >= EPS_FRACTION:
        text = f"{frac:.1%} of the coordinates of {path} have sqrt(v) < eps"
        return _hint("eps_dominated", text, layer=path, fraction=frac)
    return None


def outlier_hint(history, onset) -> dict[str, Any] | None:
    """One step's grad norm far above a stable baseline → the batch: skip the data."""
    now = _finite([onset.get(GRAD_NORM)])
    past = _series(history, GRAD_NORM)
    if not now or len(past) < 3:
        return None
    med = float(np.median(past))
    sigma = 1.4826 * float(np.median(np.abs(np.asarray(past) - med)))
    if now[0] >= OUTLIER_RATIO * med and now[0] > med + OUTLIER_Z * sigma:
        text = f"grad norm {now[0]:.4g} = {now[0] / med:.3g}x the baseline median {med:.4g}"
        return _hint("single_batch_outlier", text, value=now[0], baseline=med)
    return None


def trend_hint(history, onset) -> dict[str, Any] | None:
    """A steadily rising baseline grad norm → the LR or warmup, not one batch."""
    past = _series(history, GRAD_NORM)
    n = len(past)
    if n < MIN_BASELINE:
        return None
    x = np.arange(n, dtype=np.float64)
    y = np.asarray(past, np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    resid = y - (slope * x + intercept)
    se = math.sqrt(max(float(resid @ resid), 0.0) / (n - 2) / float(((x - x.mean()) ** 2).sum()))
    t = math.inf if se == 0 else slope / se
    start, end = intercept, slope * (n - 1) + intercept
    rise = end / start if start > 0 else math.inf
    if slope > 0 and t >= TREND_T and rise >= TREND_RISE:
        text = f"grad norm rose {rise:.3g}x over {n} steps before the onset (t = {t:.3g})"
        return _hint("rising_trend", text, rise=rise, t=t, steps=n)
    return None


def signals(history, onset) -> dict[str, Any]:
    """The onset's guard, overflow and clip counters, the loss scale, and window totals."""
    out: dict[str, Any] = {}
    for k in (SKIPPED, SKIP_STREAK, OVERFLOW, LOSS_SCALE, *CLIP_KEYS):
        if onset.get(k) is not None:
            out[k] = onset[k]
    steps = [*history, onset]
    for k, name in ((SKIPPED, "skips_in_window"), (OVERFLOW, "overflows_in_window")):
        if any(m.get(k) is not None for m in steps):
            out[name] = int(sum(bool(m.get(k)) for m in steps))
    return out


def attribute(
    history: Sequence[Mapping[str, Any]],
    onset: Mapping[str, Any],
    *,
    eps_fraction: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Names the first layer that jumped, the hints that fire and the counters at the onset.

    Args:
      history: host metrics of the steps before the onset (oldest first), the baseline.
      onset: host metrics of the onset step.
      eps_fraction: ``{path: fraction}`` from :func:`stabljax.telemetry.adam_eps_report`.

    Example:
      >>> from stabljax.control.diagnose.attribution import attribute
      >>> base = [{"grad_norm": 1.0 + 0.01 * (i % 3), "log_z": 0.1} for i in range(8)]
      >>> a = attribute(base, {"grad_norm": 40.0, "log_z": 0.1})
      >>> [h["cause"] for h in a["hints"]]
      ['single_batch_outlier']
    """
    hints = [
        attention_hint(history, onset),
        log_z_hint(history, onset),
        eps_hint(onset, eps_fraction),
        outlier_hint(history, onset),
        trend_hint(history, onset),
    ]
    return {
        "first_jump": first_jump(history, onset),
        "hints": [h for h in hints if h is not None],
        "signals": signals(history, onset),
        "baseline_steps": len(history),
    }
