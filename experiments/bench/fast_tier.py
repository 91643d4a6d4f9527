"""Benchmark: the fast tier (``fast_every``) against saves to and rollbacks from a bucket.

The reference model's train state (params and AdamW moments) under a
:class:`stabljax.RollbackController` on ``gs://`` (fake-gcs-server, started here as the
tests start it: ``tests/gcs.py``), with a stand-in train step that only counts steps and
reports a loss, so each ``ctl.step`` call costs what the controller does. Two runs, side by
side in one process:

* ``fast``: ``save_every=50, fast_every=10``: a host-RAM copy every 10 steps, a bucket save
  every 50; each spike rolls back to a fast copy (no bucket read);
* ``bucket``: ``save_every=10``, no fast tier: the same rollback targets, read from the bucket.

Each ``ctl.step`` call is timed and sorted by what it did: a bucket save (synchronous,
``async_save=False``: the whole write), a fast-tier copy, a rollback, or nothing.

    python -m experiments.bench.fast_tier [--quick] [--d-model 384 --n-layers 6]
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import statistics
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp

import stabljax
from experiments import cli
from experiments.proxy import QUICK_SIZE, BenchSize, adamw, build_model

TARGETS = {"fast_save/bucket_save": 0.5, "fast_rollback/bucket_rollback": 0.5}
GCS_HELPER = pathlib.Path(__file__).resolve().parents[2] / "tests" / "gcs.py"


@dataclasses.dataclass(frozen=True)
class Config(BenchSize):
    rollbacks: int = 4  # spikes, one every ``spike_every`` data indices
    spike_every: int = 60
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(**QUICK_SIZE, rollbacks=2)


def _emulator(log_dir: pathlib.Path):
    """fake-gcs-server with its environment set, as the tests start it (tests/gcs.py)."""
    spec = importlib.util.spec_from_file_location("stabljax_bench_gcs", GCS_HELPER)
    gcs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gcs)
    return gcs, gcs.start(log_dir)


def _state(cfg: Config) -> stabljax.TrainState:
    """The reference model's state after one AdamW update (moments not all zeros)."""
    setup = cfg.setup()
    model, _ = build_model(setup)
    _, params = stabljax.nnx_apply(model)
    opt = adamw(setup)
    state = stabljax.TrainState.create(params, opt)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(cfg.seed), len(leaves))
    noise = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    _, opt_state = jax.jit(opt.update)(jax.tree.unflatten(treedef, noise), state.opt_state, params)
    return state.replace(opt_state=opt_state)


@jax.jit
def _count(state, loss):
    """The stand-in train step: the state's step advances; the loss is the batch's."""
    return state.replace(step=state.step + 1), {"loss": loss}


def _run(cfg: Config, directory: str, state, **kw) -> dict[str, list[float]]:
    """Trains past ``cfg.rollbacks`` spikes; the seconds of each ``ctl.step``, by kind."""

    def loss_of(i: int) -> float:  # a noisy plateau, a spike at every spike_every-th index
        spike = i % cfg.spike_every == cfg.spike_every - 5 and i > cfg.spike_every
        return 1e4 if spike else 2.0 + 0.05 * math.sin(1.7 * i)

    times: dict[str, list[float]] = {"save": [], "fast": [], "rollback": [], "plain": []}
    detector = stabljax.control.SpikeDetector(warmup=10)
    kw = dict(keep=3, rollback_margin=5, detectors=[detector], async_save=False) | kw
    kw |= dict(max_rollbacks=None, preemption_signals=())
    with stabljax.RollbackController(directory, **kw) as ctl, warnings.catch_warnings():
        # A loop without a target is warned at each rollback; this one stops on a count.
        warnings.filterwarnings("ignore", "rollback at step", RuntimeWarning)
        data = stabljax.control.IndexedBatches(loss_of)
        state, data = ctl.restore_or_init(state, data)
        while ctl.rollbacks < cfg.rollbacks:
            state, metrics = _count(state, jnp.float32(next(data)))
            before, step = ctl.rollbacks, ctl.current_step + 1
            t0 = time.perf_counter()
            state, data = ctl.step(state, metrics, data)
            jax.block_until_ready(state)
            seconds = time.perf_counter() - t0
            if ctl.rollbacks > before:
                kind = "rollback"
            elif step % ctl.save_every == 0:
                kind = "save"
            elif ctl.fast_every and step % ctl.fast_every == 0:
                kind = "fast"
            else:
                kind = "plain"
            times[kind].append(seconds)
        restored = [e.details["restored_step"] for e in ctl.events if e.kind == "rollback"]
        state, data = ctl.finish(state, data)
    times["restored_steps"] = restored
    return times


def run(cfg: Config) -> tuple[list[dict], dict]:
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="stabljax-bench-ft-"))
    gcs, emu = _emulator(log_dir)
    try:
        state = _state(cfg)
        bucket = f"gs://{gcs.BUCKET}"
        _run(dataclasses.replace(cfg, rollbacks=1), f"{bucket}/warm", state, save_every=10)
        fast = _run(cfg, f"{bucket}/fast", state, save_every=50, fast_every=10)
        mark = emu.mark()
        slow = _run(cfg, f"{bucket}/bucket", state, save_every=10)
        bucket_requests = len(emu.requests(mark))
    finally:
        emu.stop()
    med = {
        "fast_save": statistics.median(fast["fast"]),
        "bucket_save": statistics.median(slow["save"]),
        "fast_rollback": statistics.median(fast["rollback"]),
        "bucket_rollback": statistics.median(slow["rollback"]),
        "plain_step": statistics.median(fast["plain"] + slow["plain"]),
    }
    rows = [
        {"operation": "save: fast tier (host RAM)", "ms": 1e3 * med["fast_save"]},
        {"operation": "save: bucket (sync, emulator)", "ms": 1e3 * med["bucket_save"]},
        {"operation": "rollback: fast tier", "ms": 1e3 * med["fast_rollback"]},
        {"operation": "rollback: bucket", "ms": 1e3 * med["bucket_rollback"]},
        {"operation": "step, nothing due", "ms": 1e3 * med["plain_step"]},
    ]
    leaves = jax.tree.leaves(state)
    results = {
        "seconds": med,
        "samples": {"fast": fast, "bucket": slow},
        "restored_steps": {"fast": fast["restored_steps"], "bucket": slow["restored_steps"]},
        "state_bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
        "n_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "bucket_run_requests": bucket_requests,
        "ratios": {
            "fast_save/bucket_save": med["fast_save"] / med["bucket_save"],
            "fast_rollback/bucket_rollback": med["fast_rollback"] / med["bucket_rollback"],
        },
        "targets": TARGETS,
    }
    return rows, results


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.fast_tier")
    rows, r = run(ex.cfg)
    title = (
        f"Fast tier vs bucket, state of {r['state_bytes'] / 2**20:.1f} MiB "
        f"({r['n_params'] / 1e6:.1f}M params), fake-gcs-server"
    )
    return ex.report(rows, r, targets=TARGETS, title=title)


if __name__ == "__main__":
    main()
