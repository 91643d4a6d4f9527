"""Benchmark 1: one optimizer update on N parameters, guards against plain Optax.

A = ``optax.chain(clip_by_global_norm(1.0), adamw)``;
B = ``skip_nonfinite(skip_spikes(chain(clip_by_zscore(), safe_adamw)))``;
C = ``adamw_atan2``. Reports XLA's bytes accessed and flops, the median wall time of
interleaved runs, the ratios B/A and C/A, and the achieved bandwidth of each update
against a copy bandwidth measured in the same run (the memory-bound limit). Each
optimizer is compiled with XLA's defaults and, on XLA:CPU, also with
``stabljax.recommended_compiler_options()`` (suffix ``(cpu_options)``), all timed in one
round-robin.

With ``--aot-tpu TOPOLOGY`` (e.g. ``v5e:2x2``; needs ``pip install -e ".[tpu]"``, no TPU)
every candidate is instead compiled ahead of time for XLA:TPU, on 1 chip and sharded over
4, and the compiler's bytes accessed, flops and memory are reported (no wall time); the
extra candidates are B with ``check_update=True``, A inside the five-line ``where``
guard (the reference for what a guard can cost), and bare ``optax.adamw`` with and without
``skip_nonfinite``.

    python -m experiments.bench.optimizer_update [--quick] [--log2-params 24]
    python -m experiments.bench.optimizer_update --aot-tpu v5e:2x2
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

import stabljax
from experiments import cli
from experiments.bench import aot_tpu
from experiments.bench.timing import (
    compiled_cost,
    copy_bytes,
    copy_runner,
    interleaved_medians,
)

TARGETS = {"bytes_B/A": 1.10, "wall_B/A": 1.15, "bandwidth_B": 0.50}
# XLA:TPU (AOT): bytes against plain, and B's temp memory above A's as a fraction of the
# state (params + optimizer state) on one chip.
TPU_TARGETS = {
    "tpu bytes_B/A (1 chip)": 1.01,
    "tpu bytes_B/A (4 chips)": 1.01,
    "tpu temp_B-A / state (1 chip)": 0.01,
    "tpu temp_B-A / state (4 chips)": 0.01,
    "tpu bytes_skip_nonfinite(adamw)/adamw (1 chip)": 1.12,
    "tpu bytes_skip_nonfinite(adamw)/adamw (4 chips)": 1.12,
}


@dataclasses.dataclass(frozen=True)
class Config:
    log2_params: int = 24
    n_leaves: int = 4
    repeats: int = 30
    lr: float = 1e-3
    seed: int = 0
    aot_tpu: str = dataclasses.field(
        default="",
        metadata={"help": "compile for this TPU topology (e.g. v5e:2x2) instead of timing"},
    )

    @classmethod
    def quick(cls) -> Config:
        return cls(log2_params=14, repeats=3)


def optimizers(lr: float) -> dict[str, optax.GradientTransformation]:
    return {
        "A": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)),
        "B": readme_optimizer(lr),
        "C": stabljax.adamw_atan2(lr),
    }


def readme_optimizer(lr: float, **guard_kwargs) -> optax.GradientTransformation:
    """README's guarded optimizer: skip_nonfinite(skip_spikes(chain(ZClip, safe AdamW)))."""
    return stabljax.skip_nonfinite(
        stabljax.skip_spikes(optax.chain(stabljax.clip_by_zscore(), stabljax.safe_adamw(lr))),
        **guard_kwargs,
    )


def run_aot_tpu(cfg: Config) -> tuple[list[dict], dict]:
    """Every candidate compiled for ``cfg.aot_tpu`` on 1 chip and over 4: no timing."""
    candidates = {
        **optimizers(cfg.lr),
        "B (check_update)": readme_optimizer(cfg.lr, check_update=True),
        "where-guard(A)": aot_tpu.where_guard(optimizers(cfg.lr)["A"]),
        # The guard alone around bare optax: its floor is one more read of the gradients
        # for their norm, 1/7 of Adam's traffic.
        "adamw": optax.adamw(cfg.lr),
        "skip_nonfinite(adamw)": stabljax.skip_nonfinite(optax.adamw(cfg.lr)),
    }
    n = 2**cfg.log2_params
    costs = aot_tpu.optimizer_update_costs(
        cfg.aot_tpu, candidates, n_params=n, n_leaves=cfg.n_leaves, chips=(1, 4)
    )
    rows, ratios = [], {}
    for chips, per in costs.items():
        a = per["A"]
        where = f"{chips} chip" + ("s" if chips > 1 else "")
        for name, c in per.items():
            rows.append(
                {
                    "chips": chips,
                    "optimizer": name,
                    "bytes accessed": c["bytes"],
                    "bytes / A": c["bytes"] / a["bytes"],
                    "flops": c["flops"],
                    "temp MiB": c["temp"] / 2**20,
                    "argument MiB": c["argument"] / 2**20,
                    "alias MiB": c["alias"] / 2**20,
                }
            )
            if name != "A":
                ratios[f"tpu bytes_{name}/A ({where})"] = c["bytes"] / a["bytes"]
        ratios[f"tpu temp_B-A / state ({where})"] = (per["B"]["temp"] - a["temp"]) / a[
            "state_bytes"
        ]
        snf, adamw = per["skip_nonfinite(adamw)"], per["adamw"]
        ratios[f"tpu bytes_skip_nonfinite(adamw)/adamw ({where})"] = snf["bytes"] / adamw["bytes"]
    return rows, {
        "per_optimizer": costs,
        "ratios": ratios,
        "targets": TPU_TARGETS,
        "n_params": n,
        "topology": cfg.aot_tpu,
        "compiler": "XLA:TPU (AOT)",
    }


