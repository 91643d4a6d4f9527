"""Mixed precision over an LR grid that holds fp32's optimum: where float16 fails, and where.

The reference model (no clipping, no weight decay) trained four ways over a log LR grid
from 1e-4 to 1: ``fp32``; ``bf16`` compute (float32 master weights, optimizer state and
loss); ``fp16-noscale`` (float16 compute, no loss scale); ``fp16`` (float16 compute with
:class:`~stabljax.precision.DynamicLossScale`: skip and halve on overflow, double after
``growth_interval`` clean steps, with a floor ``min_scale`` **below 1** (default 2^-16), so
that the scale can also shrink gradients whose unscaled values overflow). The model
computes in the arm's compute dtype (``proxy.model_config``); attention scores and output
logits are float32 (:mod:`stabljax.reference.nn`).

Primary metric (``PRIMARY``, fixed before the run): the final held-out loss, a failed run
(final loss non-finite or above its init loss) counted as its loss at init; the remedies
(``fp16`` with a loss scale, ``bf16``) are compared with ``fp16-noscale`` per LR, at every
grid LR from fp32's best LR upwards (so at 1-10x the best and above): paired t-intervals,
exact sign-flip p, Holm over that family.

Where the overflow is, measured two ways:

- per step, every run: the steps whose gradients are non-finite while the forward loss is
  finite (the forward pass survived, the backward overflowed) against those whose loss is
  non-finite, and which came first;
- per LR (seed ``diagnose_seed``): at the final parameters of the ``fp16`` and ``fp32``
  runs, one float16 forward and backward pass of a training batch evaluated op by op
  (:func:`experiments.measure.value_tracer`), at loss scale 1: the largest float16 value
  of the forward and of the backward pass against 65504, the first op whose output is
  non-finite (forward or backward, its primitive and source line), and the largest
  float16 gradient per layer.

    python -m experiments.precision [--quick] [--lrs 0.001 0.01 1] [--seeds 0 1 2]

References:
  Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, 2018
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import stabljax
from experiments import claims, cli, common, plots, proxy, stats
from experiments.measure import Diagnoser
from experiments.trainer import Trainer

#: The primary metric, declared before the run: lower is better.
PRIMARY = "primary_loss"
PRIMARY_TEXT = (
    "final held-out loss (nats/byte; a failed run counts as its init loss), "
    "remedy − fp16-noscale, per LR"
)
ARMS = ("fp32", "bf16", "fp16-noscale", "fp16")
BASE = "fp16-noscale"
REMEDIES = ("fp16", "bf16")
#: The largest finite float16.
F16_MAX = float(jnp.finfo(jnp.float16).max)


@dataclasses.dataclass(frozen=True)
class Config(proxy.SweepConfig):
    n_heads: int = 2
    weight_decay: float = 0.0
    seeds: tuple[int, ...] = tuple(range(10))
    lrs: tuple[float, ...] = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
    arms: tuple[str, ...] = ARMS
    initial_scale: float = 2.0**15
    growth_interval: int = 50
    min_scale: float = 2.0**-16
    #: the seed whose final parameters are diagnosed op by op (-1: none)
    diagnose_seed: int = 0

    @classmethod
    def quick(cls):
        q = dataclasses.asdict(proxy.SweepConfig.quick())
        return cls(
            **{**q, "weight_decay": 0.0}, lrs=(1e-4, 1e-2, 1.0), growth_interval=2, diagnose_seed=-1
        )


def precision(arm: str, cfg: Config):
    if arm == "fp16":
        return stabljax.Precision.fp16(
            initial_scale=cfg.initial_scale,
            growth_interval=cfg.growth_interval,
            min_scale=cfg.min_scale,
        )
    return proxy.precision_of(arm)


# --------------------------------------------------------------------------- the sweep


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask)) if mask.any() else -1


def run(cfg: Config, bar) -> tuple[list[dict], dict, dict]:
    rows, curves, diagnoses = [], {}, {}
    specs = [{"seed": sd, "learning_rate": lr} for lr in cfg.lrs for sd in cfg.seeds]
    s16 = cfg.setup(clip=0.0, precision="fp16")
    diagnose = Diagnoser(s16) if cfg.diagnose_seed in cfg.seeds else None
    for arm in cfg.arms:
        bar.set_postfix_str(arm)
        s = cfg.setup(clip=0.0, precision=arm)
        keep = arm in ("fp16", "fp32") and diagnose is not None
        r = Trainer(s, precision=precision(arm, cfg)).run_many(
            specs, progress=bar.update, keep_params=keep
        )
        m = r.metrics
        for i in range(len(r.specs)):
            o = r.outcome(i)
            bad_loss = ~np.isfinite(m["loss"][i])
            bad_grad = ~np.isfinite(m["grad_norm"][i])
            rows.append(
                {
                    "arm": arm,
                    **o,
                    PRIMARY: o["init_loss"] if o["failed"] else o["final_loss"],
                    "nonfinite_loss_steps": int(bad_loss.sum()),
                    "nonfinite_grad_steps": int(bad_grad.sum()),
                    # the forward pass gave a finite loss, the backward non-finite gradients
                    "backward_only_steps": int((bad_grad & ~bad_loss).sum()),
                    "first_nonfinite_grad_step": _first(bad_grad),
                    "first_nonfinite_loss_step": _first(bad_loss),
                    "overflows": int(np.sum(m["overflow"][i])),
                    "final_loss_scale": float(m["loss_scale"][i, -1]),
                    "min_loss_scale": float(np.min(m["loss_scale"][i])),
                    "max_residual_rms": float(np.nanmax(m["max_residual_rms"][i])),
                }
            )
        curves[arm] = m["loss"][r.index(learning_rate=max(cfg.lrs))]
        if keep:
            batch = proxy.corpus_batches(dataclasses.replace(s16, seed=cfg.diagnose_seed))(
                cfg.steps - 1
            )
            for lr in cfg.lrs:
                (i,) = r.index(learning_rate=lr, seed=cfg.diagnose_seed)
                params = jax.tree.map(lambda x, i=i: x[i], r.params)
                d = diagnose(params, batch, 1.0)
                if arm == "fp16":  # and at the scale the run ended with
                    d["at_run_final_scale"] = diagnose(params, batch, float(m["loss_scale"][i, -1]))
                diagnoses.setdefault(arm, {})[f"{lr:g}"] = d
    return rows, curves, diagnoses


def _seed_values(cfg: Config, rows: list[dict], key: str, arm: str, lr: float) -> list[float]:
    return stats.per_seed(rows, key, cfg.seeds, arm=arm, lr=lr)


def _overflow_location(cfg: Config, rows: list[dict], diagnoses: dict) -> dict:
    """Where fp16 without a loss scale first went non-finite: per step (the loss or a
    gradient first) and op by op (the diagnosed first non-finite primitive per LR)."""
    base_rows = [r for r in rows if r["arm"] == BASE]
    backward = sum(r["backward_only_steps"] for r in rows if r["arm"] in ("fp16", BASE))
    forward_first = sum(
        0 <= r["first_nonfinite_loss_step"] <= r["first_nonfinite_grad_step"]
        or (r["first_nonfinite_loss_step"] >= 0 and r["first_nonfinite_grad_step"] < 0)
        for r in base_rows
    )
    backward_first = sum(
        r["first_nonfinite_grad_step"] >= 0
        and (
            r["first_nonfinite_loss_step"] < 0
            or r["first_nonfinite_grad_step"] < r["first_nonfinite_loss_step"]
        )
        for r in base_rows
    )
    where = {
        "fp16-noscale runs whose first non-finite value was a gradient (loss finite)": int(
            backward_first
        ),
        "fp16-noscale runs whose first non-finite value was the loss": int(forward_first),
        "steps with non-finite gradients but a finite loss (fp16 arms, all runs)": int(backward),
        "first non-finite op at loss scale 1, per LR (fp16 arm's final params, seed "
        f"{cfg.diagnose_seed})": {
            lr: (d["first_nonfinite"] or {}).get("phase", "none")
            + (
                f": {d['first_nonfinite']['primitive']} @ {d['first_nonfinite']['source']}"
                if d["first_nonfinite"]
                else ""
            )
            for lr, d in diagnoses.get("fp16", {}).items()
        },
    }
    return where


def _comparisons(
    cfg: Config, rows: list[dict], ref: str, best: float, compared: list[float]
) -> tuple[dict, dict]:
    """Per remedy and LR: the paired seed values against the base arm, and the failed runs
    of every arm with the reference arm's loss interval beside them."""
    comparisons, effects = {}, {}
    for arm in REMEDIES:
        if arm not in cfg.arms or BASE not in cfg.arms:
            continue
        for lr in compared:
            name = f"{arm} @ lr {lr:g} ({lr / best:.3g}x best), d{cfg.d_model}x{cfg.n_layers}"
            comparisons[name] = {
                "remedy": _seed_values(cfg, rows, PRIMARY, arm, lr),
                "base": _seed_values(cfg, rows, PRIMARY, BASE, lr),
            }
            effects[name] = {
                "failed_runs": {
                    a: int(sum(_seed_values(cfg, rows, "failed", a, lr))) for a in cfg.arms
                },
                "fp32_loss": stats.interval(_seed_values(cfg, rows, PRIMARY, ref, lr)),
            }
    return comparisons, effects


