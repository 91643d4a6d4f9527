"""The bad data and the compiled programs of :mod:`experiments.spike_recovery`.

Two faults at fixed data indices: a window of garbage batches (random target bytes) and
state-dependent traps (a loss that is NaN only when the model's loss on that batch is
already below a threshold). ``cfg`` is a :class:`experiments.spike_recovery.Config`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import stabljax
from experiments import proxy


def garbage(cfg: Any) -> range:
    return range(cfg.garbage_start, cfg.garbage_start + cfg.garbage_len)


def poisoned(batch_fn, cfg: Any, seed: int):
    """``batch_fn`` with garbage targets in the window and the trap flag on trap batches."""

    def fn(i: int):
        b = dict(batch_fn(i))
        if i in garbage(cfg):
            rng = np.random.default_rng([seed, 7, i])
            b["targets"] = rng.integers(0, 256, b["targets"].shape, dtype=np.int32)
        b["trap"] = np.full((b["inputs"].shape[0],), int(i in cfg.traps), np.int32)
        return b

    return fn


def clean_batches(batch_fn):
    def fn(i: int):
        b = dict(batch_fn(i))
        b["trap"] = np.zeros((b["inputs"].shape[0],), np.int32)
        return b

    return fn


def trap_loss(apply_fn, threshold: float):
    """Cross-entropy, NaN on a trap batch when that cross-entropy is below ``threshold``."""

    def loss_fn(params, batch):
        logits = apply_fn(params, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        fire = jnp.logical_and(jnp.max(batch["trap"]) > 0, ce < threshold)
        # NaN times the loss (not a selected NaN constant) so the gradient is NaN too.
        return ce * jnp.where(fire, jnp.nan, 1.0), {"trap_fired": fire}

    return loss_fn


class Programs:
    """The jitted step of each optimizer kind and the held-out loss, compiled once."""

    def __init__(self, cfg: Any):
        s = cfg.setup(seed=0)
        self.model, _ = proxy.initial_model(s)
        self.apply_fn, _ = stabljax.nnx_apply(self.model)
        base = proxy.adamw(s)
        self.optimizers = {
            "plain": base,
            "guarded": stabljax.skip_nonfinite(
                stabljax.skip_spikes(base, warmup_steps=cfg.spike_warmup)
            ),
        }
        loss = trap_loss(self.apply_fn, cfg.trap_threshold)
        self.steps = {k: stabljax.make_train_step(loss, o) for k, o in self.optimizers.items()}
        apply_fn = self.apply_fn

        @jax.jit
        def ce(params, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, x), y).mean()

        self.ce = ce
        mesh = Mesh(np.array(jax.devices()), ("data",))
        self.rep = NamedSharding(mesh, PartitionSpec())
        self.shard = NamedSharding(mesh, PartitionSpec("data"))

    def put(self, batch):
        return {
            k: jax.make_array_from_callback(v.shape, self.shard, lambda idx, v=v: v[idx])
            for k, v in batch.items()
        }

    def evaluate(self, s: proxy.Setup, params) -> float:
        held = proxy.corpus_batches(s, seed_offset=1)
        vals = []
        for i in range(s.eval_batches):
            b = self.put(held(i))
            vals.append(self.ce(params, b["inputs"], b["targets"]))
        return float(np.mean(jax.device_get(vals)))
