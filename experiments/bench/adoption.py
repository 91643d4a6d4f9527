"""Benchmark: the controller's cost inside someone else's small trainer, and ms per save.

Two sections, rounds interleaved in one process.

**trainer** runs the example trainers' own ``train`` loops (``examples/``: a 2-layer linen
LM, ``optax.MultiSteps``, a Grain ``DataLoader``, the trainer's own Orbax
``CheckpointManager`` asked to save every step and saving every ``save_every``), each
timed from the end of its first step (compilation excluded) to its evaluation (the last
saves committed):

- ``before``: ``trainer_before.py`` as its authors wrote it;
- ``without``: ``trainer_after.py`` with the controller replaced by a pass-through (guards
  and z-loss only): the baseline of the controller's cost;
- ``both_async`` / ``both_sync``: ``trainer_after.py`` as README's recipe has it, the
  trainer's checkpoint and the controller's (saving every ``save_every``) beside each other,
  with ``async_save`` True / False;
- ``handover_async`` / ``handover_sync`` / ``handover_background``: ``trainer_handover.py``,
  the controller's checkpoint the only one (``background_save=True`` for the last: safe
  here, since no other Orbax save runs in the process).

A ratio is the median over rounds of a loop's time over ``without``'s in the same round
(the machine's load drifts between rounds). ``ms/save`` is the median time of ``ctl.step``
on a save step minus its median on the other steps (what a save puts on the training
thread). ``background_save`` beside the trainer's own ``CheckpointManager`` is not timed:
the two savers share Orbax's process-global operation id and can stall each other for
minutes (BUILD.md).

**bare** is the controller alone: a loop of ``train_step`` on device batches made up front,
against the same loop with ``ctl.step`` and ``ctl.finish``, per save mode.

    python -m experiments.bench.adoption [--quick] [--steps 400 --save-every 100 --rounds 5]
"""

from __future__ import annotations

import cProfile
import dataclasses
import io
import pathlib
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax
import numpy as np

import stabljax
from examples import trainer_after, trainer_before, trainer_handover
from experiments import cli
from stabljax.reference import default_corpus

