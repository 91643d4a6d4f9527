"""The statistics that carry the experiments' claims.

- A remedy's effect is the paired per-seed difference ``remedy − base`` of a metric that
  is lower-is-better (final loss, bursts, LR sensitivity), with a 95 % percentile
  bootstrap interval of its mean (10,000 resamples of the seeds, fixed seed).
- The claim rule: a remedy is claimed only where that interval lies below 0 **and** the
  quantity the remedy acts on moved (its own paired interval excludes 0 in the direction
  the remedy pushes it): attention logits, log Z, clip rate, loss-scale events.
- A run *fails* when its final loss is above its loss at init or is non-finite; a
  *burst* is a step whose training loss exceeds 1.5× the running minimum of the loss so
  far (threshold-free in the sense that it does not depend on the run's loss level).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

N_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
BURST_FACTOR = 1.5


def bootstrap_ci(
    x: Sequence[float], *, n: int = N_RESAMPLES, seed: int = BOOTSTRAP_SEED, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``x`` (resampling its entries).

    Non-finite entries make the interval ``(nan, nan)``; one entry gives ``(x, x)``.
    """
    v = np.asarray(x, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"x must be a non-empty 1-D sequence, got shape {v.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not np.all(np.isfinite(v)):
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n, v.size))].mean(axis=1)
    a = (1 - level) / 2
    lo, hi = np.quantile(means, [a, 1 - a])
    return float(lo), float(hi)


def per_seed(rows: Sequence[dict[str, Any]], key: str, seeds: Sequence[int], **match: Any):
    """``row[key]`` summed per seed over the rows whose fields equal ``match``, in ``seeds``
    order: one value per seed, for :func:`paired_effect` and :func:`moved`."""
    return [
        float(
            np.sum(
                [
                    r[key]
                    for r in rows
                    if r["seed"] == sd and all(r[k] == v for k, v in match.items())
                ]
            )
        )
        for sd in seeds
    ]


def paired_effect(
    remedy: Sequence[float], base: Sequence[float], metric: str, *, interval: str = "bootstrap"
) -> dict[str, Any]:
    """``remedy − base`` per seed (same seeds, same order), its mean and 95 % interval.

    ``interval="bootstrap"``: the percentile bootstrap; ``"t"``: issue 29's paired
    t-interval, with the exact sign-flip p-value as ``p_sign_flip``.
    """
    r, b = np.asarray(remedy, dtype=float), np.asarray(base, dtype=float)
    if r.shape != b.shape or r.ndim != 1:
        raise ValueError(f"remedy and base must be 1-D of one length, got {r.shape}, {b.shape}")
    d = r - b
    if interval == "bootstrap":
        (lo, hi), extra = bootstrap_ci(d), {}
    elif interval == "t":
        (lo, hi), extra = t_interval(d), {"interval": "paired t", "p_sign_flip": sign_flip_p(d)}
    else:
        raise ValueError(f"interval must be 'bootstrap' or 't', got {interval!r}")
    return {
        "metric": metric,
        "effect_mean": float(np.mean(d)),
        "ci95": [lo, hi],
        **extra,
        "per_seed": d.tolist(),
    }


def below_zero(effect: dict[str, Any]) -> bool:
    """The effect's interval lies entirely below 0 (the remedy lowered the metric)."""
    hi = effect["ci95"][1]
    return bool(math.isfinite(hi) and hi < 0)


def moved(remedy: Sequence[float], base: Sequence[float], *, direction: int = -1) -> dict:
    """Whether a mechanism quantity moved: its paired interval excludes 0 on ``direction``'s
    side (-1: the remedy lowers it, +1: raises it). Returns the effect with ``moved``."""
    if direction not in (-1, 1):
        raise ValueError(f"direction must be -1 or 1, got {direction}")
    e = paired_effect(remedy, base, "mechanism")
    lo, hi = e["ci95"]
    e["moved"] = bool(hi < 0) if direction < 0 else bool(lo > 0)
    return e


def remedy(
    metric: str, effect: dict[str, Any], mechanism: dict[str, Any], mechanism_metric: str
) -> dict[str, Any]:
    """One ``summary["remedies"]`` entry: the effect, its interval and the mechanism."""
    return {
        "metric": metric,
        "effect_mean": effect["effect_mean"],
        "ci95": effect["ci95"],
        "mechanism_moved": bool(mechanism["moved"]),
        "mechanism": {
            "metric": mechanism_metric,
            "effect_mean": mechanism["effect_mean"],
            "ci95": mechanism["ci95"],
        },
        "claim_met": below_zero(effect) and bool(mechanism["moved"]),
    }


