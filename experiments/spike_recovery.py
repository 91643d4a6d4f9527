"""The main job: PaLM's rollback-and-skip remedy, end to end, on the reference model.

Trains the reference Transformer on the embedded corpus (Python's own sources) with bad
batches injected at fixed data indices — a window of garbage batches (random target
bytes: a loss spike) and single corrupted batches (out-of-range token ids: NaN) — and
runs three arms:

- ``clean``: the same run on clean data (the reference);
- ``unguarded``: plain ``clip_by_global_norm + adamw`` on the poisoned data;
- ``guarded``: ``skip_nonfinite(skip_spikes(...))`` around the same optimizer, driven by
  :class:`stabljax.RollbackController` (checkpoints, detection, rollback, data skip).

Prints a table (final held-out loss, spikes, rollbacks, batches skipped, steps lost),
writes ``results.json``, ``results.md`` and ``loss.png`` under
``experiments/results/spike_recovery/``.

    python experiments/spike_recovery.py [--quick] [--steps 600] ...
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make `experiments` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import numpy as np

import stabljax
from experiments import common


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 600
    lr: float = 3e-3
    d_model: int = 64
    n_layers: int = 2
    seq_len: int = 64
    batch_size: int = 16
    seed: int = 0
    garbage_start: int = 200
    garbage_len: int = 30
    nan_batches: tuple[int, ...] = (350, 450)
    save_every: int = 25
    keep: int = 4
    rollback_margin: int = 10
    max_skip_streak: int = 8
    spike_warmup: int = 50
    corpus: str | None = None
    workdir: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "checkpoint folder of the guarded arm, which must not exist yet; a "
            "multi-process run needs one that every process sees (default: a fresh "
            "temporary folder, single process only)"
        },
    )

    @classmethod
    def quick(cls) -> Config:
        return cls(
            steps=70,
            d_model=32,
            n_layers=1,
            seq_len=32,
            batch_size=8,
            garbage_start=35,
            garbage_len=10,
            nan_batches=(55, 60),
            save_every=10,
            spike_warmup=15,
        )

    def setup(self) -> common.Setup:
        return common.Setup(
            d_model=self.d_model,
            n_layers=self.n_layers,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            lr=self.lr,
            steps=self.steps,
            seed=self.seed,
            corpus=self.corpus,
        )


def poisoned(batch_fn, cfg: Config):
    """``batch_fn`` with the injected bad batches at their data indices."""
    garbage = range(cfg.garbage_start, cfg.garbage_start + cfg.garbage_len)

    def fn(i: int):
        b = batch_fn(i)
        if i in garbage:  # random target bytes: a bad shard, a loss spike
            rng = np.random.default_rng([cfg.seed, 7, i])
            b = {**b, "targets": rng.integers(0, 256, b["targets"].shape, dtype=np.int32)}
        if i in cfg.nan_batches:  # corrupted token ids: the embedding lookup gives NaN
            b = {**b, "inputs": np.full_like(b["inputs"], 300)}
        return b

    return fn


def bad_indices(cfg: Config) -> set[int]:
    return set(range(cfg.garbage_start, cfg.garbage_start + cfg.garbage_len)) | set(cfg.nan_batches)


class Recorder:
    """Wraps a train step to record every call's metrics (fetched once, at the end)."""

    def __init__(self, step):
        self._step, self.calls, self._metrics = step, 0, []

    def __call__(self, state, batch):
        state, m = self._step(state, batch)
        self.calls += 1
        self._metrics.append({k: m[k] for k in ("loss", "skipped")})
        return state, m

    def losses(self) -> np.ndarray:
        return np.array([float(m["loss"]) for m in jax.device_get(self._metrics)])


def run_arm(cfg: Config, arm: str, workdir: pathlib.Path, bar) -> dict:
    s = cfg.setup()
    base = common.adamw(s)
    if arm == "guarded":
        optimizer = stabljax.skip_nonfinite(
            stabljax.skip_spikes(base, warmup_steps=cfg.spike_warmup)
        )
    else:
        optimizer = base
    run = common.prepare(s, optimizer)
    put, state = run.put, run.state
    clean_fn = common.corpus_batches(s)
    source = clean_fn if arm == "clean" else poisoned(clean_fn, cfg)
    fed: list[int] = []  # data index of every call, in call order

    def batch_fn(i: int):
        fed.append(i)
        return source(i)

    step = Recorder(run.step)
    t0 = time.perf_counter()
    out = {"arm": arm}
    if arm == "guarded":
        ctl = stabljax.RollbackController(
            workdir / "ckpt",
            save_every=cfg.save_every,
            keep=cfg.keep,
            rollback_margin=cfg.rollback_margin,
            detectors=[
                stabljax.SpikeDetector(),
                stabljax.DivergenceDetector(max_skip_streak=cfg.max_skip_streak),
                stabljax.SlowDivergenceDetector(),
            ],
        )
        data = stabljax.IndexedBatches(lambda i: put(batch_fn(i)))
        rollback_calls: list[int] = []

        expected: list[int] = []  # the training step the next call should be at

        def tick(state, batch):
            if ctl.rollbacks > len(rollback_calls):  # the previous call's step rolled back
                rollback_calls.append(step.calls - 1)
            at = int(ctl.current_step)
            if expected and at < expected[0]:  # a rollback: its replay joins the total
                common.grow_bar(bar, expected[0] - at)
            expected[:] = [at + 1]
            state, m = step(state, batch)
            bar.update(1)
            return state, m

        state, data = ctl.run(tick, state, data, cfg.steps, progress=False)
        ctl.close()
        kinds = [e.kind for e in ctl.events]
        used = [i for i in range(data.index) if not any(a <= i < b for a, b in ctl.skipped_ranges)]
        out.update(
            spikes=kinds.count("spike"),
            rollbacks=ctl.rollbacks,
            batches_skipped=sum(b - a for a, b in ctl.skipped_ranges),
            skipped_ranges=ctl.skipped_ranges,
            bad_batches_trained_on=sorted(set(used) & bad_indices(cfg)),
            rollback_calls=rollback_calls,
            events=[e.to_dict() if hasattr(e, "to_dict") else dict(e) for e in ctl.events],
        )
    else:
        for i in range(cfg.steps):
            state, _ = step(state, put(batch_fn(i)))
            bar.update(1)
        out.update(spikes=0, rollbacks=0, batches_skipped=0)
    losses = step.losses()
    out["wall_s"] = time.perf_counter() - t0
    out["losses"] = losses
    out["compute_steps"] = step.calls
    out["steps_lost"] = step.calls - cfg.steps
    bad = bad_indices(cfg) if arm != "clean" else set()
    out["bad_calls"] = [c for c, i in enumerate(fed) if i in bad]
    out["guard_skips"] = int(
        sum(bool(m) for m in jax.device_get([m["skipped"] for m in step._metrics]))
    )
    out["final_loss"] = run.evaluate(state.params)
    if arm != "guarded":
        out["spikes"] = len(common.spike_steps(losses))
    return out


