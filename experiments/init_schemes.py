"""Initialisation and embedding remedies on a deep, narrow model at learning rates <= 1e-2.

A 12-layer, 32-wide reference model (no clipping, no weight decay). Two stages:

1. **LR scan** of the base arm (0.02 everywhere, ``fixed:0.02``) over ``scan_lrs`` (a log
   grid 1e-4..1, ``scan_seeds``), to locate its best LR.
2. **Remedies** at the comparison LRs: the scan's best LR and the next grid point above it,
   each kept only if <= ``max_compare_lr`` (1e-2): at such LRs Adam's steps are small
   against a 0.02-std init, so the init still matters after many steps (at lr 0.1-1 Adam
   erases it within a few). Arms, all against ``fixed:0.02``: ``gpt2`` (residual output
   projections scaled by 1/√(2L)), and Takase et al.'s two embedding remedies, which give
   the embeddings a std near 1: ``embed LN`` (a LayerNorm on token + position embedding) and
   ``scaled embed`` (embeddings × √d_model; :data:`experiments.proxy.EMBEDS`).

Primary metric (:data:`PRIMARY`, declared before the run): the final held-out loss (a
diverged run counts as its loss at init), paired per seed against ``fixed:0.02`` at the same
LR; paired t-interval, exact sign-flip p, Holm over the family (3 remedies × the comparison
LRs). Also recorded per run, as Takase et al. measure instability: loss bursts (steps
whose loss exceeds 1.5× its running minimum) and gradient-norm spikes (steps whose gradient
norm exceeds 3× the median of the previous 50 steps).

    python -m experiments.init_schemes [--quick] [--seeds 0 1 2] [--steps 200]

References:
  Takase et al., `Spike No More: Stabilizing the Pre-training of Large Language Models
  <https://arxiv.org/abs/2312.16903>`_, 2023
  Nguyen & Salazar, `Transformers without Tears
  <https://arxiv.org/abs/1910.05895>`_, 2019
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from experiments import claims, cli, common, plots, proxy, stats
from experiments.trainer import Trainer

BASE = "fixed:0.02"
#: arm name -> (init scheme, embed); the first is the base arm.
ARMS = {
    BASE: (BASE, "plain"),
    "gpt2": ("gpt2", "plain"),
    "embed LN": (BASE, "layernorm"),
    "scaled embed": (BASE, "scaled"),
}
#: The primary metric, declared before the run: lower is better.
PRIMARY = "final held-out loss (nats/byte; diverged = loss at init)"
GRAD_SPIKE_FACTOR = 3.0
GRAD_SPIKE_WINDOW = 50


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_layers: int = 12
    n_heads: int = 2
    weight_decay: float = 0.0
    seeds: tuple[int, ...] = tuple(range(10))
    scan_lrs: tuple[float, ...] = proxy.log_grid(1e-4, 1.0, 9)
    scan_seeds: tuple[int, ...] = (0, 1)
    max_compare_lr: float = 1e-2
    arms: tuple[str, ...] = tuple(ARMS)

    @classmethod
    def quick(cls):
        base = {**dataclasses.asdict(proxy.SweepConfig.quick()), "n_layers": 3, "steps": 10}
        return cls(**base, scan_lrs=(1e-3, 1e-2, 1e-1), scan_seeds=(0,))


def grad_spikes(
    grad_norm: np.ndarray, factor: float = GRAD_SPIKE_FACTOR, window: int = GRAD_SPIKE_WINDOW
) -> int:
    """Steps whose gradient norm exceeds ``factor`` × the median of the previous ``window``
    steps (a non-finite norm counts as a spike; the first step has no reference)."""
    g = np.asarray(grad_norm, dtype=float)
    n = 0
    for i in range(1, g.size):
        ref = np.median(g[max(0, i - window) : i])
        if not np.isfinite(g[i]) or (np.isfinite(ref) and g[i] > factor * ref):
            n += 1
    return n


def train(cfg: Config, arm: str, lrs, seeds, bar) -> list[dict]:
    """The runs of ``arm`` over ``lrs`` × ``seeds``: one vmapped program per embed variant."""
    scheme, embed = ARMS[arm]
    s = cfg.setup(clip=0.0, init_scheme=scheme, embed=embed)
    specs = [{"seed": sd, "learning_rate": lr} for lr in lrs for sd in seeds]
    r = Trainer(s).run_many(specs, progress=bar.update)
    m = r.metrics
    return [
        {
            "arm": arm,
            **r.outcome(i),
            "grad_spikes": grad_spikes(m["grad_norm"][i]),
            "max_grad_norm": float(np.nanmax(m["grad_norm"][i])),
            "log_max_residual_rms": float(np.log(np.nanmax(m["max_residual_rms"][i]))),
            "loss": m["loss"][i],
        }
        for i in range(len(specs))
    ]


def primary(r: dict) -> float:
    return r["final_loss"] if np.isfinite(r["final_loss"]) else r["init_loss"]


def compare_lrs(cfg: Config, grid: dict) -> list[float]:
    """The scan's best LR and the next grid point above it, kept where <= max_compare_lr
    (if none is, the largest grid LR <= max_compare_lr)."""
    lrs = grid["lrs"]
    k = lrs.index(grid["best_lr"])
    out = [x for x in lrs[k : k + 2] if x <= cfg.max_compare_lr * (1 + 1e-9)]
    return out or [max(x for x in lrs if x <= cfg.max_compare_lr * (1 + 1e-9))]


def run(cfg: Config, bar) -> tuple[list[dict], list[dict], dict, list[float]]:
    scan = train(cfg, BASE, cfg.scan_lrs, cfg.scan_seeds, bar)
    grid = stats.grid_of(scan)
    grid["arm"] = f"{BASE}, {len(cfg.scan_seeds)} seeds, {cfg.steps} steps"
    lrs = compare_lrs(cfg, grid)
    rows = [r for arm in cfg.arms for r in train(cfg, arm, lrs, cfg.seeds, bar)]
    return scan, rows, grid, lrs


def rescan(out, seeds) -> dict:
    """Adds ``seeds`` to the LR scan of a stored run (issue 39: a best LR from >= 3 seeds):
    trains the base arm over ``scan_lrs`` for them, appends the rows to ``results.scan``,
    recomputes ``summary.lr_grid`` from every scan seed, and records whether the stored
    comparison LRs still follow from it (``compare_lrs_follow``). Writes results.json back
    (nothing else is re-run) and returns the new grid."""
    out = pathlib.Path(out)
    cfg, payload = plots.stored(out, Config)
    res, summary = payload["results"], payload["summary"]
    new = train(cfg, BASE, cfg.scan_lrs, tuple(seeds), common.progress_bar(0, "", disable=True))
    res["scan"] += [{k: v for k, v in r.items() if k != "loss"} for r in new]
    n = len({r["seed"] for r in res["scan"]})
    grid = stats.grid_of(res["scan"])
    grid["arm"] = f"{BASE}, {n} seeds, {cfg.steps} steps"
    grid["compare_lrs_follow"] = compare_lrs(cfg, grid) == res["compare_lrs"]
    summary["lr_grid"] = grid
    summary["note"] += f"; scan re-derived with {n} seeds (rescan: {list(seeds)} added)"
    payload["config"]["scan_seeds"] = sorted({r["seed"] for r in res["scan"]})
    (out / "results.json").write_text(
        json.dumps(common.jsonable(payload), indent=1, sort_keys=True) + "\n"
    )
    return grid


def summarize(cfg: Config, rows, grid, lrs) -> tuple[dict, dict]:
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    best = grid["best_lr"]

    def col(arm, lr, key=None):
        rr = sorted((r for r in rows if r["arm"] == arm and r["lr"] == lr), key=lambda r: r["seed"])
        return [primary(r) if key is None else float(r[key]) for r in rr]

    comparisons, secondary = {}, {}
    for lr in lrs:
        for arm in cfg.arms[1:]:
            name = f"{arm} @ lr {lr:g} ({lr / best:.3g}x best), {size}"
            comparisons[name] = {"remedy": col(arm, lr), "base": col(BASE, lr)}
            secondary[name] = {
                k: stats.paired_effect(col(arm, lr, k), col(BASE, lr, k), k)
                for k in ("bursts", "grad_spikes", "log_max_residual_rms")
            }
    remedies = stats.family(PRIMARY, comparisons)
    base_rows = [r for r in rows if r["arm"] == BASE]
    spikes = float(np.mean([r["grad_spikes"] for r in base_rows]))
    bursts = float(np.mean([r["bursts"] for r in base_rows]))
    reproduced = bool(any(r["failed"] for r in base_rows) or bursts > 0 or spikes > 0)
    met = [k for k, r in remedies.items() if r["claim_met"]]
    not_shown = (
        ""
        if met
        else (
            f"no remedy passed Holm on the final held-out loss at {size}, lr "
            f"{', '.join(f'{x:g}' for x in lrs)} ({len(cfg.seeds)} seeds, {cfg.steps} steps)"
        )
    )
    summary = stats.summary(
        cfg,
        instability_reproduced=reproduced,
        failure_metric=(
            "fixed:0.02 base arm at the comparison LRs: any failed run, loss burst or "
            f"gradient-norm spike (> {GRAD_SPIKE_FACTOR:g}x the median of the previous "
            f"{GRAD_SPIKE_WINDOW} steps)"
        ),
        remedies=remedies,
        sizes=[size],
        note=(
            f"base arm's best LR {best:g} (scan {grid['lrs'][0]:g}..{grid['lrs'][-1]:g}, "
            f"{len(cfg.scan_seeds)} seeds); remedies at lr {', '.join(f'{x:g}' for x in lrs)}; "
            f"base arm: {bursts:.1f} bursts and {spikes:.1f} grad-norm spikes per run"
        ),
        primary_metric=PRIMARY,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown=not_shown,
    )
    return summary, {"secondary": secondary, "compare_lrs": lrs}


def tables(cfg: Config, rows, grid, summary, res) -> str:
    t = []
    for arm in cfg.arms:
        row = {"arm": arm}
        for lr in res["compare_lrs"]:
            q = [r for r in rows if r["arm"] == arm and r["lr"] == lr]
            iv = stats.interval([primary(r) for r in q])
            row[f"lr {lr:g}: final"] = (
                f"{iv['mean']:.3f} [{iv['ci95'][0]:.3f}, {iv['ci95'][1]:.3f}]"
            )
            row[f"lr {lr:g}: bursts"] = f"{np.mean([r['bursts'] for r in q]):.1f}"
            row[f"lr {lr:g}: grad spikes"] = f"{np.mean([r['grad_spikes'] for r in q]):.1f}"
        t.append(row)
    e = [
        {
            "remedy − fixed:0.02": k,
            "Δ final loss [95% t-CI]": common.fmt_ci(r),
            "p sign-flip": f"{r['p_sign_flip']:.4f}",
            "p Holm": f"{r['p_holm']:.4f}",
            "claim met": r["claim_met"],
            "Δ bursts": common.fmt_ci(res["secondary"][k]["bursts"], 1),
            "Δ grad spikes": common.fmt_ci(res["secondary"][k]["grad_spikes"], 1),
        }
        for k, r in summary["remedies"].items()
    ]
    scan = [
        {"lr": f"{lr:g}", "fixed:0.02 final held-out loss": f"{v:.3f}"}
        for lr, v in zip(grid["lrs"], grid["score"], strict=True)
    ]
    head = (
        f"{cfg.n_layers} layers × d_model {cfg.d_model}, {cfg.steps} steps, no clipping, "
        f"no weight decay; means over {len(cfg.seeds)} seeds [95% t-CI]"
    )
    return common.captioned_tables(
        (f"LR scan of the base arm ({grid['arm']}); best {grid['best_lr']:g}", scan),
        (head, t),
        (f"{PRIMARY}: paired per seed, Holm over {len(e)}", e),
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="init_schemes")
    cfg = ex.cfg
    n_cmp = min(2, len(cfg.scan_lrs))
    total = len(cfg.scan_lrs) * len(cfg.scan_seeds) + n_cmp * len(cfg.arms) * len(cfg.seeds)
    scan, rows, grid, lrs = ex.sweep(total * cfg.steps, lambda bar: run(cfg, bar))
    summary, res = summarize(cfg, rows, grid, lrs)
    table = tables(cfg, rows, grid, summary, res)
    curves = {f"{r['arm']}@{r['lr']:g}@{r['seed']}": r.pop("loss") for r in rows}
    for r in scan:
        r.pop("loss")
    res.update(rows=rows, scan=scan, losses=curves)
    summary["best_per_arm"] = claims.best_block(
        "init_schemes", {"summary": summary, "results": res}
    )
    ex.write(res, table=table, title="Initialisation and embedding remedies", summary=summary)
    figures(cfg, scan, rows, summary, ex.out)
    return res


def replot(out) -> None:
    """Redraws the figures from a stored results.json (no training run)."""
    cfg, payload = plots.stored(out, Config)
    res = payload["results"]
    figures(cfg, res["scan"], res["rows"], payload["summary"], pathlib.Path(out))


def figures(cfg: Config, scan: list[dict], rows: list[dict], summary: dict, out) -> None:
    plots.metric_vs_lr(
        scan,
        y="final_loss",
        group="arm",
        path=out / "lr_scan.png",
        title=f"base arm LR scan, d{cfg.d_model}x{cfg.n_layers}, {cfg.steps} steps",
        ylabel="final held-out loss (nats/byte)",
        fallback="init_loss",
    )
    plots.metric_vs_lr(
        rows,
        y="final_loss",
        group="arm",
        path=out / "init.png",
        title=f"remedies at the comparison LRs, {len(cfg.seeds)} seeds",
        ylabel="final held-out loss (nats/byte)",
        fallback="init_loss",
    )
    plots.effects(
        summary["remedies"],
        path=out / "effects.png",
        title=f"remedy − fixed:0.02, paired t 95% CI, Holm over {len(summary['remedies'])}",
    )


if __name__ == "__main__":
    main()
