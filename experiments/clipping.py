"""Gradient clipping against the loss bursts of a too-high learning rate.

An LR sweep per arm on the proxy with weight decay off: ``none`` (no clipping), ``clip_1.0``
(``optax.clip_by_global_norm(1.0)``), ``zclip`` (:func:`stabljax.clip_by_zscore`, ZClip,
with a 5-step warmup, shorter than the onset of the bursts) and ``autoclip``
(:func:`stabljax.clip_by_percentile`, AutoClip's 10th percentile). ZClip's claim is that at
an LR where fixed clipping still bursts or diverges, the z-score rule does not.

Failure metric: bursts, steps whose training loss exceeds 1.5× its running minimum,
summed over the LR grid per seed. Effects are paired per seed (arm − ``none``, and
``zclip`` − ``clip_1.0``) with 95 % bootstrap intervals; the mechanism is the clip rate
(the fraction of steps the rule rescaled the gradient).

    python -m experiments.clipping [--quick] [--lrs 0.3 1 3] [--seeds 0 1 2 3 4]

References:
  Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
  <https://arxiv.org/abs/2504.02507>`_, 2025
  Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source Separation
  Networks <https://arxiv.org/abs/2007.14469>`_, 2020
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax

import stabljax
from experiments import cli, common, plots, proxy, stats
from experiments.trainer import Trainer

ARMS = ("none", "clip_1.0", "zclip", "autoclip")


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_heads: int = 2
    steps: int = 300
    weight_decay: float = 0.0
    lrs: tuple[float, ...] = (0.3, 1.0, 3.0)
    arms: tuple[str, ...] = ARMS
    zclip_warmup: int = 5

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(**{**q, "steps": 12}, lrs=(1.0,), arms=("none", "zclip"), zclip_warmup=3)


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
        if arm == "clip_1.0":
            clipped = m["grad_norm"] > 1.0
        elif arm == "none":
            clipped = jnp.zeros_like(m["grad_norm"], dtype=bool)
        else:
            clipped = m["clipped"] > 0
        clipped = np.asarray(clipped)
        for i in range(len(r.specs)):
            rows.append(
                {
                    "arm": arm,
                    **r.outcome(i),
                    "clip_rate": float(np.mean(clipped[i])),
                    "max_grad_norm": float(np.nanmax(m["grad_norm"][i])),
                }
            )
        curves[arm] = m["loss"][r.index(learning_rate=max(cfg.lrs))]
    return rows, curves


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    pairs = [(a, "none") for a in cfg.arms if a != "none"]
    if "zclip" in cfg.arms and "clip_1.0" in cfg.arms:
        pairs.append(("zclip", "clip_1.0"))
    effects, remedies = {}, {}
    for a, b in pairs:
        e = stats.paired_effect(
            stats.per_seed(rows, "bursts", cfg.seeds, arm=a),
            stats.per_seed(rows, "bursts", cfg.seeds, arm=b),
            "bursts",
        )
        # Against no clipping the rate rises from 0; against fixed clipping ZClip's own
        # rate must be above 0 (it acted at all).
        other = (
            stats.per_seed(rows, "clip_rate", cfg.seeds, arm=b)
            if b == "none"
            else [0.0] * len(cfg.seeds)
        )
        mech = stats.moved(stats.per_seed(rows, "clip_rate", cfg.seeds, arm=a), other, direction=+1)
        name = f"{a} vs {b}"
        effects[name] = {"bursts": e, "mechanism": mech}
        remedies[name] = stats.remedy(
            "bursts summed over the LR grid",
            e,
            mech,
            "clip rate (summed over the grid; vs clip_1.0: zclip's own rate > 0)",
        )
    top = [r for r in rows if r["arm"] == "none" and r["lr"] == max(cfg.lrs)]
    summary = stats.summary(
        cfg,
        instability_reproduced=any(r["failed"] for r in top)
        or float(np.mean([r["bursts"] for r in top])) >= 0.05 * cfg.steps,
        failure_metric="bursts (loss > 1.5x running min) >= 5% of steps, or final > init, "
        "no clipping at the top LR",
        remedies=remedies,
    )
    return summary, effects


def tables(cfg: Config, rows: list[dict], effects: dict) -> str:
    t = []
    for a in cfg.arms:
        row = {"arm": a}
        for lr in cfg.lrs:
            rr = [r for r in rows if (r["arm"], r["lr"]) == (a, lr)]
            row[f"lr {lr:g}: final loss"] = f"{np.mean([r['final_loss'] for r in rr]):.3f}"
            row[f"lr {lr:g}: bursts"] = f"{np.mean([r['bursts'] for r in rr]):.1f}"
            row[f"lr {lr:g}: clip rate"] = f"{np.mean([r['clip_rate'] for r in rr]):.2f}"
        t.append(row)
    e = [
        {
            "pair": k,
            "Δ bursts [95% CI]": common.fmt_ci(v["bursts"], 1),
            "Δ clip rate [95% CI]": common.fmt_ci(v["mechanism"], 2),
        }
        for k, v in effects.items()
    ]
    return common.captioned_tables(
        (f"Seed means over {len(cfg.seeds)} seeds, {cfg.steps} steps", t),
        ("Paired per-seed differences, 95 % bootstrap intervals", e),
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="clipping")
    cfg = ex.cfg
    n = len(cfg.arms) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps
    rows, curves = ex.sweep(n, lambda bar: run(cfg, bar))
    summary, effects = summarize(cfg, rows)
    every_5 = {a: c[:, ::5] for a, c in curves.items()}
    res = {"rows": rows, "effects": effects, "losses_top_lr_every_5": every_5}
    table = tables(cfg, rows, effects)
    ex.write(res, table=table, title="Clipping against loss bursts", summary=summary)
    top = max(cfg.lrs)
    plots.loss_curves(
        {f"lr {top:g}, {a}": {"loss": c} for a, c in curves.items()}, ex.out / "loss.png"
    )
    plots.bursts_vs_lr(rows, group="arm", path=ex.out / "bursts_vs_lr.png")
    return res


if __name__ == "__main__":
    main()