def compile_modes() -> dict[str, dict[str, Any] | None]:
    """The compile settings each optimizer is measured under, by name.

    Always XLA's defaults; on XLA:CPU also ``stabljax.recommended_compiler_options()``.
    """
    modes: dict[str, dict[str, Any] | None] = {"default": None}
    if jax.default_backend() == "cpu":
        modes["cpu_options"] = stabljax.recommended_compiler_options("cpu")
    return modes


def _suffix(mode: str) -> str:
    return "" if mode == "default" else f" ({mode})"


def targets() -> dict[str, float]:
    """:data:`TARGETS` for every compile mode (the ratio names carry the mode's suffix)."""
    return {f"{k}{_suffix(m)}": v for m in compile_modes() for k, v in TARGETS.items()}


def run(cfg: Config) -> tuple[list[dict], dict]:
    if cfg.aot_tpu:
        return run_aot_tpu(cfg)
    n = 2**cfg.log2_params
    per = n // cfg.n_leaves
    keys = jax.random.split(jax.random.key(cfg.seed), 2 * cfg.n_leaves)
    params0 = {f"w{i}": jax.random.normal(keys[i], (per,)) for i in range(cfg.n_leaves)}
    grads = {
        f"w{i}": jax.random.normal(keys[cfg.n_leaves + i], (per,)) for i in range(cfg.n_leaves)
    }
    loss = jnp.float32(1.0)

    modes = compile_modes()
    runners, costs, results = {}, {}, {}
    for mode, options in modes.items():
        for name, opt in optimizers(cfg.lr).items():
            opt = optax.with_extra_args_support(opt)

            def update(params, state, grads, loss, opt=opt):
                updates, state = opt.update(grads, state, params, value=loss)
                return optax.apply_updates(params, updates), state

            f = jax.jit(update, donate_argnums=(0, 1), compiler_options=options)
            params = jax.tree.map(jnp.copy, params0)
            state = opt.init(params)
            compiled = f.lower(params, state, grads, loss).compile()
            key = (mode, name)
            costs[key] = compiled_cost(compiled)
            box = [params, state]

            def call(compiled=compiled, box=box):
                box[0], box[1] = compiled(box[0], box[1], grads, loss)
                return box[0]

            runners[key] = call
    # The copy is timed in the same round-robin, so it sees the same machine noise.
    walls = interleaved_medians({**runners, "copy": copy_runner(n)}, repeats=cfg.repeats)
    bw = copy_bytes(n) / walls.pop("copy")
    # The least any Adam update can move: read params, grads, mu, nu; write params, mu, nu.
    min_bytes = 7 * 4 * n
    rows = []
    for (mode, name), cost in costs.items():
        wall = walls[(mode, name)]
        achieved = cost["bytes"] / wall
        results.setdefault(mode, {})[name] = {
            **cost,
            "wall_s": wall,
            "bytes_per_s": achieved,
            "min_bytes_per_s": min_bytes / wall,
        }
        rows.append(
            {
                "compile": mode,
                "optimizer": name,
                "bytes accessed": cost["bytes"],
                "flops": cost["flops"],
                "wall ms": 1e3 * wall,
                "bytes/s": achieved,
                "of copy bw": achieved / bw,
                "7N floats/s of copy bw": min_bytes / wall / bw,
            }
        )
    ratios = {}
    for mode, r in results.items():
        sfx = _suffix(mode)
        ratios.update(
            {
                f"bytes_B/A{sfx}": r["B"]["bytes"] / r["A"]["bytes"],
                f"bytes_C/A{sfx}": r["C"]["bytes"] / r["A"]["bytes"],
                f"wall_B/A{sfx}": r["B"]["wall_s"] / r["A"]["wall_s"],
                f"wall_C/A{sfx}": r["C"]["wall_s"] / r["A"]["wall_s"],
                f"bandwidth_B{sfx}": r["B"]["bytes_per_s"] / bw,
                f"bandwidth_B_min_bytes{sfx}": r["B"]["min_bytes_per_s"] / bw,
            }
        )
    ratios["copy_bytes_per_s"] = bw
    return rows, {
        "per_optimizer": results,
        "compile_options": modes,
        "ratios": ratios,
        "targets": targets(),
        "n_params": n,
    }


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.optimizer_update")
    cfg = ex.cfg
    print(f"devices: {jax.devices()}")
    rows, results = run(cfg)
    title = f"Optimizer update, 2^{cfg.log2_params} float32 parameters"
    if cfg.aot_tpu:
        title += f", XLA:TPU AOT for {cfg.aot_tpu}"
    stem = "optimizer_update_tpu" if cfg.aot_tpu else "optimizer_update"
    return ex.report(rows, results, targets={**targets(), **TPU_TARGETS}, title=title, stem=stem)


if __name__ == "__main__":
    main()
