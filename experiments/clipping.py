"""Clipping and skipping at a learning rate where fixed global-norm clipping spikes.

At one high learning rate, five arms on the reference model: no clipping, the fixed
``clip_by_global_norm(1.0)``, ZClip (``stabljax.clip_by_zscore``), AutoClip
(``stabljax.clip_by_percentile``) and ``stabljax.skip_spikes`` around the fixed clip.
Spikes are counted on the training-loss curve by :class:`stabljax.SpikeDetector`; the
table gives the final held-out loss, spikes, steps lost (steps spent above the pre-spike
loss) and skipped updates, as mean and spread over several seeds.

    python -m experiments.clipping [--quick] [--lr 1.0] [--seeds 0 1 2]

References:
  Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
  <https://arxiv.org/abs/2504.02507>`_, 2025
  Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source Separation Networks
  <https://arxiv.org/abs/2007.14469>`_, 2020
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np
import optax

import stabljax
from experiments import common

ARMS = ("none", "clip_1.0", "zscore", "percentile", "skip_spikes")


@dataclasses.dataclass(frozen=True)
class Config(common.SweepConfig):
    lr: float = 1.0
    steps: int = 400
    seeds: tuple[int, ...] = (0, 1, 2)
    arms: tuple[str, ...] = ARMS
    spike_warmup: int = 20

    @classmethod
    def quick(cls):
        base = dataclasses.asdict(common.SweepConfig.quick())
        return cls(**{**base, "steps": 12}, spike_warmup=4)


def factory(arm: str, s: common.Setup, cfg: Config):
    adam = common.adamw_factory(s, clip=0.0)
    clipped = common.adamw_factory(s, clip=1.0)

    def make(learning_rate):
        if arm == "none":
            return adam(learning_rate)
        if arm == "clip_1.0":
            return clipped(learning_rate)
        if arm == "zscore":
            return optax.chain(stabljax.clip_by_zscore(), adam(learning_rate))
        if arm == "percentile":
            return optax.chain(stabljax.clip_by_percentile(), adam(learning_rate))
        if arm == "skip_spikes":
            return stabljax.skip_spikes(clipped(learning_rate), warmup_steps=cfg.spike_warmup)
        raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")

    return make


def main(argv=None) -> dict:
    cfg, args = common.parse_config(Config, argv, __doc__.splitlines()[0], name="clipping")
    common.init_distributed(args)
    out = pathlib.Path(args.out)
    s = cfg.setup(lr=cfg.lr)
    trainers = {a: common.Trainer(s, factory(a, s, cfg)) for a in cfg.arms}
    cells = [{"arm": a, "seed": sd} for a in cfg.arms for sd in cfg.seeds]
    curves = {}

    def run_cell(c, advance):
        r = trainers[c["arm"]].run(c["seed"], learning_rate=cfg.lr, progress=advance)
        losses = r.metrics["loss"]
        spikes = common.spike_steps(losses)
        curves[(c["arm"], c["seed"])] = losses
        return {
            **c,
            "final_loss": common.finite_or_nan(r.eval_loss),
            "spikes": len(spikes),
            "spike_steps": spikes,
            "steps_lost": common.steps_lost(losses, spikes),
            "skipped_updates": int(np.sum(r.metrics["skipped"])),
            "max_grad_norm": float(np.nanmax(r.metrics["grad_norm"])),
        }

    rows = common.sweep(cells, run_cell, steps=cfg.steps, desc="clipping", disable=args.no_progress)
    table, summary = [], {}
    for a in cfg.arms:
        rr = [r for r in rows if r["arm"] == a]
        row, summary[a] = {"arm": a}, {}
        for key in ("final_loss", "spikes", "steps_lost", "skipped_updates"):
            m, sp = common.mean_spread([r[key] for r in rr])
            summary[a][key] = {"mean": m, "spread": sp}
            row[key.replace("_", " ")] = (
                "diverged"
                if not np.isfinite(m)
                else f"{m:.3f} ± {sp:.3f}"
                if key == "final_loss"
                else f"{m:.1f} ± {sp:.1f}"
            )
        table.append(row)
    table = (
        f"lr {cfg.lr:g}, {cfg.steps} steps, seeds {list(cfg.seeds)}: "
        "mean ± half-range over seeds\n\n" + common.markdown_table(table)
    )
    res = {
        "rows": rows,
        "summary": summary,
        "losses": {f"{a}@{sd}": v for (a, sd), v in curves.items()},
    }
    common.write_results(out, config=cfg, results=res, table=table, title="Clipping and skipping")
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, a in enumerate(cfg.arms):
        y = np.asarray(curves[(a, cfg.seeds[0])], dtype=float)
        ax.plot(y, lw=0.9, color=f"C{i}", label=a)
        for st in next(
            r["spike_steps"] for r in rows if r["arm"] == a and r["seed"] == cfg.seeds[0]
        ):
            ax.axvline(st, color=f"C{i}", ls=":", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_ylim(0, 8)
    ax.set_title(f"Training loss at lr {cfg.lr:g}, seed {cfg.seeds[0]} (dotted: detected spikes)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    common.save_figure(fig, out / "loss.png")
    plt.close(fig)
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