def summarize(cfg: Config, rows: list[dict], diagnoses: dict) -> tuple[dict, dict]:
    def score(arm):
        return {lr: float(np.mean(_seed_values(cfg, rows, PRIMARY, arm, lr))) for lr in cfg.lrs}

    grid = {a: stats.lr_grid(score(a)) for a in cfg.arms}
    ref = "fp32" if "fp32" in cfg.arms else cfg.arms[0]
    best = grid[ref]["best_lr"]
    compared = [lr for lr in cfg.lrs if lr >= best * (1 - 1e-9)]
    comparisons, effects = _comparisons(cfg, rows, ref, best, compared)
    remedies = stats.family(PRIMARY_TEXT, comparisons)
    base_rows = [r for r in rows if r["arm"] == BASE]
    fp32_failed = {(r["lr"], r["seed"]) for r in rows if r["arm"] == ref and r["failed"]}
    own = [r for r in base_rows if r["failed"] and (r["lr"], r["seed"]) not in fp32_failed]
    fail_lrs = sorted({r["lr"] for r in own})
    where = _overflow_location(cfg, rows, diagnoses)
    met = [k for k, v in remedies.items() if v["claim_met"]]
    in_range = [lr for lr in compared if lr <= 10 * best * (1 + 1e-9)]
    lost = [lr for lr in in_range if lr in fail_lrs]
    not_shown = ""
    if not met:
        not_shown = (
            f"fp16 without a loss scale failed at lr {', '.join(f'{x:g}' for x in fail_lrs)} "
            f"where fp32 did not (best fp32 LR {best:g}); no remedy passed Holm at d"
            f"{cfg.d_model}x{cfg.n_layers}, {len(cfg.seeds)} seeds"
            if fail_lrs
            else f"at d{cfg.d_model}x{cfg.n_layers} fp16 without a loss scale never failed "
            f"where fp32 did not, on the grid {cfg.lrs[0]:g}-{cfg.lrs[-1]:g}"
        )
    summary = stats.summary(
        cfg,
        instability_reproduced=bool(own),
        failure_metric="fp16-noscale runs that failed (final loss non-finite or above init) "
        "where the fp32 run with the same seed and LR did not",
        remedies=remedies,
        note=(
            f"fp32's best LR {best:g}; fp16-noscale failed on its own at lr "
            f"{', '.join(f'{x:g}' for x in fail_lrs) or 'none'} (1-10x best: "
            f"{', '.join(f'{x:g}' for x in lost) or 'none'}); overflow located per step "
            "(non-finite gradient with a finite loss = backward) and op by op (see "
            "results.overflow_location)"
        ),
        primary_metric=PRIMARY_TEXT,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown=not_shown,
    )
    summary["overflow_location"] = where
    return summary, effects


