"""Benchmark 3: steps per second of a loop driven by ``RollbackController.step``.

The same jitted train step of the reference model (``make_train_step``) runs ``steps``
times in a bare loop (``state, metrics = step(state, next(data))``) and in loops that
also call ``ctl.step(state, metrics, data)`` with asynchronous Orbax saves every
``save_every`` steps (the last at the last step): "controlled" with the default
``RollbackController`` (Orbax's device-to-host copy and setup block the loop), and
"controlled+background" with ``background_save=True`` (a device copy of the state is
saved by a worker thread). Each loop is timed until its final state is
ready; ``ctl.finish`` (reading the last metrics and waiting for the last save's write,
a one-off cost per run) is timed on its own and reported as seconds and as a second
ratio with it included. Rounds alternate bare / controlled / controlled+background;
ratios are of the median steps per second.

    python -m experiments.bench.controller [--quick] [--steps 200 --save-every 50]
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax

import stabljax
from experiments import cli
from experiments.proxy import QUICK_SIZE, ModelSize, adamw, build_model, corpus_batches

TARGETS = {"steps_per_s_controlled/bare": 0.97, "steps_per_s_controlled+background/bare": 0.97}


@dataclasses.dataclass(frozen=True)
class Config(ModelSize):
    d_model: int = 128
    seq_len: int = 64
    steps: int = 200
    save_every: int = 50
    rounds: int = 5
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(**QUICK_SIZE, steps=10, save_every=5, rounds=1)


def _controlled_rate(
    cfg: Config,
    step: Callable[[Any, Any], tuple[Any, Any]],
    fresh: Callable[[], Any],
    batch_fn: Callable[[int], Any],
    background: bool,
    finish_s: dict[str, list[float]],
    with_finish: dict[str, list[float]],
) -> float:
    """Steps per second of ``step`` under a controller (``background_save`` as given), the
    final ``ctl.finish`` left out; appends its seconds to ``finish_s`` and the rate with it
    to ``with_finish``, under the mode's name."""
    name = "controlled+background" if background else "controlled"
    directory = tempfile.mkdtemp(prefix="stabljax-bench-ctl-")
    try:
        ctl = stabljax.RollbackController(
            directory,
            save_every=cfg.save_every,
            rollback_margin=cfg.save_every,  # a margin the kept checkpoints can hold
            background_save=background,
        )
        state, data = ctl.restore_or_init(fresh(), stabljax.control.IndexedBatches(batch_fn))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        while ctl.current_step < cfg.steps:
            state, metrics = step(state, next(data))
            state, data = ctl.step(state, metrics, data)
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        state, data = ctl.finish(state, data)
        jax.block_until_ready(state)
        t2 = time.perf_counter()
        ctl.close()
        finish_s[name].append(t2 - t1)
        with_finish[name].append(cfg.steps / (t2 - t0))
        return cfg.steps / (t1 - t0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run(cfg: Config) -> tuple[list[dict], dict]:
    setup = cfg.setup(seed=cfg.seed, corpus_bytes=200_000)
    model, _ = build_model(setup)
    apply_fn, params = stabljax.nnx_apply(model)
    opt = adamw(setup)
    step = stabljax.make_train_step(stabljax.lm_loss(apply_fn), opt)
    host_batch = corpus_batches(setup)
    batches = [jax.tree.map(jax.numpy.asarray, host_batch(i)) for i in range(cfg.steps)]

    def batch_fn(i):  # device batches made up front: the loop measures the loop only
        return batches[i % len(batches)]

    def fresh():
        return stabljax.TrainState.create(jax.tree.map(jax.numpy.copy, params), opt)

    # Compile (and warm) outside the timing.
    s, m = step(fresh(), batch_fn(0))
    jax.block_until_ready(m)

    def bare() -> float:
        state, data = fresh(), stabljax.control.IndexedBatches(batch_fn)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(cfg.steps):
            state, metrics = step(state, next(data))
        jax.block_until_ready((state, metrics))
        return cfg.steps / (time.perf_counter() - t0)

    def controlled(background: bool) -> float:
        return _controlled_rate(cfg, step, fresh, batch_fn, background, finish_s, with_finish)

    modes = {"controlled": False, "controlled+background": True}
    samples: dict[str, list[float]] = {"bare": [], **{m: [] for m in modes}}
    finish_s: dict[str, list[float]] = {m: [] for m in modes}
    with_finish: dict[str, list[float]] = {m: [] for m in modes}
    for background in modes.values():  # warm Orbax's own compilations and threads
        controlled(background)
    for m in modes:
        finish_s[m].clear()
        with_finish[m].clear()
    for _ in range(cfg.rounds):
        samples["bare"].append(bare())
        for m, background in modes.items():
            samples[m].append(controlled(background))
    med = {k: statistics.median(v) for k, v in samples.items()}
    for m in modes:
        med[f"{m}, with finish"] = statistics.median(with_finish[m])
    rows = [
        {"loop": k, "steps/s": v, "ms/step": 1e3 / v, "rounds": cfg.rounds} for k, v in med.items()
    ]
    ratios = {
        "steps_per_s_controlled/bare": med["controlled"] / med["bare"],
        "steps_per_s_controlled+background/bare": med["controlled+background"] / med["bare"],
    }
    for m in modes:
        ratios[f"steps_per_s_{m}_with_finish/bare"] = med[f"{m}, with finish"] / med["bare"]
        ratios[f"finish_s_{m}"] = statistics.median(finish_s[m])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    return rows, {
        "steps_per_s": med,
        "samples": {**samples, "with_finish": with_finish, "finish_s": finish_s},
        "ratios": ratios,
        "targets": TARGETS,
        "n_params": int(n_params),
        "saves_per_round": cfg.steps // cfg.save_every,
    }


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.controller")
    cfg = ex.cfg
    rows, results = run(cfg)
    title = f"Controller overhead, {cfg.steps} steps, async save every {cfg.save_every}"
    return ex.report(rows, results, targets=TARGETS, title=title)


if __name__ == "__main__":
    main()
