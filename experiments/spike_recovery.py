"""The main job: the rollback controller on loss spikes the model makes by itself.

The failure is Thilak et al.'s Slingshot (:mod:`experiments.slingshot`): a one-layer
Transformer on ``a + b mod 31`` with Adam (no weight decay, constant LR 1e-2) drives its
training loss to near zero, then spikes by 0.5-1.5 nats, again and again. Nothing is
injected into the data, the loss or the gradient. The setting and the spike criterion
(:data:`experiments.slingshot.SPIKE_NATS`) were fixed by a pilot on other seeds
(experiments/README.md).

Five arms per seed, all on the same jitted step and the same batches:
``unguarded`` (Adam), ``guards`` (``skip_nonfinite(skip_spikes(adam))``), ``rollback``
(:class:`stabljax.RollbackController` at its default detectors: checkpoints, detection,
rollback ``margin`` steps before the onset, data skip: PaLM's remedy), ``remedy`` (the same
controller with ``remedy=lower_lr(remedy_factor)``: OPT-175B's logbook restarted from a
checkpoint with a lower LR) and ``lower_lr`` (what a practitioner tries first: the LR times
``lower_lr_factor`` from the start).

Primary metric (:data:`PRIMARY`, declared before the run): the mean training loss of the
kept trajectory (for the controller arms, the steps the final state was trained through;
rolled-back steps are not kept) from step ``metric_from`` on, when the loss is near zero
and the spikes come. Each arm against ``unguarded``, paired per seed (t-interval, exact
sign-flip p, Holm over the 4: :func:`experiments.stats.family`). Also reported: spikes
kept, rollbacks and compute steps per seed, held-out (test split) loss and accuracy.

    python -m experiments.spike_recovery [--quick] [--steps 2000] [--seeds 100 101] ...

Results go to ``runs/spike_recovery/`` (git-ignored); ``--commit-results`` writes the
committed ``experiments/results/spike_recovery/`` that docs/experiments.md's claims are
read from.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax
import numpy as np
import optax

import stabljax
from experiments import cli, common, plots, stats
from experiments.slingshot import (
    SPIKE_NATS,
    Programs,
    Task,
    controller,
    kept_losses,
    scan_runs,
    spikes,
    with_lr,
)

ARMS = ("unguarded", "guards", "rollback", "remedy", "lower_lr")
REMEDIES = ARMS[1:]
CONTROLLED = ("rollback", "remedy")
#: The primary metric, declared before the run: lower is better.
PRIMARY = "mean training loss of the kept trajectory from step metric_from on (nats)"
#: Where a run writes unless told ``--commit-results`` (git-ignored).
RUN_FOLDER = "runs/spike_recovery"


@dataclasses.dataclass(frozen=True)
class Config:
    p: int = 31
    train_frac: float = 0.5
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 4
    batch_size: int = 128
    lr: float = 1e-2
    b2: float = 0.98
    steps: int = 2000
    metric_from: int = 500
    seeds: tuple[int, ...] = tuple(range(100, 110))
    arms: tuple[str, ...] = ARMS
    save_every: int = 50
    margin: int = 50
    max_rollbacks: int = 10
    remedy_factor: float = 0.5
    lower_lr_factor: float = 0.5
    spike_warmup: int = 50
    scan_lrs: tuple[float, ...] = (1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 1.0)
    workdir: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "checkpoint folder of the controller arms, which must not exist yet "
            "(default: <out>/ckpt, emptied first and kept after the run)"
        },
    )

    @classmethod
    def quick(cls) -> Config:
        return cls(
            steps=60,
            metric_from=20,
            seeds=(0, 1),
            batch_size=32,
            save_every=5,
            margin=10,
            spike_warmup=10,
            scan_lrs=(1e-3, 1e-2),
        )

    def task(self, lr: float | None = None) -> Task:
        names = ("p", "train_frac", "d_model", "n_layers", "n_heads", "batch_size", "b2")
        return Task(lr=self.lr if lr is None else lr, **{k: getattr(self, k) for k in names})


def outcome(cfg: Config, progs: Programs, params, losses, kept, calls: int, skips: int):
    """The per-run fields every arm reports, from its losses and final parameters."""
    tail = kept[cfg.metric_from :]
    test_loss, test_acc = progs.evaluate(params, progs.test)
    train_loss, _ = progs.evaluate(params, progs.train)
    return {
        "primary": float(np.mean(tail)) if np.all(np.isfinite(tail)) else float("nan"),
        "spikes_kept": len(spikes(kept)),
        "spikes_seen": len(spikes(losses)),
        "compute_steps": calls,
        "steps_lost": calls - cfg.steps,
        "guard_skips": skips,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "train_loss": train_loss,
        "kept_losses": [float(f"{v:.4g}") for v in kept],
    }


def run_scanned(cfg: Config, progs: Programs, arm: str, bar) -> list[dict]:
    """An arm without the controller: every seed side by side in one scanned program."""
    kind = "guarded" if arm == "guards" else "plain"
    lr = cfg.lr * (cfg.lower_lr_factor if arm == "lower_lr" else 1.0)
    states = [
        with_lr(stabljax.TrainState.create(progs.task.model(sd)[1], progs.optimizers[kind]), lr)
        for sd in cfg.seeds
    ]
    t0 = time.perf_counter()
    fns = [progs.task.batches(sd) for sd in cfg.seeds]
    state, ms = scan_runs(progs.scan_steps[kind], states, fns, cfg.steps)
    bar.update(len(cfg.seeds) * cfg.steps)
    wall = (time.perf_counter() - t0) / len(cfg.seeds)
    out = []
    for k, sd in enumerate(cfg.seeds):
        params = jax.tree.map(lambda x, k=k: x[k], state.params)
        losses = ms["loss"][k].astype(float)
        skips = int(ms["skipped"][k].sum())
        row = {"arm": arm, "seed": sd, "rollbacks": 0, "gave_up": False, "remedies": 0}
        row["batches_skipped"] = 0
        row |= {"rollback_steps": [], "final_lr": lr, "wall_s": wall}
        out.append(row | outcome(cfg, progs, params, losses, losses, cfg.steps, skips))
    return out


def run_controlled(cfg: Config, progs: Programs, arm: str, seed: int, workdir, bar) -> dict:
    """One seed of a controller arm: a step per call, the controller between them."""
    _, params = progs.task.model(seed)
    state = stabljax.TrainState.create(params, progs.optimizers["plain"])
    step = progs.scan_steps["plain"]  # not donated: the controller keeps what it restores
    calls: list[dict] = []
    t0 = time.perf_counter()
    ctl = controller(cfg, workdir / f"{arm}-{seed}", arm)
    expected: list[int] = []

    def tick(state, batch):
        at = int(ctl.current_step)
        if expected and at < expected[0]:  # a rollback: its replay joins the bar's total
            common.grow_bar(bar, expected[0] - at)
        expected[:] = [at + 1]
        state, m = step(state, batch)
        calls.append({"step": at, "m": m})
        bar.update(1)
        return state, m

    gave_up = False
    try:
        state, _ = ctl.run(
            tick,
            state,
            stabljax.control.IndexedBatches(progs.task.batches(seed)),
            cfg.steps,
            progress=False,
        )
    except stabljax.control.TrainingDiverged:
        gave_up = True  # max_rollbacks spent: the job stops, counted as a diverged run
    finally:
        ctl.close()
    events = [e.to_dict() if hasattr(e, "to_dict") else dict(e) for e in ctl.events]
    got = jax.device_get([c["m"] for c in calls])
    losses = np.array([float(m["loss"]) for m in got])
    kept = kept_losses(calls, got)
    if gave_up:  # the steps never trained count as diverged: NaN, ln p in the primary
        kept = np.concatenate([kept, np.full(cfg.steps - len(kept), np.nan)])
    skips = int(sum(bool(m["skipped"]) for m in got))
    return {
        "arm": arm,
        "seed": seed,
        "rollbacks": ctl.rollbacks,
        "gave_up": gave_up,
        "remedies": sum(e["kind"] == "remedy" for e in events),
        "batches_skipped": sum(b - a for a, b in ctl.skipped_ranges),
        "rollback_steps": [e["step"] for e in events if e["kind"] == "rollback"],
        "final_lr": float(np.asarray(optax.tree.get(state.opt_state, "learning_rate"))),
        "wall_s": time.perf_counter() - t0,
        **outcome(cfg, progs, state.params, losses, kept, len(calls), skips),
    }


def lr_scan(cfg: Config, seed: int) -> dict[float, float]:
    """The unguarded arm's primary metric at each of ``scan_lrs`` (one seed, vmapped)."""
    from experiments.slingshot import pilot_run

    losses = pilot_run(cfg.task(), [seed] * len(cfg.scan_lrs), cfg.steps, lrs=cfg.scan_lrs)
    init = float(np.log(cfg.p))  # uniform prediction: a diverged run's score
    return {
        lr: float(np.mean(x[cfg.metric_from :])) if np.all(np.isfinite(x)) else init
        for lr, x in zip(cfg.scan_lrs, losses, strict=True)
    }