def summary(
    cfg: Any,
    *,
    instability_reproduced: bool,
    failure_metric: str,
    remedies: dict[str, dict[str, Any]],
    sizes: Sequence[Any] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """The ``summary`` block of a results.json (issue 17's schema, plus a one-line note).

    ``cfg`` is the experiment's config: the seed count is ``len(cfg.seeds)`` and the sizes,
    unless given, its one model size, ``d<d_model>x<n_layers>``.
    """
    if sizes is None:
        sizes = [f"d{cfg.d_model}x{cfg.n_layers}"]
    return {
        "instability_reproduced": bool(instability_reproduced),
        "failure_metric": failure_metric,
        "remedies": remedies,
        "seeds": len(cfg.seeds),
        "sizes": list(sizes),
        "note": note,
    }


def burst_count(losses: Sequence[float], factor: float = BURST_FACTOR) -> int:
    """Steps whose loss exceeds ``factor`` × the running minimum of the loss up to them.

    A non-finite loss counts as a burst at every step from the first one (a diverged
    run never comes back).
    """
    x = np.asarray(losses, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"losses must be 1-D, got shape {x.shape}")
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    bad = ~np.isfinite(x)
    if bad.any():
        first = int(np.argmax(bad))
        return burst_count(x[:first], factor) + (x.size - first)
    if x.size == 0:
        return 0
    return int(np.sum(x > factor * np.minimum.accumulate(x)))


def failed(final_loss: float, init_loss: float) -> bool:
    """The run failed: its final loss is non-finite or above its loss at init."""
    return not math.isfinite(final_loss) or final_loss > init_loss


def lr_sensitivity(final_losses: Sequence[float], init_loss: float) -> float:
    """Wortsman et al.'s LR sensitivity of one LR sweep.

    .. math:: \\mathbb{E}_{\\eta}[\\min(\\ell(\\eta), \\ell_0)] - \\min_\\eta \\ell(\\eta)

    over the grid, with :math:`\\ell_0` the loss at init; a diverged (non-finite) run
    counts as :math:`\\ell_0`.
    """
    x = np.array([v if math.isfinite(v) else init_loss for v in map(float, final_losses)])
    x = np.minimum(x, init_loss)
    return float(x.mean() - x.min())


def steps_lost(losses: Sequence[float], spikes: Sequence[int], *, window: int = 10) -> int:
    """Training steps spent above the pre-spike loss, summed over ``spikes``.

    For a spike at step ``i`` the reference is the lowest loss of the ``window`` steps
    before it; the spike costs the steps until the loss is back at or below it (to the
    end of the run if it never is). Overlapping episodes are counted once.
    """
    x = np.asarray(losses, dtype=float)
    lost, covered = 0, -1
    for i in spikes:
        if i <= covered:
            continue
        ref = np.min(x[max(0, i - window) : i]) if i > 0 else x[0]
        after = np.nonzero(np.isfinite(x[i + 1 :]) & (x[i + 1 :] <= ref))[0]
        end = i + 1 + int(after[0]) if after.size else len(x)
        lost += end - i
        covered = end
    return int(lost)


def interval(values: Sequence[float]) -> dict[str, Any]:
    """Mean of ``values`` (one per seed) with its 95 % bootstrap interval."""
    v = np.asarray(values, dtype=float)
    lo, hi = bootstrap_ci(v)
    return {"mean": float(np.mean(v)), "ci95": [lo, hi]}


# --------------------------------------------------------------------------- issue 29's rules:
# paired t-intervals, exact sign-flip permutation p-values, Holm's correction.


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """The CDF of Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t (bisection on :func:`t_cdf`, to 1e-12)."""
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_quantile(1 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def t_interval(x: Sequence[float], *, level: float = 0.95) -> tuple[float, float]:
    """The t-interval of the mean of ``x`` (paired differences): mean ± t·sd/√n.

    Non-finite entries, or fewer than 2, give ``(nan, nan)``.
    """
    v = np.asarray(x, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"x must be a non-empty 1-D sequence, got shape {v.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if v.size < 2 or not np.all(np.isfinite(v)):
        return float("nan"), float("nan")
    half = t_quantile(0.5 + level / 2, v.size - 1) * float(np.std(v, ddof=1)) / math.sqrt(v.size)
    m = float(np.mean(v))
    return m - half, m + half


def sign_flip_p(x: Sequence[float]) -> float:
    """Exact two-sided sign-flip permutation p-value of the mean of paired differences.

    Under H0 (each difference symmetric about 0) every one of the 2^n sign patterns is
    equally likely; p is the fraction whose |mean| is at least the observed one (the
    observed pattern included, so p ≥ 2/2^n for n ≥ 1 and a non-zero mean). Exact, so n ≤ 20.
    Non-finite entries give NaN.
    """
    v = np.asarray(x, dtype=float)
    if v.ndim != 1 or v.size == 0 or v.size > 20:
        raise ValueError(f"x must be 1-D with 1..20 entries, got shape {v.shape}")
    if not np.all(np.isfinite(v)):
        return float("nan")
    n = v.size
    patterns = (np.arange(2**n)[:, None] >> np.arange(n)[None, :]) & 1
    sums = np.abs((1 - 2 * patterns) @ v)
    observed = abs(float(v.sum()))
    return float(np.mean(sums >= observed - 1e-12 * max(1.0, observed)))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order (NaN stays NaN, counts in m)."""
    p = np.asarray(pvalues, dtype=float)
    m = p.size
    order = np.argsort(np.where(np.isnan(p), np.inf, p), kind="stable")
    adj = np.full(m, np.nan)
    running = 0.0
    for rank, i in enumerate(order):
        if np.isnan(p[i]):
            continue
        running = max(running, min(1.0, (m - rank) * p[i]))
        adj[i] = running
    return adj.tolist()
