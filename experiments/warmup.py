"""Warmup against the early blow-up it is meant to prevent, with no clipping to mask it.

Wortsman et al. find that a longer warmup lowers the learning-rate sensitivity, mostly by
letting the highest learning rates train. Same proxy as :mod:`experiments.lr_sensitivity`
(its ``base`` arm), weight decay off and **no gradient clipping** (clipping bounds the
first updates and would hide the failure warmup targets), with the linear warmup set to
0, 5 % and 25 % of the run before the cosine decay, at learning rates up to 3.

Failure metric: bursts, steps whose training loss exceeds 1.5× its running minimum
(:func:`experiments.stats.burst_count`), summed over the LR grid per seed. Mechanism: the
largest update norm of the first 10 % of steps (what warmup bounds), summed over the grid.

    python -m experiments.warmup [--quick] [--lrs 0.3 1 3] [--seeds 0 1 2 3 4]

References:
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import cli, common, plots, proxy, stats
from experiments.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_heads: int = 2
    steps: int = 300
    weight_decay: float = 0.0
    clip: float = 0.0
    lrs: tuple[float, ...] = (0.3, 1.0, 3.0)
    warmups: tuple[float, ...] = (0.0, 0.05, 0.25)
    early_frac: float = 0.1

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(**q, lrs=(1e-2, 1.0), warmups=(0.0, 0.5))


def run(cfg: Config, bar) -> dict:
    rows, curves = [], {}
    specs = [{"seed": sd, "learning_rate": lr} for lr in cfg.lrs for sd in cfg.seeds]
    early = max(1, int(round(cfg.early_frac * cfg.steps)))
    for w in cfg.warmups:
        bar.set_postfix_str(f"warmup {w:g}")
        t = Trainer(cfg.setup(warmup_frac=w, clip=cfg.clip))
        r = t.run_many(specs, progress=bar.update)
        m = r.metrics
        for i in range(len(r.specs)):
            rows.append(
                {
                    "warmup": w,
                    "warmup_steps": int(round(w * cfg.steps)),
                    **r.outcome(i),
                    "early_max_update_norm": float(np.nanmax(m["update_norm"][i, :early])),
                    "max_attn_logit": float(np.nanmax(m["max_attn_logit"][i])),
                }
            )
        curves[w] = {f"lr {lr:g}": m["loss"][r.index(learning_rate=lr)] for lr in cfg.lrs}
    return {"rows": rows, "curves": curves}


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    base_w = cfg.warmups[0]
    base_b = stats.per_seed(rows, "bursts", cfg.seeds, warmup=base_w)
    base_u = stats.per_seed(rows, "early_max_update_norm", cfg.seeds, warmup=base_w)
    top = [r for r in rows if r["warmup"] == base_w and r["lr"] == max(cfg.lrs)]
    reproduced = any(r["failed"] for r in top) or np.mean([r["bursts"] for r in top]) >= (
        0.05 * cfg.steps
    )
    remedies, effects = {}, {}
    for w in cfg.warmups[1:]:
        e = stats.paired_effect(
            stats.per_seed(rows, "bursts", cfg.seeds, warmup=w), base_b, "bursts"
        )
        mech = stats.moved(
            stats.per_seed(rows, "early_max_update_norm", cfg.seeds, warmup=w), base_u
        )
        name = f"warmup {w:g}"
        remedies[name] = stats.remedy(
            "bursts summed over the LR grid", e, mech, "early max update norm"
        )
        sens = [
            stats.lr_sensitivity(
                [r["final_loss"] for r in rows if r["warmup"] == w and r["seed"] == sd],
                rows[0]["init_loss"],
            )
            for sd in cfg.seeds
        ]
        effects[name] = {"bursts": e, "mechanism": mech, "lr_sensitivity": stats.interval(sens)}
    summary = stats.summary(
        cfg,
        instability_reproduced=bool(reproduced),
        failure_metric="bursts (loss > 1.5x running min) or final loss > init, no warmup, top LR",
        remedies=remedies,
    )
    return summary, effects


def tables(cfg: Config, rows: list[dict], effects: dict) -> str:
    t = []
    for w in cfg.warmups:
        row = {"warmup": f"{w:g} ({int(round(w * cfg.steps))} steps)"}
        for lr in cfg.lrs:
            rr = [r for r in rows if r["warmup"] == w and r["lr"] == lr]
            fl = stats.interval([r["final_loss"] for r in rr])
            row[f"lr {lr:g}: final loss"] = f"{fl['mean']:.3f}"
            row[f"lr {lr:g}: bursts"] = f"{np.mean([r['bursts'] for r in rr]):.1f}"
            row[f"lr {lr:g}: failed"] = f"{sum(r['failed'] for r in rr)}/{len(rr)}"
        t.append(row)
    e = [
        {
            "arm vs no warmup": k,
            "Δ bursts [95% CI]": common.fmt_ci(v["bursts"], 1),
            "Δ early max update norm [95% CI]": common.fmt_ci(v["mechanism"], 3),
            "LR sensitivity (arm)": f"{v['lr_sensitivity']['mean']:.3f}",
        }
        for k, v in effects.items()
    ]
    return common.captioned_tables(
        (f"Seed means over {len(cfg.seeds)} seeds, {cfg.steps} steps, no clipping", t),
        ("Paired per-seed differences (arm − no warmup), 95 % bootstrap intervals", e),
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="warmup")
    cfg = ex.cfg
    total = len(cfg.warmups) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps
    res = ex.sweep(total, lambda bar: run(cfg, bar))
    rows, curves = res["rows"], res.pop("curves")
    summary, res["effects"] = summarize(cfg, rows)
    res["curves_every_5"] = {
        f"{w:g}": {k: v[:, ::5] for k, v in c.items()} for w, c in curves.items()
    }
    table = tables(cfg, rows, res["effects"])
    ex.write(res, table=table, title="Warmup against the early blow-up", summary=summary)
    top = f"lr {max(cfg.lrs):g}"
    panels = {f"{top}, warmup {w:g}": {"loss": c[top]} for w, c in curves.items()}
    plots.loss_curves(panels, ex.out / "loss.png")
    labelled = [{**r, "warmup": f"warmup {r['warmup']:g}"} for r in rows]
    plots.bursts_vs_lr(labelled, group="warmup", path=ex.out / "bursts_vs_lr.png")
    return res


if __name__ == "__main__":
    main()