def summarize(cfg: Config, runs: list[dict], scan: dict[float, float]) -> tuple[dict, dict]:
    def col(arm, key):
        rr = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if key == "primary":  # a diverged run counts as uniform prediction, ln p
            return stats.finite_or([r[key] for r in rr], [float(np.log(cfg.p))] * len(rr))
        return [r[key] for r in rr]

    arms = {
        arm: {
            "primary": stats.interval(col(arm, "primary")),
            **{
                k: float(np.mean(col(arm, k)))
                for k in (
                    "spikes_kept",
                    "spikes_seen",
                    "rollbacks",
                    "remedies",
                    "steps_lost",
                    "guard_skips",
                    "test_loss",
                    "test_acc",
                    "final_lr",
                )
            },
            "rollbacks_per_seed": col(arm, "rollbacks"),
            "seeds_with_spikes": int(sum(n > 0 for n in col(arm, "spikes_seen"))),
        }
        for arm in cfg.arms
    }
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    regime = f"@ lr {cfg.lr:g}, {size}"
    base = col("unguarded", "primary")
    remedies = stats.family(
        PRIMARY,
        {
            f"{arm} {regime}": {"remedy": col(arm, "primary"), "base": base}
            for arm in REMEDIES
            if arm in cfg.arms
        },
    )
    spiked = arms["unguarded"]["seeds_with_spikes"]
    reproduced = spiked * 2 >= len(cfg.seeds)
    grid = stats.lr_grid(scan)
    grid["arm"] = f"unguarded, seed {cfg.seeds[0]}, {cfg.steps} steps, {size}"
    grid["main_lr"] = cfg.lr
    met = [k for k, r in remedies.items() if r["claim_met"]]
    if not reproduced:
        not_shown = f"the unguarded run spiked on only {spiked} of {len(cfg.seeds)} seeds"
    elif not met:
        not_shown = "no arm beat unguarded on the primary metric with Holm p < 0.05"
    else:
        not_shown = ""
    summary = stats.summary(
        cfg,
        instability_reproduced=reproduced,
        failure_metric=(
            f"seeds whose unguarded training loss spikes (> {SPIKE_NATS} nats above its "
            "running minimum), at least half (Slingshot: the model's own spikes; nothing "
            "is injected)"
        ),
        remedies=remedies,
        sizes=[size],
        note=(
            f"Slingshot on a + b mod {cfg.p}, Adam lr {cfg.lr:g} b2 {cfg.b2:g}, {cfg.steps} "
            f"steps; unguarded spiked on {spiked}/{len(cfg.seeds)} seeds"
        ),
        primary_metric=PRIMARY,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown=not_shown,
    )
    return summary, {"arms": arms, "lr_scan": {str(k): v for k, v in scan.items()}}


