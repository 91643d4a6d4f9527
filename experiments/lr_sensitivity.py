"""Wortsman et al.'s small-scale proxy: final loss vs learning rate, with and without remedies.

Trains the reference pre-LN decoder (AdamW 0.9/0.95, eps 1e-8, clip 1.0, 5% warmup then
cosine, weight decay off) over a log-spaced learning-rate grid up to 1.0, in four arms:
``base``, ``qk_norm`` (LayerNorm on queries and keys), ``z_loss`` (1e-4·log²Z) and
``both``. Reports the final held-out loss per LR per arm, each arm's LR sensitivity
(mean over the grid of min(loss, loss at init) minus the best loss of the grid) with its
spread over seeds, the max attention logit and the mean log Z over training.

    python -m experiments.lr_sensitivity [--quick] [--lrs 1e-3 1e-2 1e-1 1] [--seeds 0 1 2]

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

ARMS = {
    "base": {},
    "qk_norm": {"qk_norm": True},
    "z_loss": {"z_loss": 1e-4},
    "both": {"qk_norm": True, "z_loss": 1e-4},
}


@dataclasses.dataclass(frozen=True)
class Config(common.SweepConfig):
    weight_decay: float = 0.0
    lrs: tuple[float, ...] = common.log_grid(1e-3, 1.0, 6)
    arms: tuple[str, ...] = tuple(ARMS)
    aux_every: int = 10
    unstable_frac: float = 0.1

    @classmethod
    def quick(cls):
        # base and both: "both" runs the qk-layernorm and the z-loss code; one compile
        # per arm is most of a quick run's time.
        base = common.SweepConfig.quick()
        return cls(**dataclasses.asdict(base), lrs=(1e-2, 1.0), arms=("base", "both"), aux_every=2)


def is_unstable(loss: float, best: float, init: float, frac: float) -> bool:
    """Non-finite, or more than ``frac`` of the way from the grid's best loss back to init."""
    return not np.isfinite(loss) or loss > best + frac * (init - best)


def run(cfg: Config, progress: bool = True) -> dict:
    rows, curves = [], {}
    trainers = {arm: common.Trainer(cfg.setup(**ARMS[arm])) for arm in cfg.arms}
    cells = [
        {"arm": a, "lr": lr, "seed": sd} for a in cfg.arms for lr in cfg.lrs for sd in cfg.seeds
    ]

    def run_cell(c, advance):
        r = trainers[c["arm"]].run(
            c["seed"], learning_rate=c["lr"], aux_every=cfg.aux_every, progress=advance
        )
        m = r.metrics
        curves[(c["arm"], c["lr"], c["seed"])] = common.curve_summary(r, every=2)
        return {
            **c,
            "final_loss": common.finite_or_nan(r.eval_loss),
            "init_loss": r.init_loss,
            "max_attn_logit": float(np.nanmax(m["max_attn_logit"])),
            "final_attn_logit": float(m["max_attn_logit"][-1]),
            "mean_log_z": float(np.mean(m["log_z"])),
            "final_log_z": float(m["log_z"][-1]),
        }

    rows = common.sweep(
        cells, run_cell, steps=cfg.steps, desc="lr_sensitivity", disable=not progress
    )
    sens = {}
    for arm in cfg.arms:
        per_seed = []
        for sd in cfg.seeds:
            rr = [r for r in rows if r["arm"] == arm and r["seed"] == sd]
            per_seed.append(
                common.lr_sensitivity([r["final_loss"] for r in rr], rr[0]["init_loss"])
            )
        mean, spread = common.mean_spread(per_seed)
        sens[arm] = {"per_seed": per_seed, "mean": mean, "spread": spread}
    return {"rows": rows, "sensitivity": sens, "curves": curves}


