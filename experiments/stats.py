"""The statistics that carry the experiments' claims.

Issue 29's rule (:func:`family`): per seed, the paired difference ``remedy − base`` of a
lower-is-better primary metric declared before the run; its paired t-interval (95 %), its
exact sign-flip p, Holm over the experiment's family; a claim needs the interval below 0
and the Holm p below 0.05. A run *fails* when its final loss is non-finite or above its
loss at init; a *burst* is a step whose loss exceeds 1.5× the running minimum so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

BURST_FACTOR = 1.5


def per_seed(rows: Sequence[dict[str, Any]], key: str, seeds: Sequence[int], **match: Any):
    """``row[key]`` summed per seed over the rows whose fields equal ``match``, in ``seeds``
    order: one value per seed, for :func:`paired_effect` and :func:`family`."""
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


def paired_effect(remedy: Sequence[float], base: Sequence[float], metric: str) -> dict[str, Any]:
    """``remedy − base`` per seed (same seeds, same order): its mean, 95 % paired t-interval
    and exact sign-flip p (``p_sign_flip``)."""
    r, b = np.asarray(remedy, dtype=float), np.asarray(base, dtype=float)
    if r.shape != b.shape or r.ndim != 1:
        raise ValueError(f"remedy and base must be 1-D of one length, got {r.shape}, {b.shape}")
    d = r - b
    return {
        "metric": metric,
        "effect_mean": float(np.mean(d)),
        "ci95": list(t_interval(d)),
        "interval": "paired t",
        "p_sign_flip": sign_flip_p(d),
        "per_seed": d.tolist(),
    }


def below_zero(effect: dict[str, Any]) -> bool:
    """The effect's interval lies entirely below 0 (the remedy lowered the metric)."""
    hi = effect["ci95"][1]
    return bool(math.isfinite(hi) and hi < 0)


def summary(
    cfg: Any,
    *,
    instability_reproduced: bool,
    failure_metric: str,
    remedies: dict[str, dict[str, Any]],
    sizes: Sequence[Any] | None = None,
    note: str = "",
    primary_metric: str | None = None,
    lr_grid: dict[str, Any] | None = None,
    failure_made_by_model: bool | None = None,
    not_shown: str = "",
) -> dict[str, Any]:
    """The ``summary`` block of a results.json (issue 17's schema, plus a one-line note).

    ``cfg`` is the experiment's config: the seed count is ``len(cfg.seeds)`` and the sizes,
    unless given, its one model size, ``d<d_model>x<n_layers>``.

    Issue 29's fields, given together: ``primary_metric`` (declared before the run; the
    remedies then come from :func:`family`), ``lr_grid`` (:func:`lr_grid`, or a dict of
    them), ``failure_made_by_model`` (False for an injected failure, a stress test) and
    ``not_shown`` (one line: what was tried and why no claim is met at this size).
    """
    if sizes is None:
        sizes = [f"d{cfg.d_model}x{cfg.n_layers}"]
    out = {
        "instability_reproduced": bool(instability_reproduced),
        "failure_metric": failure_metric,
        "remedies": remedies,
        "seeds": len(cfg.seeds),
        "sizes": list(sizes),
        "note": note,
    }
    if primary_metric is None:
        return out
    missing = [k for k, r in remedies.items() if "p_holm" not in r]
    if missing:
        raise ValueError(f"remedies without a Holm-adjusted p (use stats.family): {missing}")
    if lr_grid is None or failure_made_by_model is None:
        raise ValueError("primary_metric needs lr_grid and failure_made_by_model too")
    return out | {
        "seed_ids": [int(s) for s in cfg.seeds],
        "primary_metric": primary_metric,
        "interval": INTERVAL_TEXT,
        "p_values": P_VALUES_TEXT,
        "family_size": len(remedies),
        "lr_grid": lr_grid,
        "failure_made_by_model": bool(failure_made_by_model),
        "not_shown": not_shown,
    }


