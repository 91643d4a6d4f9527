"""Benchmark: the generic step (``lm_loss`` + ``make_train_step``) against the former LM step.

The reference Transformer (about 10M parameters by default). ``legacy`` is the language
model step ``make_train_step`` was before it took a ``loss_fn`` (its code is copied below,
verbatim but for the names, as the baseline); ``generic`` is
``make_train_step(lm_loss(apply_fn, z_loss_weight=...), optimizer)``. Both run the guarded
optimizer of the README (``skip_nonfinite(skip_spikes(chain(clip_by_zscore(),
safe_adamw)))``) and, as a second pair, plain ``optax.adamw``. On XLA:CPU every step is
compiled with ``stabljax.recommended_compiler_options()``. All are timed round-robin in one
process; ratios are generic over legacy, of walls and of XLA's bytes accessed, and
``hlo_identical`` says whether the two compiled programs are the same HLO (metadata,
i.e. Python names and source lines, aside).

    python -m experiments.bench.generic_step [--quick] [--d-model 384 --n-layers 6]
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stabljax
from experiments.bench.timing import bench_main, compiled_cost, interleaved_medians
from experiments.common import Setup, build_model, corpus_batches
from stabljax import telemetry
from stabljax.losses import cross_entropy_with_z_loss
from stabljax.optim import guards
from stabljax.optim._base import validate, with_extra_args
from stabljax.precision import Precision, all_finite, scale_loss, unscale_grads
from stabljax.step import TrainState

TARGETS = {"wall_generic/legacy": 1.01, "wall_generic/legacy (plain-opt)": 1.01}


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 6
    seq_len: int = 128
    batch_size: int = 8
    repeats: int = 15
    lr: float = 1e-3
    z_loss: float = 1e-4
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(d_model=32, n_layers=1, n_heads=2, seq_len=16, batch_size=2, repeats=2)


# ---------------------------------------------------------------------------------------
# BASELINE: the language-model step as stabljax.step.make_train_step was at commit 5954aa4,
# before it took a loss_fn. Copied for this benchmark only; not part of the library.
def legacy_lm_step(
    apply_fn,
    optimizer,
    *,
    z_loss=1e-4,
    precision=Precision.fp32(),  # noqa: B008 (a frozen dataclass, as in the original)
    layer_metrics=False,
    donate=True,
    compiler_options=None,
):
    validate("legacy_lm_step", "z_loss_weight", z_loss, lambda v: v >= 0, ">= 0")
    if not isinstance(precision, Precision):
        raise ValueError(f"precision must be a stabljax Precision, got {type(precision)}")
    tx = with_extra_args(optimizer)
    dls = precision.loss_scale

    def loss_fn(params, batch, ls_state):
        logits = apply_fn(precision.cast_to_compute(params), batch["inputs"])
        loss, aux = cross_entropy_with_z_loss(
            logits, batch["targets"], z_loss_weight=z_loss, where=batch.get("mask")
        )
        return scale_loss(loss, ls_state), (loss, aux)

    def step(state: TrainState, batch: Mapping[str, jax.Array]):
        ls_state = state.loss_scale_state
        if (ls_state is None) != (dls is None):
            raise ValueError(
                "state.loss_scale_state does not match the precision policy: create the "
                "state with TrainState.create(..., precision=precision)"
            )
        grads, (loss, aux) = jax.grad(loss_fn, has_aux=True)(state.params, batch, ls_state)
        grads = unscale_grads(grads, ls_state)

        def apply(_):
            updates, opt_state = tx.update(grads, state.opt_state, state.params, value=loss)
            return optax.apply_updates(state.params, updates), opt_state, updates

        def skip(_):
            return state.params, state.opt_state, optax.tree.zeros_like(state.params)

        if ls_state is None:
            params, opt_state, updates = apply(None)
            overflow = jnp.zeros([], jnp.bool_)
            scale = jnp.ones([], jnp.float32)
            new_ls_state = None
        else:
            finite = jnp.logical_and(all_finite(grads), jnp.isfinite(loss))
            params, opt_state, updates = jax.lax.cond(finite, apply, skip, None)
            overflow = jnp.logical_not(finite)
            scale = ls_state.loss_scale
            new_ls_state = dls.adjust(ls_state, finite)

        metrics = {
            "loss": loss,
            "ce": aux["ce"],
            "z_loss": aux["z_loss"],
            "log_z": aux["log_z"],
            "log_z_max": aux["log_z_max"],
            "grad_norm": telemetry.global_norm(grads),
            "update_norm": telemetry.global_norm(updates),
            "param_norm": telemetry.global_norm(state.params),
            # On an overflow the optimizer did not run: its flags are the previous step's.
            "skipped": jnp.logical_and(jnp.logical_not(overflow), guards.any_skipped(opt_state)),
            "skip_streak": jnp.asarray(guards.skip_streak(opt_state), jnp.int32),
            "spike_rebaselines": guards.spike_rebaselines(opt_state),
            "overflow": overflow,
            "loss_scale": scale,
        }
        if layer_metrics:
            metrics["layers"] = telemetry.layer_metrics(grads, state.params, updates)
        new_state = TrainState(
            step=optax.safe_increment(state.step),
            params=params,
            opt_state=opt_state,
            loss_scale_state=new_ls_state,
        )
        return new_state, metrics

    options = None if compiler_options is None else dict(compiler_options)
    return jax.jit(step, donate_argnums=(0,) if donate else (), compiler_options=options)


# END OF BASELINE
# ---------------------------------------------------------------------------------------


def _program(text: str) -> str:
    """The compiled HLO from ENTRY on, without metadata (Python names and source lines)."""
    return re.sub(r", metadata=\{[^}]*\}", "", text[text.index("\nENTRY") :])


def run(cfg: Config) -> tuple[list[dict], dict]:
    setup = Setup(
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        corpus_bytes=200_000,
    )
    model, _ = build_model(setup)
    apply_fn, params0 = stabljax.nnx_apply(model)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params0))
    batch = jax.tree.map(jnp.asarray, corpus_batches(setup)(0))
    options = stabljax.recommended_compiler_options()

    optimizers = {
        "guarded": lambda: stabljax.skip_nonfinite(
            stabljax.skip_spikes(
                optax.chain(stabljax.clip_by_zscore(), stabljax.safe_adamw(cfg.lr))
            )
        ),
        "plain-opt": lambda: optax.adamw(cfg.lr),
    }
    builders = {
        "legacy": lambda opt: legacy_lm_step(
            apply_fn, opt, z_loss=cfg.z_loss, compiler_options=options
        ),
        "generic": lambda opt: stabljax.make_train_step(
            stabljax.lm_loss(apply_fn, z_loss_weight=cfg.z_loss), opt, compiler_options=options
        ),
    }
    runners, costs, hlo = {}, {}, {}
    for opt_name, make_opt in optimizers.items():
        for kind, build in builders.items():
            name = f"{kind} ({opt_name})"
            opt = make_opt()
            state = stabljax.TrainState.create(jax.tree.map(jnp.copy, params0), opt)
            step = build(opt)
            compiled = step.lower(state, batch).compile()
            costs[name] = compiled_cost(compiled)
            hlo[name] = _program(compiled.as_text())
            box = [state]

            def call(step=step, box=box):
                box[0], metrics = step(box[0], batch)
                return metrics["loss"]

            runners[name] = call

    walls = interleaved_medians(runners, repeats=cfg.repeats)
    rows, per = [], {}
    for name in runners:
        kind, opt_name = name.split(" ", 1)
        base = f"legacy {opt_name}"
        per[name] = {**costs[name], "wall_s": walls[name]}
        rows.append(
            {
                "step": name,
                "wall ms": 1e3 * walls[name],
                "wall / legacy": walls[name] / walls[base],
                "bytes / legacy": costs[name]["bytes"] / costs[base]["bytes"],
            }
        )
    g, lg = "generic (guarded)", "legacy (guarded)"
    p, lp = "generic (plain-opt)", "legacy (plain-opt)"
    ratios = {
        "wall_generic/legacy": walls[g] / walls[lg],
        "wall_generic/legacy (plain-opt)": walls[p] / walls[lp],
        "bytes_generic/legacy": costs[g]["bytes"] / costs[lg]["bytes"],
        "bytes_generic/legacy (plain-opt)": costs[p]["bytes"] / costs[lp]["bytes"],
    }
    return rows, {
        "per_step": per,
        "ratios": ratios,
        "targets": TARGETS,
        "n_params": n_params,
        "hlo_identical": {"guarded": hlo[g] == hlo[lg], "plain-opt": hlo[p] == hlo[lp]},
    }


def main(argv=None) -> dict:
    return bench_main(
        Config,
        run,
        argv,
        description=__doc__.splitlines()[0],
        stem="generic_step",
        targets=TARGETS,
        title=lambda cfg, r: f"Generic vs LM train step, {r['n_params'] / 1e6:.1f}M parameters",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
