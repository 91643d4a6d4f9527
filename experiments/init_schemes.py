"""Initialisation schemes on a deep, narrow model at high learning rates.

A 12-layer, 32-wide reference model (no clipping, no weight decay) trained under each
scheme of :mod:`stabljax.init` named here: 0.02 everywhere (``fixed:0.02``, the
unremedied arm), GPT-2's 0.02 with residual outputs scaled by 1/√(2L) (``gpt2``), Nguyen &
Salazar's small init (``small_init``) and per-layer depth scaling (``depth_scaled``).
Before training :func:`stabljax.init.check_init` reports the residual growth and its flags;
during training every step records the loss and the largest residual-stream RMS.

Failure metric: bursts (steps whose loss exceeds 1.5× its running minimum) summed over
the LR grid per seed; effects are paired per seed against ``fixed:0.02`` with 95 %
bootstrap intervals, the mechanism being the residual growth (log of the largest
residual RMS over training). The loss curves of every run are saved.

    python -m experiments.init_schemes [--quick] [--schemes gpt2 small_init] [--lrs 0.3 1]

(``python -m experiments.init`` is the same experiment under its short name.)

References:
  Nguyen & Salazar, `Transformers without Tears
  <https://arxiv.org/abs/1910.05895>`_, 2019
  Takase et al., `Spike No More: Stabilizing the Pre-training of Large Language Models
  <https://arxiv.org/abs/2312.16903>`_, 2023
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np

import stabljax
from experiments import cli, common, plots, proxy, stats
from experiments.trainer import Trainer

SCHEMES = ("fixed:0.02", "gpt2", "small_init", "depth_scaled")


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_layers: int = 12
    n_heads: int = 2
    weight_decay: float = 0.0
    lrs: tuple[float, ...] = (0.1, 1.0)
    schemes: tuple[str, ...] = SCHEMES

    @classmethod
    def quick(cls):
        base = {**dataclasses.asdict(proxy.SweepConfig.quick()), "n_layers": 3}
        return cls(**base, lrs=(1.0,), schemes=("fixed:0.02", "gpt2"))


def check(s: proxy.Setup, scheme: str, seed: int, apply_fn) -> stabljax.init.InitReport:
    """``check_init`` on the model the run starts from (same seed, same first batch)."""
    s = dataclasses.replace(s, init_scheme=scheme, seed=seed)
    _, params = proxy.initial_model(s)
    return stabljax.init.check_init(apply_fn, params, proxy.corpus_batches(s)(0))


def run(cfg: Config, bar) -> tuple[list[dict], dict]:
    s = cfg.setup(clip=0.0)
    probe = stabljax.nnx_apply(proxy.initial_model(s)[0], return_aux=True)[0]
    reports = {(sc, sd): check(s, sc, sd, probe) for sc in cfg.schemes for sd in cfg.seeds}
    specs = [
        {"seed": sd, "learning_rate": lr, "overrides": {"init_scheme": sc}}
        for sc in cfg.schemes
        for lr in cfg.lrs
        for sd in cfg.seeds
    ]
    r = Trainer(s).run_many(specs, progress=bar.update)  # the scheme sets values: one program
    m, rows = r.metrics, []
    for i, sp in enumerate(r.specs):
        sc = sp["overrides"]["init_scheme"]
        rep = reports[(sc, sp["seed"])]
        rows.append(
            {
                "scheme": sc,
                **r.outcome(i),
                "check_ok": bool(rep.ok),
                "check_flags": [f.name for f in rep.flags],
                "growth_init": float(rep.growth_exponent),
                "log_max_residual_rms": float(np.log(np.nanmax(m["max_residual_rms"][i]))),
            }
        )
    curves = {
        (sc, lr): m["loss"][
            [
                i
                for i, sp in enumerate(r.specs)
                if sp["overrides"]["init_scheme"] == sc and sp["learning_rate"] == lr
            ]
        ]
        for sc in cfg.schemes
        for lr in cfg.lrs
    }
    return rows, curves


def summarize(cfg: Config, rows: list[dict]) -> tuple[dict, dict]:
    base = cfg.schemes[0]
    effects, remedies = {}, {}
    for sc in cfg.schemes[1:]:
        e = stats.paired_effect(
            stats.per_seed(rows, "bursts", cfg.seeds, scheme=sc),
            stats.per_seed(rows, "bursts", cfg.seeds, scheme=base),
            "bursts",
        )
        mech = stats.moved(
            stats.per_seed(rows, "log_max_residual_rms", cfg.seeds, scheme=sc),
            stats.per_seed(rows, "log_max_residual_rms", cfg.seeds, scheme=base),
        )
        effects[sc] = {"bursts": e, "mechanism": mech}
        remedies[f"{sc} vs {base}"] = stats.remedy(
            "bursts summed over the LR grid", e, mech, "log max residual RMS (summed over grid)"
        )
    flagged = [r["bursts"] for r in rows if not r["check_ok"]]
    clean = [r["bursts"] for r in rows if r["check_ok"]]
    effects["check_init"] = {
        "flagged_runs": len(flagged),
        "unflagged_runs": len(clean),
        "mean_bursts_flagged": float(np.mean(flagged)) if flagged else float("nan"),
        "mean_bursts_unflagged": float(np.mean(clean)) if clean else float("nan"),
    }
    b = [r for r in rows if r["scheme"] == base]
    summary = stats.summary(
        instability_reproduced=any(r["failed"] for r in b)
        or float(np.mean([r["bursts"] for r in b])) >= 0.05 * cfg.steps,
        failure_metric="bursts >= 5% of steps or final > init, fixed:0.02 init",
        remedies=remedies,
        seeds=len(cfg.seeds),
        sizes=[f"d{cfg.d_model}x{cfg.n_layers}"],
    )
    return summary, effects


def tables(cfg: Config, rows: list[dict], effects: dict) -> str:
    t = []
    for sc in cfg.schemes:
        rr = [r for r in rows if r["scheme"] == sc]
        flags = sorted({f for r in rr for f in r["check_flags"]})
        row = {
            "scheme": sc,
            "check_init": "ok" if not flags else ", ".join(flags),
            "λ at init": f"{np.mean([r['growth_init'] for r in rr]):.3f}",
        }
        for lr in cfg.lrs:
            q = [r for r in rr if r["lr"] == lr]
            row[f"lr {lr:g}: final"] = f"{np.mean([r['final_loss'] for r in q]):.3f}"
            row[f"lr {lr:g}: bursts"] = f"{np.mean([r['bursts'] for r in q]):.1f}"
        t.append(row)
    e = [
        {
            "scheme vs " + cfg.schemes[0]: k,
            "Δ bursts [95% CI]": common.fmt_ci(v["bursts"], 1),
            "Δ log max residual RMS [95% CI]": common.fmt_ci(v["mechanism"], 2),
        }
        for k, v in effects.items()
        if k != "check_init"
    ]
    c = effects["check_init"]
    return (
        f"{cfg.n_layers} layers × d_model {cfg.d_model}, {cfg.steps} steps, no clipping; "
        f"means over {len(cfg.seeds)} seeds\n\n"
        + common.markdown_table(t)
        + "\nPaired per-seed differences, 95 % bootstrap intervals\n\n"
        + common.markdown_table(e)
        + f"\ncheck_init flagged {c['flagged_runs']} runs (mean bursts "
        f"{c['mean_bursts_flagged']:.1f}) and passed {c['unflagged_runs']} (mean bursts "
        f"{c['mean_bursts_unflagged']:.1f}).\n"
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="init_schemes")
    cfg, out = ex.cfg, ex.out
    rows, curves = ex.sweep(
        len(cfg.schemes) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps, lambda bar: run(cfg, bar)
    )
    summary, effects = summarize(cfg, rows)
    table = tables(cfg, rows, effects)
    res = {
        "rows": rows,
        "effects": effects,
        "losses": {f"{sc}@{lr:g}": c for (sc, lr), c in curves.items()},
    }
    ex.write(res, table=table, title="Initialisation schemes", summary=summary)
    plots.curves(
        {f"lr {lr:g}": {sc: curves[(sc, lr)] for sc in cfg.schemes} for lr in cfg.lrs},
        path=out / "init.png",
        xlabel="step",
        ylabel="training loss (nats/byte)",
        logy=True,
    )
    print(table)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
