"""Wortsman et al.'s small-scale proxy: LR sensitivity against model size, with remedies.

Trains the reference pre-LN decoder (AdamW 0.9/0.95, eps 1e-8, 5 % warmup then cosine)
with **no weight decay and no gradient clipping**, so the attention logits and the output
logits are free to grow (the two failures Wortsman et al. study), over a log-spaced
learning-rate grid from 0.3 to 10, at three widths (depth and heads scaled with them), in four
arms: ``base``, ``qk_norm`` (LayerNorm on queries and keys), ``z_loss`` (1e-4·log²Z) and
``both``. Reports per size and arm the final held-out loss per LR and the LR sensitivity
(mean over the grid of min(loss, loss at init) minus the best loss of the grid), and as
mechanisms the max attention logit and the mean log Z over the last 10 % of steps.

Remedy effects are paired per seed (arm − base), with 95 % bootstrap intervals.

    python -m experiments.lr_sensitivity [--quick] [--lrs 0.1 1 10] [--seeds 0 1 2 3 4]

References:
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import cli, common, plots, proxy, stats
from experiments.trainer import Trainer

ARMS = {
    "base": {},
    "qk_norm": {"qk_norm": True},
    "z_loss": {"z_loss": 1e-4},
    "both": {"qk_norm": True, "z_loss": 1e-4},
}
#: What each remedy acts on: (metric key, the arm's component that targets it).
MECHANISM = {"qk_norm": "log10_max_attn_logit", "z_loss": "late_log_z", "both": "late_log_z"}


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    steps: int = 200
    weight_decay: float = 0.0
    clip: float = 0.0
    lrs: tuple[float, ...] = (0.3, 1.0, 3.0, 10.0)
    arms: tuple[str, ...] = tuple(ARMS)
    widths: tuple[int, ...] = (32, 48, 64)
    depths: tuple[int, ...] = (1, 2, 3)
    heads: tuple[int, ...] = (2, 4, 4)

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(
            **q,
            lrs=(1e-2, 1.0),
            arms=("base", "both"),
            widths=(16, 32),
            depths=(1, 1),
            heads=(2, 2),
        )

    def sizes(self) -> list[dict]:
        if not len(self.widths) == len(self.depths) == len(self.heads):
            raise ValueError("widths, depths and heads must have one length")
        return [
            {"d_model": d, "n_layers": L, "n_heads": h}
            for d, L, h in zip(self.widths, self.depths, self.heads, strict=True)
        ]


def size_name(z: dict) -> str:
    return f"d{z['d_model']}x{z['n_layers']}"


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    rows, curves = [], {}
    specs = [{"seed": sd, "learning_rate": lr} for lr in cfg.lrs for sd in cfg.seeds]
    late = max(1, cfg.steps // 10)
    for z in cfg.sizes():
        for arm in cfg.arms:
            bar.set_postfix_str(f"{size_name(z)} {arm}")
            r = Trainer(cfg.setup(clip=cfg.clip, **z, **ARMS[arm])).run_many(
                specs, progress=bar.update
            )
            m = r.metrics
            for i in range(len(r.specs)):
                rows.append(
                    {
                        "size": size_name(z),
                        "arm": arm,
                        **r.outcome(i),
                        "max_attn_logit": float(np.nanmax(m["max_attn_logit"][i])),
                        "log10_max_attn_logit": float(np.log10(np.nanmax(m["max_attn_logit"][i]))),
                        "late_log_z": float(np.nanmean(m["log_z"][i, -late:])),
                    }
                )
            top = r.index(learning_rate=max(cfg.lrs))
            curves[(size_name(z), arm)] = {
                "max_attn_logit": m["max_attn_logit"][top],
                "log_z": m["log_z"][top],
            }
    return rows, curves


def sensitivity(rows, size, arm, seeds) -> list[float]:
    out = []
    for sd in seeds:
        rr = [r for r in rows if r["size"] == size and r["arm"] == arm and r["seed"] == sd]
        out.append(stats.lr_sensitivity([r["final_loss"] for r in rr], rr[0]["init_loss"]))
    return out


def mech(rows, size, arm, seeds, key) -> list[float]:
    """The mechanism per seed: its mean over the LR grid."""
    return [
        float(
            np.mean([r[key] for r in rows if (r["size"], r["arm"], r["seed"]) == (size, arm, sd)])
        )
        for sd in seeds
    ]


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    sizes = [size_name(z) for z in cfg.sizes()]
    effects = {}
    for size in sizes:
        base = sensitivity(rows, size, "base", cfg.seeds)
        effects[size] = {"base_sensitivity": stats.interval(base)}
        for arm in cfg.arms:
            if arm == "base":
                continue
            key = MECHANISM[arm]
            effects[size][arm] = {
                "sensitivity": stats.paired_effect(
                    sensitivity(rows, size, arm, cfg.seeds), base, "LR sensitivity"
                ),
                "mechanism": stats.moved(
                    mech(rows, size, arm, cfg.seeds, key), mech(rows, size, "base", cfg.seeds, key)
                )
                | {"metric": key},
                "arm_sensitivity": stats.interval(sensitivity(rows, size, arm, cfg.seeds)),
            }
    big = sizes[-1]
    remedies = {
        f"{arm} @ {big}": stats.remedy(
            "LR sensitivity", e["sensitivity"], e["mechanism"], e["mechanism"]["metric"]
        )
        for arm, e in effects[big].items()
        if arm != "base_sensitivity"
    }
    top = [r for r in rows if r["arm"] == "base" and r["lr"] == max(cfg.lrs)]
    summary = stats.summary(
        cfg,
        instability_reproduced=any(r["failed"] for r in top),
        failure_metric="final loss > init or non-finite, base arm at the top LR",
        remedies=remedies,
        sizes=sizes,
    )
    return summary, effects


def tables(cfg: Config, rows: list[dict], effects: dict) -> str:
    t, e = [], []
    for size, eff in effects.items():
        for arm in cfg.arms:
            row = {"size": size, "arm": arm}
            for lr in cfg.lrs:
                rr = [r for r in rows if (r["size"], r["arm"], r["lr"]) == (size, arm, lr)]
                v = np.mean([r["final_loss"] for r in rr])
                row[f"lr {lr:g}"] = f"{v:.3f}" + (
                    f" ({sum(r['failed'] for r in rr)} failed)"
                    if any(r["failed"] for r in rr)
                    else ""
                )
            row["max attn logit (grid mean, log10)"] = (
                f"{np.mean(mech(rows, size, arm, cfg.seeds, 'log10_max_attn_logit')):.2f}"
            )
            row["late log Z (grid mean)"] = (
                f"{np.mean(mech(rows, size, arm, cfg.seeds, 'late_log_z')):.2f}"
            )
            t.append(row)
        b = eff["base_sensitivity"]
        e.append(
            {
                "size": size,
                "arm": "base",
                "LR sensitivity": f"{b['mean']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]",
            }
        )
        for arm, v in eff.items():
            if arm == "base_sensitivity":
                continue
            s = v["arm_sensitivity"]
            e.append(
                {
                    "size": size,
                    "arm": arm,
                    "LR sensitivity": f"{s['mean']:.3f} [{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]",
                    "Δ vs base [95% CI]": common.fmt_ci(v["sensitivity"]),
                    f"Δ {v['mechanism']['metric']} [95% CI]": common.fmt_ci(v["mechanism"], 2),
                }
            )
    return (
        f"Seed-mean final held-out loss, {len(cfg.seeds)} seeds, {cfg.steps} steps\n\n"
        + common.markdown_table(t)
        + "\nLR sensitivity (mean [95 % bootstrap CI]) and paired differences vs base\n\n"
        + common.markdown_table(e, columns=list(e[1]) if len(e) > 1 else None)
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="lr_sensitivity")
    cfg, out = ex.cfg, ex.out
    rows, curves = ex.sweep(
        len(cfg.sizes()) * len(cfg.arms) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps,
        lambda bar: run(cfg, bar),
    )
    summary, effects = summarize(cfg, rows)
    table = tables(cfg, rows, effects)
    res = {
        "rows": rows,
        "effects": effects,
        "curves_top_lr_every_5": {
            f"{s}/{a}": {k: v[:, ::5] for k, v in c.items()} for (s, a), c in curves.items()
        },
    }
    ex.write(res, table=table, title="LR sensitivity against model size", summary=summary)
    sens_rows = [
        {"size_i": i, "arm": arm, "seed": sd, "sens": v}
        for i, size in enumerate(effects)
        for arm in cfg.arms
        for sd, v in zip(cfg.seeds, sensitivity(rows, size, arm, cfg.seeds), strict=True)
    ]
    plots.groups_vs_x(
        sens_rows,
        x="size_i",
        y="sens",
        group="arm",
        path=out / "sensitivity_vs_size.png",
        title="LR sensitivity vs size (x: "
        + ", ".join(f"{i}={s}" for i, s in enumerate(effects))
        + ")",
        xlabel="model size index",
        ylabel="LR sensitivity (nats/byte)",
        logx=False,
    )
    plots.groups_vs_x(
        rows,
        x="lr",
        y="final_loss",
        group="arm",
        panel="size",
        path=out / "loss_vs_lr.png",
        title="final held-out loss",
        xlabel="peak learning rate",
        ylabel="final loss (nats/byte)",
        logy=True,
    )
    big = list(effects)[-1]
    plots.curves(
        {
            f"{big}, lr {max(cfg.lrs):g}: max attention logit": {
                a: curves[(big, a)]["max_attn_logit"] for a in cfg.arms
            },
        },
        path=out / "logits.png",
        xlabel="step",
        ylabel="max attention logit",
        logy=True,
    )
    plots.curves(
        {f"{big}, lr {max(cfg.lrs):g}: log Z": {a: curves[(big, a)]["log_z"] for a in cfg.arms}},
        path=out / "log_z.png",
        xlabel="step",
        ylabel="mean log Z of the output",
        logy=True,
    )
    return res


if __name__ == "__main__":
    main()
