"""The main job: which remedy recovers a run from bad data, attributed arm by arm.

Trains the reference Transformer on the embedded corpus (Python's own sources) with two
kinds of bad data injected at fixed data indices, and five arms on each of 3 seeds:

- a window of **garbage batches** (random target bytes: a bad shard, a loss spike);
- **state-dependent traps**: batches whose loss is NaN only when the model's loss on them
  is already below ``trap_threshold`` (inside the loss function: it depends on the
  parameters, not on a peek at the controller). The first trap falls where the model has
  not learnt yet and is harmless; the later ones fire. PaLM saw spikes that the same
  batches did not cause from another state; this is a synthetic, deterministic version.

Arms: ``clean`` (no bad data), ``unguarded`` (``clip_by_global_norm + adamw``), ``guards``
(``skip_nonfinite(skip_spikes(...))`` around it), ``rollback`` (the plain optimizer driven
by :class:`stabljax.RollbackController`: checkpoints, detection, rollback, data skip) and
``both``. The controller's margins are PaLM's scaled to the run: restart about
``steps / 8`` steps before the onset (PaLM: ~100 steps) and skip past the detection by
``garbage_len`` batches, so the skip covers the bad window. Reports the final held-out
loss with its interval, steps lost (compute steps beyond ``steps``), batches skipped,
rollbacks and the bad updates applied in the final trajectory; effects are paired per seed
against ``unguarded`` (a diverged run counts as its loss at init).

    python experiments/spike_recovery.py [--quick] [--steps 400] [--seeds 0 1 2] ...
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import sys
import time

if __package__ in (None, ""):  # run as a script: make `experiments` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import numpy as np

import stabljax
import stabljax.report
from experiments import cli, common, faults, plots, proxy, stats
from experiments.faults import Programs, garbage

ARMS = ("clean", "unguarded", "guards", "rollback", "both")
DETECTION_DELAY = 21  # DivergenceDetector's default max_skip_streak, plus one
TRIAGE_KEYS = ("verdict", "reason", "window", "culprits", "narrowed")


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 400
    lr: float = 3e-3
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 2
    seq_len: int = 32
    batch_size: int = 8
    seeds: tuple[int, ...] = (0, 1, 2)
    garbage_start: int = 150
    garbage_len: int = 30
    traps: tuple[int, ...] = (20, 260, 320)
    trap_threshold: float = 2.9
    save_every: int = 10
    spike_warmup: int = 50
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
            seq_len=16,
            seeds=(0, 1, 2),
            garbage_start=40,
            garbage_len=8,
            traps=(2, 60),
            trap_threshold=4.5,
            save_every=5,
            spike_warmup=15,
        )

    @property
    def margin(self) -> int:
        """PaLM's ~100 steps before the onset, scaled to the run length."""
        return max(self.save_every, self.steps // 8)

    def setup(self, seed: int) -> proxy.Setup:
        return proxy.Setup(
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            lr=self.lr,
            steps=self.steps,
            seed=seed,
            corpus=self.corpus,
        )


def run_arm(cfg: Config, progs: Programs, arm: str, seed: int, dirs: tuple, bar):
    workdir, report_dir = dirs
    s = cfg.setup(seed)
    kind = "guarded" if arm in ("guards", "both") else "plain"
    _, params = proxy.initial_model(s)
    params = jax.device_put(params, progs.rep)
    init_loss = progs.evaluate(s, params)
    state = stabljax.TrainState.create(params, progs.optimizers[kind])
    step = progs.steps[kind]
    source = proxy.corpus_batches(s)
    source = faults.clean_batches(source) if arm == "clean" else faults.poisoned(source, cfg, seed)
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
        triage = arm == "both" and stabljax.TriageConfig(
            step_fn=step, batch_fn=lambda i: progs.put(source(i))
        )
        ctl = stabljax.RollbackController(
            ckpt,
            triage=triage,
            save_every=cfg.save_every,
            # Enough checkpoints that one lies `margin` before an onset even when the
            # detection comes late (a 20-step skip streak, or 10 steps of patience).
            keep=(cfg.margin + DETECTION_DELAY) // cfg.save_every + 2,
            rollback_margin=cfg.margin,
            extra_skip=cfg.garbage_len,
            detectors=[
                stabljax.SpikeDetector(),
                stabljax.DivergenceDetector(),
                stabljax.SlowDivergenceDetector(),
            ],
        )
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
                stabljax.IndexedBatches(batch_fn),
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
        )
    else:
        for i in range(cfg.steps):
            if len(calls) >= 2:  # at most two steps in flight (BUILD.md, "Bounded dispatch")
                jax.block_until_ready(calls[-2]["m"])
            state, m = step(state, batch_fn(i))
            calls.append({"step": i, "index": i, "m": m})
            bar.update(1)
        out.update(rollbacks=0, batches_skipped=0, skipped_ranges=[])
    got = jax.device_get([c["m"] for c in calls])
    final_call = {}  # the call that trained each step of the final trajectory
    for k, c in enumerate(calls):
        final_call[c["step"]] = k
    bad_applied = 0
    for k in final_call.values():
        m, idx = got[k], calls[k]["index"]
        applied = not bool(m["skipped"])
        if arm != "clean" and applied and (idx in garbage(cfg) or bool(m["trap_fired"])):
            bad_applied += 1
    losses = np.array([float(m["loss"]) for m in got])
    final = progs.evaluate(s, state.params)
    out.update(
        wall_s=time.perf_counter() - t0,
        losses=losses,
        compute_steps=len(calls),
        steps_lost=len(calls) - cfg.steps,
        guard_skips=int(sum(bool(m["skipped"]) for m in got)),
        traps_fired=[calls[k]["index"] for k, m in enumerate(got) if bool(m["trap_fired"])],
        bad_updates_applied=bad_applied,
        final_loss=common.finite_or_nan(final),
        diverged=not np.isfinite(final),
        bad_calls=[
            k for k, c in enumerate(calls) if c["index"] in garbage(cfg) or c["index"] in cfg.traps
        ],
    )
    return out


