"""Benchmark 4b: what the per-leaf digest costs a checkpoint's save and restore.

The train state of :mod:`experiments.bench.rollback` (the reference model's params and AdamW
moments, after one update so the moments are not zeros) is saved and restored by a
:class:`stabljax.RollbackController` under three settings, interleaved in one process
(each repeat runs every setting once, in turn, so drift on a shared machine hits all):

* ``verify=True``: the fingerprint (two sums per leaf on device) and the meta digest;
* ``verify="digest"``: also a SHA-256 of each leaf's host bytes, checked on restore;
* ``verify="digest"`` with ``STABLJAX_CHECKPOINT_KEY``: the same as HMAC-SHA256.

``save``: ``restore_or_init`` on an empty directory, which saves the state synchronously
(``async_save=False``, so the whole write is timed); ``restore``: ``restore_or_init`` on
that directory, the checkpoint read back and verified (from the page cache). Then the
checks alone, on the state in memory: the fingerprint and the leaf digests (plain, HMAC).

    python -m experiments.bench.digest [--quick] [--d-model 384 --n-layers 6]
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
from stabljax.control.checkpoint.integrity import ENV_KEY, fingerprint, leaf_digests

TARGETS = {"save_digest/fingerprint": 1.05, "restore_digest/fingerprint": 1.05}
SETTINGS = {"fingerprint": (True, None), "digest": ("digest", None), "hmac": ("digest", "k")}


@dataclasses.dataclass(frozen=True)
class Config(BenchSize):
    repeats: int = 5
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(**QUICK_SIZE, repeats=1)


def reference_state(cfg: Config) -> tuple[stabljax.TrainState, int]:
    """The rollback bench's state (AdamW moments made non-zero); its parameter count."""
    setup = cfg.setup()
    model, _ = build_model(setup)
    _, params = stabljax.nnx_apply(model)
    opt = adamw(setup)
    state = stabljax.TrainState.create(params, opt)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(cfg.seed), len(leaves))
    grads = jax.tree.unflatten(
        treedef,
        [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)],
    )
    _, opt_state = jax.jit(opt.update)(grads, state.opt_state, state.params)
    return state.replace(opt_state=opt_state), sum(x.size for x in leaves)


def _timed(directory: pathlib.Path, state, verify, key: str | None) -> float:
    """One ``restore_or_init`` (a save in an empty directory, else a restore), in seconds."""
    if key is None:
        os.environ.pop(ENV_KEY, None)
    else:
        os.environ[ENV_KEY] = key
    try:
        ctl = stabljax.RollbackController(directory, async_save=False, verify=verify)
        data = stabljax.control.IndexedBatches(lambda i: i)
        t0 = time.perf_counter()
        restored, _ = ctl.restore_or_init(state, data)
        jax.block_until_ready(restored)
        seconds = time.perf_counter() - t0
        ctl.close()
        return seconds
    finally:
        os.environ.pop(ENV_KEY, None)


def run(cfg: Config) -> tuple[list[dict], dict]:
    state, n_params = reference_state(cfg)
    root = pathlib.Path(tempfile.mkdtemp(prefix="stabljax-bench-digest-"))
    samples: dict[str, list[float]] = {
        f"{op} ({name})": [] for op in ("save", "restore") for name in SETTINGS
    }
    ckpt_bytes = 0
    try:
        for repeat in range(cfg.repeats + 1):  # the first round warms up Orbax and the cache
            for name, (verify, key) in SETTINGS.items():
                directory = root / f"{name}-{repeat}"
                save = _timed(directory, state, verify, key)
                restore = _timed(directory, state, verify, key)
                if repeat:
                    samples[f"save ({name})"].append(save)
                    samples[f"restore ({name})"].append(restore)
                ckpt_bytes = sum(p.stat().st_size for p in (directory / "0").rglob("*"))
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    # The checks alone, without Orbax's I/O around them: the cost per checkpoint in seconds.
    alone = {"fingerprint alone": lambda: fingerprint(state).block_until_ready()}
    alone["leaf_digests alone"] = lambda: leaf_digests(state, None)
    alone["leaf_digests alone (hmac)"] = lambda: leaf_digests(state, b"k")
    samples |= {name: [] for name in alone}
    for repeat in range(cfg.repeats + 1):
        for name, fn in alone.items():
            t0 = time.perf_counter()
            fn()
            if repeat:
                samples[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = {op: med[f"{op} (fingerprint)"] for op in ("save", "restore")}
    rows = [
        {"operation": k, "seconds": v, "/ fingerprint": v / base[k.split(" ")[0]]}
        for k, v in med.items()
        if "alone" not in k
    ]
    rows += [{"operation": k, "seconds": v} for k, v in med.items() if "alone" in k]
    ratios = {
        f"{op}_{name}/fingerprint": med[f"{op} ({name})"] / base[op]
        for op in ("save", "restore")
        for name in ("digest", "hmac")
    }
    results = {
        "seconds": med,
        "samples": samples,
        "checkpoint_bytes": ckpt_bytes,
        "ratios": ratios,
        "digest_bytes_per_s": ckpt_bytes / med["leaf_digests alone"],
        "targets": TARGETS,
        "n_params": int(n_params),
    }
    return rows, results


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.digest")
    rows, r = run(ex.cfg)
    title = (
        f"Digest cost, checkpoint of {r['checkpoint_bytes'] / 2**20:.1f} MiB "
        f"({r['n_params'] / 1e6:.1f}M params), medians of {ex.cfg.repeats} interleaved rounds"
    )
    return ex.report(rows, r, targets=TARGETS, title=title)


if __name__ == "__main__":
    main()