def plot(cfg: Config, arms: dict, path: pathlib.Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = {"clean": "tab:green", "unguarded": "tab:red", "guarded": "tab:blue"}
    for name, r in arms.items():
        y = np.asarray(r["losses"], dtype=float)
        ax.plot(np.arange(len(y)), y, lw=1, color=colors[name], label=name, alpha=0.85)
        bad = ~np.isfinite(y)
        if bad.any():
            first = int(np.argmax(bad))
            ax.axvline(first, color=colors[name], ls=":", lw=1)
            ax.annotate(
                f"{name}: NaN from here",
                (first, ax.get_ylim()[1] * 0.9),
                color=colors[name],
                fontsize=8,
            )
    for name, r in arms.items():
        if r["bad_calls"]:
            y = {"clean": 7.6, "unguarded": 7.3, "guarded": 7.0}[name]
            ax.scatter(
                r["bad_calls"],
                [y] * len(r["bad_calls"]),
                marker="|",
                s=30,
                color=colors[name],
                label=f"{name}: bad batch fed",
            )
    for c in arms.get("guarded", {}).get("rollback_calls", []):
        ax.axvline(c, color="tab:blue", ls="--", lw=0.8)
    ax.set_xlabel("train-step calls (compute)")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_ylim(0, 8)
    ax.set_title("Spike recovery: injected bad batches (dashed: guarded arm's rollbacks)")
    ax.legend(loc="upper right", fontsize=8)
    common.save_figure(fig, path)
    plt.close(fig)


def make_workdir(cfg: Config) -> pathlib.Path:
    """The guarded arm's checkpoint folder: ``--workdir``, else a fresh temporary one.

    The controller resumes from any checkpoint it finds, so a given folder must not exist
    yet; every process checks before any of them writes. A temporary folder is private
    to one process, so a multi-process run must name a shared one.
    """
    if cfg.workdir is None:
        if jax.process_count() > 1:
            raise ValueError(
                "a multi-process run needs --workdir, a folder that every process sees"
            )
        return pathlib.Path(tempfile.mkdtemp(prefix="stabljax-spike-"))
    from jax.experimental import multihost_utils

    workdir = pathlib.Path(cfg.workdir)
    if workdir.exists():
        raise ValueError(f"--workdir {workdir} exists; the run would resume from it")
    multihost_utils.sync_global_devices("spike_recovery: workdir checked")
    return workdir


def main(argv=None) -> dict:
    cfg, args = common.parse_config(Config, argv, __doc__.splitlines()[0], name="spike_recovery")
    common.init_distributed(args)
    out = pathlib.Path(args.out)
    workdir = make_workdir(cfg)
    bar = common.progress_bar(3 * cfg.steps, "spike_recovery", disable=args.no_progress)
    try:
        arms = {arm: run_arm(cfg, arm, workdir, bar) for arm in ("clean", "unguarded", "guarded")}
    finally:
        bar.close()
        if cfg.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    clean = arms["clean"]["final_loss"]
    rows = []
    for name, r in arms.items():
        rows.append(
            {
                "arm": name,
                "final loss": common.finite_or_nan(r["final_loss"]),
                "vs clean": common.finite_or_nan(r["final_loss"] / clean - 1.0),
                "spikes": r["spikes"],
                "rollbacks": r["rollbacks"],
                "batches skipped": r["batches_skipped"],
                "guard skips": r["guard_skips"],
                "steps lost": r["steps_lost"],
            }
        )
    table = common.markdown_table(rows)
    guarded_gap = arms["guarded"]["final_loss"] / clean - 1.0
    summary = {
        "arms": arms,
        "guarded_vs_clean": guarded_gap,
        "guarded_within_1pct": bool(abs(guarded_gap) <= 0.01),
        "unguarded_diverged": bool(not np.isfinite(arms["unguarded"]["final_loss"])),
    }
    common.write_results(
        out, config=cfg, results=summary, table=table, title="Spike recovery (main job)"
    )
    plot(cfg, arms, out / "loss.png")
    print(table)
    print(f"guarded vs clean final loss: {100 * guarded_gap:+.2f}%  ->  {out}")
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