def make_workdir(cfg: Config, out: pathlib.Path) -> pathlib.Path:
    """The controller arms' checkpoint folder: ``--workdir``, else ``<out>/ckpt`` (emptied)."""
    if cfg.workdir is None:
        if jax.process_count() > 1:
            raise ValueError("a multi-process run needs --workdir, a folder every process sees")
        workdir = out / "ckpt"
        shutil.rmtree(workdir, ignore_errors=True)  # this run's own folder: start afresh
        return workdir
    from jax.experimental import multihost_utils

    workdir = pathlib.Path(cfg.workdir)
    if workdir.exists():
        raise ValueError(f"--workdir {workdir} exists; the run would resume from it")
    multihost_utils.sync_global_devices("spike_recovery: workdir checked")
    return workdir


def summarize(cfg: Config, runs: list[dict]) -> tuple[dict, dict]:
    def col(arm, key, diverged_as_init=False):
        rr = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if diverged_as_init:
            return [r["init_loss"] if r["diverged"] else r["final_loss"] for r in rr]
        return [r[key] for r in rr]

    arms = {}
    for arm in ARMS:
        fl = col(arm, "final_loss", diverged_as_init=True)
        arms[arm] = {
            "final_loss": stats.interval(fl),
            "diverged": int(sum(col(arm, "diverged"))),
            **{
                k: float(np.mean(col(arm, k)))
                for k in (
                    "steps_lost",
                    "batches_skipped",
                    "rollbacks",
                    "guard_skips",
                    "bad_updates_applied",
                )
            },
        }
    base = col("unguarded", "final_loss", diverged_as_init=True)
    remedies, effects = {}, {}
    for arm in ("guards", "rollback", "both"):
        e = stats.paired_effect(col(arm, "final_loss", True), base, "final loss (diverged = init)")
        mech = stats.moved(col(arm, "bad_updates_applied"), col("unguarded", "bad_updates_applied"))
        effects[arm] = {
            "final_loss": e,
            "mechanism": mech,
            "vs_clean": stats.paired_effect(
                col(arm, "final_loss", True), col("clean", "final_loss", True), "final loss"
            ),
        }
        remedies[arm] = stats.remedy(
            "final held-out loss (diverged = init)",
            e,
            mech,
            "bad updates applied in the final trajectory",
        )
    summary = stats.summary(
        instability_reproduced=bool(
            arms["unguarded"]["diverged"] > 0
            or stats.below_zero(stats.paired_effect(col("clean", "final_loss", True), base, "x"))
        ),
        failure_metric="unguarded final loss non-finite or above the clean run's (paired CI)",
        remedies=remedies,
        seeds=len(cfg.seeds),
        sizes=[f"d{cfg.d_model}x{cfg.n_layers}"],
    )
    return summary, {"arms": arms, "effects": effects}


