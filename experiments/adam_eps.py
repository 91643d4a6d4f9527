"""Molybog et al.'s mechanism made visible: Adam's eps against tiny gradients, by width.

The gradient is multiplied by a factor down to 1e-8 before the optimizer (what a loss
multiplier, tiny gradients at scale or an fp16 loss scale do), either everywhere or only
in the shallow layers (the embedding and the first block: Molybog et al.'s case, where the
shallow layers' gradients vanish first). Adam's update m̂/(√v̂ + eps) does not depend on
the gradient's scale until √v̂ falls to eps; from there eps sets the step and those
parameters stop learning. Three arms: ``optax.adamw`` with eps 1e-8 (the failure),
``stabljax.safe_adamw`` with eps 0 and ``stabljax.adamw_atan2`` (no eps), at three widths,
with the gradient RMS per width at ×1 (it falls with width: the trend that makes eps bind
sooner at scale). No gradient clipping: clipping a global norm is not scale invariant.

Effects are paired per seed against ``adamw_eps1e-8`` at the same scale, with 95 %
bootstrap intervals; the mechanism is the update norm (log10), which eps shrinks.

    python -m experiments.adam_eps [--quick] [--scales 1 1e-4 1e-8] [--seeds 0 1 2 3 4]

References:
  Molybog et al., `A Theory on Adam Instability in Large-Scale Machine Learning
  <https://arxiv.org/abs/2304.09871>`_, 2023
  Everett et al., `Scaling Exponents Across Parameterizations and Optimizers
  <https://arxiv.org/abs/2407.05872>`_, 2024
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

import stabljax
from experiments import cli, common, plots, proxy, stats
from experiments.trainer import Trainer
from stabljax.telemetry import path_str

ARMS = ("adamw_eps1e-8", "safe_adamw_eps0", "adamw_atan2")
BASE = "adamw_eps1e-8"


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    lr: float = 1e-2
    steps: int = 200
    scales: tuple[float, ...] = (1.0, 1e-4, 1e-8)
    shallow_scale: float = 1e-8
    arms: tuple[str, ...] = ARMS
    widths: tuple[int, ...] = (32, 64, 128)
    heads: tuple[int, ...] = (2, 4, 4)

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(
            **q,
            scales=(1.0, 1e-8),
            widths=(16,),
            heads=(2,),
            arms=("adamw_eps1e-8", "safe_adamw_eps0"),
        )


def is_shallow(path) -> bool:
    """The embedding and the first block (``blocks/0``), by parameter path."""
    p = path_str(path)
    return "embed" in p or "blocks/0/" in p or "blocks.0." in p or "layers/0/" in p


def scale_grads(grad_scale, shallow_scale) -> optax.GradientTransformation:
    """Multiplies every gradient by ``grad_scale`` and the shallow ones also by
    ``shallow_scale`` (both traced)."""

    def update(updates, state, params=None):
        del params
        out = jax.tree_util.tree_map_with_path(
            lambda p, g: g * grad_scale * (shallow_scale if is_shallow(p) else 1.0), updates
        )
        return out, state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def factory(arm: str, s: proxy.Setup):
    """``factory(learning_rate, grad_scale, shallow_scale)``: scaled gradients, then ``arm``."""
    unit = proxy.unit_schedule(s)

    def make(learning_rate, grad_scale, shallow_scale):
        lr = lambda c: learning_rate * unit(c)  # noqa: E731
        kw = {"b1": s.b1, "b2": s.b2, "weight_decay": s.weight_decay}
        if arm == "adamw_eps1e-8":
            opt = optax.adamw(lr, eps=1e-8, **kw)
        elif arm == "safe_adamw_eps0":
            opt = stabljax.safe_adamw(lr, eps=0.0, **kw)
        elif arm == "adamw_atan2":
            opt = stabljax.adamw_atan2(lr, **kw)
        else:
            raise ValueError(f"unknown arm {arm!r}; one of {ARMS}")
        return optax.chain(scale_grads(grad_scale, shallow_scale), opt)

    return make


def conditions(cfg: Config) -> list[tuple[str, float, float]]:
    """(name, grad_scale, shallow_scale) of every gradient condition."""
    out = [(f"x{g:g}", g, 1.0) for g in cfg.scales]
    return [*out, (f"shallow x{cfg.shallow_scale:g}", 1.0, cfg.shallow_scale)]


def run(cfg: Config, bar) -> list[dict]:
    rows = []
    conds = conditions(cfg)
    specs = [
        {"seed": sd, "learning_rate": cfg.lr, "grad_scale": g, "shallow_scale": h}
        for _, g, h in conds
        for sd in cfg.seeds
    ]
    for d, h in zip(cfg.widths, cfg.heads, strict=True):
        s = cfg.setup(lr=cfg.lr, d_model=d, n_heads=h, clip=0.0)
        n_params = sum(np.size(x) for x in jax.tree.leaves(proxy.initial_model(s)[1]))
        for arm in cfg.arms:
            bar.set_postfix_str(f"d{d} {arm}")
            r = Trainer(s, factory(arm, s)).run_many(specs, progress=bar.update)
            m = r.metrics
            for i, sp in enumerate(r.specs):
                name = next(
                    c for c, g, hh in conds if (g, hh) == (sp["grad_scale"], sp["shallow_scale"])
                )
                rows.append(
                    {
                        "width": d,
                        "arm": arm,
                        "condition": name,
                        "seed": sp["seed"],
                        "init_loss": float(r.init_loss[i]),
                        "final_loss": common.finite_or_nan(r.final_loss[i]),
                        "failed": stats.failed(r.final_loss[i], r.init_loss[i]),
                        "grad_rms": float(np.mean(m["grad_norm"][i]) / np.sqrt(n_params)),
                        "log10_update_norm": float(np.log10(np.mean(m["update_norm"][i]) + 1e-30)),
                    }
                )
    return rows


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    effects = {}
    conds = [c for c, _, _ in conditions(cfg)]
    ref = conds[0]
    for d in cfg.widths:

        def at(key, arm, cond, d=d):  # one value per seed, in cfg.seeds order
            return stats.per_seed(rows, key, cfg.seeds, width=d, arm=arm, condition=cond)

        effects[d] = {}
        for c in conds:
            base = at("final_loss", BASE, c)
            e = {
                "stall_vs_x1": stats.paired_effect(base, at("final_loss", BASE, ref), "final loss")
            }
            for arm in cfg.arms[1:]:
                e[arm] = {
                    "final_loss": stats.paired_effect(at("final_loss", arm, c), base, "final loss"),
                    "mechanism": stats.moved(
                        at("log10_update_norm", arm, c),
                        at("log10_update_norm", BASE, c),
                        direction=+1,
                    ),
                    "shift_vs_x1": stats.paired_effect(
                        at("final_loss", arm, c), at("final_loss", arm, ref), "final loss"
                    ),
                }
            effects[d][c] = e
        effects[d]["grad_rms_x1"] = stats.interval(at("grad_rms", BASE, ref))
    big, tiny = cfg.widths[-1], f"x{min(cfg.scales):g}"
    shallow = conds[-1]
    remedies = {}
    for c in (tiny, shallow):
        for arm in cfg.arms[1:]:
            e = effects[big][c][arm]
            remedies[f"{arm} @ {c}, d{big}"] = stats.remedy(
                "final loss", e["final_loss"], e["mechanism"], "log10 mean update norm (raised)"
            )
    stall = effects[big][tiny]["stall_vs_x1"]
    summary = stats.summary(
        cfg,
        instability_reproduced=bool(stall["ci95"][0] > 0),
        failure_metric=f"eps 1e-8 final loss at {tiny} above its x1 loss (paired CI > 0)",
        remedies=remedies,
        sizes=[f"d{d}" for d in cfg.widths],
    )
    return summary, effects


def tables(cfg: Config, rows: list[dict], effects: dict) -> str:
    conds = [c for c, _, _ in conditions(cfg)]
    t = []
    for d in cfg.widths:
        for arm in cfg.arms:
            row = {"width": d, "arm": arm}
            for c in conds:
                loss = stats.per_seed(rows, "final_loss", cfg.seeds, width=d, arm=arm, condition=c)
                row[c] = f"{np.mean(loss):.3f}"
            t.append(row)
    e = []
    for d in cfg.widths:
        g = effects[d]["grad_rms_x1"]
        for c in conds:
            row = {
                "width": d,
                "gradient RMS at x1": f"{g['mean']:.2e}",
                "condition": c,
                "eps 1e-8 vs its x1": common.fmt_ci(effects[d][c]["stall_vs_x1"]),
            }
            for arm in cfg.arms[1:]:
                row[f"{arm} − eps 1e-8"] = common.fmt_ci(effects[d][c][arm]["final_loss"])
            e.append(row)
    head = (
        f"Seed-mean final held-out loss ({len(cfg.seeds)} seeds, lr {cfg.lr:g}, {cfg.steps} steps)"
    )
    paired = "Paired per-seed differences of the final loss, mean [95 % bootstrap CI]"
    return common.captioned_tables((head, t), (paired, e))


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="adam_eps")
    cfg, out = ex.cfg, ex.out
    rows = ex.sweep(
        len(cfg.widths) * len(cfg.arms) * len(conditions(cfg)) * len(cfg.seeds) * cfg.steps,
        lambda bar: run(cfg, bar),
    )
    summary, effects = summarize(cfg, rows)
    table = tables(cfg, rows, effects)
    res = {"rows": rows, "effects": effects}
    ex.write(res, table=table, title="Adam epsilon vs tiny gradients, by width", summary=summary)
    plots.groups_vs_x(
        [
            {**r, "x": i}
            for r in rows
            for i, (c, _, _) in enumerate(conditions(cfg))
            if r["condition"] == c
        ],
        x="x",
        y="final_loss",
        group="arm",
        panel="width",
        path=out / "loss_vs_scale.png",
        title="final loss; x: "
        + ", ".join(f"{i}={c}" for i, (c, _, _) in enumerate(conditions(cfg))),
        xlabel="gradient condition",
        ylabel="final loss (nats/byte)",
        logx=False,
    )
    plots.groups_vs_x(
        [r for r in rows if r["arm"] == BASE and r["condition"] == conditions(cfg)[0][0]],
        x="width",
        y="grad_rms",
        group="arm",
        path=out / "grad_rms_vs_width.png",
        title="gradient RMS at x1 vs width",
        xlabel="d_model",
        ylabel="gradient RMS",
        logy=True,
    )
    return res


if __name__ == "__main__":
    main()
