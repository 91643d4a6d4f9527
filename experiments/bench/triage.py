"""Benchmark: the cost of spike triage against the same number of plain replayed steps.

Trains the reference Transformer under ``RollbackController(triage=...)`` on the corpus
with one garbage batch at data index ``bad`` (every target byte NUL, which the corpus
never holds): the loss spikes, the controller rolls back and triage replays the window
(from the restored checkpoint, the onset again, from the checkpoint before, each batch
alone). The triage event gives its wall time and its replayed steps ``n``. Right after,
in the same process, the same jitted step runs ``n`` times in a bare loop on the same
device batches ("plain replay", timed to the final state's readiness). The figure is the
ratio of the medians over ``rounds`` runs; the issue's bar is triage <= 1.10 x the plain
replay. Two models: "large" (the step time dominates the checkpoint restore and the
copies that triage also pays) and "small" (it does not), side by side.

With ``--keep-dir`` the last large run's directory (with ``metrics.jsonl`` and
``report.html``, from ``stabljax.report``) is copied there.

    python -m experiments.bench.triage [--quick] [--rounds 3]
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

import stabljax
from experiments.bench.timing import bench_main
from experiments.common import Setup, adamw, build_model, corpus_batches

TARGETS = {"triage/plain_large": 1.10}


@dataclasses.dataclass(frozen=True)
class Config:
    large_d_model: int = 256
    large_n_layers: int = 4
    large_seq_len: int = 128
    large_batch_size: int = 16
    small_d_model: int = 32
    small_n_layers: int = 1
    small_seq_len: int = 32
    small_batch_size: int = 4
    steps: int = 44
    bad: int = 35
    save_every: int = 10
    rounds: int = 3
    seed: int = 0
    keep_dir: str | None = dataclasses.field(
        default=None, metadata={"help": "copy the last large run's directory (and report) here"}
    )

    @classmethod
    def quick(cls) -> Config:
        return cls(
            large_d_model=64,
            large_n_layers=1,
            large_seq_len=32,
            large_batch_size=4,
            small_d_model=16,
            small_seq_len=16,
            small_batch_size=2,
            rounds=1,
        )


def _model(cfg: Config, size: str):
    names = ("d_model", "n_layers", "seq_len", "batch_size")
    pick = {k: getattr(cfg, f"{size}_{k}") for k in names}
    setup = Setup(
        n_heads=4 if pick["d_model"] >= 64 else 2, seed=cfg.seed, corpus_bytes=400_000, **pick
    )
    model, _ = build_model(setup)
    apply_fn, params = stabljax.nnx_apply(model)
    opt = adamw(setup)
    step = stabljax.make_train_step(stabljax.lm_loss(apply_fn), opt, layer_metrics=True)
    host = corpus_batches(setup)

    def make(i):
        b = host(i)
        if i == cfg.bad:  # a bad shard of NUL bytes (never in the corpus): a spike from any state
            b = {**b, "targets": np.zeros_like(b["targets"])}
        return jax.tree.map(jax.numpy.asarray, b)

    batches = [make(i) for i in range(cfg.steps + 40)]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return params, opt, step, batches, int(n_params)


def _one(cfg: Config, size: str, model, directory: pathlib.Path) -> dict:
    params, opt, step, batches, _ = model
    state = stabljax.TrainState.create(jax.tree.map(jax.numpy.copy, params), opt)
    ctl = stabljax.RollbackController(
        directory,
        save_every=cfg.save_every,
        keep=3,
        rollback_margin=5,
        # A sensitive detector: the small model's spike is only 1.45x its loss.
        detectors=[stabljax.SpikeDetector(4.0, warmup=10, window=16, rel_floor=0.25)],
        triage=stabljax.TriageConfig(spike_ratio=1.25),  # the small model's spike is 1.45x
    )
    with ctl, stabljax.control.JsonlMetricsWriter(directory / "metrics.jsonl") as writer:
        ctl.run(
            step,
            state,
            stabljax.IndexedBatches(batches.__getitem__),
            cfg.steps,
            progress=False,
            metrics_writer=writer,
        )
    found = [e.details for e in ctl.events if e.kind == "triage"]
    if not found:
        raise RuntimeError(f"{size}: no rollback, so no triage (events: {ctl.events!r})")
    t = found[0]
    # The plain replay: the same number of steps of the same step on the same batches.
    indices = [r["index"] for r in t["replayed"]]
    plain_state = stabljax.TrainState.create(jax.tree.map(jax.numpy.copy, params), opt)
    jax.block_until_ready(plain_state)
    t0 = time.perf_counter()
    for i in indices:
        plain_state, m = step(plain_state, batches[i])
    jax.block_until_ready((plain_state, m))
    plain = time.perf_counter() - t0
    return {
        "triage_s": t["seconds"],
        "plain_s": plain,
        "steps": t["steps"],
        "verdict": t["verdict"],
        "culprits": t["culprits"],
    }


def run(cfg: Config) -> tuple[list[dict], dict]:
    rows, ratios, samples = [], {}, {}
    for size in ("large", "small"):
        model = _model(cfg, size)
        runs = []
        for k in range(cfg.rounds + 1):  # the first run warms compilations and Orbax
            directory = pathlib.Path(tempfile.mkdtemp(prefix=f"stabljax-bench-triage-{size}-"))
            try:
                r = _one(cfg, size, model, directory)
                if k:
                    runs.append(r)
                if size == "large" and k == cfg.rounds and cfg.keep_dir:
                    from stabljax.report import write_report

                    write_report(directory)
                    shutil.rmtree(cfg.keep_dir, ignore_errors=True)
                    shutil.copytree(directory, cfg.keep_dir)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        tri = statistics.median(r["triage_s"] for r in runs)
        plain = statistics.median(r["plain_s"] for r in runs)
        steps = runs[-1]["steps"]
        rows.append(
            {
                "model": size,
                "params": model[4],
                "replayed steps": steps,
                "triage s": tri,
                "plain replay s": plain,
                "ms/step plain": 1e3 * plain / steps,
                "triage/plain": tri / plain,
                "verdict": runs[-1]["verdict"],
                "culprits": runs[-1]["culprits"],
            }
        )
        ratios[f"triage/plain_{size}"] = tri / plain
        samples[size] = runs
    return rows, {"ratios": ratios, "targets": TARGETS, "samples": samples}


def main(argv=None) -> dict:
    return bench_main(
        Config,
        run,
        argv,
        description=__doc__.splitlines()[0],
        stem="triage",
        targets=TARGETS,
        title=lambda cfg, r: "Spike triage: wall time vs the same number of plain replayed steps",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