def table(cfg: Config, res: dict, summary: dict) -> str:
    rows = [
        {
            "arm": arm,
            "primary [95% t-CI]": common.fmt_interval(a["primary"]),
            "seeds spiking": f"{a['seeds_with_spikes']}/{len(cfg.seeds)}",
            "spikes seen": a["spikes_seen"],
            "spikes kept": a["spikes_kept"],
            "rollbacks per seed": " ".join(str(n) for n in a["rollbacks_per_seed"]),
            "steps lost": a["steps_lost"],
            "guard skips": a["guard_skips"],
            "final LR": f"{a['final_lr']:.3g}",
            "test loss": f"{a['test_loss']:.3f}",
            "test acc": f"{a['test_acc']:.3f}",
        }
        for arm, a in res["arms"].items()
    ]
    eff = [
        {
            "arm − unguarded": k,
            "Δ primary [95% t-CI]": common.fmt_ci(r, digits=4),
            "p sign-flip": f"{r['p_sign_flip']:.4f}",
            "p Holm": f"{r['p_holm']:.4f}",
            "claim met": r["claim_met"],
        }
        for k, r in summary["remedies"].items()
    ]
    g = summary["lr_grid"]
    scan = [
        {"lr": f"{lr:g}", "primary": f"{v:.4f}"} for lr, v in zip(g["lrs"], g["score"], strict=True)
    ]
    return common.captioned_tables(
        (f"Means over {len(cfg.seeds)} seeds ({PRIMARY}; means of the counts)", rows),
        (f"{PRIMARY}: paired per seed against unguarded, Holm over {len(eff)}", eff),
        (f"LR scan ({g['arm']})", scan),
    )


