"""Benchmark 2: the full train step, hand-written plain Optax against ``make_train_step``.

The reference Transformer (about 10M parameters by default). ``plain`` is a hand-written
jitted step: optax cross-entropy, ``clip_by_global_norm(1.0)`` and ``adamw``, state donated.
The ``stabljax`` rows are :func:`stabljax.make_train_step` with z-loss and every metric:
``stabljax-plain-opt`` with the same optimizer (the cost of the step's losses and
metrics), ``stabljax-guarded`` with ``skip_nonfinite(skip_spikes(chain(clip_by_zscore(),
safe_adamw)))`` (losses, metrics and guards), once with ``layer_metrics=False`` and once
with ``True``. On XLA:CPU, ``plain`` and ``stabljax-guarded`` are also compiled with
``stabljax.recommended_compiler_options()`` (suffix ``(cpu_options)``, compared with each
other). All are timed round-robin in one process; ratios are against ``plain``.

With ``--aot-tpu TOPOLOGY`` (e.g. ``v5e:2x4``; needs ``pip install -e ".[tpu]"``, no TPU)
the steps are instead compiled ahead of time for XLA:TPU at two sizes, in bf16 compute
with float32 master weights: ~185M parameters (d_model 1024, 12 layers, vocab 32000, seq
1024, batch 64) data parallel over every chip, and ~1B (d_model 2048, 18 layers) FSDP
over every chip. ``plain`` is the hand-written step above in bf16; ``guarded`` is
``make_train_step`` with z-loss, the guarded optimizer and ``Precision.bf16()``;
``guarded+qk_clip`` adds :func:`stabljax.qk_clip` (issue 30: ≤ 1 % more bytes at 185M). The
compiler's bytes accessed and per-device memory are reported, and whether the step fits
in the chip's HBM.

    python -m experiments.bench.train_step [--quick] [--d-model 384 --n-layers 6]
    python -m experiments.bench.train_step --aot-tpu v5e:2x4
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stabljax
from experiments import cli
from experiments.bench import aot_tpu
from experiments.bench.timing import compiled_cost, interleaved_medians
from experiments.proxy import QUICK_SIZE, BenchSize, build_model, corpus_batches

TARGETS = {"wall_guarded/plain": 1.03, "wall_guarded/plain (cpu_options)": 1.03}
# XLA:TPU (AOT), per model size: bytes against plain, and the guarded step's temp memory
# above plain's as a fraction of plain's.
TPU_SIZES = {
    "185M-data": dict(d_model=1024, n_layers=12, n_heads=16, parallelism="data"),
    "1B-fsdp": dict(d_model=2048, n_layers=18, n_heads=16, parallelism="fsdp"),
    # For --quick smoke runs only.
    "tiny-data": dict(d_model=64, n_layers=2, n_heads=4, parallelism="data"),
    "tiny-fsdp": dict(d_model=64, n_layers=2, n_heads=4, parallelism="fsdp"),
}
TPU_TARGETS = {
    **{f"tpu bytes_guarded/plain ({k})": 1.03 for k in ("185M-data", "1B-fsdp")},
    **{f"tpu temp_guarded-plain / plain ({k})": 0.02 for k in ("185M-data", "1B-fsdp")},
    "tpu bytes_guarded+qk_clip/guarded (185M-data)": 1.01,
}


@dataclasses.dataclass(frozen=True)
class Config(BenchSize):
    repeats: int = 7
    lr: float = 1e-3
    z_loss: float = 1e-4
    seed: int = 0
    aot_tpu: str = dataclasses.field(
        default="",
        metadata={"help": "compile for this TPU topology (e.g. v5e:2x4) instead of timing"},
    )
    tpu_sizes: tuple[str, ...] = ("185M-data", "1B-fsdp")
    tpu_vocab: int = 32000
    tpu_seq_len: int = 1024
    tpu_batch_size: int = 64

    @classmethod
    def quick(cls) -> Config:
        return cls(
            **QUICK_SIZE,
            repeats=2,
            tpu_sizes=("tiny-data", "tiny-fsdp"),
            tpu_vocab=256,
            tpu_seq_len=64,
            tpu_batch_size=8,
        )


def _plain_step(apply_fn, opt, compiler_options=None):
    def loss_fn(params, batch):
        logits = apply_fn(params, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    @functools.partial(jax.jit, donate_argnums=(0, 1), compiler_options=compiler_options)
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def guarded_opt(lr: float, qk_layers=None) -> optax.GradientTransformation:
    parts = [stabljax.clip_by_zscore(), stabljax.safe_adamw(lr)]
    if qk_layers is not None:
        parts.append(stabljax.qk_clip(qk_layers))
    return stabljax.skip_nonfinite(stabljax.skip_spikes(optax.chain(*parts)))


def tpu_steps(cfg: Config, arch: dict) -> dict:
    """The steps compiled for XLA:TPU: ``plain`` (bf16 compute), ``guarded`` and
    ``guarded+qk_clip`` (``guarded`` with :func:`stabljax.qk_clip` last in the guarded
    chain, fed the reference model's per-head max logits through ``aux``)."""
    precision = stabljax.Precision.bf16()

    def plain(apply_fn):
        opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cfg.lr))

        def loss_fn(params, batch):
            logits = apply_fn(precision.cast_to_compute(params), batch["inputs"])
            logits = logits.astype(jnp.float32)
            labels = batch["targets"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        def args(params, rule, batch):
            return params, aot_tpu.abstract(jax.eval_shape(opt.init, params), rule), batch

        return step, args

    def guarded(apply_fn, qk_clip=False):
        opt = guarded_opt(cfg.lr)
        loss_fn = stabljax.lm_loss(apply_fn, z_loss_weight=cfg.z_loss)
        if qk_clip:
            model = aot_tpu.abstract_model(
                arch["d_model"], arch["n_layers"], arch["n_heads"], cfg.tpu_vocab, cfg.tpu_seq_len
            )
            aux_apply = stabljax.nnx_apply(model, return_aux=True)[0]
            opt = guarded_opt(cfg.lr, qk_layers=model.qk_layers())

            def loss_fn(params, batch):
                logits, a = aux_apply(params, batch["inputs"])
                loss, aux = stabljax.cross_entropy_with_z_loss(
                    logits, batch["targets"], z_loss_weight=cfg.z_loss
                )
                return loss, {**aux, "max_attn_logits": a["max_attn_logits"]}

        step = stabljax.make_train_step(loss_fn, opt, precision=precision)

        return step, aot_tpu.train_state_args(opt)

    return {
        "plain": plain,
        "guarded": guarded,
        "guarded+qk_clip": functools.partial(guarded, qk_clip=True),
    }


def run_aot_tpu(cfg: Config) -> tuple[list[dict], dict]:
    """Both steps compiled for ``cfg.aot_tpu`` at the two sizes of :data:`TPU_SIZES`."""
    hbm = aot_tpu.hbm_bytes(cfg.aot_tpu)
    rows, ratios, per_size = [], {}, {}
    for size in cfg.tpu_sizes:
        if size not in TPU_SIZES:
            raise ValueError(f"--tpu-sizes: unknown size {size!r}; known: {sorted(TPU_SIZES)}")
        arch = TPU_SIZES[size]
        res = aot_tpu.train_step_costs(
            cfg.aot_tpu,
            tpu_steps(cfg, arch),
            vocab=cfg.tpu_vocab,
            seq_len=cfg.tpu_seq_len,
            batch_size=cfg.tpu_batch_size,
            **arch,
        )
        per_size[size] = res
        plain = res["per_step"]["plain"]
        for name, c in res["per_step"].items():
            rows.append(
                {
                    "model": size,
                    "params": f"{res['n_params'] / 1e6:.0f}M",
                    "step": name,
                    "bytes accessed": c["bytes"],
                    "bytes / plain": c["bytes"] / plain["bytes"],
                    "flops / plain": c["flops"] / plain["flops"],
                    "temp GiB": c["temp"] / 2**30,
                    "peak GiB / chip": c["peak"] / 2**30,
                    "fits HBM": "?" if hbm is None else ("yes" if c["peak"] <= hbm else "no"),
                }
            )
        guarded = res["per_step"]["guarded"]
        ratios[f"tpu bytes_guarded/plain ({size})"] = guarded["bytes"] / plain["bytes"]
        extra = guarded["temp"] - plain["temp"]
        ratios[f"tpu temp_guarded-plain / plain ({size})"] = (
            extra / plain["temp"] if plain["temp"] else (float("inf") if extra > 0 else 0.0)
        )
        qk = res["per_step"]["guarded+qk_clip"]
        ratios[f"tpu bytes_guarded+qk_clip/guarded ({size})"] = qk["bytes"] / guarded["bytes"]
    return rows, {
        "per_size": per_size,
        "ratios": ratios,
        "targets": TPU_TARGETS,
        "topology": cfg.aot_tpu,
        "hbm_bytes": hbm,
        "compiler": "XLA:TPU (AOT)",
        "n_params": per_size[cfg.tpu_sizes[0]]["n_params"],
    }


def run(cfg: Config) -> tuple[list[dict], dict]:
    if cfg.aot_tpu:
        return run_aot_tpu(cfg)
    setup = cfg.setup(seed=cfg.seed, corpus_bytes=200_000)
    model, _ = build_model(setup)
    apply_fn, params0 = stabljax.nnx_apply(model)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params0))
    batch = jax.tree.map(jax.numpy.asarray, corpus_batches(setup)(0))

    def plain_opt():
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(cfg.lr))

    def guarded():
        return guarded_opt(cfg.lr)

    runners, costs = {}, {}

    # On XLA:CPU the plain and the guarded step are also compiled with
    # stabljax.recommended_compiler_options(), both (a ratio of like to like).
    cpu = jax.default_backend() == "cpu"
    options = stabljax.recommended_compiler_options("cpu") if cpu else None
    plain_modes = {"plain": None, **({"plain (cpu_options)": options} if cpu else {})}
    for name, compiler_options in plain_modes.items():
        opt = plain_opt()
        step = _plain_step(apply_fn, opt, compiler_options)
        params = jax.tree.map(jax.numpy.copy, params0)
        box = [params, opt.init(params)]
        costs[name] = compiled_cost(step.lower(box[0], box[1], batch).compile())

        def call_plain(step=step, box=box):
            box[0], box[1], loss = step(box[0], box[1], batch)
            return loss

        runners[name] = call_plain

    variants = {
        "stabljax-plain-opt": (plain_opt, False, None),
        "stabljax-guarded": (guarded, False, None),
        "stabljax-guarded+layers": (guarded, True, None),
    }
    if cpu:
        variants["stabljax-guarded (cpu_options)"] = (guarded, False, options)
    for name, (make_opt, layers, compiler_options) in variants.items():
        opt = make_opt()
        state = stabljax.TrainState.create(jax.tree.map(jax.numpy.copy, params0), opt)
        step = stabljax.make_train_step(
            stabljax.lm_loss(apply_fn, z_loss_weight=cfg.z_loss),
            opt,
            layer_metrics=layers,
            compiler_options=compiler_options,
        )
        costs[name] = compiled_cost(step.lower(state, batch).compile())
        sbox = [state]

        def call(step=step, sbox=sbox):
            sbox[0], metrics = step(sbox[0], batch)
            return metrics["loss"]

        runners[name] = call

    walls = interleaved_medians(runners, repeats=cfg.repeats)
    rows, per = [], {}
    for name in runners:
        per[name] = {**costs[name], "wall_s": walls[name]}
        rows.append(
            {
                "step": name,
                "wall ms": 1e3 * walls[name],
                "wall / plain": walls[name] / walls["plain"],
                "bytes / plain": costs[name]["bytes"] / costs["plain"]["bytes"],
                "flops / plain": costs[name]["flops"] / costs["plain"]["flops"],
            }
        )
    ratios = {
        "wall_plain-opt/plain": walls["stabljax-plain-opt"] / walls["plain"],
        "wall_guarded/plain": walls["stabljax-guarded"] / walls["plain"],
        "wall_guarded+layers/plain": walls["stabljax-guarded+layers"] / walls["plain"],
    }
    if cpu:
        guarded, plain = "stabljax-guarded (cpu_options)", "plain (cpu_options)"
        ratios["wall_guarded/plain (cpu_options)"] = walls[guarded] / walls[plain]
        ratios["bytes_guarded/plain (cpu_options)"] = (
            costs[guarded]["bytes"] / costs[plain]["bytes"]
        )
    return rows, {"per_step": per, "ratios": ratios, "targets": TARGETS, "n_params": n_params}


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.train_step")
    cfg = ex.cfg
    rows, r = run(cfg)
    if cfg.aot_tpu:
        title, stem = f"Train step, XLA:TPU AOT for {cfg.aot_tpu}", "train_step_tpu"
    else:
        title, stem = f"Train step, {r['n_params'] / 1e6:.1f}M parameters", "train_step"
    return ex.report(rows, r, targets={**TARGETS, **TPU_TARGETS}, title=title, stem=stem)


if __name__ == "__main__":
    main()
