"""Adam's eps against the model's own gradients, and Molybog et al.'s mechanism measured.

Three arms over a log LR grid from 1e-4 to 1: ``optax.adamw`` with eps 1e-8 (the base),
``stabljax.safe_adamw`` with eps 0 and ``stabljax.adamw_atan2`` (no eps). No gradient
clipping (clipping a global norm is not scale invariant). Two gradient conditions:

- ``x1``: the model's own gradients (the regime the claims are about);
- ``x1e-08`` (**stress test, set by hand**): every gradient multiplied by 1e-8 before the
  optimizer, so that √v̂ falls to eps. It runs only at the LRs compared (1-10x the base
  arm's best LR at ``x1``). A failure there is made by the multiplier, not the model.

Molybog et al.'s mechanism, measured every step from the optimizer's moments (the same
formula for every arm, from its own bias-corrected m̂ and v̂): the normalized update
``u`` (``m̂/(√v̂ + eps)``, ``m̂/√v̂`` or ``1.27·atan2(m̂, √v̂)``), the fraction of
coordinates whose update is sign-like (``| |u| − 1 | < 0.1``), the bimodality coefficient
of ``u`` over all coordinates ((skew² + 1)/kurtosis: 1/3 for a Gaussian, 1 for ±1 signs,
above 5/9 read as bimodal), and the fraction of coordinates whose √v̂ lies in (0, eps),
where eps sets the step (``eps_bound_frac``).

Primary metric (``PRIMARY``, fixed before the run): the final held-out loss, a failed run
counted as its init loss; paired per seed (remedy − adamw eps 1e-8) at every grid LR from
1x to 10x the base arm's best ``x1`` LR, for each condition; paired t-intervals, exact
sign-flip p, Holm over that family.

    python -m experiments.adam_eps [--quick] [--lrs 0.001 0.01 0.1] [--seeds 0 1 2]

References:
  Molybog et al., `A Theory on Adam Instability in Large-Scale Machine Learning
  <https://arxiv.org/abs/2304.09871>`_, 2023
  Everett et al., `Scaling Exponents Across Parameterizations and Optimizers
  <https://arxiv.org/abs/2407.05872>`_, 2024
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
import optax

import stabljax
from experiments import claims, cli, common, plots, proxy, stats
from experiments.measure import EPS, adam_moments, mechanism
from experiments.trainer import Trainer
from stabljax.telemetry import path_str

#: The primary metric, declared before the run: lower is better.
PRIMARY = "primary_loss"
PRIMARY_TEXT = (
    "final held-out loss (nats/byte; a failed run counts as its init loss), "
    "remedy − adamw eps 1e-8, per LR and gradient condition"
)
ARMS = ("adamw_eps1e-8", "safe_adamw_eps0", "adamw_atan2")
BASE = "adamw_eps1e-8"
MECHANISM = ("sign_frac", "bimodality", "eps_bound_frac", "sign_frac_shallow")


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    seeds: tuple[int, ...] = tuple(range(10))
    lrs: tuple[float, ...] = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 1.0)
    stress_scale: float = 1e-8
    arms: tuple[str, ...] = ARMS

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(**q, lrs=(1e-3, 1e-2, 1e-1), arms=("adamw_eps1e-8", "safe_adamw_eps0"))


def is_shallow(path) -> bool:
    """The embedding and the first block (``blocks/0``), by parameter path."""
    p = path_str(path)
    return "embed" in p or "blocks/0/" in p or "blocks.0." in p or "layers/0/" in p


def scale_grads(grad_scale) -> optax.GradientTransformation:
    """Multiplies every gradient by ``grad_scale`` (traced)."""

    def update(updates, state, params=None):
        del params
        return jax.tree.map(lambda g: g * grad_scale, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def factory(arm: str, s: proxy.Setup):
    """``factory(learning_rate, grad_scale)``: scaled gradients, then ``arm``."""
    unit = proxy.unit_schedule(s)

    def make(learning_rate, grad_scale):
        lr = lambda c: learning_rate * unit(c)  # noqa: E731
        kw = {"b1": s.b1, "b2": s.b2, "weight_decay": s.weight_decay}
        if arm == "adamw_eps1e-8":
            opt = optax.adamw(lr, eps=EPS[arm], **kw)
        elif arm == "safe_adamw_eps0":
            opt = stabljax.safe_adamw(lr, eps=0.0, **kw)
        elif arm == "adamw_atan2":
            opt = stabljax.adamw_atan2(lr, **kw)
        else:
            raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")
        return optax.chain(scale_grads(grad_scale), opt)

    return make


# --------------------------------------------------------------------------- the mechanism


def probes(arm: str, s: proxy.Setup) -> dict:
    """:func:`mechanism` of the state after every step, one probe per quantity."""
    params = proxy.initial_model(s)[1]
    shallow = jax.tree_util.tree_map_with_path(lambda p, _: is_shallow(p), params)

    def of(name):
        def probe(state):
            st = adam_moments(state.opt_state)
            return mechanism(st.mu, st.nu, st.count, arm, s.b1, s.b2, shallow)[name]

        return probe

    return {k: of(k) for k in MECHANISM}


# --------------------------------------------------------------------------- the sweep


def conditions(cfg: Config) -> dict[str, float]:
    return {"x1": 1.0, f"x{cfg.stress_scale:g}": cfg.stress_scale}


def _rows(cfg, arm, r, n_params, cond) -> list[dict]:
    m, tail = r.metrics, max(1, cfg.steps // 4)
    out = []
    for i in range(len(r.specs)):
        o = r.outcome(i)
        out.append(
            {
                "arm": arm,
                "condition": cond,
                **o,
                PRIMARY: o["init_loss"] if o["failed"] else o["final_loss"],
                "grad_rms_late": float(np.mean(m["grad_norm"][i][-tail:]) / np.sqrt(n_params)),
                **{f"{k}_late": float(np.mean(m[k][i][-tail:])) for k in MECHANISM},
                **{f"{k}_max": float(np.max(m[k][i])) for k in ("sign_frac", "bimodality")},
            }
        )
    return out


def best_lr(cfg: Config, rows: list[dict], arm: str = BASE, cond: str = "x1") -> float:
    def score(lr):
        return float(
            np.mean(stats.per_seed(rows, PRIMARY, cfg.seeds, arm=arm, condition=cond, lr=lr))
        )

    return min(cfg.lrs, key=score)


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    rows, curves = [], {}
    s = cfg.setup(clip=0.0)
    n_params = sum(np.size(x) for x in jax.tree.leaves(proxy.initial_model(s)[1]))
    trainers = {a: Trainer(s, factory(a, s), probes=probes(a, s)) for a in cfg.arms}
    natural = [
        {"seed": sd, "learning_rate": lr, "grad_scale": 1.0} for lr in cfg.lrs for sd in cfg.seeds
    ]
    for arm in cfg.arms:
        bar.set_postfix_str(f"{arm} x1")
        r = trainers[arm].run_many(natural, progress=bar.update)
        rows += _rows(cfg, arm, r, n_params, "x1")
        curves[(arm, "x1")] = (r.specs, {k: r.metrics[k] for k in ("loss", *MECHANISM)})
    lrs = stats.lrs_from_best(cfg.lrs, best_lr(cfg, rows))
    stress = f"x{cfg.stress_scale:g}"
    specs = [
        {"seed": sd, "learning_rate": lr, "grad_scale": cfg.stress_scale}
        for lr in lrs
        for sd in cfg.seeds
    ]
    for arm in cfg.arms:
        bar.set_postfix_str(f"{arm} {stress}")
        r = trainers[arm].run_many(specs, progress=bar.update)
        rows += _rows(cfg, arm, r, n_params, stress)
        curves[(arm, stress)] = (r.specs, {k: r.metrics[k] for k in ("loss", *MECHANISM)})
    return rows, curves


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    best = best_lr(cfg, rows)
    lrs = stats.lrs_from_best(cfg.lrs, best)
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    comparisons, effects = {}, {}
    for cond in conditions(cfg):
        label = "model's gradients" if cond == "x1" else "stress test, set by hand"
        for lr in lrs:

            def at(key, arm, cond=cond, lr=lr):
                return stats.per_seed(rows, key, cfg.seeds, arm=arm, condition=cond, lr=lr)

            for arm in cfg.arms[1:]:
                name = f"{arm} @ lr {lr:g} ({lr / best:.3g}x best), {cond} ({label}), {size}"
                comparisons[name] = {"remedy": at(PRIMARY, arm), "base": at(PRIMARY, BASE)}
                effects[name] = {
                    f"{k}_late": stats.paired_effect(at(f"{k}_late", arm), at(f"{k}_late", BASE), k)
                    for k in ("sign_frac", "bimodality", "eps_bound_frac")
                }
            effects[f"{BASE} @ lr {lr:g}, {cond}: {cond} − x1"] = stats.paired_effect(
                at(PRIMARY, BASE), at(PRIMARY, BASE, cond="x1"), PRIMARY
            )
    remedies = stats.family(PRIMARY_TEXT, comparisons)
    grid = {
        a: stats.lr_grid(
            {
                lr: float(
                    np.mean(stats.per_seed(rows, PRIMARY, cfg.seeds, arm=a, condition="x1", lr=lr))
                )
                for lr in cfg.lrs
            }
        )
        for a in cfg.arms
    }
    nat = [r for r in rows if r["condition"] == "x1" and r["lr"] in lrs]
    base_failed = {(r["lr"], r["seed"]) for r in nat if r["arm"] == BASE and r["failed"]}
    rem_failed = {(r["lr"], r["seed"]) for r in nat if r["arm"] != BASE and r["failed"]}
    own = sorted(base_failed - rem_failed)
    eps_bound = max(r["eps_bound_frac_late"] for r in nat if r["arm"] == BASE)
    stalls = [
        lr
        for lr in lrs
        if effects[f"{BASE} @ lr {lr:g}, x{cfg.stress_scale:g}: x{cfg.stress_scale:g} − x1"][
            "ci95"
        ][0]
        > 0
    ]
    not_shown = ""
    if not own:
        not_shown = (
            f"at this size eps=1e-8 only stalls: with the model's own gradients ({size}, "
            f"lr {', '.join(f'{x:g}' for x in lrs)}) adamw eps 1e-8 never diverged where "
            f"eps 0 did not, and at most {eps_bound:.2g} of its coordinates had √v̂ below "
            f"eps; only the hand-set x{cfg.stress_scale:g} stress test reaches eps, and "
            f"there it stalls (lr {', '.join(f'{x:g}' for x in stalls) or 'none'})"
        )
    summary = stats.summary(
        cfg,
        instability_reproduced=bool(own),
        failure_metric="adamw eps 1e-8 runs that failed (final loss non-finite or above "
        "init) with the model's own gradients at 1-10x its best LR where no eps-free arm "
        "with that seed and LR failed",
        remedies=remedies,
        sizes=[size],
        note=(
            f"best LR of adamw eps 1e-8 (x1): {best:g}; compared at {lrs}; the x"
            f"{cfg.stress_scale:g} rows are a stress test (gradient scale set by hand)"
        ),
        primary_metric=PRIMARY_TEXT,
        lr_grid=grid,
        failure_made_by_model=bool(own),
        not_shown=not_shown,
    )
    return summary, effects


def tables(cfg: Config, rows: list[dict], summary: dict) -> str:
    t = []
    for cond in conditions(cfg):
        for arm in cfg.arms:
            for lr in cfg.lrs:
                rr = [r for r in rows if (r["arm"], r["condition"], r["lr"]) == (arm, cond, lr)]
                if not rr:
                    continue
                ci = stats.interval([r[PRIMARY] for r in rr])
                t.append(
                    {
                        "condition": cond,
                        "arm": arm,
                        "lr": f"{lr:g}",
                        "primary [95% t-CI]": f"{ci['mean']:.3f} [{ci['ci95'][0]:.3f}, "
                        f"{ci['ci95'][1]:.3f}]",
                        "failed": f"{sum(r['failed'] for r in rr)}/{len(rr)}",
                        "grad RMS (late)": f"{np.mean([r['grad_rms_late'] for r in rr]):.2e}",
                        "sign-like (late)": f"{np.mean([r['sign_frac_late'] for r in rr]):.4f}",
                        "sign-like, shallow (late)": (
                            f"{np.mean([r['sign_frac_shallow_late'] for r in rr]):.4f}"
                        ),
                        "bimodality (late)": f"{np.mean([r['bimodality_late'] for r in rr]):.3f}",
                        "√v̂ < eps (late)": f"{np.mean([r['eps_bound_frac_late'] for r in rr]):.2g}",
                    }
                )
    e = common.family_rows(summary["remedies"], "Δ primary [95% t-CI]")
    g = summary["lr_grid"]
    head = (
        f"Seed means over {len(cfg.seeds)} seeds, {cfg.steps} steps, d{cfg.d_model}x"
        f"{cfg.n_layers}, no clipping; late = mean over the last quarter of the run. Best "
        "x1 LR: " + ", ".join(f"{a} {v['best_lr']:g}" for a, v in g.items())
    )
    return common.captioned_tables(
        (head, t),
        (
            "Primary metric, paired per seed (remedy − adamw eps 1e-8), 95 % t-intervals, "
            "exact sign-flip p, Holm over the family",
            e,
        ),
    )


def mechanism_figure(cfg: Config, curves: dict, lr: float, path) -> None:
    """Sign-like fraction and bimodality against the step, per arm and condition, at the
    base arm's best LR (seed mean with a 95 % t band)."""
    plt = plots.pyplot()
    conds = list(conditions(cfg))
    fig, axes = plt.subplots(2, len(conds), figsize=(5.2 * len(conds), 6.6), squeeze=False)
    for j, cond in enumerate(conds):
        for k, arm in enumerate(cfg.arms):
            if (arm, cond) not in curves:
                continue
            specs, m = curves[(arm, cond)]
            idx = [i for i, sp in enumerate(specs) if sp["learning_rate"] == lr]
            if not idx:
                continue
            for row, key, ylabel in (
                (0, "sign_frac", "sign-like fraction | |u|-1 | < 0.1"),
                (1, "bimodality", "bimodality coefficient of u"),
            ):
                ys = np.asarray(m[key])[idx]
                plots.mean_band(
                    axes[row][j], np.arange(1, ys.shape[1] + 1), ys, color=f"C{k}", name=arm
                )
                axes[row][j].set_ylabel(ylabel)
                axes[row][j].set_xlabel("step")
                plots.label(axes[row][j], f"{cond}, lr {lr:g}")
                axes[row][j].grid(alpha=0.3)
        axes[1][j].axhline(5 / 9, color="0.4", ls=":", lw=0.8)
        axes[0][j].legend(fontsize=7, loc="upper right")
    plots.save_figure(fig, path)


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="adam_eps")
    cfg, out = ex.cfg, ex.out
    total = len(cfg.arms) * (len(cfg.lrs) + 2) * len(cfg.seeds) * cfg.steps  # + the stress LRs
    rows, curves = ex.sweep(total, lambda bar: run(cfg, bar))
    summary, effects = summarize(cfg, rows)
    res = {"primary_metric": PRIMARY, "rows": rows, "effects": effects}
    title = "Adam eps: the model's gradients, and a hand-set x1e-8 stress test"
    summary["best_per_arm"] = claims.best_block("adam_eps", {"summary": summary, "results": res})
    ex.write(res, table=tables(cfg, rows, summary), title=title, summary=summary)
    lr_figures(cfg, rows, out)
    mechanism_figure(cfg, curves, best_lr(cfg, rows), out / "mechanism.png")
    plots.effects(summary["remedies"], path=out / "effects.png", title=title)
    return res


def replot(out) -> None:
    """Redraws the LR figures from a stored results.json (no training run)."""
    cfg, payload = plots.stored(out, Config)
    lr_figures(cfg, payload["results"]["rows"], pathlib.Path(out))


def lr_figures(cfg: Config, rows: list[dict], out) -> None:
    nat = [r for r in rows if r["condition"] == "x1"]
    plots.metric_vs_lr(
        nat,
        y=PRIMARY,
        group="arm",
        path=out / "loss_vs_lr.png",
        title=f"model's gradients (x1), d{cfg.d_model}x{cfg.n_layers}",
        ylabel="final held-out loss (failed = init)",
    )
    plots.metric_vs_lr(
        rows,
        y="sign_frac_late",
        group="arm",
        panel="condition",
        path=out / "sign_frac_vs_lr.png",
        title="sign-like updates, last quarter",
        ylabel="fraction of coordinates with | |u|-1 | < 0.1",
    )


if __name__ == "__main__":
    main()
