"""Molybog et al.'s mechanism made visible: Adam's eps against gradients shrunk by a factor.

The gradient is multiplied by a factor down to 1e-8 before the optimizer (what a loss
multiplier, tiny gradients at scale or an fp16 loss scale do). Adam's update
m̂/(√v̂ + eps) does not depend on the gradient's scale until √v̂ falls to eps; from there
eps sets the step and the model stops learning. Four arms: ``optax.adamw`` with eps 1e-8
and 1e-15, ``stabljax.safe_adamw`` with eps 0, and ``stabljax.adamw_atan2`` (no eps).
Reports the final loss per factor per arm and, from :func:`stabljax.adam_eps_report`, the
fraction of coordinates whose √v̂ is below 1e-8 (where eps = 1e-8 dominates).

An arm counts as invariant to the gradient scale when no scale moves its seed-mean final
loss away from the ×1 one by more than the seed-to-seed standard deviation of a single
run (:func:`invariance` states it exactly).

No gradient clipping here: clipping a global norm to 1.0 is itself not scale invariant,
and the point is to isolate eps.

    python -m experiments.adam_eps [--quick] [--scales 1 1e-4 1e-8] [--seeds 0 1 2 3]

References:
  Molybog et al., `A Theory on Adam Instability in Large-Scale Machine Learning
  <https://arxiv.org/abs/2304.09871>`_, 2023
  Everett et al., `Scaling Exponents Across Parameterizations and Optimizers
  <https://arxiv.org/abs/2407.05872>`_, 2024
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import numpy as np
import optax

import stabljax
from experiments import common

ARMS = ("adamw_eps1e-8", "adamw_eps1e-15", "safe_adamw_eps0", "adamw_atan2")


@dataclasses.dataclass(frozen=True)
class Config(common.SweepConfig):
    seeds: tuple[int, ...] = (0, 1, 2, 3)
    lr: float = 1e-2
    scales: tuple[float, ...] = (1.0, 1e-2, 1e-4, 1e-6, 1e-8)
    arms: tuple[str, ...] = ARMS
    eps_threshold: float = 1e-8
    pow2_scales: tuple[float, ...] = (2.0**-7, 2.0**-27)

    @classmethod
    def quick(cls):
        # Two seeds, so the invariance criterion has a seed spread to compare against;
        # eps 1e-15 runs the same code as eps 1e-8 and is left to the full run.
        base = {**dataclasses.asdict(common.SweepConfig.quick()), "seeds": (0, 1)}
        return cls(
            **base,
            scales=(1.0, 1e-8),
            pow2_scales=(2.0**-27,),
            arms=("adamw_eps1e-8", "safe_adamw_eps0", "adamw_atan2"),
        )


def factory(arm: str, s: common.Setup):
    """``factory(learning_rate, grad_scale)``: the gradient times ``grad_scale``, then ``arm``."""
    unit = common.unit_schedule(s)

    def make(learning_rate, grad_scale):
        lr = lambda c: learning_rate * unit(c)  # noqa: E731
        kw = {"b1": s.b1, "b2": s.b2, "weight_decay": s.weight_decay}
        if arm == "adamw_eps1e-8":
            opt = optax.adamw(lr, eps=1e-8, **kw)
        elif arm == "adamw_eps1e-15":
            opt = optax.adamw(lr, eps=1e-15, **kw)
        elif arm == "safe_adamw_eps0":
            opt = stabljax.safe_adamw(lr, eps=0.0, **kw)
        elif arm == "adamw_atan2":
            opt = stabljax.adamw_atan2(lr, **kw)
        else:
            raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")
        return optax.chain(optax.scale(grad_scale), opt)

    return make


def eps_fraction(opt_state, params, eps: float, b2: float) -> float:
    """Fraction of all coordinates (weighted by size) whose √v̂ is below ``eps``; NaN if no Adam."""
    report = stabljax.adam_eps_report(opt_state, eps, b2=b2)
    if not report:
        return float("nan")
    sizes = {
        stabljax.telemetry.path_str(p): np.size(x)
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    n = sum(sizes.get(k.split(":")[-1], 0) for k in report)
    return float(sum(v * sizes.get(k.split(":")[-1], 0) for k, v in report.items()) / max(n, 1))


def invariance(by_scale: dict[float, list[float]], ref: float) -> dict:
    """The scale-invariance criterion of one arm, from its final losses.

    ``by_scale[g]`` holds the final loss of each seed at gradient scale ``g`` (the same
    seeds, in the same order, at every scale); ``ref`` is the reference scale (×1).

    - ``seed_sd``: the seed-to-seed standard deviation of one run's final loss, pooled
      over the scales: √(mean_g var_k L[g, k]), each variance with ddof 1, so
      (scales × (seeds − 1)) degrees of freedom. Pooling uses every run, where the
      variance at ×1 alone would rest on seeds − 1 degrees of freedom.
    - ``scale_effect``: the largest shift of the seed-mean loss from the ×1 one,
      max_g |mean_k L[g, k] − mean_k L[ref, k]|.
    - ``invariant``: ``scale_effect <= seed_sd``; ``None`` with fewer than two seeds.

    For a shift that is pure seed-like noise the difference of two n-seed means has
    standard deviation σ·√(2/n), so with n ≤ 8 seeds this bound is tighter than two
    standard errors of the difference (with 4 seeds: σ against 1.41σ).
    """
    losses = {g: np.asarray(v, dtype=float) for g, v in by_scale.items()}
    n = min(v.size for v in losses.values())
    base = float(np.mean(losses[ref]))
    shifts = {g: float(np.mean(v) - base) for g, v in losses.items()}
    effect = max(abs(d) for d in shifts.values())
    if n < 2:
        sd, ok = float("nan"), None
    else:
        sd = float(np.sqrt(np.mean([np.var(v, ddof=1) for v in losses.values()])))
        ok = bool(effect <= sd)
    return {
        "shift_vs_x1": {f"{g:g}": d for g, d in shifts.items()},
        "scale_effect": effect,
        "seed_sd": sd,
        "seed_sd_dof": len(losses) * (n - 1),
        "effect_over_sd": effect / sd if n >= 2 else float("nan"),
        "invariant": ok,
    }


def main(argv=None) -> dict:
    cfg, args = common.parse_config(Config, argv, __doc__.splitlines()[0], name="adam_eps")
    common.init_distributed(args)
    out = pathlib.Path(args.out)
    s = cfg.setup(lr=cfg.lr)
    trainers = {a: common.Trainer(s, factory(a, s)) for a in cfg.arms}
    cells = [
        {"arm": a, "scale": g, "seed": sd} for a in cfg.arms for g in cfg.scales for sd in cfg.seeds
    ]

    def run_cell(c, advance):
        r = trainers[c["arm"]].run(
            c["seed"],
            learning_rate=cfg.lr,
            grad_scale=c["scale"],
            progress=advance,
            keep_state=True,
        )
        frac = eps_fraction(r.state.opt_state, r.state.params, cfg.eps_threshold, s.b2)
        return {
            **c,
            "final_loss": common.finite_or_nan(r.eval_loss),
            "init_loss": r.init_loss,
            "eps_fraction": frac,
        }

    # Powers of two scale a float exactly: there the eps-free arms must match ×1 bit for bit,
    # which separates scale invariance from float32 rounding of a ×0.01 gradient.
    exact = [a for a in ("safe_adamw_eps0", "adamw_atan2") if a in cfg.arms]
    cells += [
        {"arm": a, "scale": g, "seed": sd}
        for a in exact
        for g in cfg.pow2_scales
        for sd in cfg.seeds
    ]
    rows = common.sweep(cells, run_cell, steps=cfg.steps, desc="adam_eps", disable=args.no_progress)
    pow2 = [r for r in rows if r["scale"] in cfg.pow2_scales and r["scale"] not in cfg.scales]
    rows = [r for r in rows if r not in pow2]
    ref1 = {(r["arm"], r["seed"]): r["final_loss"] for r in rows if r["scale"] == 1.0}
    pow2_check = {
        a: {
            f"{g:g}": [r["final_loss"] for r in pow2 if r["arm"] == a and r["scale"] == g]
            for g in cfg.pow2_scales
        }
        | {
            "bit_identical_to_x1": all(
                r["final_loss"] == ref1.get((a, r["seed"])) for r in pow2 if r["arm"] == a
            )
        }
        for a in exact
    }
    arms, table = {}, []
    for a in cfg.arms:
        by_scale = {
            g: [r["final_loss"] for r in rows if r["arm"] == a and r["scale"] == g]
            for g in cfg.scales
        }
        ref = np.mean(by_scale[cfg.scales[0]])
        inv = invariance(by_scale, cfg.scales[0])
        arms[a] = {
            "loss_by_scale": {f"{g:g}": common.mean_spread(v) for g, v in by_scale.items()},
            "max_gap_vs_scale1": inv["scale_effect"],
            "invariance": inv,
            "degradation_at_smallest_scale": float(np.mean(by_scale[cfg.scales[-1]]) - ref),
        }
        row = {"arm": a}
        for g in cfg.scales:
            m, sp = common.mean_spread(by_scale[g])
            fr = np.mean([r["eps_fraction"] for r in rows if r["arm"] == a and r["scale"] == g])
            fr_s = "n/a" if not np.isfinite(fr) else f"{100 * fr:.0f}%"
            row[f"×{g:g}"] = f"{m:.3f} ± {sp:.3f} ({fr_s})"
        row["largest shift vs ×1"] = f"{inv['scale_effect']:.4f}"
        row["seed SD"] = f"{inv['seed_sd']:.4f}"
        row["invariant"] = {True: "yes", False: "no", None: "n/a"}[inv["invariant"]]
        table.append(row)
    table = (
        "Final held-out loss (mean ± half-range over seeds) by gradient scale; in brackets the "
        f"fraction of coordinates with √v̂ < {cfg.eps_threshold:g} at the end (n/a: atan2 has no v̂ "
        "in adam_eps_report's sense). Largest shift vs ×1: the largest change of the seed-mean "
        "loss from ×1; seed SD: the standard deviation of one run's final loss across seeds, "
        f"pooled over the scales ({len(cfg.scales)} × ({len(cfg.seeds)} − 1) degrees of freedom); "
        "invariant: largest shift ≤ seed SD.\n\n" + common.markdown_table(table)
    )
    res = {"rows": rows, "arms": arms, "pow2_check": pow2_check, "pow2_rows": pow2}
    table += "\nPower-of-two gradient scales (exact in floating point), final loss per seed:\n\n"
    table += common.markdown_table(
        [
            {"arm": a}
            | {f"×{g:g}": ", ".join(f"{v:.6f}" for v in c[f"{g:g}"]) for g in cfg.pow2_scales}
            | {"×1": ", ".join(f"{ref1[(a, sd)]:.6f}" for sd in cfg.seeds if (a, sd) in ref1)}
            | {"bit-identical to ×1": c["bit_identical_to_x1"]}
            for a, c in pow2_check.items()
        ]
    )
    common.write_results(
        out, config=cfg, results=res, table=table, title="Adam epsilon vs gradient scale"
    )
    common.plot_groups(
        rows,
        x="scale",
        y="final_loss",
        group="arm",
        path=out / "loss_vs_scale.png",
        title=f"Final loss vs gradient scale (lr {cfg.lr:g}; band: seeds min-max)",
        xlabel="gradient multiplier",
        ylabel="final loss (nats/byte)",
    )
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
