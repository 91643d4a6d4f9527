"""Figures people can read: every seed as a thin line with the mean, labels inside the
axes, legends outside them (never over the data), log axes for learning rates and logits,
a y-range set by the region of interest (marking where values were cut), and paired
differences with their intervals where a claim is paired.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments.common import is_primary


def stored(out: pathlib.Path | str, config_cls: Any) -> tuple[Any, dict[str, Any]]:
    """The config (as ``config_cls``) and the payload of a stored ``<out>/results.json``, with
    every ``"nan"``/``"inf"`` string of its rows back to a float: what a figure needs to be
    redrawn without a training run."""
    payload = json.loads((pathlib.Path(out) / "results.json").read_text())

    def num(v):
        return float(v) if v in ("nan", "inf", "-inf") else v

    res = payload["results"]
    for key in ("rows", "scan"):
        if key in res:
            res[key] = [{k: num(v) for k, v in r.items()} for r in res[key]]
    c = {k: tuple(v) if isinstance(v, list) else v for k, v in payload["config"].items()}
    assert all(not isinstance(v, float) or math.isfinite(v) for v in c.values() if v is not None)
    return config_cls(**c), payload


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: pathlib.Path) -> None:
    """Writes a figure as PNG through a temporary file; process 0 alone writes."""
    if not is_primary():
        return
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    pyplot().close(fig)


def label(ax, text: str) -> None:
    """A panel label inside the axes (top left), on a white box."""
    ax.text(
        0.02,
        0.98,
        text,
        transform=ax.transAxes,
        va="top",
        ha="left",
        fontsize=8,
        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"},
    )


def legend_outside(ax) -> None:
    """The legend to the right of the axes, so that it never hides a data point."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def roi_top(lrs: Sequence[float], grids: Sequence[np.ndarray], span: float = 10.0) -> float:
    """The largest value at LRs >= the lowest best LR / ``span`` (grids ``[seeds, lrs]``,
    lower is better): a far-too-small LR's loss does not stretch a loss-vs-LR y-axis."""
    lrs = np.asarray(lrs, dtype=float)
    best = min(float(lrs[int(np.nanargmin(np.nanmean(g, axis=0)))]) for g in grids)
    keep = lrs >= best / span * (1 - 1e-9)
    return float(
        max(np.nanmax(np.where(np.isfinite(g[:, keep]), g[:, keep], np.nan)) for g in grids)
    )