ALPHA = 0.05
INTERVAL_TEXT = "paired t, 95 %"
P_VALUES_TEXT = "exact sign-flip permutation, Holm-adjusted over the experiment's family"


#: The tests :func:`family` can take its p-values from.
TESTS = ("sign_flip", "paired_t")


def family(
    metric: str,
    comparisons: dict[str, dict[str, Any]],
    *,
    alpha: float = ALPHA,
    test: str = "sign_flip",
) -> dict[str, dict[str, Any]]:
    """Issue 29's claim rule over one experiment's family of comparisons.

    ``comparisons`` maps a name (say ``"clip 1.0 @ lr 0.3, d32x2"``: name the regime) to
    ``{"remedy": [...], "base": [...]}``, one value of the primary metric per seed (same
    seeds, same order; lower is better; a diverged run must already be mapped to a finite
    value, e.g. its init loss). Optionally ``"mechanism": {"remedy": [...], "base": [...],
    "metric": str, "direction": -1 | +1}``: a quantity the remedy acts on that is **not**
    moved by construction (leave it out where it would be).

    Each comparison gets its paired t-interval (95 %), its exact sign-flip p and that p
    Holm-adjusted over the whole family. ``claim_met``: the interval lies below 0, the
    Holm p is below ``alpha``, and the mechanism (where given) moved, its own t-interval
    excluding 0 on ``direction``'s side. ``mechanism_moved`` is None where none is given.

    ``test``: ``"sign_flip"`` (exact; its floor is :func:`sign_flip_floor`, so with few seeds
    and a large family nothing can pass) or ``"paired_t"`` (:func:`paired_t_p`, no floor):
    the p that is Holm-adjusted (``p_test``; ``p_sign_flip`` is kept either way).
    """
    if test not in TESTS:
        raise ValueError(f"test must be one of {TESTS}, got {test!r}")
    if not comparisons:
        return {}
    effects = {k: paired_effect(c["remedy"], c["base"], metric) for k, c in comparisons.items()}
    for e in effects.values():
        e["p_test"] = e["p_sign_flip"] if test == "sign_flip" else paired_t_p(e["per_seed"])
    adjusted = holm([e["p_test"] for e in effects.values()])
    out = {}
    for (k, c), e, p_adj in zip(comparisons.items(), effects.values(), adjusted, strict=True):
        entry = {
            "metric": metric,
            "effect_mean": e["effect_mean"],
            "ci95": e["ci95"],
            "p_sign_flip": e["p_sign_flip"],
            "test": test,
            "p_test": e["p_test"],
            "p_holm": p_adj,
            "per_seed": e["per_seed"],
            "mechanism_moved": None,
        }
        mech = c.get("mechanism")
        if mech is not None:
            direction = mech.get("direction", -1)
            if direction not in (-1, 1):
                raise ValueError(f"{k}: mechanism direction must be -1 or 1, got {direction}")
            m = paired_effect(mech["remedy"], mech["base"], mech["metric"])
            lo, hi = m["ci95"]
            entry["mechanism_moved"] = bool(hi < 0) if direction < 0 else bool(lo > 0)
            entry["mechanism"] = {
                "metric": mech["metric"],
                "effect_mean": m["effect_mean"],
                "ci95": m["ci95"],
            }
        entry["claim_met"] = bool(
            below_zero(e) and p_adj < alpha and entry["mechanism_moved"] is not False
        )
        out[k] = entry
    return out


def lr_grid(score: dict[float, float]) -> dict[str, Any]:
    """The LR grid record of one arm: ``score`` maps each learning rate to the arm's
    seed-mean primary metric there (lower is better; diverged runs counted as their init
    loss). Says which LR is best, whether it lies strictly inside the grid, and whether
    the grid spans issue 29's 1e-4..1."""
    if not score:
        raise ValueError("score must map at least one learning rate to a value")
    lrs = sorted(float(x) for x in score)
    vals = {float(k): float(v) for k, v in score.items()}
    if not all(math.isfinite(v) for v in vals.values()):
        raise ValueError(f"scores must be finite (map a diverged run to its init loss): {vals}")
    best = min(lrs, key=lambda x: vals[x])
    return {
        "lrs": lrs,
        "best_lr": best,
        "best_strictly_inside": bool(lrs[0] < best < lrs[-1]),
        "spans_1e-4_to_1": bool(lrs[0] <= 1e-4 * (1 + 1e-9) and lrs[-1] >= 1 - 1e-9),
        "score": [vals[x] for x in lrs],
    }


