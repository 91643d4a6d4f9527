"""Warmup against the high-learning-rate failures of the proxy, per learning rate.

Wortsman et al. find that a longer warmup lowers the learning-rate sensitivity, mostly by
letting the high learning rates train; Kalra & Barkeshli find that warmup's benefit is to
let a network tolerate a larger peak LR. The proxy at d32x2, weight decay off and **no
gradient clipping** (clipping bounds the first
updates and would hide what warmup targets), one LR sweep per arm on a log grid from 1e-4
to 1 that holds the no-warmup optimum strictly inside. Arms: no warmup, a **short** warmup
(5 % of the run, 15 steps: the proxy's default, shorter than the 20-step horizon of Adam's
second moment at β2 = 0.95) and a **long** one (25 %, 75 steps, several such horizons);
the cosine decay to 0 follows in every arm.

The primary metric, fixed here before any run (:data:`PRIMARY`): the final held-out loss
(a diverged run counts as its loss at init), paired per seed (warmup − none) at each LR
from the no-warmup arm's best LR to 10× it, not pooled over the grid. The final loss
counts a blow-up that the decay merely ends (a run that diverges, then settles at a
worse loss, is worse at the end), and it needs no burst threshold. 95 % paired
t-intervals, exact sign-flip p-values, Holm's correction over the family (2 warmups × the
LRs in that range). No mechanism is claimed: that warmup shrinks the first updates is true
by construction. Reported beside it, not claimed: each arm's LR sensitivity (Wortsman
et al.'s metric, paired against no warmup) and the bursts per LR.

    python -m experiments.warmup [--quick] [--lrs 1e-4 1e-2 1] [--seeds 0 1 2]

References:
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023
  Kalra & Barkeshli, `Why Warmup the Learning Rate? Underlying Mechanisms and Improvements
  <https://arxiv.org/abs/2406.09405>`_, 2024
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from experiments import claims, cli, common, plots, proxy, stats
from experiments.trainer import Trainer

#: The primary metric, declared before the run: lower is better.
PRIMARY = "final_loss"
PRIMARY_TEXT = (
    "final held-out loss (nats/byte; diverged = init loss), warmup − none, per LR from the "
    "no-warmup best LR to 10x it"
)
#: Comparisons run at the LRs from the base arm's best LR to this multiple of it.
SPAN = 10.0


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_heads: int = 2
    steps: int = 300
    weight_decay: float = 0.0
    clip: float = 0.0
    seeds: tuple[int, ...] = tuple(range(10))
    lrs: tuple[float, ...] = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
    warmups: tuple[float, ...] = (0.0, 0.05, 0.25)

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(**q, lrs=(1e-4, 1e-2, 1.0), warmups=(0.0, 0.5))


def arm_name(cfg: Config, w: float) -> str:
    return f"warmup {w:g} ({int(round(w * cfg.steps))} steps)" if w else "no warmup"


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    rows, curves = [], {}
    specs = [{"seed": sd, "learning_rate": lr} for lr in cfg.lrs for sd in cfg.seeds]
    early = max(1, cfg.steps // 4)
    for w in cfg.warmups:
        bar.set_postfix_str(f"warmup {w:g}")
        r = Trainer(cfg.setup(warmup_frac=w, clip=cfg.clip)).run_many(specs, progress=bar.update)
        m = r.metrics
        for i in range(len(r.specs)):
            loss = m["loss"][i]
            rows.append(
                {
                    "warmup": w,
                    "warmup_steps": int(round(w * cfg.steps)),
                    **r.outcome(i),
                    # the early blow-up (descriptive): the largest training loss of the
                    # first quarter, and the held-out loss at its worst evaluation
                    "early_max_loss": float(
                        np.nanmax(np.where(np.isfinite(loss), loss, np.inf)[:early])
                    ),
                    "max_eval_loss": float(
                        np.nanmax(np.where(np.isfinite(r.eval_loss[i]), r.eval_loss[i], np.inf))
                    ),
                    "max_attn_logit": float(np.nanmax(m["max_attn_logit"][i])),
                }
            )
        curves[w] = {lr: m["loss"][r.index(learning_rate=lr)] for lr in cfg.lrs}
    return rows, curves


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    base_w = cfg.warmups[0]
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    grid = {arm_name(cfg, w): stats.grid_of(rows, warmup=w) for w in cfg.warmups}
    best = grid[arm_name(cfg, base_w)]["best_lr"]
    at = stats.lrs_from_best(cfg.lrs, best, SPAN)
    comparisons = {}
    for w in cfg.warmups[1:]:
        for lr in at:
            name = f"{arm_name(cfg, w)} @ lr {lr:g} ({lr / best:.3g}x best), {size}"
            comparisons[name] = {
                "remedy": stats.final_per_seed(rows, cfg.seeds, warmup=w, lr=lr),
                "base": stats.final_per_seed(rows, cfg.seeds, warmup=base_w, lr=lr),
            }
    remedies = stats.family(PRIMARY_TEXT, comparisons)
    # Reported, not claimed: Wortsman et al.'s LR sensitivity over the whole grid, per seed.
    init = {
        sd: stats.per_seed(rows, "init_loss", [sd], warmup=base_w, lr=cfg.lrs[0])[0]
        for sd in cfg.seeds
    }

    def sensitivity(w):
        return [
            stats.lr_sensitivity(
                [stats.per_seed(rows, PRIMARY, [sd], warmup=w, lr=lr)[0] for lr in cfg.lrs],
                init[sd],
            )
            for sd in cfg.seeds
        ]

    base_sens = sensitivity(base_w)
    effects = {
        "best_lr_no_warmup": best,
        "compared_lrs": at,
        "lr_sensitivity": {
            arm_name(cfg, w): {
                "arm": stats.interval(sensitivity(w)),
                **(
                    {
                        "vs_no_warmup": stats.paired_effect(
                            sensitivity(w), base_sens, "LR sensitivity"
                        )
                    }
                    if w != base_w
                    else {}
                ),
            }
            for w in cfg.warmups
        },
    }
    top = [r for r in rows if r["warmup"] == base_w and r["lr"] == max(at)]
    base_at = [
        float(np.mean(stats.final_per_seed(rows, cfg.seeds, warmup=base_w, lr=lr))) for lr in at
    ]
    # The failure: no warmup ends worse at 10x its best LR than at its best (a model-made
    # failure: nothing injected, only a high peak LR).
    reproduced = len(at) > 1 and base_at[-1] > base_at[0]
    met = [k for k, r in remedies.items() if r["claim_met"]]
    summary = stats.summary(
        cfg,
        instability_reproduced=bool(reproduced),
        failure_metric=f"no-warmup final held-out loss at {max(at):g} ({max(at) / best:.3g}x its "
        f"best LR {best:g}) above the loss at the best LR (seed means {base_at[-1]:.3f} vs "
        f"{base_at[0]:.3f}); runs failed there: {sum(r['failed'] for r in top)}/{len(top)}",
        remedies=remedies,
        sizes=[size],
        note=f"{cfg.steps} steps, no clipping, weight decay 0; comparisons at the LRs from the "
        f"no-warmup best LR to {SPAN:g}x it; primary metric fixed in code before the run",
        primary_metric=PRIMARY_TEXT,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown=""
        if met
        else f"no warmup arm lowers the final loss at 1-{SPAN:g}x the best LR with Holm p < 0.05 "
        f"at {size}, {cfg.steps} steps",
    )
    return summary, effects


def fmt(mean: float, ci, spec: str) -> str:
    """``mean [lo, hi]`` in format ``spec``."""
    return f"{mean:{spec}} [{ci[0]:{spec}}, {ci[1]:{spec}}]"


def tables(cfg: Config, rows: list[dict], summary: dict, effects: dict) -> str:
    t = []
    for w in cfg.warmups:
        row = {"arm": arm_name(cfg, w)}
        for lr in cfg.lrs:
            rr = [r for r in rows if r["warmup"] == w and r["lr"] == lr]
            v = stats.final_per_seed(rows, cfg.seeds, warmup=w, lr=lr)
            failed = sum(r["failed"] for r in rr)
            row[f"lr {lr:g}"] = f"{np.mean(v):.3f}" + (f" ({failed} failed)" if failed else "")
        t.append(row)
    b = []
    for w in cfg.warmups:
        row = {"arm": arm_name(cfg, w)}
        for lr in cfg.lrs:
            rr = [r for r in rows if r["warmup"] == w and r["lr"] == lr]
            row[f"lr {lr:g}"] = f"{np.mean([r['bursts'] for r in rr]):.1f}"
        b.append(row)
    e = common.family_rows(summary["remedies"], "Δ final loss [95% t-CI]")
    s = []
    for k, v in effects["lr_sensitivity"].items():
        a = v["arm"]
        row = {
            "arm": k,
            "LR sensitivity [95% t-CI]": fmt(a["mean"], a["ci95"], ".3f"),
        }
        row["arm − no warmup [95% t-CI]"] = row["p (sign-flip, not corrected)"] = "—"
        if "vs_no_warmup" in v:
            d = v["vs_no_warmup"]
            row["arm − no warmup [95% t-CI]"] = fmt(d["effect_mean"], d["ci95"], "+.3f")
            row["p (sign-flip, not corrected)"] = f"{d['p_sign_flip']:.4f}"
        s.append(row)
    grid = "; ".join(f"{k}: best LR {g['best_lr']:g}" for k, g in summary["lr_grid"].items())
    n = len(cfg.seeds)
    return common.captioned_tables(
        (
            f"Final held-out loss (nats/byte; a diverged run counts as its init loss), seed mean "
            f"over {n} seeds, {cfg.steps} steps, no clipping. {grid}",
            t,
        ),
        (
            f"Primary metric: {PRIMARY_TEXT}. Paired per seed, 95 % t-intervals, exact "
            "sign-flip p, Holm over the family",
            e,
        ),
        (
            "Reported, not claimed: Wortsman et al.'s LR sensitivity over the whole grid, per seed",
            s,
        ),
        (
            "Reported, not claimed: bursts per run (training loss > 1.5x its running "
            "minimum), seed mean",
            b,
        ),
    )


def figures(
    cfg: Config, rows: list[dict], curves: dict, summary: dict, effects: dict, out: pathlib.Path
) -> None:
    lr_figures(cfg, rows, summary, out)
    shown = sorted({max(effects["compared_lrs"]), max(cfg.lrs)})
    panels = {
        f"lr {lr:g} ({lr / effects['best_lr_no_warmup']:.3g}x best)": {
            arm_name(cfg, w): c[lr] for w, c in curves.items()
        }
        for lr in shown
    }
    plots.loss_curves(panels, out / "loss.png")


def replot(out) -> None:
    """Redraws the LR figures from a stored results.json (no training run)."""
    cfg, payload = plots.stored(out, Config)
    lr_figures(cfg, payload["results"]["rows"], payload["summary"], pathlib.Path(out))


def lr_figures(cfg: Config, rows: list[dict], summary: dict, out: pathlib.Path) -> None:
    labelled = [{**r, "arm": arm_name(cfg, r["warmup"])} for r in rows]
    plots.metric_vs_lr(
        labelled,
        y=PRIMARY,
        group="arm",
        path=out / "final_loss_vs_lr.png",
        title=f"warmup, d{cfg.d_model}x{cfg.n_layers}, {cfg.steps} steps, no clipping",
        ylabel="final held-out loss (nats/byte; diverged = init)",
        fallback="init_loss",
    )
    plots.effects(
        summary["remedies"],
        path=out / "effects.png",
        title=f"warmup − no warmup, final held-out loss, {len(cfg.seeds)} seeds "
        f"(Holm over {len(summary['remedies'])})",
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="warmup")
    cfg = ex.cfg
    total = len(cfg.warmups) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps
    rows, curves = ex.sweep(total, lambda bar: run(cfg, bar))
    summary, effects = summarize(cfg, rows)
    every = max(1, cfg.steps // 60)
    res = {
        "primary_metric": PRIMARY,
        "rows": rows,
        "effects": effects,
        "curves_every": every,
        "curves": {
            arm_name(cfg, w): {f"lr {lr:g}": v[:, ::every] for lr, v in c.items()}
            for w, c in curves.items()
        },
    }
    table = tables(cfg, rows, summary, effects)
    summary["best_per_arm"] = claims.best_block("warmup", {"summary": summary, "results": res})
    ex.write(res, table=table, title="Warmup against high-learning-rate failures", summary=summary)
    figures(cfg, rows, curves, summary, effects, ex.out)
    return res


if __name__ == "__main__":
    main()
