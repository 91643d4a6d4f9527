"""Benchmark 4: the cost of a rollback: restoring a checkpoint and skipping data.

A train state of the reference model (params and AdamW moments) is saved by a
:class:`stabljax.RollbackController`. Then, alternately:

* ``restore``: a new controller over that directory, ``restore_or_init(template, data)``:
  the newest checkpoint read back into the template's shardings, verified (fingerprint)
  and the data iterator set to its position, as a rollback does;
* ``read bytes``: every file of that checkpoint read from disk with plain ``open().read()``,
  the floor of any restore (both after the save, so both read from the page cache).

Then ``IndexedBatches.skip(n)`` for ``n = 10**6`` (a rollback's data skip) and ``seek``.

    python -m experiments.bench.rollback [--quick] [--d-model 384 --n-layers 6]
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import statistics
import tempfile
import time

import jax

import stabljax
from experiments import cli
from experiments.proxy import QUICK_SIZE, BenchSize, adamw, build_model

TARGETS = {"skip_s": 0.010}


@dataclasses.dataclass(frozen=True)
class Config(BenchSize):
    repeats: int = 5
    skip_batches: int = 10**6
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(**QUICK_SIZE, repeats=1)


def _read_all(path: pathlib.Path) -> int:
    n = 0
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                n += len(fh.read())
    return n


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(cfg: Config) -> tuple[list[dict], dict]:
    setup = cfg.setup()
    model, _ = build_model(setup)
    _, params = stabljax.nnx_apply(model)
    opt = adamw(setup)
    state = stabljax.TrainState.create(params, opt)
    # One update with random gradients, so the moments are not all zeros (which the
    # checkpoint format would compress away, making the read floor unfairly small).
    keys = jax.random.split(jax.random.key(cfg.seed), len(jax.tree.leaves(params)))
    leaves, treedef = jax.tree.flatten(params)
    grads = jax.tree.unflatten(
        treedef,
        [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)],
    )
    _, opt_state = jax.jit(opt.update)(grads, state.opt_state, state.params)
    state = state.replace(opt_state=opt_state)

    def batch_fn(i):
        return i

    directory = pathlib.Path(tempfile.mkdtemp(prefix="stabljax-bench-rb-"))
    try:
        with stabljax.RollbackController(directory, async_save=False) as ctl:
            ctl.restore_or_init(state, stabljax.control.IndexedBatches(batch_fn, start=12345))
        ckpt = directory / "0"
        if not ckpt.exists():  # Orbax's step folder naming
            ckpt = next(p for p in directory.iterdir() if p.is_dir() and p.name.endswith("0"))
        ckpt_bytes = _read_all(ckpt)

        def restore(verify: bool):
            ctl = stabljax.RollbackController(directory, async_save=False, verify=verify)
            data = stabljax.control.IndexedBatches(batch_fn)
            t0 = time.perf_counter()
            restored, data = ctl.restore_or_init(state, data)
            jax.block_until_ready(restored)
            t = time.perf_counter() - t0
            assert data.index == 12345, data.index
            ctl.close()
            return t

        samples: dict[str, list[float]] = {"restore": [], "restore (verify=False)": []}
        samples["read bytes"] = []
        restore(True)  # warm the page cache and Orbax
        for _ in range(cfg.repeats):
            samples["restore"].append(restore(True))
            samples["restore (verify=False)"].append(restore(False))
            t0 = time.perf_counter()
            _read_all(ckpt)
            samples["read bytes"].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in samples.items()}
    it = stabljax.control.IndexedBatches(batch_fn)
    skip_s = _median_time(lambda: it.skip(cfg.skip_batches), max(cfg.repeats, 5))
    seek_s = _median_time(lambda: it.seek(it.index + cfg.skip_batches), max(cfg.repeats, 5))

    rows = [
        {"operation": k, "seconds": v, "/ read bytes": v / med["read bytes"]}
        for k, v in med.items()
    ]
    rows += [
        {"operation": f"IndexedBatches.skip({cfg.skip_batches})", "seconds": skip_s},
        {"operation": f"IndexedBatches.seek(+{cfg.skip_batches})", "seconds": seek_s},
    ]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    results = {
        "seconds": med,
        "samples": samples,
        "checkpoint_bytes": ckpt_bytes,
        "read_bytes_per_s": ckpt_bytes / med["read bytes"],
        "ratios": {
            "restore/read_bytes": med["restore"] / med["read bytes"],
            "restore_noverify/read_bytes": med["restore (verify=False)"] / med["read bytes"],
            "skip_s": skip_s,
            "seek_s": seek_s,
        },
        "targets": TARGETS,
        "n_params": int(n_params),
    }
    return rows, results


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.rollback")
    rows, r = run(ex.cfg)
    title = (
        f"Rollback cost, checkpoint of {r['checkpoint_bytes'] / 2**20:.1f} MiB "
        f"({r['n_params'] / 1e6:.1f}M params)"
    )
    return ex.report(rows, r, targets=TARGETS, title=title)


if __name__ == "__main__":
    main()
