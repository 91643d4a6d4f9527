"""The Slingshot failure: loss spikes a small Transformer makes by itself on modular addition.

Thilak et al. (`The Slingshot Mechanism <https://arxiv.org/abs/2206.04817>`_, 2022): a
one-layer Transformer trained with Adam (no weight decay, constant LR) on ``a + b mod p``
drives its training loss to near zero, then spikes by orders of magnitude, recovers and
spikes again, cyclically. Nothing is injected: the spike is Adam's normalised step meeting
a gradient that has shrunk for many steps (the last layer's norm grows, the second moment
decays, and the next step is too large).

This module is the task (data, model, loss) and the pilot that measured it
(``python -m experiments.slingshot``): spikes per run, their size in nats, how many seeds
spike, for a few settings, vmapped over seeds in one scanned program.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stabljax
from experiments import common
from stabljax.reference.nn import TransformerConfig, TransformerLM

#: The spike criterion, fixed from the pilot before the main run: a step whose training loss
#: exceeds the running minimum of the run so far by more than ``SPIKE_NATS`` nats. Slingshot
#: spikes rise from ~1e-3 nats to >= 1 nat; healthy minibatch noise near zero stays far below.
SPIKE_NATS = 0.5
#: The pilot's seeds (the main job uses others, from 100 on).
PILOT_SEEDS = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Task:
    """Modular addition ``a + b mod p`` as a 3-token sequence ``[a, b, =]`` -> ``c``."""

    p: int = 31
    train_frac: float = 0.5
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 4
    batch_size: int = 128
    lr: float = 1e-2
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    data_seed: int = 0

    def split(self) -> tuple[np.ndarray, np.ndarray]:
        """``(train, test)`` rows ``[a, b, =, c]`` (int32), split by ``data_seed``."""
        a, b = np.meshgrid(np.arange(self.p), np.arange(self.p), indexing="ij")
        rows = np.stack(
            [a.ravel(), b.ravel(), np.full(a.size, self.p), (a + b).ravel() % self.p], axis=1
        ).astype(np.int32)
        perm = np.random.default_rng(self.data_seed).permutation(len(rows))
        n = int(round(self.train_frac * len(rows)))
        return rows[perm[:n]], rows[perm[n:]]

    def model(self, seed: int):
        """``(apply_fn, params)`` of the Transformer (vocabulary p + 1: the ``=`` token)."""
        cfg = TransformerConfig(
            vocab_size=self.p + 1,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            max_len=3,
        )
        from flax import nnx

        return stabljax.nnx_apply(TransformerLM(cfg, rngs=nnx.Rngs(seed)))

    def optimizer(self, lr: float | None = None) -> optax.GradientTransformation:
        """Adam, no weight decay, constant LR (the Slingshot setting), its LR in the state
        (``optax.inject_hyperparams``: a rollback remedy can lower it)."""
        adam = optax.inject_hyperparams(optax.adam)
        return adam(self.lr if lr is None else lr, b1=self.b1, b2=self.b2, eps=self.eps)

    def batches(self, seed: int):
        """``batch_fn(i)``: batch ``i`` of run ``seed``, rows ``[a, b, =, c]``."""
        train, _ = self.split()
        return lambda i: train[batch_indices(len(train), self.batch_size, seed, i)]


def batch_indices(n_train: int, batch_size: int, seed: int, i: int) -> np.ndarray:
    """Batch ``i`` of a run: ``batch_size`` train rows drawn without replacement, a pure
    function of ``(seed, i)`` (a skipped batch is a different draw, not a shifted epoch)."""
    rng = np.random.default_rng([seed, 11, i])
    return rng.choice(n_train, batch_size, replace=False)


def loss_fn(apply_fn):
    """Cross-entropy of the answer token (the logits at the ``=`` position)."""

    def fn(params, batch):
        logits = apply_fn(params, batch[:, :3])[:, -1]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 3])
        acc = jnp.mean(jnp.argmax(logits, -1) == batch[:, 3])
        return ce.mean(), {"acc": acc}

    return fn


def spikes(losses: np.ndarray, nats: float = SPIKE_NATS) -> list[int]:
    """Onsets of spikes: steps where the loss first exceeds the running minimum by > ``nats``
    (one onset per excursion: the loss must come back within ``nats`` before the next)."""
    x = np.asarray(losses, float)
    run_min = np.minimum.accumulate(np.where(np.isfinite(x), x, np.inf))
    above = ~(x - run_min <= nats)  # NaN counts as above
    return [int(i) for i in np.flatnonzero(above & ~np.concatenate([[False], above[:-1]]))]


def scan_runs(step, states: list, batch_fns: list, steps: int):
    """Runs ``step`` on several independent runs at once (``jax.vmap`` over the runs,
    ``lax.scan`` over the steps): run ``k`` starts at ``states[k]`` and trains on
    ``batch_fns[k](0..steps-1)``. Returns the final states stacked over the runs and the
    metrics ``loss`` and ``skipped`` as host arrays ``[runs, steps]``."""
    state = jax.tree.map(lambda *x: jnp.stack(x), *states)
    data = jnp.asarray(
        np.stack([[fn(i) for i in range(steps)] for fn in batch_fns], axis=1)
    )  # [steps, runs, B, 4]

    @jax.jit
    def go(state, data):
        def one(s, b):
            s, m = jax.vmap(step)(s, b)
            return s, {k: m[k] for k in ("loss", "skipped")}

        return jax.lax.scan(one, state, data)

    state, ms = go(state, data)
    return state, {k: np.asarray(v).T for k, v in ms.items()}


def with_lr(state, lr: float):
    """``state`` (an inject_hyperparams optimizer's, possibly wrapped) with its LR set."""
    hp = optax.tree.get(state.opt_state, "hyperparams")
    hp["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return state


def pilot_run(task: Task, seeds, steps: int, lrs=None) -> np.ndarray:
    """Training losses ``[runs, steps]``, the runs vmapped in one scanned program: one per
    seed, or with ``lrs`` one per ``(seed, lr)`` pair of ``zip(seeds, lrs)``."""
    lrs = [task.lr] * len(seeds) if lrs is None else list(lrs)
    apply_fn, _ = task.model(0)
    tx = task.optimizer()
    step = stabljax.make_train_step(loss_fn(apply_fn), tx, donate=False)
    states = [
        with_lr(stabljax.TrainState.create(task.model(sd)[1], tx), lr)
        for sd, lr in zip(seeds, lrs, strict=True)
    ]
    _, ms = scan_runs(step, states, [task.batches(sd) for sd in seeds], steps)
    return ms["loss"]


class Programs:
    """The jitted steps (plain and guarded) and the evaluation of the main job
    (:mod:`experiments.spike_recovery`; ``cfg`` is its config), compiled once."""

    def __init__(self, cfg):
        self.task = cfg.task()
        apply_fn, _ = self.task.model(0)
        loss = loss_fn(apply_fn)
        tx = self.task.optimizer()
        self.optimizers = {
            "plain": tx,
            "guarded": stabljax.skip_nonfinite(
                stabljax.skip_spikes(tx, warmup_steps=cfg.spike_warmup)
            ),
        }
        self.steps = {k: stabljax.make_train_step(loss, o) for k, o in self.optimizers.items()}
        self.scan_steps = {
            k: stabljax.make_train_step(loss, o, donate=False) for k, o in self.optimizers.items()
        }
        self.eval = jax.jit(loss)
        self.train, self.test = self.task.split()

    def evaluate(self, params, rows) -> tuple[float, float]:
        loss, aux = self.eval(params, rows)
        return common.finite_or_nan(float(loss)), float(aux["acc"])


def controller(cfg, ckpt, arm: str) -> stabljax.RollbackController:
    """The main job's controller at its default detectors (``cfg``: the main job's config);
    for arm ``remedy`` it also lowers the LR of the restored state at every rollback."""
    keep = (cfg.margin + 2 * cfg.save_every) // cfg.save_every + 2
    kw = {}
    if arm == "remedy":
        from stabljax.control.decide import remedies

        kw["remedy"] = remedies.lower_lr(cfg.remedy_factor)
    return stabljax.RollbackController(
        ckpt,
        save_every=cfg.save_every,
        keep=keep,
        rollback_margin=cfg.margin,
        max_rollbacks=cfg.max_rollbacks,
        **kw,
    )


def kept_losses(calls: list[dict], got: list[dict]) -> np.ndarray:
    """The loss of each step of the kept trajectory, the one the final state was trained
    through: walking back from the last call, the latest earlier call of each step before
    (a rollback's replay comes after the calls it discards)."""
    out, want = [], calls[-1]["step"] if calls else -1
    for k in range(len(calls) - 1, -1, -1):
        if calls[k]["step"] == want:
            out.append(float(got[k]["loss"]))
            want -= 1
    return np.array(out[::-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    t = Task()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--lr", type=float, nargs="+", default=[t.lr])
    ap.add_argument("--b2", type=float, default=t.b2)
    ap.add_argument("--d-model", type=int, default=t.d_model)
    ap.add_argument("--batch-size", type=int, default=t.batch_size)
    ap.add_argument("--train-frac", type=float, default=t.train_frac)
    ap.add_argument("--p", type=int, default=t.p)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(PILOT_SEEDS))
    a = ap.parse_args(argv)
    for lr in a.lr:
        task = Task(
            lr=lr,
            b2=a.b2,
            d_model=a.d_model,
            batch_size=a.batch_size,
            train_frac=a.train_frac,
            p=a.p,
        )
        t0 = time.perf_counter()
        losses = pilot_run(task, a.seeds, a.steps)
        wall = time.perf_counter() - t0
        rows = []
        for sd, x in zip(a.seeds, losses, strict=True):
            on = spikes(x)
            sizes = [float(np.nanmax(x[o : o + 50]) - np.min(x[: o + 1])) for o in on]
            rows.append(
                {
                    "seed": sd,
                    "spikes": len(on),
                    "onsets": on[:12],
                    "size_nats": [round(s, 2) for s in sizes[:12]],
                    "min_loss": float(np.nanmin(x)),
                    "final_loss": float(x[-1]),
                    "first_below_0.01": int(np.argmax(x < 0.01)) if np.any(x < 0.01) else None,
                }
            )
        print(json.dumps({"lr": lr, "b2": a.b2, "steps": a.steps, "wall_s": round(wall, 1)}))
        for r in rows:
            print(" ", json.dumps(r))


if __name__ == "__main__":
    main()
