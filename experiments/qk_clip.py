"""QK-Clip against attention-logit growth under Muon and AdamW at rising learning rates.

An LR sweep per optimizer and arm on the proxy: ``muon`` (:func:`optax.contrib.muon`,
Newton-Schulz on every hidden 2-D kernel, AdamW on the embeddings and norms, update RMS
matched to AdamW's with ``consistent_rms=0.2`` as in Moonlight and Kimi K2, so that one
LR serves both) and ``adamw`` (the proxy's AdamW), each with the arms ``none`` (no
attention-logit control), ``qk_clip`` (:func:`stabljax.qk_clip` last in the chain, inside
``skip_nonfinite``, with the per-head max logits the reference model reports) and
``qk_norm`` (qk-layernorm, Wortsman et al.'s remedy). Global-norm clipping at 1.0 on the
gradients (before the optimizer) in every arm.

τ = 100, Kimi K2's value, fixed in code before the run (an earlier run used τ = 20,
chosen after seeing this proxy's logits: a choice a reviewer cannot audit, so it was
dropped). At this size τ = 100 is reached only far above each optimizer's best LR. The
primary metric, fixed here before any run (``PRIMARY``): the final held-out loss, paired
per seed (remedy − none), per optimizer and per LR (not pooled); 95 % paired
t-intervals, exact sign-flip p-values, Holm's correction over the whole family
(optimizers × remedies × LRs). The mechanism is the max attention logit over the last
quarter of the run, which QK-Clip bounds by construction (it is reported, not claimed).

    python -m experiments.qk_clip [--quick] [--muon-lrs 0.01 0.1 1] [--seeds 0 1 2] [--tau 100]

References:
  Kimi Team, `Kimi K2: Open Agentic Intelligence <https://arxiv.org/abs/2507.20534>`_, 2025
  Wortsman et al., `Small-scale proxies for large-scale Transformer training instabilities
  <https://arxiv.org/abs/2309.14322>`_, 2023
  Jordan et al., `Muon: An optimizer for hidden layers in neural networks
  <https://kellerjordan.github.io/posts/muon/>`_, 2024
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
import optax

import stabljax
from experiments import claims, cli, common, plots, proxy, stats
from experiments.trainer import Trainer
from stabljax.telemetry import path_str, spike_score

#: The primary metric, declared before the run: lower is better.
PRIMARY = "final_loss"
PRIMARY_TEXT = "final held-out loss (nats/byte), remedy − none, per optimizer and LR"
OPTIMIZERS = ("muon", "adamw")
ARMS = ("none", "qk_clip", "qk_norm")
COLORS = {"none": "tab:red", "qk_clip": "tab:blue", "qk_norm": "tab:green"}


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    steps: int = 150
    seeds: tuple[int, ...] = tuple(range(10))
    muon_lrs: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0)
    adamw_lrs: tuple[float, ...] = (0.003, 0.01, 0.03, 0.1, 0.3)
    optimizers: tuple[str, ...] = OPTIMIZERS
    arms: tuple[str, ...] = ARMS
    tau: float = 100.0  # Kimi K2's τ, fixed before the run
    clip: float = 1.0
    #: Extra LRs run for the ``none`` arm only, so each optimizer's grid record spans
    #: issue 29's 1e-4..1 (the family compares remedies on ``<opt>_lrs`` alone).
    scan_lrs: tuple[float, ...] = (1e-4, 1e-3, 1.0)
    #: A stored results.json whose ``none`` and ``qk_norm`` rows (which τ does not touch)
    #: are reused instead of re-run, e.g. to re-run the ``qk_clip`` arm at a new τ alone;
    #: its config must equal this one but for ``tau``. Empty: run every arm.
    reuse: str = ""

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(
            **{**q, "steps": 8, "seeds": (0, 1)},
            muon_lrs=(0.03, 0.3),
            adamw_lrs=(0.01, 0.1),
            tau=2.0,
            scan_lrs=(1e-3,),
        )

    def lrs(self, opt: str, arm: str = "") -> tuple[float, ...]:
        """The LR grid of optimizer ``opt`` (for the ``none`` arm, with ``scan_lrs``)."""
        grid = {"muon": self.muon_lrs, "adamw": self.adamw_lrs}[opt]
        if arm == "none":
            grid = tuple(sorted(set(grid) | set(self.scan_lrs)))
        return grid


def hidden_kernels(params):
    """Muon's leaves: the 2-D kernels of the blocks (not the embeddings, not the norms)."""
    dims = optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)

    def label(path, x):
        name = path_str(path)
        return dims if x.ndim == 2 and name.startswith("blocks/") else None

    return jax.tree_util.tree_map_with_path(label, params)


