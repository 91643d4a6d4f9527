"""Benchmark 1: one optimizer update on N parameters, guards against plain Optax.

A = ``optax.chain(clip_by_global_norm(1.0), adamw)``;
B = ``skip_nonfinite(skip_spikes(chain(clip_by_zscore(), safe_adamw)))``;
C = ``adamw_atan2``. Reports XLA's bytes accessed and flops, the median wall time of
interleaved runs, the ratios B/A and C/A, and the achieved bandwidth of each update
against a copy bandwidth measured in the same run (the memory-bound limit).

    python -m experiments.bench.optimizer_update [--quick] [--log2-params 24]
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import optax

import stabljax
from experiments.bench.timing import (
    bench_main,
    compiled_cost,
    copy_bytes,
    copy_runner,
    interleaved_medians,
)

TARGETS = {"bytes_B/A": 1.10, "wall_B/A": 1.15, "bandwidth_B": 0.50}


@dataclasses.dataclass(frozen=True)
class Config:
    log2_params: int = 24
    n_leaves: int = 4
    repeats: int = 30
    lr: float = 1e-3
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(log2_params=14, repeats=3)


def optimizers(lr: float) -> dict[str, optax.GradientTransformation]:
    return {
        "A": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)),
        "B": stabljax.skip_nonfinite(
            stabljax.skip_spikes(optax.chain(stabljax.clip_by_zscore(), stabljax.safe_adamw(lr)))
        ),
        "C": stabljax.adamw_atan2(lr),
    }


def run(cfg: Config) -> tuple[list[dict], dict]:
    n = 2**cfg.log2_params
    per = n // cfg.n_leaves
    keys = jax.random.split(jax.random.key(cfg.seed), 2 * cfg.n_leaves)
    params0 = {f"w{i}": jax.random.normal(keys[i], (per,)) for i in range(cfg.n_leaves)}
    grads = {
        f"w{i}": jax.random.normal(keys[cfg.n_leaves + i], (per,)) for i in range(cfg.n_leaves)
    }
    loss = jnp.float32(1.0)

    runners, costs, results = {}, {}, {}
    for name, opt in optimizers(cfg.lr).items():
        opt = optax.with_extra_args_support(opt)

        def update(params, state, grads, loss, opt=opt):
            updates, state = opt.update(grads, state, params, loss=loss)
            return optax.apply_updates(params, updates), state

        f = jax.jit(update, donate_argnums=(0, 1))
        params = jax.tree.map(jnp.copy, params0)
        state = opt.init(params)
        costs[name] = compiled_cost(f.lower(params, state, grads, loss).compile())
        box = [params, state]

        def call(f=f, box=box):
            box[0], box[1] = f(box[0], box[1], grads, loss)
            return box[0]

        runners[name] = call
    # The copy is timed in the same round-robin, so it sees the same machine noise.
    walls = interleaved_medians({**runners, "copy": copy_runner(n)}, repeats=cfg.repeats)
    bw = copy_bytes(n) / walls.pop("copy")
    # The least any Adam update can move: read params, grads, mu, nu; write params, mu, nu.
    min_bytes = 7 * 4 * n
    rows = []
    for name in runners:
        achieved = costs[name]["bytes"] / walls[name]
        results[name] = {
            **costs[name],
            "wall_s": walls[name],
            "bytes_per_s": achieved,
            "min_bytes_per_s": min_bytes / walls[name],
        }
        rows.append(
            {
                "optimizer": name,
                "bytes accessed": costs[name]["bytes"],
                "flops": costs[name]["flops"],
                "wall ms": 1e3 * walls[name],
                "bytes/s": achieved,
                "of copy bw": achieved / bw,
                "7N floats/s of copy bw": min_bytes / walls[name] / bw,
            }
        )
    ratios = {
        "bytes_B/A": costs["B"]["bytes"] / costs["A"]["bytes"],
        "bytes_C/A": costs["C"]["bytes"] / costs["A"]["bytes"],
        "wall_B/A": walls["B"] / walls["A"],
        "wall_C/A": walls["C"] / walls["A"],
        "bandwidth_B": results["B"]["bytes_per_s"] / bw,
        "bandwidth_B_min_bytes": results["B"]["min_bytes_per_s"] / bw,
        "copy_bytes_per_s": bw,
    }
    return rows, {"per_optimizer": results, "ratios": ratios, "targets": TARGETS, "n_params": n}


def main(argv=None) -> dict:
    print(f"devices: {jax.devices()}")
    return bench_main(
        Config,
        run,
        argv,
        description=__doc__.splitlines()[0],
        stem="optimizer_update",
        targets=TARGETS,
        title=lambda cfg, r: f"Optimizer update, 2^{cfg.log2_params} float32 parameters",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