def set_ylim(ax, values: np.ndarray, *, log: bool = False, cap: float | None = None) -> None:
    """A y-range that shows every finite peak; above ``cap`` values are cut and the cut
    is marked with a triangle at the top and a note inside the axes."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return
    if log:
        v = v[v > 0]
        if v.size == 0:
            return
    top = float(v.max())
    if cap is not None and top > cap:
        ax.text(
            0.98,
            0.98,
            f"cut at {cap:.3g}",
            transform=ax.transAxes,
            va="top",
            ha="right",
            fontsize=7,
            color="0.3",
        )
        top = cap
    lo = float(v.min())
    if log:
        ax.set_yscale("log")
        ax.set_ylim(lo / 1.5, top * 1.5)
    else:
        pad = 0.05 * (top - lo or 1.0)
        ax.set_ylim(lo - pad, top + pad)


def seed_lines(ax, x, ys, *, color, name: str, cap: float | None = None, lw: float = 0.6):
    """Every row of ``ys`` as a thin line and their mean as a thick one; non-finite
    points become a cross at the last finite value (a diverged run), values above
    ``cap`` a triangle at ``cap``."""
    ys = np.asarray(ys, dtype=float)
    x = np.asarray(x)
    for y in ys:
        shown = np.where(np.isfinite(y), y, np.nan)
        if cap is not None:
            over = shown > cap
            ax.plot(x[over], np.full(over.sum(), cap), "^", ms=3, color=color)
            shown = np.where(over, np.nan, shown)
        ax.plot(x, shown, lw=lw, alpha=0.45, color=color)
        bad = ~np.isfinite(y)
        if bad.any():
            i = int(np.argmax(bad))
            ax.plot(x[i], shown[i - 1] if i else 0, "x", color=color, ms=6)
    with np.errstate(all="ignore"):
        mean = np.nanmean(np.where(np.isfinite(ys), ys, np.nan), axis=0)
    if cap is not None:
        mean = np.where(mean > cap, np.nan, mean)
    ax.plot(x, mean, lw=1.8, color=color, label=f"{name} (mean of {len(ys)})")


def curves(
    panels: dict[str, dict[str, np.ndarray]],
    *,
    path: pathlib.Path,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    cap: float | None = None,
    x: np.ndarray | None = None,
    marks: dict[str, Sequence[int]] | None = None,
) -> None:
    """One subplot per ``panels`` key; in each, one colour per arm (``[seeds, T]``)."""
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.8 * len(panels), 4.0), squeeze=False, layout="constrained"
    )
    for ax, (pname, arms) in zip(axes[0], panels.items(), strict=True):
        allv = []
        for j, (arm, ys) in enumerate(arms.items()):
            ys = np.asarray(ys, dtype=float)
            xs = np.arange(ys.shape[1]) if x is None else x
            seed_lines(ax, xs, ys, color=f"C{j}", name=arm, cap=cap)
            allv.append(ys.ravel())
        set_ylim(ax, np.concatenate(allv), log=logy, cap=cap)
        for m in (marks or {}).get(pname, ()):
            ax.axvline(m, color="0.5", ls=":", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        label(ax, pname)
        legend_outside(ax)
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def loss_curves(panels: dict[str, dict[str, np.ndarray]], path: pathlib.Path) -> None:
    """:func:`curves` of training losses against the step, on a log scale."""
    curves(panels, path=path, xlabel="step", ylabel="training loss (nats/byte)", logy=True)


def mean_band(ax, x, ys, *, color, name: str) -> None:
    """The seed mean of ``ys`` (``[seeds, len(x)]``) as a line with markers and its 95 %
    t-interval as a shaded band (columns with a non-finite seed draw no band)."""
    from experiments.stats import t_interval

    ys = np.asarray(ys, dtype=float)
    with np.errstate(all="ignore"):
        mean = np.where(np.all(np.isfinite(ys), axis=0), ys.mean(axis=0), np.nan)
    ci = np.array([t_interval(ys[:, i]) for i in range(ys.shape[1])])
    ax.plot(
        x, mean, "o-", ms=3.5, lw=1.6, color=color, label=f"{name} (mean, 95% t-CI; n={len(ys)})"
    )
    ax.fill_between(x, ci[:, 0], ci[:, 1], color=color, alpha=0.2, lw=0)


def metric_vs_lr(
    rows: Sequence[dict[str, Any]],
    *,
    y: str,
    group: str,
    path: pathlib.Path,
    title: str,
    ylabel: str,
    panel: str | None = None,
    fallback: str | None = None,
    logy: bool = False,
) -> None:
    """``y`` against the peak learning rate (log axis), one colour per ``group``: the seed
    mean with its 95 % t-interval band. ``fallback`` names the field that replaces a
    non-finite ``y`` (a diverged run's init loss); with ``panel``, one subplot per value.
    For a loss (``"loss"`` in ``y``, linear axis) the y-range is the region of interest,
    :func:`roi_top`; the legend sits outside the axes."""
    plt = pyplot()
    panels = list(dict.fromkeys(r[panel] for r in rows)) if panel else [None]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.8 * len(panels), 4.2), squeeze=False, layout="constrained"
    )
    for ax, pv in zip(axes[0], panels, strict=True):
        sub = [r for r in rows if panel is None or r[panel] == pv]
        allv, grids, lrs_all = [], [], None
        for j, g in enumerate(dict.fromkeys(r[group] for r in sub)):
            rr = [r for r in sub if r[group] == g]
            xs = sorted({r["lr"] for r in rr})
            seeds = sorted({r["seed"] for r in rr})

            def val(r):
                v = float(r[y])
                return v if np.isfinite(v) or fallback is None else float(r[fallback])

            grid = np.array(
                [
                    [next(val(r) for r in rr if r["lr"] == v and r["seed"] == sd) for v in xs]
                    for sd in seeds
                ]
            )
            mean_band(ax, xs, grid, color=f"C{j}", name=str(g))
            allv.append(grid.ravel())
            if lrs_all is None or xs == lrs_all:
                lrs_all = xs
                grids.append(grid)
        ax.set_xscale("log")
        cap = None
        if "loss" in y and not logy and len(lrs_all) > 2:
            cap = roi_top(lrs_all, grids)
            cap += 0.08 * (cap - float(np.nanmin(np.concatenate(allv))))
        set_ylim(ax, np.concatenate(allv), log=logy, cap=cap)
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel(ylabel)
        label(ax, title if pv is None else f"{title}\n{panel} {pv}")
        legend_outside(ax)
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def effects(remedies: dict[str, dict[str, Any]], *, path: pathlib.Path, title: str) -> None:
    """A forest plot of a family: each comparison's mean effect (remedy − base) with its
    95 % interval, one labelled row each, 0 marked; filled where the claim is met."""
    plt = pyplot()
    names = list(remedies)
    fig, ax = plt.subplots(figsize=(7.5, 0.38 * len(names) + 1.4))
    for i, k in enumerate(names):
        r = remedies[k]
        lo, hi = (float(v) for v in r["ci95"])
        m = float(r["effect_mean"])
        color = "C2" if r.get("claim_met") else "0.35"
        if np.isfinite(lo) and np.isfinite(hi):
            ax.plot([lo, hi], [i, i], color=color, lw=2)
        ax.plot(m, i, "o", color=color, mfc=color if r.get("claim_met") else "white", ms=6)
    ax.axvline(0, color="0.5", ls=":", lw=1)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(
        [
            f"{k}  (p_Holm {r['p_holm']:.3g})" if r.get("p_holm") is not None else k
            for k, r in remedies.items()
        ],
        fontsize=7,
    )
    ax.invert_yaxis()
    metric = next(iter(remedies.values()))["metric"] if remedies else ""
    ax.set_xlabel(f"{metric}: remedy − base, mean and 95% interval (filled: claim met)", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    save_figure(fig, path)


def seed_dots(panels: dict[str, dict[str, Sequence[float]]], *, path: pathlib.Path, ylabel: str):
    """One panel per key, one category per inner key: every seed a dot, the mean with its
    95 % t-interval beside them (categories side by side, not joined by lines)."""
    from experiments.stats import t_interval

    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, (pname, cats) in zip(axes[0], panels.items(), strict=True):
        for j, values in enumerate(cats.values()):
            v = np.asarray(values, dtype=float)
            jitter = np.linspace(-0.15, 0.15, v.size)
            ax.plot(j + jitter, v, ".", color=f"C{j}", alpha=0.5)
            if v.size > 1:
                lo, hi = t_interval(v)
                m = float(v.mean())
                ax.errorbar(
                    j + 0.3, m, yerr=[[m - lo], [hi - m]], fmt="o", color=f"C{j}", capsize=4
                )
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(list(cats), fontsize=8)
        ax.set_ylabel(ylabel)
        n = max(len(v) for v in cats.values())
        label(ax, f"{pname}, {n} seeds: dots, mean ± 95% t-CI")
        ax.grid(alpha=0.3, axis="y")
    save_figure(fig, path)


def paired_vs_lr(
    panels: dict[str, dict[str, list[dict[str, Any]]]],
    *,
    best_lr: dict[str, float],
    path: pathlib.Path,
    title: str,
    ylabel: str,
) -> None:
    """Paired differences (remedy − base, mean and 95 % interval; filled where the claim is
    met) against the LR, one subplot per panel; the base's best LR dashed, > 10x it shaded
    as stress. ``panels[p][arm]`` lists ``{"lr", "effect_mean", "ci95", "claim_met"}``."""
    plt = pyplot()
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.6 * len(panels), 3.8), squeeze=False, layout="constrained"
    )
    for ax, (pname, arms) in zip(axes[0], panels.items(), strict=True):
        best = best_lr[pname]
        for k, (arm, pts) in enumerate(arms.items()):
            pts = sorted(pts, key=lambda e: e["lr"])
            x = np.array([e["lr"] for e in pts]) * (1.0 + 0.06 * (k - (len(arms) - 1) / 2))
            m = np.array([e["effect_mean"] for e in pts])
            lo = m - np.array([e["ci95"][0] for e in pts])
            hi = np.array([e["ci95"][1] for e in pts]) - m
            ax.errorbar(x, m, yerr=[lo, hi], color=f"C{k}", ls="-", lw=1, capsize=3, marker="")
            for xi, mi, e in zip(x, m, pts, strict=True):
                ax.plot(xi, mi, "o", color=f"C{k}", mfc=f"C{k}" if e["claim_met"] else "w", ms=5)
            ax.plot([], [], "o-", color=f"C{k}", label=f"{arm} − base")
        ax.set_xscale("log")
        xs = [e["lr"] for pts in arms.values() for e in pts]
        left, right = min(xs + [best]) / 1.6, max(xs + [best]) * 1.6
        ax.axhline(0, color="0.4", ls=":", lw=1)
        ax.axvline(best, color="0.3", ls="--", lw=0.8, label=f"base's best LR {best:g}")
        if right > 10 * best:
            ax.axvspan(
                10 * best * (1 + 1e-3), right, color="0.88", lw=0, label="> 10x best: stress"
            )
        ax.set_xlim(left, right)
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel(ylabel)
        label(ax, f"{title}\n{pname}" if pname else title)
        ax.plot([], [], "o", color="0.3", mfc="0.3", label="filled: claim met (Holm)")
        legend_outside(ax)
        ax.grid(alpha=0.3)
    save_figure(fig, path)
