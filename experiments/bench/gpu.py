"""Benchmark for a lent GPU: optimizer update, 185M bf16 train step, controller; one script.

Prepared for a machine with an accelerator (run it there; ≤ 8 minutes on one H200 at the
defaults). Three parts, all timed round-robin in one process and reported as ratios:

* the optimizer update (``experiments.bench.optimizer_update``) at 2^24 and 2^27 float32
  parameters: wall time of README's guarded optimizer (B) and of ``adamw_atan2`` (C)
  against ``chain(clip_by_global_norm, adamw)`` (A);
* the train step at 185M parameters (``TPU_SIZES["185M-data"]`` of
  ``experiments.bench.train_step``: d_model 1024, 12 layers, 16 heads, remat), bf16
  compute with float32 master weights: the hand-written plain step against
  ``make_train_step`` with z-loss and README's guarded optimizer; wall, tokens/s and
  guarded/plain;
* the controller bench (``experiments.bench.controller``) at its defaults.

Results go to ``experiments/results/bench/gpu/gpu.json`` and ``.md`` with the device
named (``device`` in the results, and the environment block). ``--quick`` runs tiny sizes
on whatever backend is there (the CPU in the tests).

    python -m experiments.bench.gpu [--quick]
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

import stabljax
from experiments.bench import controller, optimizer_update, train_step
from experiments.bench.timing import bench_main, interleaved_medians
from experiments.common import RESULTS

TARGETS = {
    "wall_B/A (2^24)": 1.15,
    "wall_B/A (2^27)": 1.15,
    "wall_guarded/plain (185M bf16)": 1.03,
}


@dataclasses.dataclass(frozen=True)
class Config:
    log2_params: tuple[int, ...] = (24, 27)
    opt_repeats: int = 20
    model: str = "185M-data"
    vocab: int = 32000
    seq_len: int = 1024
    batch_size: int = 16
    step_repeats: int = 10
    controller: bool = True
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(
            log2_params=(12,),
            opt_repeats=2,
            model="tiny-data",
            vocab=256,
            seq_len=32,
            batch_size=2,
            step_repeats=2,
        )


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{d.device_kind} x{jax.device_count()}"


def optimizer_part(cfg: Config, quick: bool) -> tuple[list[dict], dict]:
    rows, ratios = [], {}
    for lp in cfg.log2_params:
        base = optimizer_update.Config.quick() if quick else optimizer_update.Config()
        sub = dataclasses.replace(base, log2_params=lp, repeats=cfg.opt_repeats)
        _, res = optimizer_update.run(sub)
        for k in ("wall_B/A", "wall_C/A", "bytes_B/A"):
            ratios[f"{k} (2^{lp})"] = float(res["ratios"][k])
        for name, c in res["per_optimizer"]["default"].items():  # XLA's default options
            wall = 1e3 * c["wall_s"]
            rows.append(
                {"part": f"optimizer 2^{lp}", "name": name, "wall ms": wall, "tokens/s": ""}
            )
    return rows, ratios


def train_step_part(cfg: Config) -> tuple[list[dict], dict]:
    from flax import nnx

    arch = train_step.TPU_SIZES[cfg.model]
    model_cfg = stabljax.reference.TransformerConfig(
        vocab_size=cfg.vocab,
        d_model=arch["d_model"],
        n_layers=arch["n_layers"],
        n_heads=arch["n_heads"],
        max_len=cfg.seq_len,
        dtype=jnp.bfloat16,
        remat=True,
    )
    apply_fn, params0 = stabljax.nnx_apply(
        stabljax.reference.TransformerLM(model_cfg, rngs=nnx.Rngs(cfg.seed))
    )
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params0))
    rng = np.random.default_rng(cfg.seed)
    tokens = rng.integers(0, cfg.vocab, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    steps = train_step._tpu_steps(train_step.Config())  # the steps the TPU table compiles

    plain_step, _ = steps["plain"](apply_fn)
    plain_opt = optax_plain(train_step.Config().lr)
    pbox = [jax.tree.map(jnp.copy, params0)]
    pbox.append(plain_opt.init(pbox[0]))

    def call_plain():
        pbox[0], pbox[1], loss = plain_step(pbox[0], pbox[1], batch)
        return loss

    guarded_step, _ = steps["guarded"](apply_fn)
    opt = train_step._guarded_opt(train_step.Config().lr)
    gbox = [
        stabljax.TrainState.create(jax.tree.map(jnp.copy, params0), opt, stabljax.Precision.bf16())
    ]

    def call_guarded():
        gbox[0], metrics = guarded_step(gbox[0], batch)
        return metrics["loss"]

    walls = interleaved_medians(
        {"plain": call_plain, "guarded": call_guarded}, repeats=cfg.step_repeats
    )
    tokens_per_step = cfg.batch_size * cfg.seq_len
    rows = [
        {
            "part": f"train step {cfg.model} ({n_params / 1e6:.0f}M) bf16",
            "name": name,
            "wall ms": 1e3 * w,
            "tokens/s": tokens_per_step / w,
        }
        for name, w in walls.items()
    ]
    key = f"{cfg.model.split('-')[0]} bf16"
    return rows, {
        f"wall_guarded/plain ({key})": walls["guarded"] / walls["plain"],
        f"tokens_per_s_guarded ({key})": tokens_per_step / walls["guarded"],
        f"tokens_per_s_plain ({key})": tokens_per_step / walls["plain"],
    }


def optax_plain(lr: float):
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))


def controller_part(quick: bool) -> tuple[list[dict], dict]:
    _, res = controller.run(controller.Config.quick() if quick else controller.Config())
    return [], {k: float(v) for k, v in res["ratios"].items()}


def run(cfg: Config, *, quick: bool = False) -> tuple[list[dict], dict]:
    rows, ratios = optimizer_part(cfg, quick)
    r, x = train_step_part(cfg)
    rows += r
    ratios.update(x)
    if cfg.controller:
        _, x = controller_part(quick)
        ratios.update({f"controller {k}": v for k, v in x.items()})
    return rows, {"device": device_name(), "ratios": ratios, "targets": TARGETS}


def main(argv=None) -> dict:
    argv = list(argv or [])
    if "--out" not in argv:
        argv += ["--out", str(RESULTS / "bench" / "gpu")]
    quick = "--quick" in argv
    return bench_main(
        Config,
        lambda cfg: run(cfg, quick=quick),
        argv,
        description=__doc__.splitlines()[0],
        stem="gpu",
        targets=TARGETS,
        title=lambda cfg, r: f"Accelerator bench on {r['device']}",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