def _final(rr: list[dict]) -> str:
    finite = [r["final_loss"] for r in rr if np.isfinite(r["final_loss"])]
    if not finite:
        return "non-finite"
    more = "" if len(finite) == len(rr) else f" ({len(finite)} finite)"
    return f"{np.mean(finite):.3f}{more}"


def tables(cfg: Config, rows: list[dict], summary: dict, diagnoses: dict) -> str:
    per_lr = []
    for a in cfg.arms:
        for lr in cfg.lrs:
            rr = [r for r in rows if (r["arm"], r["lr"]) == (a, lr)]
            ci = stats.interval([r[PRIMARY] for r in rr])

            def mean(key, rr=rr):
                return f"{np.mean([r[key] for r in rr]):.1f}"

            per_lr.append(
                {
                    "arm": a,
                    "lr": f"{lr:g}",
                    "primary [95% t-CI]": f"{ci['mean']:.3f} [{ci['ci95'][0]:.3f}, "
                    f"{ci['ci95'][1]:.3f}]",
                    "final (finite runs)": _final(rr),
                    "failed": f"{sum(r['failed'] for r in rr)}/{len(rr)}",
                    "non-finite loss steps": mean("nonfinite_loss_steps"),
                    "non-finite grad steps": mean("nonfinite_grad_steps"),
                    "grad non-finite, loss finite": mean("backward_only_steps"),
                    "min loss scale": f"{np.min([r['min_loss_scale'] for r in rr]):.3g}",
                    "max residual RMS": f"{np.mean([r['max_residual_rms'] for r in rr]):.3g}",
                }
            )
    e = common.family_rows(summary["remedies"], "Δ primary [95% t-CI]")
    d = []
    for arm, by_lr in diagnoses.items():
        for lr, x in by_lr.items():
            f = x["first_nonfinite"]
            worst = max(x["grad16_max_abs_per_layer"].items(), key=lambda kv: kv[1])
            d.append(
                {
                    "params of": f"{arm}, lr {lr}",
                    "loss": f"{x['scaled_loss']:.3g}",
                    "fwd max |fp16|": f"{x['forward_max_abs']:.3g}",
                    "fwd ops non-finite": x["forward_nonfinite_ops"],
                    "bwd max |fp16|": f"{x['backward_max_abs']:.3g}",
                    "bwd ops non-finite": x["backward_nonfinite_ops"],
                    "first non-finite op": "none"
                    if f is None
                    else f"{f['phase']}: {f['primitive']} @ {f['source']}",
                    "largest fp16 grad (layer)": f"{worst[1]:.3g} ({worst[0]})",
                }
            )
    g = summary["lr_grid"]
    grid = "; ".join(f"{a}: best LR {v['best_lr']:g}" for a, v in g.items())
    return common.captioned_tables(
        (
            f"Per arm and LR over {len(cfg.seeds)} seeds, {cfg.steps} steps, no clipping, "
            f"d{cfg.d_model}x{cfg.n_layers}; fp16 loss-scale floor {cfg.min_scale:g}. "
            f"Primary: {PRIMARY_TEXT.split(',')[0]}. {grid}",
            per_lr,
        ),
        (
            "Primary metric, paired per seed (remedy − fp16-noscale), 95 % t-intervals, exact "
            "sign-flip p, Holm over the family",
            e,
        ),
        (
            f"Op-by-op float16 forward + backward at loss scale 1 (final params of seed "
            f"{cfg.diagnose_seed}, last training batch; float16 max {F16_MAX:g})",
            d,
        ),
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="precision")
    cfg, out = ex.cfg, ex.out
    total = len(cfg.arms) * len(cfg.lrs) * len(cfg.seeds) * cfg.steps
    rows, curves, diagnoses = ex.sweep(total, lambda bar: run(cfg, bar))
    summary, effects = summarize(cfg, rows, diagnoses)
    losses = {a: c[:, ::5] for a, c in curves.items()}
    res = {
        "primary_metric": PRIMARY,
        "rows": rows,
        "effects": effects,
        "overflow_location": diagnoses,
        "losses_top_lr_every_5": losses,
    }
    title = TITLE
    summary["best_per_arm"] = claims.best_block("precision", {"summary": summary, "results": res})
    ex.write(res, table=tables(cfg, rows, summary, diagnoses), title=title, summary=summary)
    figures(cfg, rows, summary, out)
    return res


TITLE = "Mixed precision over an LR grid holding fp32's optimum"


def figures(cfg: Config, rows: list[dict], summary: dict, out) -> None:
    """Loss and non-finite-gradient steps against LR, and the family's forest plot."""
    plots.metric_vs_lr(
        rows,
        y=PRIMARY,
        group="arm",
        path=out / "loss_vs_lr.png",
        title=f"d{cfg.d_model}x{cfg.n_layers}, {cfg.steps} steps",
        ylabel="final held-out loss (failed = init)",
    )
    plots.metric_vs_lr(
        rows,
        y="nonfinite_grad_steps",
        group="arm",
        path=out / "nonfinite_grad_steps.png",
        title="steps with non-finite gradients",
        ylabel="steps per run",
    )
    if summary["remedies"]:
        plots.effects(summary["remedies"], path=out / "effects.png", title=TITLE)


def replot(out) -> None:
    """Redraws the figures from a stored results.json (no training run)."""
    cfg, payload = plots.stored(out, Config)
    figures(cfg, payload["results"]["rows"], payload["summary"], pathlib.Path(out))


if __name__ == "__main__":
    main()