TARGETS = {"trainer_handover_async/without": 1.05}
MODES = {
    "sync": dict(async_save=False),
    "async": dict(async_save=True),
    "background": dict(background_save=True),
}
VARIANTS = {  # name: (trainer module, the controller's save mode or None: no controller)
    "before": (trainer_before, None),
    "without": (trainer_after, None),
    "both_async": (trainer_after, "async"),
    "both_sync": (trainer_after, "sync"),
    "handover_async": (trainer_handover, "async"),
    "handover_sync": (trainer_handover, "sync"),
    "handover_background": (trainer_handover, "background"),
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


class _NoController:
    """Stands in for ``stabljax.RollbackController``: the loop without the controller."""

    def __init__(self, *args, **kwargs):
        pass

    def restore_or_init(self, state, data, *, total_steps=None):
        return state, data

    step = finish = lambda self, state, *rest: (state, rest[-1])

    def close(self):
        pass


def _controller(mode: str, save_every: int, calls: list[tuple[int, float]]) -> type:
    """``RollbackController`` saving every ``save_every`` in ``mode``, timing each ``step``."""

    class Timed(stabljax.RollbackController):
        def __init__(self, *args, **kwargs):
            super().__init__(
                *args,
                **{
                    **kwargs,
                    "save_every": save_every,
                    "rollback_margin": save_every,
                    **MODES[mode],
                },
            )

        def step(self, state, metrics, data):
            t = time.perf_counter()
            out = super().step(state, metrics, data)
            calls.append((self.current_step, time.perf_counter() - t))
            return out

    return Timed


def _rows(section: str, med: dict, save_ms: dict, step_ms: dict, steps: int) -> list[dict]:
    """The table's rows: each loop's median time, and its save and step costs in ms."""
    median = lambda v: statistics.median(v) if v else ""
    return [
        {
            "loop": f"{section}: {k}",
            "s/loop": v,
            "ms/step": 1e3 * v / steps,
            "ms/save (ctl.step on a save step - other steps)": median(save_ms.get(k)),
            "ms/ctl.step (other steps)": median(step_ms.get(k)),
        }
        for k, v in med.items()
    ]


def run_trainers(cfg: Config) -> tuple[list[dict], dict]:
    tcfg = trainer_after.Config(steps=cfg.steps, save_every=cfg.save_every)
    n = tcfg.seq_len + 1
    corpus = np.asarray(default_corpus(n * tcfg.batch_size * (cfg.steps + 2)))
    docs = [(corpus[i * n : (i + 1) * n].tobytes(), 1.0) for i in range(len(corpus) // n)]
    held_out = docs[-tcfg.batch_size :]

    def loop(name: str, tc, calls: list) -> float:
        module, mode = VARIANTS[name]
        marks: list[float] = []
        evaluate = module.eval_loss

        def on_step(state, metrics):
            if not marks:
                marks.append(time.perf_counter())

        def eval_loss(*args):
            if len(marks) == 1:
                marks.append(time.perf_counter())
            return evaluate(*args)

        ctl = _NoController if mode is None else _controller(mode, tc.save_every, calls)
        workdir = tempfile.mkdtemp(prefix="stabljax-bench-trainer-")
        try:
            with (
                mock.patch.object(stabljax, "RollbackController", ctl),
                mock.patch.object(module, "eval_loss", eval_loss),
            ):
                module.train(
                    module.Config(**dataclasses.asdict(tc)),
                    docs,
                    held_out,
                    pathlib.Path(workdir),
                    on_step,
                )
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return marks[1] - marks[0]

    warm = dataclasses.replace(tcfg, steps=cfg.save_every + 2)
    for name in VARIANTS:  # Orbax's threads and first-save costs, Grain's workers
        loop(name, warm, [])
    samples: dict[str, list[float]] = {k: [] for k in VARIANTS}
    save_ms: dict[str, list[float]] = {k: [] for k, (_, m) in VARIANTS.items() if m}
    step_ms: dict[str, list[float]] = {k: [] for k in save_ms}
    names = list(VARIANTS)
    for r in range(cfg.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            calls: list[tuple[int, float]] = []
            samples[name].append(loop(name, tcfg, calls))
            if calls:
                due = [t for k, t in calls if k % cfg.save_every == 0]
                other = [t for k, t in calls if k % cfg.save_every]
                save_ms[name].append(1e3 * (statistics.median(due) - statistics.median(other)))
                step_ms[name].append(1e3 * statistics.median(other))
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = _rows("trainer", med, save_ms, step_ms, cfg.steps - 1)

    # Each loop against the baseline of its own round (the load drifts between rounds).
    def paired(k: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(samples[k], samples[base], strict=True))

    with_ctl = [k for k, (_, mode) in VARIANTS.items() if mode is not None]
    ratios = {f"trainer_{k}/without": paired(k, "without") for k in with_ctl}
    ratios["trainer_without/before"] = paired("without", "before")
    results = {
        "seconds": med,
        "samples": samples,
        "save_ms": save_ms,
        "ctl_step_ms": step_ms,
        "ratios": ratios,
    }
    return rows, results


def _controlled_loop(
    cfg: Config,
    mode: str,
    fresh: Callable[[], Any],
    data_cache: list[Any],
    save_ms: dict[str, list[float]],
    step_ms: dict[str, list[float]],
    profiler: cProfile.Profile | None = None,
) -> float:
    """Seconds of ``trainer_after``'s step under a controller in ``mode`` over the cached
    batches; appends the median extra milliseconds of a saving ``ctl.step`` and of the
    others to ``save_ms[mode]`` and ``step_ms[mode]``; profiles the saving steps if asked."""
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
            state, metrics = trainer_after.train_step(state, next(data))
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


def run_bare(cfg: Config) -> tuple[list[dict], dict]:
    tcfg = trainer_after.Config(steps=cfg.steps)
    n = tcfg.seq_len + 1
    corpus = np.asarray(default_corpus(n * tcfg.batch_size * (cfg.steps + 1)))
    docs = [(corpus[i * n : (i + 1) * n].tobytes(), 1.0) for i in range(len(corpus) // n)]
    model = trainer_after.LM(tcfg)
    params = model.init(jax.random.key(0), np.zeros((1, tcfg.seq_len), np.int32))["params"]
    tx = stabljax.skip_nonfinite(
        stabljax.skip_spikes(trainer_after.optax.MultiSteps(trainer_after.optax.adamw(tcfg.lr), 2))
    )

    def fresh():
        return trainer_after.train_state.TrainState.create(
            apply_fn=model.apply, params=jax.tree.map(np.copy, params), tx=tx
        )

    def batches():  # device batches made up front: the loop measures the loop only
        it = iter(trainer_after.make_loader(docs, tcfg))
        return [jax.device_put(next(it)) for _ in range(cfg.steps)]

    data_cache = batches()
    s, m = trainer_after.train_step(fresh(), data_cache[0])  # compile outside the timing
    jax.block_until_ready(m)

    def bare() -> float:
        state = fresh()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for b in data_cache:
            state, metrics = trainer_after.train_step(state, b)
        jax.block_until_ready((state, metrics))
        return time.perf_counter() - t0

    save_ms: dict[str, list[float]] = {k: [] for k in MODES}
    step_ms: dict[str, list[float]] = {k: [] for k in MODES}

    def controlled(mode: str, profiler: cProfile.Profile | None = None) -> float:
        return _controlled_loop(cfg, mode, fresh, data_cache, save_ms, step_ms, profiler)

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
    rows = _rows("bare", med, save_ms, step_ms, cfg.steps)
    ratios = {f"bare_loop_{m}/bare": med[m] / med["bare"] for m in MODES}
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
    rows, results = run_trainers(cfg)
    bare_rows, bare = run_bare(cfg)
    results = {
        "trainer": results,
        "bare": bare,
        "seconds": {**results["seconds"], **{f"bare_{k}": v for k, v in bare["seconds"].items()}},
        "save_ms": {**results["save_ms"], **{f"bare_{k}": v for k, v in bare["save_ms"].items()}},
        "ratios": {**results["ratios"], **bare["ratios"]},
        "targets": TARGETS,
        "n_params": bare["n_params"],
        "saves_per_loop": cfg.steps // cfg.save_every,
    }
    title = f"Controller in the adopted trainer, {cfg.steps} steps, a save every {cfg.save_every}"
    return ex.report([*rows, *bare_rows], results, targets=TARGETS, title=title)


if __name__ == "__main__":
    main()
