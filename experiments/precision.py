"""Mixed precision at learning rates where float16's range runs out.

The reference model (no clipping, no weight decay) trained four ways over an LR grid:
float32; bfloat16 compute (float32 master weights, optimizer state and loss); float16
compute with no loss scale; float16 with :class:`stabljax.DynamicLossScale` (skip and
halve on overflow, double after ``growth_interval`` clean steps). The model computes in the
arm's compute dtype (``proxy.model_config``). At high learning rates the residual stream grows
past float16's 65504 (attention scores and output logits are computed in float32 by
:mod:`stabljax.reference.nn`, so it is the activations that overflow).

Failure metric: failed runs (final loss non-finite or above its loss at init), summed
over the grid per seed; the steps with a non-finite training loss are reported beside it.
Effects are paired per seed against ``fp16-noscale`` with 95 % bootstrap intervals; the
mechanism of the scaler is its loss-scale events (overflow skips), that of bfloat16 the
steps whose output logits are non-finite. A loss scale protects the range of the
*gradients*; where the forward activations overflow, it can only skip the step.

    python -m experiments.precision [--quick] [--lrs 0.01 1 3] [--seeds 0 1 2 3 4]

References:
  Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, 2018
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

import stabljax
from experiments import cli, common, plots, proxy, stats
from experiments.trainer import Trainer

ARMS = ("fp32", "bf16", "fp16-noscale", "fp16")
BASE = "fp16-noscale"


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_heads: int = 2
    weight_decay: float = 0.0
    lrs: tuple[float, ...] = (0.01, 1.0, 3.0)
    arms: tuple[str, ...] = ARMS
    initial_scale: float = 2.0**15
    growth_interval: int = 50

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(**q, lrs=(1.0,), arms=("fp16-noscale", "fp16"), growth_interval=2)


def precision(arm: str, cfg: Config):
    if arm == "fp16":
        return stabljax.Precision.fp16(
            initial_scale=cfg.initial_scale, growth_interval=cfg.growth_interval
        )
    return proxy.precision_of(arm)


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    rows, curves = [], {}
    specs = [{"seed": sd, "learning_rate": lr} for lr in cfg.lrs for sd in cfg.seeds]
    for arm in cfg.arms:
        bar.set_postfix_str(arm)
        s = cfg.setup(clip=0.0, precision=arm)
        r = Trainer(s, precision=precision(arm, cfg)).run_many(specs, progress=bar.update)
        m = r.metrics
        for i in range(len(r.specs)):
            rows.append(
                {
                    "arm": arm,
                    **r.outcome(i),
                    "nonfinite_steps": int(np.sum(~np.isfinite(m["loss"][i]))),
                    "nonfinite_logit_steps": int(np.sum(~np.isfinite(m["max_abs_logit"][i]))),
                    "overflows": int(np.sum(m["overflow"][i])),
                    "final_loss_scale": float(m["loss_scale"][i, -1]),
                    "max_residual_rms": float(np.nanmax(m["max_residual_rms"][i])),
                }
            )
        curves[arm] = m["loss"][r.index(learning_rate=max(cfg.lrs))]
    return rows, curves


FAILED = "failed runs (final loss non-finite or above init) over the LR grid"


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    mechs = {
        "fp16": ("overflows", +1, "loss-scale events (overflow skips)"),
        "bf16": ("nonfinite_logit_steps", -1, "steps with non-finite logits"),
    }
    effects, remedies = {}, {}
    seeds = cfg.seeds
    base = {k: stats.per_seed(rows, k, seeds, arm=BASE) for k in ("failed", "nonfinite_steps")}
    for arm, (key, direction, label) in mechs.items():
        if arm not in cfg.arms or BASE not in cfg.arms:
            continue
        failed = stats.paired_effect(
            stats.per_seed(rows, "failed", seeds, arm=arm), base["failed"], "failed"
        )
        nonfinite = stats.paired_effect(
            stats.per_seed(rows, "nonfinite_steps", seeds, arm=arm),
            base["nonfinite_steps"],
            "non-finite loss steps",
        )
        mech = stats.moved(
            stats.per_seed(rows, key, seeds, arm=arm),
            stats.per_seed(rows, key, seeds, arm=BASE),
            direction=direction,
        )
        effects[arm] = {"failed_runs": failed, "nonfinite_steps": nonfinite, "mechanism": mech}
        remedies[f"{arm} vs {BASE}"] = stats.remedy(FAILED, failed, mech, label)
    b = [r for r in rows if r["arm"] == BASE]
    summary = stats.summary(
        instability_reproduced=any(r["failed"] for r in b),
        failure_metric=FAILED + ", fp16 compute without a loss scale",
        remedies=remedies,
        seeds=len(seeds),
        sizes=[f"d{cfg.d_model}x{cfg.n_layers}"],
        note=(
            "a loss scale guards the gradients' range, not the forward pass's: where the "
            "activations overflow, fp16 with the scaler skips almost every step and fails too"
        ),
    )
    return summary, effects


def _final(rr: list[dict]) -> str:
    finite = [r["final_loss"] for r in rr if np.isfinite(r["final_loss"])]
    if not finite:
        return "non-finite"
    more = "" if len(finite) == len(rr) else f" ({len(finite)} finite)"
    return f"{np.mean(finite):.3f}{more}"


def tables(cfg: Config, rows: list[dict], effects: dict) -> str:
    t = []
    for a in cfg.arms:
        row = {"arm": a}
        for lr in cfg.lrs:
            rr = [r for r in rows if (r["arm"], r["lr"]) == (a, lr)]
            row[f"lr {lr:g}: final"] = _final(rr)
            row[f"lr {lr:g}: failed"] = f"{sum(r['failed'] for r in rr)}/{len(rr)}"
            row[f"lr {lr:g}: non-finite steps"] = (
                f"{np.mean([r['nonfinite_steps'] for r in rr]):.1f}"
            )
            row[f"lr {lr:g}: overflows"] = f"{np.mean([r['overflows'] for r in rr]):.1f}"
            row[f"lr {lr:g}: max residual RMS"] = (
                f"{np.mean([r['max_residual_rms'] for r in rr]):.3g}"
            )
        t.append(row)
    e = [
        {
            "arm vs " + BASE: k,
            "Δ failed runs [95% CI]": common.fmt_ci(v["failed_runs"], 1),
            "Δ non-finite steps [95% CI]": common.fmt_ci(v["nonfinite_steps"], 1),
            "Δ mechanism [95% CI]": common.fmt_ci(v["mechanism"], 1),
        }
        for k, v in effects.items()
    ]
    return (
        f"Seed means over {len(cfg.seeds)} seeds, {cfg.steps} steps, no clipping (final loss: "
        "mean of the finite runs; failed: final loss non-finite or above init; non-finite "
        "steps, overflows: per run; max residual RMS: largest over training, inf where it "
        "overflowed)\n\n"
        + common.markdown_table(t)
        + "\nPaired per-seed differences (summed over the LR grid), 95 % bootstrap "
        "intervals\n\n" + (common.markdown_table(e) if e else "(none)\n")
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="precision")
    cfg, out = ex.cfg, ex.out
    rows, curves = ex.sweep(
        len(cfg.arms) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps, lambda bar: run(cfg, bar)
    )
    summary, effects = summarize(cfg, rows)
    table = tables(cfg, rows, effects)
    res = {
        "rows": rows,
        "effects": effects,
        "losses_top_lr_every_5": {a: c[:, ::5] for a, c in curves.items()},
    }
    ex.write(res, table=table, title="Mixed precision at high learning rates", summary=summary)
    plots.curves(
        {f"lr {max(cfg.lrs):g}: training loss": curves},
        path=out / "precision.png",
        xlabel="step",
        ylabel="training loss (nats/byte)",
        logy=True,
    )
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
