"""Wortsman et al.'s small-scale proxy: LR sensitivity with and without qk-layernorm and z-loss.

The setup follows Wortsman et al. (2023, §2) as far as a 2-core CPU allows: a pre-LN decoder
with head dimension ≥ 32, AdamW (β = 0.9, 0.95, eps 1e-8), gradient clipping at global norm
1, a linear warmup over 5 % of the run then cosine decay (to 0 here, to 1e-5 there), and
**independent** weight decay 1e-4: θ ← θ − s_t·(η·u_t + λ·θ), where s_t ∈ [0, 1] is the
schedule and η the peak LR, so the decay does not scale with η (optax's ``adamw`` decays by
η·s_t·λ; :func:`experiments.proxy.independent_adamw`). The LR grid is a log grid over
1e-4..1 that holds the base arm's best LR strictly inside (``lr_grid``, per arm and size).

Four arms: ``base``, ``qk_norm`` (LayerNorm on queries and keys per head), ``z_loss``
(1e-4·log²Z) and ``both``. One LR sweep per seed gives one value of the primary metric,
declared here before the run (:data:`PRIMARY`): Wortsman et al.'s LR sensitivity
E_η[min(ℓ(η), ℓ₀)] − min_η ℓ(η) over the grid (ℓ₀: the loss at init; a diverged run counts
as ℓ₀). Each remedy is compared with ``base`` per size, paired per seed: 95 % paired
t-interval, exact sign-flip p, Holm over the family (remedies × sizes). Secondary, in their
own Holm family and not in the summary: the final loss per LR at 1–10× the base arm's best
LR. The mechanisms (max attention logit, log Z) are reported, not claimed: qk-layernorm
bounds the attention logits and z-loss penalises log Z by construction.

    python -m experiments.lr_sensitivity [--quick] [--lrs 1e-4 1e-2 1] [--seeds 0 1 2]

References:
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from experiments import claims, cli, common, plots, proxy, stats
from experiments.trainer import Trainer

#: The primary metric, declared before the run: one value per seed (lower is better).
PRIMARY = "lr_sensitivity"
PRIMARY_TEXT = (
    "LR sensitivity E_lr[min(loss, init)] - min_lr loss over the grid (nats/byte), "
    "remedy - base, per size"
)
ARMS = {
    "base": {},
    "qk_norm": {"qk_norm": True},
    "z_loss": {"z_loss": 1e-4},
    "both": {"qk_norm": True, "z_loss": 1e-4},
}
#: Head dimension at least this (Wortsman et al. keep it fixed at 64 while scaling width).
MIN_HEAD_DIM = 32
#: The figures against the LR: (row key, file, title, y label).
VS_LR = (
    ("final_loss", "loss_vs_lr", "final held-out loss after {steps} steps", "final held-out loss"),
    ("late_max_attn_logit", "attn_logit_vs_lr", "max attention logit, last 10 % of steps", "logit"),
    ("late_log_z", "log_z_vs_lr", "mean output log Z, last 10 % of steps", "log Z"),
)


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    steps: int = 2000
    seq_len: int = 32
    batch_size: int = 8
    warmup_frac: float = 0.05
    weight_decay: float = 1e-4
    clip: float = 1.0
    seeds: tuple[int, ...] = tuple(range(10))
    lrs: tuple[float, ...] = proxy.log_grid(1e-4, 1.0, 5)
    arms: tuple[str, ...] = tuple(ARMS)
    widths: tuple[int, ...] = (32,)
    depths: tuple[int, ...] = (1,)
    heads: tuple[int, ...] = (1,)
    #: Secondary comparisons: the grid's LRs from 1x to this many times the base's best LR.
    top_factor: float = 10.0

    @classmethod
    def quick(cls):
        return cls(
            steps=12,
            seq_len=16,
            batch_size=8,
            seeds=(0, 1),
            lrs=(1e-4, 1e-2, 1.0),
            arms=("base", "both"),
        )

    def sizes(self) -> list[dict]:
        if not len(self.widths) == len(self.depths) == len(self.heads):
            raise ValueError("widths, depths and heads must have one length")
        out = []
        for d, L, h in zip(self.widths, self.depths, self.heads, strict=True):
            if d % h or d // h < MIN_HEAD_DIM:
                raise ValueError(f"d_model {d} / {h} heads: head dim must be >= {MIN_HEAD_DIM}")
            out.append({"d_model": d, "n_layers": L, "n_heads": h})
        return out


def size_name(z: dict) -> str:
    return f"d{z['d_model']}x{z['n_layers']}h{z['n_heads']}"


def factory(s: proxy.Setup):
    """``factory(learning_rate)``: :func:`experiments.proxy.independent_adamw` on ``s``."""
    unit = proxy.unit_schedule(s)

    def make(learning_rate):
        return proxy.independent_adamw(
            learning_rate,
            unit,
            b1=s.b1,
            b2=s.b2,
            eps=s.eps,
            weight_decay=s.weight_decay,
            clip=s.clip,
        )

    return make


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    rows, curves = [], {}
    specs = [{"seed": sd, "learning_rate": lr} for lr in cfg.lrs for sd in cfg.seeds]
    late = max(1, cfg.steps // 10)
    every = max(1, cfg.steps // 50)
    for z in cfg.sizes():
        for arm in cfg.arms:
            bar.set_postfix_str(f"{size_name(z)} {arm}")
            s = cfg.setup(clip=cfg.clip, **z, **ARMS[arm])
            r = Trainer(s, factory(s)).run_many(specs, progress=bar.update)
            m = r.metrics
            for i in range(len(r.specs)):
                logit = m["max_attn_logit"][i]
                rows.append(
                    {
                        "size": size_name(z),
                        "params": params_of(z),
                        "arm": arm,
                        **r.outcome(i),
                        "max_attn_logit": float(np.nanmax(logit)),
                        "late_max_attn_logit": float(np.nanmax(logit[-late:])),
                        "late_log_z": float(np.nanmean(m["log_z"][i, -late:])),
                    }
                )
            curves[(size_name(z), arm)] = {
                "specs": r.specs,
                "loss": m["loss"][:, ::every],
                "max_attn_logit": m["max_attn_logit"][:, ::every],
                "log_z": m["log_z"][:, ::every],
                "every": every,
            }
    return rows, curves


def params_of(z: dict) -> int:
    """Parameter count of the reference model of size ``z``."""
    import jax

    _, p = proxy.initial_model(proxy.Setup(**z))
    return int(sum(x.size for x in jax.tree.leaves(p)))


def sensitivity(rows, size, arm, seeds) -> list[float]:
    """The primary metric: one LR sensitivity per seed (that seed's sweep over the grid)."""
    out = []
    for sd in seeds:
        rr = [r for r in rows if (r["size"], r["arm"], r["seed"]) == (size, arm, sd)]
        out.append(stats.lr_sensitivity([r["final_loss"] for r in rr], rr[0]["init_loss"]))
    return out


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    sizes = [size_name(z) for z in cfg.sizes()]
    remedies_arms = [a for a in cfg.arms if a != "base"]
    grids = {
        f"{size}/{arm}": stats.grid_of(rows, size=size, arm=arm)
        for size in sizes
        for arm in cfg.arms
    }
    comparisons, secondary, effects = {}, {}, {}
    for size in sizes:
        base = sensitivity(rows, size, "base", cfg.seeds)
        best = grids[f"{size}/base"]["best_lr"]
        effects[size] = {
            "sensitivity": {
                a: stats.interval(sensitivity(rows, size, a, cfg.seeds)) for a in cfg.arms
            },
            "base_best_lr": best,
            "lrs_1_to_10x_best": stats.lrs_from_best(cfg.lrs, best, cfg.top_factor),
        }
        for arm in remedies_arms:
            comparisons[f"{arm} vs base, {size}"] = {
                "remedy": sensitivity(rows, size, arm, cfg.seeds),
                "base": base,
            }
            for lr in stats.lrs_from_best(cfg.lrs, best, cfg.top_factor):
                secondary[f"{arm} @ lr {lr:g} ({lr / best:.3g}x best), {size}"] = {
                    "remedy": stats.final_per_seed(rows, cfg.seeds, size=size, arm=arm, lr=lr),
                    "base": stats.final_per_seed(rows, cfg.seeds, size=size, arm="base", lr=lr),
                }
    remedies = stats.family(PRIMARY_TEXT, comparisons)
    second = stats.family(
        "final held-out loss (nats/byte, diverged = init), remedy - base", secondary
    )
    # The failure: above its best LR the base arm's loss climbs (the top LR against the best).
    top = max(cfg.lrs)
    degrade = {}
    for size in sizes:
        best = grids[f"{size}/base"]["best_lr"]
        d = np.subtract(
            stats.final_per_seed(rows, cfg.seeds, size=size, arm="base", lr=top),
            stats.final_per_seed(rows, cfg.seeds, size=size, arm="base", lr=best),
        )
        degrade[size] = stats.interval(d) | {"top_lr": top, "best_lr": best}
    reproduced = all(v["ci95"][0] > 0 for v in degrade.values())
    met = [k for k, r in remedies.items() if r["claim_met"]]
    not_shown = ""
    if not met:
        not_shown = (
            f"tried {', '.join(remedies_arms)} against the LR sensitivity over a "
            f"{min(cfg.lrs):g}..{max(cfg.lrs):g} log grid at {', '.join(sizes)} "
            f"({cfg.steps} steps, {len(cfg.seeds)} seeds); no remedy lowered it with its "
            "t-interval below 0 and Holm p < 0.05 at this size"
        )
    summary = stats.summary(
        cfg,
        instability_reproduced=reproduced,
        failure_metric="base arm: final loss at the top LR minus at its best LR, per seed "
        "(t-interval above 0 at every size)",
        remedies=remedies,
        sizes=sizes,
        note="primary metric fixed in code before the run; one LR sensitivity per seed and "
        "arm; paired t-intervals, exact sign-flip p, Holm over remedies x sizes",
        primary_metric=PRIMARY_TEXT,
        lr_grid=grids,
        failure_made_by_model=True,
        not_shown=not_shown,
    )
    effects["degradation_top_vs_best"] = degrade
    effects["secondary_final_loss_1_to_10x_best"] = second
    return summary, effects


def fmt(v: dict, digits: int = 3) -> str:
    lo, hi = v["ci95"]
    m = v.get("effect_mean", v.get("mean"))
    return f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def tables(cfg: Config, rows: list[dict], summary: dict, effects: dict) -> str:
    sizes = summary["sizes"]
    t = []
    for size in sizes:
        for arm in cfg.arms:
            row = {"size": size, "arm": arm}
            for lr in cfg.lrs:
                rr = [r for r in rows if (r["size"], r["arm"], r["lr"]) == (size, arm, lr)]
                nf = sum(r["failed"] for r in rr)
                v = np.mean(stats.final_per_seed(rows, cfg.seeds, size=size, arm=arm, lr=lr))
                row[f"lr {lr:g}"] = f"{v:.3f}" + (f" ({nf} failed)" if nf else "")
            g = summary["lr_grid"][f"{size}/{arm}"]
            row["best LR"] = f"{g['best_lr']:g}" + ("" if g["best_strictly_inside"] else " (edge)")
            row["LR sensitivity [95% t-CI]"] = fmt(effects[size]["sensitivity"][arm])
            t.append(row)
    m = []
    for size in sizes:
        for arm in cfg.arms:
            for key, name in (
                ("late_max_attn_logit", "late max attn logit"),
                ("late_log_z", "late log Z"),
            ):
                row = {"size": size, "arm": arm, "quantity": name}
                for lr in cfg.lrs:
                    rr = [r for r in rows if (r["size"], r["arm"], r["lr"]) == (size, arm, lr)]
                    row[f"lr {lr:g}"] = f"{np.nanmean([r[key] for r in rr]):.3g}"
                m.append(row)
    fam = common.family_rows(summary["remedies"], "Δ LR sensitivity [95% t-CI]")
    sec = [
        {
            "comparison": k,
            "Δ final loss [95% t-CI]": fmt(v),
            "p (sign-flip)": f"{v['p_sign_flip']:.4f}",
            "p (Holm, secondary family)": f"{v['p_holm']:.4f}",
        }
        for k, v in effects["secondary_final_loss_1_to_10x_best"].items()
    ]
    deg = "; ".join(
        f"{s}: lr {v['top_lr']:g} − lr {v['best_lr']:g} = {fmt(v)}"
        for s, v in effects["degradation_top_vs_best"].items()
    )
    return (
        f"Seed-mean final held-out loss (diverged = init), {len(cfg.seeds)} seeds, "
        f"{cfg.steps} steps, and each arm's LR sensitivity (mean [95 % t-CI])\n\n"
        + common.markdown_table(t)
        + f"\nThe failure (base arm, top LR − best LR, paired t-CI): {deg}\n\n"
        + f"Primary family: {PRIMARY_TEXT}. Paired per seed, 95 % t-intervals, exact "
        "sign-flip p, Holm over the family\n\n"
        + common.markdown_table(fam)
        + "\nSecondary (own Holm family, not in the summary): final loss at 1–10x the base "
        "arm's best LR\n\n"
        + (common.markdown_table(sec) if sec else "(none)\n")
        + "\nMechanisms, seed means over the last 10 % of steps (reported, not claimed: "
        "qk-layernorm bounds the logits and z-loss penalises log Z by construction)\n\n"
        + common.markdown_table(m)
    )


def replot(out) -> None:
    """Redraws the LR figures from a stored results.json (no training run)."""
    cfg, payload = plots.stored(out, Config)
    lr_figures(cfg, payload["results"]["rows"], payload["summary"], pathlib.Path(out))


def figures(cfg: Config, rows: list[dict], summary: dict, curves: dict, out: pathlib.Path):
    lr_figures(cfg, rows, summary, out)
    curve_figure(cfg, summary, curves, out)


def lr_figures(cfg: Config, rows: list[dict], summary: dict, out: pathlib.Path) -> None:
    for y, name, title, ylabel in VS_LR:
        plots.metric_vs_lr(
            rows,
            y=y,
            group="arm",
            panel="size",
            fallback="init_loss" if y == "final_loss" else None,
            path=out / f"{name}.png",
            title=title.format(steps=cfg.steps),
            ylabel=ylabel,
            logy=y == "late_max_attn_logit",
        )
    plots.effects(
        summary["remedies"], path=out / "effects.png", title="LR sensitivity: remedy − base"
    )
    plots.seed_dots(
        {
            size: {arm: sensitivity(rows, size, arm, cfg.seeds) for arm in cfg.arms}
            for size in summary["sizes"]
        },
        path=out / "sensitivity.png",
        ylabel="LR sensitivity (nats/byte)",
    )


def curve_figure(cfg: Config, summary: dict, curves: dict, out: pathlib.Path) -> None:
    size = summary["sizes"][-1]
    lr = max(cfg.lrs)
    panels = {}
    for key, name in (("loss", "training loss"), ("max_attn_logit", "max attention logit")):
        panels[f"{size}, lr {lr:g}: {name}"] = {}
        for arm in cfg.arms:
            c = curves[(size, arm)]
            idx = [i for i, sp in enumerate(c["specs"]) if sp["learning_rate"] == lr]
            panels[f"{size}, lr {lr:g}: {name}"][arm] = np.asarray(c[key])[idx]
    every = curves[(size, cfg.arms[0])]["every"]
    n = next(iter(next(iter(panels.values())).values())).shape[1]
    plots.curves(
        panels,
        path=out / "curves_top_lr.png",
        xlabel="step",
        ylabel="value (log scale)",
        logy=True,
        x=np.arange(n) * every,
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="lr_sensitivity")
    cfg, out = ex.cfg, ex.out
    rows, curves = ex.sweep(
        len(cfg.sizes()) * len(cfg.arms) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps,
        lambda bar: run(cfg, bar),
    )
    summary, effects = summarize(cfg, rows)
    table = tables(cfg, rows, summary, effects)
    res = {
        "primary_metric": PRIMARY,
        "rows": rows,
        "effects": effects,
        "curves_every": {f"{s}/{a}": c["every"] for (s, a), c in curves.items()},
        "curves": {
            f"{s}/{a}": {k: np.asarray(c[k]) for k in ("loss", "max_attn_logit", "log_z")}
            for (s, a), c in curves.items()
        },
    }
    summary["best_per_arm"] = claims.best_block(
        "lr_sensitivity", {"summary": summary, "results": res}
    )
    ex.write(res, table=table, title="LR sensitivity with qk-layernorm and z-loss", summary=summary)
    figures(cfg, rows, summary, curves, out)
    return res


if __name__ == "__main__":
    main()