def factory(opt: str, arm: str, s: proxy.Setup, cfg: Config):
    unit = proxy.unit_schedule(s)
    layers = proxy.build_model(s)[0].qk_layers() if arm == "qk_clip" else None

    def make(learning_rate):
        lr = lambda c: learning_rate * unit(c)  # noqa: E731
        if opt == "muon":
            base = optax.contrib.muon(
                lr,
                weight_decay=s.weight_decay,
                adam_b1=s.b1,
                adam_b2=s.b2,
                adam_weight_decay=s.weight_decay,
                consistent_rms=0.2,
                muon_weight_dimension_numbers=hidden_kernels,
            )
        elif opt == "adamw":
            base = optax.adamw(lr, b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay)
        else:
            raise ValueError(f"unknown optimizer {opt!r}; one of {OPTIMIZERS}")
        parts = [optax.clip_by_global_norm(cfg.clip)] if cfg.clip > 0 else []
        parts.append(base)
        if layers is not None:
            parts.append(stabljax.qk_clip(layers, tau=cfg.tau))
        # The guard outside everything: a skipped step clips nothing (qk_clip's docstring).
        return stabljax.skip_nonfinite(optax.chain(*parts))

    return make


def probes(arm: str) -> dict:
    if arm == "qk_clip":
        return {"clipped_heads": lambda st: optax.tree.get(st.opt_state, "qk_clipped_heads")}
    return {}


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    rows, curves = [], {}
    tail = max(1, cfg.steps // 4)
    stored = reused(cfg)
    for opt in cfg.optimizers:
        for arm in cfg.arms:
            if stored is not None and arm != "qk_clip":
                rows += [r for r in stored["rows"] if (r["optimizer"], r["arm"]) == (opt, arm)]
                curves[(opt, arm)] = stored["curves"][(opt, arm)]
                continue
            specs = [
                {"seed": sd, "learning_rate": lr} for lr in cfg.lrs(opt, arm) for sd in cfg.seeds
            ]
            bar.set_postfix_str(f"{opt} {arm}")
            s = cfg.setup(qk_norm=arm == "qk_norm")
            r = Trainer(s, factory(opt, arm, s, cfg), probes=probes(arm)).run_many(
                specs, progress=bar.update
            )
            m = r.metrics
            for i in range(len(r.specs)):
                logit = m["max_attn_logit"][i]
                rows.append(
                    {
                        "optimizer": opt,
                        "arm": arm,
                        **r.outcome(i),
                        "max_attn_logit": float(np.nanmax(logit)),
                        "late_max_attn_logit": float(np.nanmax(logit[-tail:])),
                        "clipped_head_steps": float(np.sum(m["clipped_heads"][i]))
                        if "clipped_heads" in m
                        else 0.0,
                        "spike_score_loss": spike_score(m["loss"][i], window=100, min_history=20),
                        "skipped_steps": int(np.sum(m["skipped"][i])),
                    }
                )
            curves[(opt, arm)] = {"logit": m["max_attn_logit"], "loss": m["loss"], "specs": r.specs}
    return rows, curves


def reused(cfg: Config) -> dict | None:
    """The rows and max-logit curves of ``cfg.reuse`` (None without it); each stored curve
    value is repeated back to one per step, so storing them again gives the same numbers."""
    if not cfg.reuse:
        return None
    old, payload = plots.stored(pathlib.Path(cfg.reuse).parent, Config)
    diff = {
        f.name
        for f in dataclasses.fields(Config)
        if f.name not in ("tau", "reuse") and getattr(old, f.name) != getattr(cfg, f.name)
    }
    if diff:
        raise ValueError(f"qk_clip: `reuse` was run with other settings: {sorted(diff)}")
    res, every = payload["results"], payload["results"]["max_logit_every"]
    curves = {}
    for key, by_lr in res["max_logit_curves"].items():
        opt, arm = key.split()
        lrs = cfg.lrs(opt)  # the curves were stored at the family's LRs only
        specs = [{"seed": sd, "learning_rate": lr} for lr in lrs for sd in cfg.seeds]
        logit = np.concatenate([np.asarray(by_lr[f"lr {lr:g}"]) for lr in lrs])
        curves[(opt, arm)] = {
            "logit": np.repeat(logit, every, axis=1)[:, : cfg.steps],
            "specs": specs,
        }
    return {"rows": res["rows"], "curves": curves}


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    """Paired effects per (optimizer, remedy, LR), Holm over the family; the summary.

    The max attention logit is reported per comparison but is no mechanism claim: QK-Clip
    and qk-layernorm bound it by construction."""
    comparisons, effects = {}, {}
    for opt in cfg.optimizers:
        for arm in (a for a in cfg.arms if a != "none"):
            for lr in cfg.lrs(opt):

                def seeds_of(key, a, lr=lr, opt=opt):
                    return stats.per_seed(rows, key, cfg.seeds, arm=a, optimizer=opt, lr=lr)

                name = f"{opt} {arm} @ lr {lr:g}"
                comparisons[name] = {
                    "remedy": stats.finite_or(seeds_of(PRIMARY, arm), seeds_of("init_loss", arm)),
                    "base": stats.finite_or(
                        seeds_of(PRIMARY, "none"), seeds_of("init_loss", "none")
                    ),
                }
                effects[name] = {
                    "late_max_attn_logit": stats.paired_effect(
                        seeds_of("late_max_attn_logit", arm),
                        seeds_of("late_max_attn_logit", "none"),
                        "late_max_attn_logit",
                    )
                }
    remedies = stats.family(PRIMARY_TEXT, comparisons, test="paired_t")  # sign-flip floor: 0.039
    for k, r in remedies.items():
        effects[k][PRIMARY] = r
    grid = {opt: stats.grid_of(rows, optimizer=opt, arm="none") for opt in cfg.optimizers}
    top = [r for r in rows if r["arm"] == "none" and r["lr"] == max(cfg.lrs(r["optimizer"]))]
    reproduced = float(np.mean([r["late_max_attn_logit"] for r in top])) > cfg.tau
    summary = stats.summary(
        cfg,
        instability_reproduced=reproduced,
        failure_metric=f"no-control max attention logit (last quarter) above tau={cfg.tau:g} "
        "at the top LR, seed mean",
        remedies=remedies,
        note="primary metric fixed in code before the run; paired t-intervals, exact "
        "sign-flip p, Holm over every (optimizer, remedy, LR) row; the logit bound is by "
        "construction, so no mechanism is claimed",
        primary_metric=PRIMARY_TEXT,
        lr_grid=grid,
        failure_made_by_model=True,
    )
    summary["tau"] = cfg.tau
    return summary, effects


def multiple(summary: dict, comparison: str) -> float:
    """A comparison's LR over its optimizer's no-control best LR ("muon qk_clip @ lr 0.3")."""
    opt, *_, lr = comparison.split()
    return float(lr) / summary["lr_grid"][opt]["best_lr"]


def tables(cfg: Config, rows: list[dict], summary: dict, effects: dict) -> str:
    per_opt = []
    for opt in cfg.optimizers:
        t = []
        for a in cfg.arms:
            row = {"optimizer": opt, "arm": a}
            for lr in cfg.lrs(opt):
                rr = [r for r in rows if (r["optimizer"], r["arm"], r["lr"]) == (opt, a, lr)]
                row[f"lr {lr:g}: loss"] = f"{np.nanmean([r['final_loss'] for r in rr]):.3f}"
                row[f"lr {lr:g}: max logit"] = (
                    f"{np.nanmean([r['late_max_attn_logit'] for r in rr]):.3g}"
                )
            t.append(row)
        per_opt.append(common.markdown_table(t))
    e = [
        {
            "comparison": k,
            "Δ final loss [95% t-CI]": f"{v['effect_mean']:+.3f} [{v['ci95'][0]:+.3f}, "
            f"{v['ci95'][1]:+.3f}]",
            "p (sign-flip)": f"{v['p_sign_flip']:.4f}",
            "p (Holm)": f"{v['p_holm']:.4f}",
            "Δ late max logit": f"{effects[k]['late_max_attn_logit']['effect_mean']:+.1f}",
            "x best": f"{multiple(summary, k):.3g}",
            "claim met": (
                ("stress test (not counted)" if multiple(summary, k) > 10 else "yes")
                if v["claim_met"]
                else "no"
            ),
        }
        for k, v in summary["remedies"].items()
    ]
    grid = "; ".join(
        f"{o}: best LR (no control, over {min(g['lrs']):g}..{max(g['lrs']):g}) "
        f"{g['best_lr']:g}, strictly inside the grid: "
        f"{'yes' if g['best_strictly_inside'] else 'no'}"
        for o, g in summary["lr_grid"].items()
    )
    return (
        f"Seed means over {len(cfg.seeds)} seeds, {cfg.steps} steps, tau = {cfg.tau:g}. "
        f"Max logit: the max attention logit over the last quarter of the run. {grid}.\n\n"
        + "\n".join(per_opt)
        + f"\nPrimary metric: {PRIMARY_TEXT}. Paired per-seed differences, 95 % t-intervals, "
        "paired t p-values (sign-flip p beside), Holm over all rows\n\n" + common.markdown_table(e)
    )


def figures(cfg: Config, rows: list[dict], curves: dict, summary: dict, out: pathlib.Path):
    """Kimi K2's Fig. 2 (max logit against step, every arm at the top two LRs) and the loss
    figures; ``curves[(opt, arm)]["lr <lr>"]`` is ``[seeds, steps / every]``."""
    plt = plots.pyplot()
    n_top, every = min(2, min(len(cfg.lrs(o)) for o in cfg.optimizers)), curves["every"]
    fig, axes = plt.subplots(
        len(cfg.optimizers),
        n_top,
        figsize=(5.6 * n_top, 3.4 * len(cfg.optimizers)),
        squeeze=False,
        layout="constrained",
    )
    for i, opt in enumerate(cfg.optimizers):
        for j, lr in enumerate(sorted(cfg.lrs(opt))[-n_top:]):
            ax = axes[i][j]
            for arm in cfg.arms:
                ys = np.asarray(curves[f"{opt} {arm}"][f"lr {lr:g}"], dtype=float)
                x = np.arange(ys.shape[1]) * every
                plots.seed_lines(ax, x, ys, color=COLORS[arm], name=arm)
            ax.axhline(cfg.tau, color="k", ls="--", lw=0.8, label=f"τ = {cfg.tau:g}")
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("max attention logit")
            plots.label(ax, f"{opt}, lr {lr:g}")
            if j == n_top - 1:
                plots.legend_outside(ax)
    plots.save_figure(fig, out / "max_logit.png")
    loss_figure(cfg, rows, summary, out)


def loss_figure(cfg: Config, rows: list[dict], summary: dict, out: pathlib.Path) -> None:
    """Final loss against LR per arm (95 % t-bands), and the paired differences the claims
    rest on (remedy − none per LR, 95 % paired t-intervals, stress region shaded)."""
    plots.metric_vs_lr(
        rows,
        y=PRIMARY,
        group="arm",
        panel="optimizer",
        fallback="init_loss",
        path=out / "loss_vs_lr.png",
        title=f"qk_clip, d{cfg.d_model}x{cfg.n_layers}, {cfg.steps} steps, tau {cfg.tau:g}",
        ylabel="final held-out loss (nats/byte)",
    )
    panels = {o: {a: [] for a in cfg.arms if a != "none"} for o in cfg.optimizers}
    for k, r in summary["remedies"].items():
        opt, arm, _, _, lr = k.split()
        panels[opt][arm].append({**r, "lr": float(lr)})
    plots.paired_vs_lr(
        panels,
        best_lr={o: g["best_lr"] for o, g in summary["lr_grid"].items()},
        path=out / "paired_vs_lr.png",
        title=f"remedy − none, {len(cfg.seeds)} seeds",
        ylabel="Δ final held-out loss",
    )


def replot(out: pathlib.Path) -> None:
    """Redraws the figures from a stored results.json (no training run)."""
    cfg, payload = plots.stored(out, Config)
    res = payload["results"]
    curves = {**res["max_logit_curves"], "every": res["max_logit_every"]}
    figures(cfg, res["rows"], curves, payload["summary"], pathlib.Path(out))


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="qk_clip")
    cfg, out = ex.cfg, ex.out
    n = sum(len(cfg.lrs(o, a)) for o in cfg.optimizers for a in cfg.arms)
    n *= len(cfg.seeds) * cfg.steps
    rows, curves = ex.sweep(n, lambda bar: run(cfg, bar))
    summary, effects = summarize(cfg, rows)
    table = tables(cfg, rows, summary, effects)
    every = max(1, cfg.steps // 50)
    res = {
        "primary_metric": PRIMARY,
        "rows": rows,
        "effects": effects,
        "max_logit_every": every,
        "max_logit_curves": {
            f"{o} {a}": {
                f"lr {lr:g}": np.asarray(c["logit"])[
                    [k for k, sp in enumerate(c["specs"]) if sp["learning_rate"] == lr]
                ][:, ::every]
                for lr in cfg.lrs(o)
            }
            for (o, a), c in curves.items()
        },
    }
    summary["best_per_arm"] = claims.best_block("qk_clip", {"summary": summary, "results": res})
    ex.write(res, table=table, title="QK-Clip against attention-logit growth", summary=summary)
    figures(cfg, rows, {**res["max_logit_curves"], "every": every}, summary, out)
    return res


if __name__ == "__main__":
    main()