def table(res: dict) -> str:
    rows = []
    for arm, a in res["arms"].items():
        fl = a["final_loss"]
        rows.append(
            {
                "arm": arm,
                "final loss [95% CI]": (
                    f"{fl['mean']:.3f} [{fl['ci95'][0]:.3f}, {fl['ci95'][1]:.3f}]"
                ),
                "diverged": a["diverged"],
                "rollbacks": a["rollbacks"],
                "batches skipped": a["batches_skipped"],
                "guard skips": a["guard_skips"],
                "steps lost": a["steps_lost"],
                "bad updates applied": a["bad_updates_applied"],
            }
        )
    eff = [
        {
            "arm − unguarded": k,
            "Δ final loss [95% CI]": common.fmt_ci(v["final_loss"]),
            "arm − clean": common.fmt_ci(v["vs_clean"]),
            "Δ bad updates applied [95% CI]": common.fmt_ci(v["mechanism"], 1),
        }
        for k, v in res["effects"].items()
    ]
    return (
        "Means over seeds (a diverged run's final loss counts as its loss at init)\n\n"
        + common.markdown_table(rows)
        + "\nPaired per-seed differences, 95 % bootstrap intervals\n\n"
        + common.markdown_table(eff)
    )


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="spike_recovery")
    cfg, out = ex.cfg, ex.out
    workdir = make_workdir(cfg, out)
    progs = Programs(cfg)
    dirs = (workdir, out / "reports")
    runs = ex.sweep(
        len(ARMS) * len(cfg.seeds) * cfg.steps,
        lambda bar: [run_arm(cfg, progs, arm, sd, dirs, bar) for arm in ARMS for sd in cfg.seeds],
    )
    summary, res = summarize(cfg, runs)
    res["runs"] = runs
    text = table(res)
    ex.write(res, table=text, title="Spike recovery (main job)", summary=summary)
    panels = {}
    for arm in ARMS:
        rr = [r for r in runs if r["arm"] == arm]
        n = max(len(r["losses"]) for r in rr)
        ys = np.full((len(rr), n), np.nan)
        for j, r in enumerate(rr):
            ys[j, : len(r["losses"])] = r["losses"]
        panels[f"{arm} (x: step calls)"] = {"loss": ys}
    plots.curves(
        panels,
        path=out / "loss.png",
        xlabel="train-step calls (compute)",
        ylabel="training loss (nats/byte)",
        cap=8.0,
        marks={f"{a} (x: step calls)": [cfg.garbage_start, *cfg.traps] for a in ARMS},
    )
    print(text)
    for r in runs:
        if "report" in r:
            print(f"stability report (both, seed {r['seed']}): {out / r['report']}")
    print(f"checkpoints and metrics.jsonl of the controller arms: {workdir}")
    print(f"wall {ex.elapsed():.0f}s -> {out}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
