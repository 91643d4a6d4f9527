"""Gradient clipping against the high-learning-rate failures of the proxy, per learning rate.

One LR sweep per arm on a log grid from 1e-4 to 1 that holds the unclipped optimum
strictly inside, weight decay off, the proxy's 5 % warmup and cosine decay: ``none`` (no
clipping), ``clip_1.0`` (``optax.clip_by_global_norm(1.0)``, the fixed clip of Wortsman
et al.'s proxy), ``zclip`` (:func:`stabljax.clip_by_zscore`, ZClip, with a 5-step warmup,
shorter than the onset of the bursts) and ``autoclip`` (:func:`stabljax.clip_by_percentile`,
AutoClip's 10th percentile). ZClip's own claim is that the z-score rule beats a fixed
global-norm clip.

The primary metric, fixed here before any run (:data:`PRIMARY`): the final held-out loss
(a diverged run counts as its loss at init), paired per seed at each LR from the
unclipped arm's best LR to 10× it, not pooled over the grid: each clipper against
``none``, and ``zclip`` against ``clip_1.0``. 95 % paired t-intervals, exact sign-flip
p-values, Holm's correction over the family (4 pairs × the LRs in that range). No
mechanism is claimed: that a clipper clips (its clip rate) is true by construction; the
clip rate, the largest gradient norm and the bursts are reported beside it.

    python -m experiments.clipping [--quick] [--lrs 1e-4 1e-2 1] [--seeds 0 1 2]

References:
  Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
  <https://arxiv.org/abs/2504.02507>`_, 2025
  Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source Separation
  Networks <https://arxiv.org/abs/2007.14469>`_, 2020
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import optax

import stabljax
from experiments import claims, cli, common, plots, proxy, stats
from experiments.trainer import Trainer

#: The primary metric, declared before the run: lower is better.
PRIMARY = "final_loss"
PRIMARY_TEXT = (
    "final held-out loss (nats/byte; diverged = init loss), arm − base, per LR from the "
    "unclipped best LR to 10x it"
)
#: Comparisons run at the LRs from the base arm's best LR to this multiple of it.
SPAN = 10.0
ARMS = ("none", "clip_1.0", "zclip", "autoclip")


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_heads: int = 2
    steps: int = 300
    weight_decay: float = 0.0
    seeds: tuple[int, ...] = tuple(range(10))
    lrs: tuple[float, ...] = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
    arms: tuple[str, ...] = ARMS
    zclip_warmup: int = 5

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(
            **{**q, "steps": 10},
            lrs=(1e-4, 1e-2, 1.0),
            arms=("none", "clip_1.0", "zclip"),
            zclip_warmup=3,
        )


def factory(arm: str, s: proxy.Setup, cfg: Config):
    adam = proxy.adamw_factory(s, clip=0.0)

    def make(learning_rate):
        if arm == "none":
            return adam(learning_rate)
        if arm == "clip_1.0":
            return optax.chain(optax.clip_by_global_norm(1.0), adam(learning_rate))
        if arm == "zclip":
            return optax.chain(
                stabljax.clip_by_zscore(warmup_steps=cfg.zclip_warmup), adam(learning_rate)
            )
        if arm == "autoclip":
            return optax.chain(stabljax.clip_by_percentile(), adam(learning_rate))
        raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")

    return make


def probes(arm: str) -> dict:
    """``clipped``: whether the arm's rule rescaled this step's gradient."""
    if arm == "zclip":
        return {"clipped": lambda st: optax.tree.get(st.opt_state, "zclip_clipped")}
    if arm == "autoclip":

        def pclip(st):
            n = optax.tree.get(st.opt_state, "pclip_norm")
            return n > optax.tree.get(st.opt_state, "pclip_threshold")

        return {"clipped": pclip}
    return {}


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    rows, curves = [], {}
    specs = [{"seed": sd, "learning_rate": lr} for lr in cfg.lrs for sd in cfg.seeds]
    s = cfg.setup(clip=0.0)
    for arm in cfg.arms:
        bar.set_postfix_str(arm)
        r = Trainer(s, factory(arm, s, cfg), probes=probes(arm)).run_many(
            specs, progress=bar.update
        )
        m = r.metrics
        gn = np.asarray(m["grad_norm"])
        if arm == "clip_1.0":
            clipped = gn > 1.0
        elif arm == "none":
            clipped = np.zeros_like(gn, dtype=bool)
        else:
            clipped = np.asarray(m["clipped"]) > 0
        for i in range(len(r.specs)):
            rows.append(
                {
                    "arm": arm,
                    **r.outcome(i),
                    "clip_rate": float(np.mean(clipped[i])),
                    "max_grad_norm": float(np.nanmax(gn[i])),
                }
            )
        curves[arm] = {lr: m["loss"][r.index(learning_rate=lr)] for lr in cfg.lrs}
    return rows, curves


def pairs(arms) -> list[tuple[str, str]]:
    """The family's (arm, base) pairs: each clipper against ``none``, ZClip against the
    fixed clip."""
    out = [(a, "none") for a in arms if a != "none"] if "none" in arms else []
    if "zclip" in arms and "clip_1.0" in arms:
        out.append(("zclip", "clip_1.0"))
    return out


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    grid = {a: stats.grid_of(rows, arm=a) for a in cfg.arms}
    best = grid["none"]["best_lr"]
    at = stats.lrs_from_best(cfg.lrs, best, SPAN)
    comparisons = {}
    for a, b in pairs(cfg.arms):
        for lr in at:
            comparisons[f"{a} vs {b} @ lr {lr:g} ({lr / best:.3g}x best), {size}"] = {
                "remedy": stats.final_per_seed(rows, cfg.seeds, arm=a, lr=lr),
                "base": stats.final_per_seed(rows, cfg.seeds, arm=b, lr=lr),
            }
    remedies = stats.family(PRIMARY_TEXT, comparisons)
    effects = {"best_lr_none": best, "compared_lrs": at}
    base_at = [
        float(np.mean(stats.final_per_seed(rows, cfg.seeds, arm="none", lr=lr))) for lr in at
    ]
    top = [r for r in rows if r["arm"] == "none" and r["lr"] == max(at)]
    reproduced = len(at) > 1 and base_at[-1] > base_at[0]
    met = [k for k, r in remedies.items() if r["claim_met"]]
    summary = stats.summary(
        cfg,
        instability_reproduced=bool(reproduced),
        failure_metric=f"unclipped final held-out loss at {max(at):g} ({max(at) / best:.3g}x "
        f"its best LR {best:g}) above the loss at the best LR (seed means {base_at[-1]:.3f} "
        f"vs {base_at[0]:.3f}); runs failed there: {sum(r['failed'] for r in top)}/{len(top)}",
        remedies=remedies,
        sizes=[size],
        note=f"{cfg.steps} steps, weight decay 0, {cfg.warmup_frac:g} warmup; comparisons at "
        f"the LRs from the unclipped best LR to {SPAN:g}x it; primary metric fixed in code "
        "before the run",
        primary_metric=PRIMARY_TEXT,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown=""
        if met
        else f"no clipper lowers the final loss at 1-{SPAN:g}x the unclipped best LR with Holm "
        f"p < 0.05 at {size}, {cfg.steps} steps",
    )
    return summary, effects


def fmt(mean: float, ci, spec: str) -> str:
    """``mean [lo, hi]`` in format ``spec``."""
    return f"{mean:{spec}} [{ci[0]:{spec}}, {ci[1]:{spec}}]"


def tables(cfg: Config, rows: list[dict], summary: dict) -> str:
    def per_lr(key, spec, fallback=False):
        t = []
        for a in cfg.arms:
            row = {"arm": a}
            for lr in cfg.lrs:
                if fallback:
                    v = stats.final_per_seed(rows, cfg.seeds, arm=a, lr=lr)
                else:
                    v = [r[key] for r in rows if (r["arm"], r["lr"]) == (a, lr)]
                row[f"lr {lr:g}"] = f"{np.mean(v):{spec}}"
            t.append(row)
        return t

    e = common.family_rows(summary["remedies"], "Δ final loss [95% t-CI]")
    grid = "; ".join(f"{k}: best LR {g['best_lr']:g}" for k, g in summary["lr_grid"].items())
    n = len(cfg.seeds)
    return common.captioned_tables(
        (
            f"Final held-out loss (nats/byte; a diverged run counts as its init loss), seed "
            f"mean over {n} seeds, {cfg.steps} steps. {grid}",
            per_lr(PRIMARY, ".3f", fallback=True),
        ),
        (
            f"Primary metric: {PRIMARY_TEXT}. Paired per seed, 95 % t-intervals, exact "
            "sign-flip p, Holm over the family",
            e,
        ),
        (
            "Reported, not claimed: clip rate (fraction of steps rescaled; by construction)",
            per_lr("clip_rate", ".2f"),
        ),
        (
            "Reported, not claimed: largest gradient norm of the run (before clipping)",
            per_lr("max_grad_norm", ".3g"),
        ),
        (
            "Reported, not claimed: bursts per run (training loss > 1.5x its running minimum)",
            per_lr("bursts", ".1f"),
        ),
    )


def figures(cfg, rows, curves, summary, effects, out: pathlib.Path) -> None:
    lr_figures(cfg, rows, summary, out)
    shown = sorted({max(effects["compared_lrs"]), max(cfg.lrs)})
    panels = {
        f"lr {lr:g} ({lr / effects['best_lr_none']:.3g}x best)": {
            a: c[lr] for a, c in curves.items()
        }
        for lr in shown
    }
    plots.loss_curves(panels, out / "loss.png")


def replot(out) -> None:
    """Redraws the LR figures from a stored results.json (no training run)."""
    cfg, payload = plots.stored(out, Config)
    lr_figures(cfg, payload["results"]["rows"], payload["summary"], pathlib.Path(out))


def lr_figures(cfg, rows, summary, out: pathlib.Path) -> None:
    plots.metric_vs_lr(
        rows,
        y=PRIMARY,
        group="arm",
        path=out / "final_loss_vs_lr.png",
        title=f"clipping, d{cfg.d_model}x{cfg.n_layers}, {cfg.steps} steps",
        ylabel="final held-out loss (nats/byte; diverged = init)",
        fallback="init_loss",
    )
    plots.effects(
        summary["remedies"],
        path=out / "effects.png",
        title=f"clipping, final held-out loss, {len(cfg.seeds)} seeds "
        f"(Holm over {len(summary['remedies'])})",
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="clipping")
    cfg = ex.cfg
    n = len(cfg.arms) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps
    rows, curves = ex.sweep(n, lambda bar: run(cfg, bar))
    summary, effects = summarize(cfg, rows)
    every = max(1, cfg.steps // 60)
    res = {
        "primary_metric": PRIMARY,
        "rows": rows,
        "effects": effects,
        "curves_every": every,
        "curves": {
            a: {f"lr {lr:g}": v[:, ::every] for lr, v in c.items()} for a, c in curves.items()
        },
    }
    table = tables(cfg, rows, summary)
    summary["best_per_arm"] = claims.best_block("clipping", {"summary": summary, "results": res})
    ex.write(
        res, table=table, title="Clipping against high-learning-rate failures", summary=summary
    )
    figures(cfg, rows, curves, summary, effects, ex.out)
    return res


if __name__ == "__main__":
    main()