def stable_pair(cfg: Config, rows: list[dict], arm: str = "base") -> tuple[float, float | None]:
    """Above the best LR of ``arm``: the largest stable LR and the first unstable one.

    Unstable: :func:`is_unstable` on the seed-mean loss. ``None`` when no LR above the best
    one is unstable.
    """
    mean = {
        lr: np.mean([r["final_loss"] for r in rows if r["arm"] == arm and r["lr"] == lr])
        for lr in cfg.lrs
    }
    init = np.mean([r["init_loss"] for r in rows if r["arm"] == arm])
    best_lr = min((lr for lr in cfg.lrs if np.isfinite(mean[lr])), key=mean.get)
    stable = best_lr
    for lr in cfg.lrs:
        if lr <= best_lr:
            continue
        if is_unstable(mean[lr], mean[best_lr], init, cfg.unstable_frac):
            return stable, lr
        stable = lr
    return stable, None


def tables(cfg: Config, res: dict) -> str:
    rows = res["rows"]

    def cell(arm, lr, key):
        v = [r[key] for r in rows if r["arm"] == arm and r["lr"] == lr]
        m, sp = common.mean_spread(v)
        return "diverged" if not np.isfinite(m) else f"{m:.3f} ± {sp:.3f}"

    out = ["## Final held-out loss (mean ± half-range over seeds)\n"]
    t = []
    for arm in cfg.arms:
        s = res["sensitivity"][arm]
        t.append(
            {"arm": arm}
            | {f"lr {lr:g}": cell(arm, lr, "final_loss") for lr in cfg.lrs}
            | {"LR sensitivity": f"{s['mean']:.3f} ± {s['spread']:.3f}"}
        )
    out.append(common.markdown_table(t))
    for key, title in (
        ("max_attn_logit", "Max attention logit over training"),
        ("mean_log_z", "Mean log Z over training"),
    ):
        out.append(f"\n## {title} (mean ± half-range over seeds)\n")
        out.append(
            common.markdown_table(
                [{"arm": a} | {f"lr {lr:g}": cell(a, lr, key) for lr in cfg.lrs} for a in cfg.arms]
            )
        )
    return "\n".join(out)


def plot_curves(cfg: Config, res: dict, lrs: list[float], path: pathlib.Path) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(lrs), figsize=(5 * len(lrs), 6.5), squeeze=False)
    seed = cfg.seeds[0]
    for j, lr in enumerate(lrs):
        for arm in cfg.arms:
            c = res["curves"][(arm, lr, seed)]
            axes[0, j].plot(c["attn_step"], c["max_attn_logit"], label=arm)
            axes[1, j].plot(np.arange(len(c["log_z"])) * c["every"], c["log_z"], label=arm)
        axes[0, j].set_title(f"lr {lr:g}: max attention logit")
        axes[1, j].set_title(f"lr {lr:g}: mean log Z of the output")
        axes[1, j].set_xlabel("step")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    common.save_figure(fig, path)
    plt.close(fig)


def main(argv=None) -> dict:
    cfg, args = common.parse_config(Config, argv, __doc__.splitlines()[0], name="lr_sensitivity")
    common.init_distributed(args)
    out = pathlib.Path(args.out)
    res = run(cfg, progress=not args.no_progress)
    stable, unstable = stable_pair(cfg, res["rows"])
    res["base_largest_stable_lr"], res["base_first_unstable_lr"] = stable, unstable
    table = tables(cfg, res)
    curves = res.pop("curves")
    res["curves_seed0"] = {
        f"{a}@{lr:g}": v for (a, lr, sd), v in curves.items() if sd == cfg.seeds[0]
    }
    common.write_results(out, config=cfg, results=res, table=table, title="LR sensitivity")
    common.plot_groups(
        res["rows"],
        x="lr",
        y="final_loss",
        group="arm",
        path=out / "loss_vs_lr.png",
        title="Final held-out loss vs learning rate (band: seeds min-max)",
        xlabel="peak learning rate",
        ylabel="final loss (nats/byte)",
    )
    pair = [lr for lr in (stable, unstable) if lr is not None] or list(cfg.lrs[-2:])
    plot_curves(cfg, {"curves": curves}, pair, out / "logits.png")
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
