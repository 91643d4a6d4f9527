"""Mixed precision: fp32, bf16, fp16 without loss scaling, fp16 with dynamic loss scaling.

The reference model trained four ways: float32; bfloat16 compute (float32 master
weights, optimizer state and loss); float16 compute with no loss scale, where small
gradients flush to zero and large activations overflow; float16 with
:class:`stabljax.DynamicLossScale` (skip and halve on overflow, double after
``growth_interval`` clean steps). Reports the final loss, overflow and skip counts and
the loss-scale trajectory.

    python -m experiments.precision [--quick] [--growth-interval 100] [--seeds 0 1]

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
from experiments import common

ARMS = ("fp32", "bf16", "fp16-noscale", "fp16")


@dataclasses.dataclass(frozen=True)
class Config(common.SweepConfig):
    lr: float = 1e-2
    arms: tuple[str, ...] = ARMS
    initial_scale: float = 2.0**15
    growth_interval: int = 50

    @classmethod
    def quick(cls):
        return cls(**dataclasses.asdict(common.SweepConfig.quick()), growth_interval=2)


def precision(arm: str, cfg: Config):
    if arm == "fp16":
        return stabljax.Precision.fp16(
            initial_scale=cfg.initial_scale, growth_interval=cfg.growth_interval
        )
    return common.precision_of(arm)


def main(argv=None) -> dict:
    cfg, args = common.parse_config(Config, argv, __doc__.splitlines()[0], name="precision")
    common.init_distributed(args)
    out = pathlib.Path(args.out)
    s = cfg.setup(lr=cfg.lr)
    trainers = {a: common.Trainer(s, precision=precision(a, cfg)) for a in cfg.arms}
    cells = [{"arm": a, "seed": sd} for a in cfg.arms for sd in cfg.seeds]
    curves = {}

    def run_cell(c, advance):
        r = trainers[c["arm"]].run(c["seed"], learning_rate=cfg.lr, progress=advance)
        m = r.metrics
        curves[(c["arm"], c["seed"])] = {"loss": m["loss"], "loss_scale": m["loss_scale"]}
        finite = np.isfinite(m["loss"])
        return {
            **c,
            "final_loss": common.finite_or_nan(r.eval_loss),
            "final_train_loss": common.finite_or_nan(float(np.mean(m["loss"][-10:]))),
            "overflows": int(np.sum(m["overflow"])),
            "skipped": int(np.sum(m["skipped"])),
            "nonfinite_losses": int(np.sum(~finite)),
            "final_loss_scale": float(m["loss_scale"][-1]),
            "min_loss_scale": float(np.min(m["loss_scale"])),
        }

    rows = common.sweep(
        cells, run_cell, steps=cfg.steps, desc="precision", disable=args.no_progress
    )
    table, summary = [], {}
    for a in cfg.arms:
        rr = [r for r in rows if r["arm"] == a]
        fl = common.mean_spread([r["final_loss"] for r in rr])
        summary[a] = {"final_loss": fl}
        table.append(
            {
                "arm": a,
                "final loss": "diverged"
                if not np.isfinite(fl[0])
                else f"{fl[0]:.3f} ± {fl[1]:.3f}",
                "overflows": sum(r["overflows"] for r in rr),
                "skipped steps": sum(r["skipped"] for r in rr),
                "non-finite losses": sum(r["nonfinite_losses"] for r in rr),
                "final loss scale": ", ".join(f"{r['final_loss_scale']:g}" for r in rr),
            }
        )
    table = (
        f"lr {cfg.lr:g}, {cfg.steps} steps; loss mean ± half-range over seeds "
        f"{list(cfg.seeds)}, counts summed over seeds\n\n" + common.markdown_table(table)
    )
    res = {
        "rows": rows,
        "summary": summary,
        "curves": {f"{a}@{sd}": v for (a, sd), v in curves.items()},
    }
    common.write_results(out, config=cfg, results=res, table=table, title="Mixed precision")
    plt = common.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for i, a in enumerate(cfg.arms):
        c = curves[(a, cfg.seeds[0])]
        ax.plot(np.asarray(c["loss"], dtype=float), lw=0.9, color=f"C{i}", label=a)
        bx.plot(np.asarray(c["loss_scale"], dtype=float), color=f"C{i}", label=a)
    ax.set(
        xlabel="step",
        ylabel="training loss (nats/byte)",
        title=f"Training loss, seed {cfg.seeds[0]}",
    )
    bx.set(xlabel="step", ylabel="loss scale", yscale="log", title="Loss scale (1 when unused)")
    for x in (ax, bx):
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    common.save_figure(fig, out / "precision.png")
    plt.close(fig)
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