def grid_of(rows: Sequence[dict[str, Any]], key: str = "final_loss", **match: Any) -> dict:
    """:func:`lr_grid` of the rows whose fields equal ``match``: the seed mean of ``key``
    per ``lr``, a non-finite value counted as the row's ``init_loss``."""
    score: dict[float, list[float]] = {}
    for r in rows:
        if all(r[k] == v for k, v in match.items()):
            v = r[key] if math.isfinite(r[key]) else r["init_loss"]
            score.setdefault(float(r["lr"]), []).append(float(v))
    return lr_grid({lr: float(np.mean(v)) for lr, v in score.items()})


def final_per_seed(rows, seeds, key: str = "final_loss", **match: Any) -> list[float]:
    """``key`` per seed (:func:`per_seed`) of the rows matching ``match``, a non-finite value
    replaced by the row's ``init_loss`` (a diverged run counts as its loss at init)."""
    return finite_or(
        per_seed(rows, key, seeds, **match), per_seed(rows, "init_loss", seeds, **match)
    )


def lrs_from_best(lrs: Sequence[float], best: float, span: float = 10.0) -> list[float]:
    """The grid's LRs from ``best`` to ``span`` × ``best``, both included (issue 29's 1–10×)."""
    return [lr for lr in sorted(lrs) if best * (1 - 1e-9) <= lr <= span * best * (1 + 1e-9)]


def finite_or(values: Sequence[float], fallback: Sequence[float]) -> list[float]:
    """``values`` with each non-finite entry replaced by the matching ``fallback`` (a
    diverged run's final loss counted as its loss at init)."""
    return [
        float(v) if math.isfinite(float(v)) else float(f)
        for v, f in zip(values, fallback, strict=True)
    ]


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
    """Mean of ``values`` (one per seed) with its 95 % t-interval."""
    return {"mean": float(np.mean(values)), "ci95": list(t_interval(values))}


# --------------------------------------------------------------------------- issue 29's rules:
# paired t-intervals, exact sign-flip permutation p-values, Holm's correction.


def t_cdf(t: float, df: float) -> float:
    """The CDF of Student's t with ``df`` degrees of freedom (scipy, a JAX dependency)."""
    from scipy import stats as sps

    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    return float(sps.t.cdf(t, df))


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t."""
    from scipy import stats as sps

    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q}")
    return float(sps.t.ppf(q, df))


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


def paired_t_p(x: Sequence[float]) -> float:
    """Two-sided paired t-test p of mean 0 on the differences ``x``, ``2·(1 − F_{n−1}(|mean|
    ·√n / sd))``: no floor (unlike :func:`sign_flip_p`), assumes a near-normal mean. Equal
    non-zero differences give 0, all zero 1; non-finite entries or fewer than 2, NaN."""
    v = np.asarray(x, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"x must be a non-empty 1-D sequence, got shape {v.shape}")
    if v.size < 2 or not np.all(np.isfinite(v)):
        return float("nan")
    m, sd = float(np.mean(v)), float(np.std(v, ddof=1))
    if sd == 0:
        return 1.0 if m == 0 else 0.0
    t = abs(m) * math.sqrt(v.size) / sd
    return float(2 * (1 - t_cdf(t, v.size - 1)))


def sign_flip_floor(n: int) -> float:
    """The smallest p :func:`sign_flip_p` gives with ``n`` seeds, ``2 / 2**n``; Holm over
    ``m`` comparisons makes it ``m`` times that (10 seeds, 20 comparisons: 0.039)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 2.0 / 2**n


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
