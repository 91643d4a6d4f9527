"""The main job: which remedy recovers a run from bad data, attributed arm by arm.

Trains the reference Transformer on the embedded corpus and replaces ``bad_len`` batches
by OLMo 2's bad data, documents of one short n-gram repeated over and over (Team OLMo,
`2 OLMo 2 Furious <https://arxiv.org/abs/2501.00656>`_, 2024: behind their loss spikes;
:mod:`experiments.faults`). Nothing is injected into the loss or the gradient.

Six arms per seed: ``clean`` (no bad data), ``unguarded`` (``clip_by_global_norm + adamw``),
``guards`` (``skip_nonfinite(skip_spikes(...))`` around it), ``rollback`` (the plain
optimizer driven by :class:`stabljax.RollbackController`: checkpoints, detection, rollback,
data skip), ``both``, and ``filter`` (OLMo 2's remedy: the repeated-n-gram filter on the
data stream, an instance with an n-gram of 1-13 tokens repeated >= 32 times in a row gets
loss weight 0). The controller's margins are PaLM's scaled to the run: restart about
``steps / 8`` steps before the onset (PaLM: ~100 steps) and skip past the detection by
``bad_len`` batches.

Primary metric (:data:`PRIMARY`, declared before the run): the final held-out loss (a
diverged run: its loss at init), each remedy against ``unguarded`` paired per seed (t-interval,
exact sign-flip p, Holm over the 4). The LR is fixed (``lr``); a one-seed ``clean`` scan
over 1e-4..1 (``scan_lrs``) places it against the best LR. Also reported: the held-out loss
right after the bad window, steps lost, skips, rollbacks, bad and clean sequences trained.

    python -m experiments.spike_recovery [--quick] [--steps 400] [--seeds 0 1 2] ...
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

import stabljax
import stabljax.report
from experiments import cli, common, faults, plots, proxy, stats
from experiments.faults import Programs, bad_window
from experiments.trainer import Trainer

ARMS = ("clean", "unguarded", "guards", "rollback", "both", "filter")
REMEDIES = ("guards", "rollback", "both", "filter")
#: The primary metric, declared before the run: lower is better.
PRIMARY = "final held-out loss (nats/byte; diverged = loss at init)"
TRIAGE_KEYS = ("verdict", "reason", "window", "culprits", "narrowed")


@dataclasses.dataclass(frozen=True)
class Config(proxy.ModelSize):
    n_heads: int = 2
    seq_len: int = 128
    steps: int = 400
    lr: float = 1e-2
    seeds: tuple[int, ...] = tuple(range(8))
    bad_start: int = 150
    bad_len: int = 20
    bad_frac: float = 1.0
    ngram_max: int = 4
    save_every: int = 10
    spike_warmup: int = 50
    scan_lrs: tuple[float, ...] = proxy.log_grid(1e-4, 1.0, 9)
    scan_seeds: tuple[int, ...] = (0,)
    corpus: str | None = None
    workdir: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "checkpoint folder of the controller arms, which must not exist yet; a "
            "multi-process run needs one that every process sees (default: <out>/ckpt, "
            "emptied first and kept after the run; single process only)"
        },
    )

    @classmethod
    def quick(cls) -> Config:
        return cls(
            steps=80,
            d_model=16,
            n_layers=1,
            seq_len=64,
            seeds=(0, 1, 2),
            bad_start=40,
            bad_len=8,
            ngram_max=2,
            save_every=5,
            spike_warmup=15,
            scan_lrs=(1e-3, 1e-2, 1e-1),
        )

    @property
    def margin(self) -> int:
        """PaLM's ~100 steps before the onset, scaled to the run length."""
        return max(self.save_every, self.steps // 8)

    def setup(self, **fields) -> proxy.Setup:
        return super().setup(
            **{"lr": self.lr, "steps": self.steps, "corpus": self.corpus, **fields}
        )


def run_arm(cfg: Config, progs: Programs, arm: str, seed: int, dirs: tuple, bar):
    workdir, report_dir = dirs
    s = cfg.setup(seed=seed)
    kind = "guarded" if arm in ("guards", "both") else "plain"
    _, params = proxy.initial_model(s)
    params = jax.device_put(params, progs.rep)
    init_loss = progs.evaluate(s, params)
    state = stabljax.TrainState.create(params, progs.optimizers[kind])
    step = progs.steps[kind]
    source = faults.source_for(cfg, s, arm, seed)
    calls: list[dict] = []  # one per step call: data index, step it trained, metrics
    fed: list[int] = []

    def batch_fn(i: int):
        fed.append(i)
        return progs.put(source(i))

    t0 = time.perf_counter()
    out: dict = {"arm": arm, "seed": seed, "init_loss": init_loss}
    if arm in ("rollback", "both"):
        ckpt = workdir / f"{arm}-{seed}"
        # The "both" arm also triages each rollback (replays the window to name the cause)
        # and logs every step's metrics, which the stability report reads.
        triage = arm == "both" and stabljax.control.TriageConfig(
            step_fn=step, batch_fn=lambda i: progs.put(source(i))
        )
        ctl = faults.controller(cfg, ckpt, triage)
        expected: list[int] = []

        def tick(state, batch):
            at = int(ctl.current_step)
            if expected and at < expected[0]:  # a rollback: its replay joins the bar's total
                common.grow_bar(bar, expected[0] - at)
            expected[:] = [at + 1]
            state, m = step(state, batch)
            calls.append({"step": at, "index": fed[-1], "m": m})
            bar.update(1)
            return state, m

        writer = stabljax.control.JsonlMetricsWriter(ckpt / "metrics.jsonl") if triage else None
        try:
            state, data = ctl.run(
                tick,
                state,
                stabljax.control.IndexedBatches(batch_fn),
                cfg.steps,
                progress=False,
                metrics_writer=writer,
            )
        finally:
            ctl.close()
            if writer is not None:
                writer.close()
        if triage and common.is_primary():
            page = stabljax.report.write_report(ckpt, report_dir / f"seed{seed}")
            out["report"] = page.relative_to(report_dir.parent).as_posix()  # under --out
        events = [e.to_dict() if hasattr(e, "to_dict") else dict(e) for e in ctl.events]
        out.update(
            triage=[
                {"step": e["step"], **{k: e["details"].get(k) for k in TRIAGE_KEYS}}
                for e in events
                if e["kind"] == "triage"
            ],
            rollbacks=ctl.rollbacks,
            batches_skipped=sum(b - a for a, b in ctl.skipped_ranges),
            skipped_ranges=ctl.skipped_ranges,
            events=events,
            heldout_after_window=None,
        )
    else:
        after = None
        for i in range(cfg.steps):
            if len(calls) >= 2:  # at most two steps in flight (BUILD.md, "Bounded dispatch")
                jax.block_until_ready(calls[-2]["m"])
            state, m = step(state, batch_fn(i))
            calls.append({"step": i, "index": i, "m": m})
            bar.update(1)
            if i == bad_window(cfg)[-1]:  # the spike on clean data: held-out loss right after
                after = progs.evaluate(s, state.params)
        out.update(
            rollbacks=0,
            batches_skipped=0,
            skipped_ranges=[],
            heldout_after_window=common.finite_or_nan(after),
        )
    got = jax.device_get([c["m"] for c in calls])
    bad_trained, dropped, bad_in_traj = faults.trajectory_counts(cfg, arm, calls, got)
    losses = np.array([float(m["loss"]) for m in got])
    final = progs.evaluate(s, state.params)
    out.update(
        wall_s=time.perf_counter() - t0,
        losses=losses,
        compute_steps=len(calls),
        steps_lost=len(calls) - cfg.steps,
        guard_skips=int(sum(bool(m["skipped"]) for m in got)),
        bad_sequences_trained=bad_trained,
        # sequences of the final trajectory the filter dropped that were not bad data
        clean_dropped=dropped - (bad_in_traj - bad_trained) if arm == "filter" else 0,
        final_loss=common.finite_or_nan(final),
        diverged=not np.isfinite(final),
        bad_calls=[k for k, c in enumerate(calls) if c["index"] in bad_window(cfg)],
    )
    return out


def summarize(cfg: Config, runs: list[dict], scan: list[dict]) -> tuple[dict, dict]:
    def col(arm, key):
        rr = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if key == "final_loss":  # the primary metric: a diverged run counts as its init loss
            return stats.finite_or([r["final_loss"] for r in rr], [r["init_loss"] for r in rr])
        return [r[key] for r in rr]

    arms = {}
    for arm in ARMS:
        after = col(arm, "heldout_after_window")
        arms[arm] = {
            "final_loss": stats.interval(col(arm, "final_loss")),
            "heldout_after_window": stats.interval(after) if None not in after else None,
            "diverged": int(sum(col(arm, "diverged"))),
            **{
                k: float(np.mean(col(arm, k)))
                for k in (
                    "steps_lost",
                    "batches_skipped",
                    "rollbacks",
                    "guard_skips",
                    "bad_sequences_trained",
                    "clean_dropped",
                )
            },
        }
    base = col("unguarded", "final_loss")
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    regime = f"@ lr {cfg.lr:g}, {size}"
    remedies = stats.family(
        PRIMARY,
        {f"{arm} {regime}": {"remedy": col(arm, "final_loss"), "base": base} for arm in REMEDIES},
    )
    # The failure: the bad data raises the unguarded run's final loss over the clean run's.
    failure = stats.paired_effect(base, col("clean", "final_loss"), PRIMARY)
    spike = stats.paired_effect(
        col("unguarded", "heldout_after_window"),
        col("clean", "heldout_after_window"),
        "held-out loss right after the bad window",
    )
    vs_clean = {
        arm: stats.paired_effect(col(arm, "final_loss"), col("clean", "final_loss"), PRIMARY)
        for arm in REMEDIES
    }
    reproduced = bool(failure["ci95"][0] > 0)
    grid = stats.grid_of(scan)
    grid["arm"] = f"clean, {len(cfg.scan_seeds)} seed(s), {cfg.steps} steps, {size}"
    grid["main_lr"] = cfg.lr
    grid["main_lr_over_best"] = cfg.lr / grid["best_lr"]
    met = [k for k, r in remedies.items() if r["claim_met"]]
    if not reproduced:
        not_shown = (
            f"at {size}, lr {cfg.lr:g}, the repeated-n-gram window did not raise the unguarded "
            "final loss above the clean run's (paired t-interval includes 0)"
        )
    elif not met:
        not_shown = (
            f"the bad data raised the final loss by {failure['effect_mean']:+.3f}, but no remedy "
            "passed Holm at p < 0.05 on the final held-out loss"
        )
    else:
        not_shown = ""
    summary = stats.summary(
        cfg,
        instability_reproduced=reproduced,
        failure_metric=(
            "unguarded minus clean final held-out loss, paired t-interval above 0 (the spike "
            "is the model's response to repeated-n-gram documents; nothing is injected into "
            "the loss or gradient)"
        ),
        remedies=remedies,
        sizes=[size],
        note=(
            f"fixed lr {cfg.lr:g} = {grid['main_lr_over_best']:.3g}x the best LR of a "
            f"{len(cfg.scan_seeds)}-seed clean-arm scan ({grid['best_lr']:g}); bad batches "
            f"{cfg.bad_start}-{cfg.bad_start + cfg.bad_len - 1} of {cfg.steps}"
        ),
        primary_metric=PRIMARY,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown=not_shown,
    )
    return summary, {
        "arms": arms,
        "failure": failure,
        "spike_after_window": spike,
        "vs_clean": vs_clean,
        "lr_scan": scan,
    }


def table(cfg: Config, res: dict, summary: dict) -> str:
    rows = []
    for arm, a in res["arms"].items():
        rows.append(
            {
                "arm": arm,
                "final held-out loss [95% t-CI]": common.fmt_interval(a["final_loss"]),
                "held-out loss after the bad window": common.fmt_interval(
                    a["heldout_after_window"]
                ),
                "diverged": a["diverged"],
                "rollbacks": a["rollbacks"],
                "batches skipped": a["batches_skipped"],
                "guard skips": a["guard_skips"],
                "steps lost": a["steps_lost"],
                "bad sequences trained": a["bad_sequences_trained"],
                "clean sequences filtered": a["clean_dropped"],
            }
        )
    eff = [
        {
            "remedy − unguarded": k,
            "Δ final loss [95% t-CI]": common.fmt_ci(r),
            "p sign-flip": f"{r['p_sign_flip']:.4f}",
            "p Holm": f"{r['p_holm']:.4f}",
            "claim met": r["claim_met"],
            "remedy − clean": common.fmt_ci(res["vs_clean"][k.split(" ")[0]]),
        }
        for k, r in summary["remedies"].items()
    ]
    f, sp = res["failure"], res["spike_after_window"]
    g = summary["lr_grid"]
    scan = [
        {"lr": f"{lr:g}", "clean final held-out loss": f"{v:.3f}"}
        for lr, v in zip(g["lrs"], g["score"], strict=True)
    ]
    return common.captioned_tables(
        (f"Means over {len(cfg.seeds)} seeds, lr {cfg.lr:g}", rows),
        (f"{PRIMARY}: paired per seed against unguarded, Holm over 4", eff),
        (f"LR scan of the clean arm ({g['arm']}); best {g['best_lr']:g}", scan),
    ) + (
        f"\nunguarded − clean: final loss {common.fmt_ci(f)} (p sign-flip "
        f"{f['p_sign_flip']:.4f}); held-out loss right after the bad window "
        f"{common.fmt_ci(sp)}.\n"
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="spike_recovery")
    cfg, out = ex.cfg, ex.out
    workdir = cli.fresh_workdir(cfg.workdir, out, name="spike_recovery")
    progs = Programs(cfg)
    dirs = (workdir, out / "reports")
    total = (len(ARMS) * len(cfg.seeds) + len(cfg.scan_lrs) * len(cfg.scan_seeds)) * cfg.steps
    runs, scan = ex.sweep(
        total,
        lambda bar: (
            [run_arm(cfg, progs, arm, sd, dirs, bar) for arm in ARMS for sd in cfg.seeds],
            Trainer(cfg.setup()).scan(cfg.scan_lrs, cfg.scan_seeds, progress=bar.update),
        ),
    )
    summary, res = summarize(cfg, runs, scan)
    res["runs"] = runs
    text = table(cfg, res, summary)
    ex.write(res, table=text, title="Spike recovery (main job)", summary=summary)
    panels = {}
    for arm in ARMS:
        rr = [r for r in runs if r["arm"] == arm]
        n = max(len(r["losses"]) for r in rr)
        ys = np.full((len(rr), n), np.nan)
        for j, r in enumerate(rr):
            ys[j, : len(r["losses"])] = r["losses"]
        panels[arm] = {"loss": ys}
    w = bad_window(cfg)
    plots.curves(
        panels,
        path=out / "loss.png",
        xlabel="train-step calls (compute; rollback arms replay steps)",
        ylabel="training loss (nats/byte)",
        cap=8.0,
        marks={a: [w[0], w[-1] + 1] for a in ARMS},
    )
    plots.effects(
        summary["remedies"],
        path=out / "effects.png",
        title=f"remedy − unguarded, {len(cfg.seeds)} seeds (paired t 95% CI, Holm over 4)",
    )
    plots.metric_vs_lr(
        [{**r, "arm": "clean"} for r in scan],
        y="final_loss",
        group="arm",
        path=out / "lr_scan.png",
        title=f"clean arm LR scan (main run: lr {cfg.lr:g})",
        ylabel="final held-out loss (nats/byte)",
        fallback="init_loss",
    )
    for r in runs:
        if "report" in r:
            print(f"stability report (both, seed {r['seed']}): {out / r['report']}")
    print(f"checkpoints and metrics.jsonl of the controller arms: {workdir}")
    print(f"wall {ex.elapsed():.0f}s -> {out}")
    return res


if __name__ == "__main__":
    main()
