"""The trainer of ``trainer_before.py`` handing its checkpoints over to the controller.

``trainer_after.py`` keeps the trainer's own Orbax ``CheckpointManager`` beside the
controller's, so every save point writes two checkpoints of the same state. Here the
controller's checkpoint is the only one: it already holds the train state and the Grain
iterator, and ``restore_or_init`` is the restore. README shows the diff against
``trainer_before.py``; ``tests/test_adoption.py`` checks it and runs this trainer through a
kill and a resume, and ``experiments/bench/adoption.py`` times it.
"""

from __future__ import annotations

import dataclasses
import pathlib

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import stabljax
from flax.training import train_state


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8
    micro_steps: int = 2  # micro-batches per optimizer update (optax.MultiSteps)
    lr: float = 3e-3
    steps: int = 200
    save_every: int = 100
    seed: int = 0


class Block(nn.Module):
    d_model: int
    n_heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.n_heads)(
            nn.LayerNorm()(x), mask=mask
        )
        h = nn.Dense(4 * self.d_model)(nn.LayerNorm()(x))
        return x + nn.Dense(self.d_model)(nn.gelu(h))


class LM(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        x = nn.Embed(256, cfg.d_model)(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model))
        for _ in range(cfg.n_layers):
            x = Block(cfg.d_model, cfg.n_heads)(x)
        return nn.Dense(256)(nn.LayerNorm()(x))


class Tokenize(grain.transforms.Map):
    """A document (bytes, a loss weight) -> inputs, targets and per-token weights."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def map(self, record):
        doc, weight = record
        tokens = np.frombuffer(doc, np.uint8)[: self.seq_len + 1].astype(np.int32)
        weights = np.full(self.seq_len, weight, np.float32)
        return {"inputs": tokens[:-1], "targets": tokens[1:], "weights": weights}


def make_loader(docs, cfg: Config) -> grain.DataLoader:
    return grain.DataLoader(
        data_source=docs,
        sampler=grain.samplers.IndexSampler(len(docs), num_epochs=1, shuffle=False),
        operations=[Tokenize(cfg.seq_len), grain.transforms.Batch(cfg.batch_size)],
        worker_count=0,
    )


def loss_fn(params, apply_fn, batch):
    logits = apply_fn({"params": params}, batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    loss = jnp.sum(ce * batch["weights"]) / jnp.sum(jnp.isfinite(batch["weights"]))
    return loss + 1e-4 * stabljax.z_loss(logits)


@jax.jit
def train_step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, state.apply_fn, batch)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params, value=loss)
    params = optax.apply_updates(state.params, updates)
    state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return state, {"loss": loss, "skipped": stabljax.any_skipped(opt_state)}


@jax.jit
def eval_loss(state, batch):
    return loss_fn(state.params, state.apply_fn, batch)


def train(cfg: Config, docs, held_out, workdir: pathlib.Path, on_step=None):
    model = LM(cfg)
    params = model.init(jax.random.key(cfg.seed), jnp.zeros((1, cfg.seq_len), jnp.int32))
    tx = optax.MultiSteps(optax.adamw(cfg.lr), every_k_schedule=cfg.micro_steps)
    tx = stabljax.skip_nonfinite(stabljax.skip_spikes(tx))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params["params"], tx=tx)
    it = iter(make_loader(docs, cfg))
    ctl = stabljax.RollbackController(
        workdir / "ctl", save_every=cfg.save_every, screen_ahead=64, screen_step=train_step
    )
    state, it = ctl.restore_or_init(state, it, total_steps=cfg.steps)
    log = []
    while int(state.step) < cfg.steps:
        state, metrics = train_step(state, next(it))
        state, it = ctl.step(state, metrics, it)
        step = int(state.step)
        if on_step is not None:  # the tests look at every step
            on_step(state, metrics)
        if step % 50 == 0:
            gradient_step = int(optax.tree.get(state.opt_state, "gradient_step"))
            log.append((step, gradient_step, float(metrics["loss"])))
    state, it = ctl.finish(state, it)
    ctl.close()
    evals = [float(eval_loss(state, b)) for b in iter(make_loader(held_out, cfg))]
    return state, float(np.mean(evals)), log


def main(argv=None) -> None:
    """A small default run on this file's own bytes: ``python -m examples.<this module>``."""
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="train steps (micro-batches)")
    p.add_argument("--workdir", type=pathlib.Path, help="where checkpoints go (default: a tempdir)")
    args = p.parse_args(argv)
    cfg = Config(steps=args.steps)
    n = cfg.seq_len + 1
    text = pathlib.Path(__file__).read_bytes() * 8  # the trainer's source as its corpus
    docs = [(text[i : i + n], 1.0) for i in range(0, len(text) - n, n)]
    held_out, docs = docs[: 2 * cfg.batch_size], docs[2 * cfg.batch_size :]
    with tempfile.TemporaryDirectory() as tmp:
        state, held_out_loss, _ = train(cfg, docs, held_out, args.workdir or pathlib.Path(tmp))
    print(f"{int(state.step)} steps, held-out loss {held_out_loss:.3f}")


if __name__ == "__main__":
    main()
