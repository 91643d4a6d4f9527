"""A small job whose spikes triage must classify; importable, and runnable as a script.

A linear regression trained with SGD on batches that are a pure function of their
index. Three constructed causes:

* ``bad``: those batches hold garbage targets (+50): their loss spikes from any state, so
  triage must say ``data`` and name them.
* ``trigger``: those batches carry a flag that multiplies their loss by 1000 only when
  ``state.step >= STATE_FROM``: a spike that needs this batch *and* this state (PaLM's
  case), so triage must say ``state``.
* a ``TriageConfig._fault_hook`` that perturbs the re-run of the onset step: triage must
  say ``nondeterministic``.

As a script it trains under a RollbackController with triage on, optionally SIGKILLing
itself during triage (``--kill-in-triage K``: at the K-th replayed step), and writes the
final params, ledger and events for the test to compare:

    python tests/triage_worker.py --dir D --bad 35 --out final.npz [--kill-in-triage 8]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from typing import Any

import numpy as np

W_TRUE = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
ROWS = 16
STATE_FROM = 30


def batch_fn_factory(bad=(), trigger=()):
    bad, trigger = frozenset(bad), frozenset(trigger)

    def batch_fn(i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([7, i])
        x = rng.normal(size=(ROWS, 4)).astype(np.float32)
        y = x @ W_TRUE + 0.1 * rng.normal(size=(ROWS, 1)).astype(np.float32)
        if i in bad:
            y = y + 50.0
        flag = np.float32(1.0 if i in trigger else 0.0)
        return {"x": x, "y": y.astype(np.float32), "trigger": flag}

    return batch_fn


def make_toy(*, donate: bool = True):
    """``(init_state, train_step)``; the step donates its state, as real ones do."""
    import flax.struct
    import jax
    import jax.numpy as jnp
    import optax

    opt = optax.sgd(0.05)

    @flax.struct.dataclass
    class ToyState:
        step: jax.Array
        params: Any
        opt_state: Any

    def loss_fn(params, batch, step):
        pred = batch["x"] @ params["w"] + params["b"]
        mse = jnp.mean((pred - batch["y"]) ** 2)
        amplify = 1.0 + 1e3 * batch["trigger"] * (step >= STATE_FROM)
        return mse * amplify

    @functools.partial(jax.jit, donate_argnums=(0,) if donate else ())
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, state.step)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "layers": {"grad_norm": {k: jnp.linalg.norm(g) for k, g in grads.items()}},
        }
        return ToyState(state.step + 1, params, opt_state), metrics

    params = {"w": jnp.zeros((4, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}
    state = ToyState(jnp.zeros([], jnp.int32), params, opt.init(params))
    return state, train_step


def controller_kwargs() -> dict[str, Any]:
    from stabljax.control import SpikeDetector

    return dict(
        save_every=10,
        keep=3,
        rollback_margin=5,
        detectors=[SpikeDetector(warmup=10, patience=5)],
        async_save=False,
    )


def kill_at(k: int):
    """A fault hook that SIGKILLs this process at the ``k``-th replayed step."""
    seen = [0]

    def hook(phase, step, metrics):
        seen[0] += 1
        if seen[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return metrics

    return hook


def comparable(events) -> list[dict[str, Any]]:
    """Events without their wall-clock fields (``time``, triage's ``seconds``)."""
    out = []
    for e in events:
        d = {k: v for k, v in e.details.items() if k != "seconds"}
        out.append({"kind": e.kind, "step": e.step, "details": d})
    return out


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--bad", default="")
    p.add_argument("--trigger", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--kill-in-triage", type=int, default=0, help="SIGKILL at this replayed step")
    args = p.parse_args(argv)

    import jax

    from stabljax.control import IndexedBatches, RollbackController, TriageConfig

    hook = kill_at(args.kill_in_triage) if args.kill_in_triage else None
    state, train_step = make_toy()
    data = IndexedBatches(batch_fn_factory(_ints(args.bad), _ints(args.trigger)))
    ctl = RollbackController(args.dir, triage=TriageConfig(_fault_hook=hook), **controller_kwargs())
    with ctl:
        state, data = ctl.run(train_step, state, data, args.steps, progress=False)
    host = jax.device_get(state.params)
    np.savez(args.out, w=host["w"], b=host["b"], step=int(state.step))
    with open(args.out + ".json", "w") as f:
        json.dump({"ranges": ctl.skipped_ranges, "index": data.index}, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