def output_argv(argv) -> list[str]:
    """``argv`` with the results folder made explicit: ``--out`` if given, else the committed
    folder with ``--commit-results``, else :data:`RUN_FOLDER` (git-ignored)."""
    argv = list(argv)
    commit = "--commit-results" in argv
    argv = [a for a in argv if a != "--commit-results"]
    if not commit and not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv = [*argv, "--out", RUN_FOLDER]
    return argv


def main(argv=None) -> dict:
    argv = output_argv(sys.argv[1:] if argv is None else argv)
    doc = __doc__ + "\n--commit-results: write experiments/results/spike_recovery/ instead."
    ex = cli.start(Config, argv, doc, name="spike_recovery")
    cfg, out = ex.cfg, ex.out
    unknown = set(cfg.arms) - set(ARMS)
    if "unguarded" not in cfg.arms or unknown:
        raise ValueError(f"arms must include 'unguarded' and be among {ARMS}, got {cfg.arms}")
    workdir = cli.fresh_workdir(cfg.workdir, out, name="spike_recovery")
    progs = Programs(cfg)
    total = len(cfg.arms) * len(cfg.seeds) * cfg.steps

    def sweep(bar):
        runs = []
        for arm in cfg.arms:
            if arm in CONTROLLED:
                runs += [run_controlled(cfg, progs, arm, sd, workdir, bar) for sd in cfg.seeds]
            else:
                runs += run_scanned(cfg, progs, arm, bar)
        return runs

    runs = ex.sweep(total, sweep)
    scan = lr_scan(cfg, cfg.seeds[0])
    summary, res = summarize(cfg, runs, scan)
    res["runs"] = runs
    text = table(cfg, res, summary)
    ex.write(res, table=text, title="Spike recovery (main job)", summary=summary)
    panels = {
        arm: {"kept loss": np.array([r["kept_losses"] for r in runs if r["arm"] == arm])}
        for arm in cfg.arms
    }
    plots.curves(
        {"kept trajectory": {a: p["kept loss"] for a, p in panels.items()}},
        path=out / "loss.png",
        xlabel="step (kept trajectory)",
        ylabel="training loss (nats)",
        logy=True,
    )
    plots.effects(
        summary["remedies"],
        path=out / "effects.png",
        title=f"arm − unguarded, {len(cfg.seeds)} seeds (paired t 95% CI, Holm)",
    )
    print(f"checkpoints of the controller arms: {workdir}")
    print(f"wall {ex.elapsed():.0f}s -> {out}")
    return res


if __name__ == "__main__":
    main()
