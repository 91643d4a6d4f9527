"""Benchmark: the controller's cost inside someone else's small trainer, and ms per save.

The adopted trainer of README's recipe (``examples/trainer_after.py``: a 2-layer linen LM,
``optax.MultiSteps`` under the guards, a Grain ``DataLoader``) runs ``steps`` steps in a
bare loop (``state, metrics = train_step(state, next(data))``) and in loops that also call
``ctl.step`` with a save every ``save_every`` steps and ``ctl.finish`` at the end, one per
save mode: ``sync`` (``async_save=False``: the loop waits for the whole write),
``async`` (the default: Orbax copies to host, then writes in its own thread) and
``background`` (``background_save=True``: the loop dispatches a device copy, a worker
thread does the rest). Rounds alternate bare / sync / async / background; each loop is
timed from its first step until ``finish`` returned (the last save committed), and the
ratios are of the median loop times. ``ms/save`` is the median time of ``ctl.step`` on a
save step minus its median on the other steps; with ``--profile`` a cProfile of the
save steps of one async loop says where that time goes.

    python -m experiments.bench.adoption [--quick] [--steps 400 --save-every 100]
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import pstats
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np

import stabljax
from examples import trainer_after as trainer
from experiments import cli
from stabljax.reference import default_corpus

TARGETS = {"loop_time_async/bare": 1.05}
MODES = {
    "sync": dict(async_save=False),
    "async": dict(async_save=True),
    "background": dict(background_save=True),
}


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 400
    save_every: int = 100
    rounds: int = 5
    profile: bool = False

    @classmethod
    def quick(cls) -> Config:
        return cls(steps=20, save_every=10, rounds=1)


def run(cfg: Config) -> tuple[list[dict], dict]:
    tcfg = trainer.Config(steps=cfg.steps)
    n = tcfg.seq_len + 1
    corpus = np.asarray(default_corpus(n * tcfg.batch_size * (cfg.steps + 1)))
    docs = [(corpus[i * n : (i + 1) * n].tobytes(), 1.0) for i in range(len(corpus) // n)]
    model = trainer.LM(tcfg)
    params = model.init(jax.random.key(0), np.zeros((1, tcfg.seq_len), np.int32))["params"]
    tx = stabljax.skip_nonfinite(
        stabljax.skip_spikes(trainer.optax.MultiSteps(trainer.optax.adamw(tcfg.lr), 2))
    )

    def fresh():
        return trainer.train_state.TrainState.create(
            apply_fn=model.apply, params=jax.tree.map(np.copy, params), tx=tx
        )

    def batches():  # device batches made up front: the loop measures the loop only
        it = iter(trainer.make_loader(docs, tcfg))
        return [jax.device_put(next(it)) for _ in range(cfg.steps)]

    data_cache = batches()
    s, m = trainer.train_step(fresh(), data_cache[0])  # compile outside the timing
    jax.block_until_ready(m)

    def bare() -> float:
        state = fresh()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for b in data_cache:
            state, metrics = trainer.train_step(state, b)
        jax.block_until_ready((state, metrics))
        return time.perf_counter() - t0

    save_ms: dict[str, list[float]] = {k: [] for k in MODES}
    step_ms: dict[str, list[float]] = {k: [] for k in MODES}

    def controlled(mode: str, profiler: cProfile.Profile | None = None) -> float:
        directory = tempfile.mkdtemp(prefix="stabljax-bench-adopt-")
        try:
            ctl = stabljax.RollbackController(
                directory, save_every=cfg.save_every, rollback_margin=cfg.save_every, **MODES[mode]
            )
            data = stabljax.control.IndexedBatches(lambda i: data_cache[i])
            state, data = ctl.restore_or_init(fresh(), data)
            jax.block_until_ready(state)
            on_save, other = [], []
            t0 = time.perf_counter()
            while ctl.current_step < cfg.steps:
                state, metrics = trainer.train_step(state, next(data))
                due = (ctl.current_step + 1) % cfg.save_every == 0
                if profiler is not None and due:
                    profiler.enable()
                t = time.perf_counter()
                state, data = ctl.step(state, metrics, data)
                (on_save if due else other).append(time.perf_counter() - t)
                if profiler is not None and due:
                    profiler.disable()
            state, data = ctl.finish(state, data)
            jax.block_until_ready(state)
            elapsed = time.perf_counter() - t0
            ctl.close()
            if on_save and other:
                save_ms[mode].append(1e3 * (statistics.median(on_save) - statistics.median(other)))
                step_ms[mode].append(1e3 * statistics.median(other))
            return elapsed
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    for mode in MODES:  # warm Orbax's own compilations and threads
        controlled(mode)
    for v in (*save_ms.values(), *step_ms.values()):
        v.clear()
    samples: dict[str, list[float]] = {"bare": [], **{m: [] for m in MODES}}
    for _ in range(cfg.rounds):
        samples["bare"].append(bare())
        for mode in MODES:
            samples[mode].append(controlled(mode))
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [
        {
            "loop": k,
            "s/loop": v,
            "ms/step": 1e3 * v / cfg.steps,
            "ms/save (ctl.step on a save step - other steps)": (
                statistics.median(save_ms[k]) if save_ms.get(k) else ""
            ),
            "ms/ctl.step (other steps)": statistics.median(step_ms[k]) if step_ms.get(k) else "",
        }
        for k, v in med.items()
    ]
    ratios = {f"loop_time_{m}/bare": med[m] / med["bare"] for m in MODES}
    results = {
        "seconds": med,
        "samples": samples,
        "save_ms": save_ms,
        "ctl_step_ms": step_ms,
        "ratios": ratios,
        "targets": TARGETS,
        "saves_per_loop": cfg.steps // cfg.save_every,
        "n_params": int(sum(x.size for x in jax.tree.leaves(params))),
    }
    if cfg.profile:
        profiler = cProfile.Profile()
        controlled("async", profiler)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        results["profile_async_save_steps"] = out.getvalue()
    return rows, results


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.adoption")
    cfg = ex.cfg
    rows, results = run(cfg)
    title = f"Controller in the adopted trainer, {cfg.steps} steps, a save every {cfg.save_every}"
    return ex.report(rows, results, targets=TARGETS, title=title)


if __name__ == "__main__":
    main()
