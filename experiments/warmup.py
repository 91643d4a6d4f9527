"""LR sensitivity without warmup, with a short and with a long warmup.

Wortsman et al. find that a longer warmup lowers the learning-rate sensitivity, mostly by
letting the highest learning rates train. Same proxy as :mod:`experiments.lr_sensitivity`
(its ``base`` arm, weight decay off), with the linear warmup set to 0, 5% and 25% of the
run before the cosine decay.

    python -m experiments.warmup [--quick] [--warmups 0 0.05 0.25] [--seeds 0 1]

References:
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

from experiments import common


@dataclasses.dataclass(frozen=True)
class Config(common.SweepConfig):
    weight_decay: float = 0.0
    lrs: tuple[float, ...] = common.log_grid(1e-3, 1.0, 6)
    warmups: tuple[float, ...] = (0.0, 0.05, 0.25)

    @classmethod
    def quick(cls):
        return cls(
            **dataclasses.asdict(common.SweepConfig.quick()), lrs=(1e-2, 1.0), warmups=(0.0, 0.25)
        )


def main(argv=None) -> dict:
    cfg, args = common.parse_config(Config, argv, __doc__.splitlines()[0], name="warmup")
    common.init_distributed(args)
    out = pathlib.Path(args.out)
    trainers = {w: common.Trainer(cfg.setup(warmup_frac=w)) for w in cfg.warmups}
    cells = [
        {"warmup": w, "lr": lr, "seed": sd}
        for w in cfg.warmups
        for lr in cfg.lrs
        for sd in cfg.seeds
    ]

    def run_cell(c, advance):
        r = trainers[c["warmup"]].run(c["seed"], learning_rate=c["lr"], progress=advance)
        return {
            **c,
            "warmup_steps": int(round(c["warmup"] * cfg.steps)),
            "final_loss": common.finite_or_nan(r.eval_loss),
            "init_loss": r.init_loss,
            "max_grad_norm": float(np.nanmax(r.metrics["grad_norm"])),
        }

    rows = common.sweep(cells, run_cell, steps=cfg.steps, desc="warmup", disable=args.no_progress)
    sens, table = {}, []
    for w in cfg.warmups:
        per_seed = []
        for sd in cfg.seeds:
            rr = [r for r in rows if r["warmup"] == w and r["seed"] == sd]
            per_seed.append(
                common.lr_sensitivity([r["final_loss"] for r in rr], rr[0]["init_loss"])
            )
        mean, spread = common.mean_spread(per_seed)
        sens[w] = {"per_seed": per_seed, "mean": mean, "spread": spread}
        row = {"warmup": f"{w:g} ({int(round(w * cfg.steps))} steps)"}
        for lr in cfg.lrs:
            m, sp = common.mean_spread(
                [r["final_loss"] for r in rows if r["warmup"] == w and r["lr"] == lr]
            )
            row[f"lr {lr:g}"] = "diverged" if not np.isfinite(m) else f"{m:.3f} ± {sp:.3f}"
        row["LR sensitivity"] = f"{mean:.3f} ± {spread:.3f}"
        table.append(row)
    table = (
        "Final held-out loss (mean ± half-range over seeds) and LR sensitivity\n\n"
        + common.markdown_table(table)
    )
    res = {"rows": rows, "sensitivity": sens}
    common.write_results(
        out, config=cfg, results=res, table=table, title="Warmup and LR sensitivity"
    )
    common.plot_groups(
        [{**r, "warmup": f"warmup {r['warmup']:g}"} for r in rows],
        x="lr",
        y="final_loss",
        group="warmup",
        path=out / "loss_vs_lr.png",
        title="Final loss vs LR by warmup length (band: seeds min-max)",
        xlabel="peak learning rate",
        ylabel="final loss (nats/byte)",
    )
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
