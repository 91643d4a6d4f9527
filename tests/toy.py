"""The controller tests' toy problem, one definition for the tests and the worker scripts.

A linear regression ``y = x @ W_TRUE + noise`` trained with SGD. Batch ``i`` is a pure
function of ``(seed, i)``, so any replay of the data is exact, and indices can be
poisoned:

* ``bad``: targets +50, a loss spike whose update wrecks the parameters; it spikes from
  any state, so triage says ``data``.
* ``nan``: NaN targets.
* ``trigger``: rows flagged so that their loss is multiplied by 1001 only once
  ``state.step >= STATE_FROM``: a spike that needs this batch *and* this state (PaLM's
  case), so triage says ``state``.
* ``drift_from``: targets drift up slowly from that index on (a slow divergence).

The tests import it, and conftest.py's fixtures (``toy``, ``reference``) build on it;
the worker scripts (``ctl_worker.py``, ``triage_worker.py``) run it in subprocesses,
where fixtures do not exist. JAX is imported inside the functions: a worker that joins
a multi-process job must configure it before anything touches a backend.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import numpy as np

W_TRUE = np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
ROWS = 16
STATE_FROM = 30  # the step from which ``trigger`` rows amplify their loss
BAD = (35, 36, 80)  # the poisoned batches of the reference run (``conftest.reference``)
TRIAGE_SEED = 7  # the data seed of the triage tests, whose verdicts were worked out on it


def batch_fn_factory(bad=(), nan=(), trigger=(), *, seed: int = 0, drift_from: int | None = None):
    """Returns ``batch_fn(i) -> {"x", "y", "trigger"}``, poisoned as the module says."""
    bad, nan, trigger = frozenset(bad), frozenset(nan), frozenset(trigger)

    def batch_fn(i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([seed, i])
        x = rng.normal(size=(ROWS, 4)).astype(np.float32)
        y = x @ W_TRUE + 0.1 * rng.normal(size=(ROWS, 1)).astype(np.float32)
        if i in bad:
            y = y + 50.0
        if i in nan:
            y = y * np.nan
        if drift_from is not None and i >= drift_from:
            y = y + rng.normal(size=(ROWS, 1)).astype(np.float32) * 0.02 * (i - drift_from)
        flag = np.full((ROWS, 1), 1.0 if i in trigger else 0.0, np.float32)
        return {"x": x, "y": y.astype(np.float32), "trigger": flag}

    return batch_fn


def make_toy(optimizer=None, *, extra: int = 0, donate: bool = False):
    """Returns ``(init_state, train_step)`` for ``optimizer`` (default SGD, lr 0.05).

    ``extra`` floats of ballast make saves slow. With ``donate`` the train step donates
    the state it is given, as real ones do. The metrics are the loss, the guards'
    ``skipped`` and ``skip_streak``, the gradient norm and per-layer gradient norms.
    """
    import flax.struct
    import jax
    import jax.numpy as jnp
    import optax

    from stabljax.optim.guards.skips import any_skipped, skip_streak

    opt = optax.with_extra_args_support(optimizer or optax.sgd(0.05))

    @flax.struct.dataclass
    class ToyState:
        step: jax.Array
        params: Any
        opt_state: Any
        ballast: Any

    def loss_fn(params, batch, step):
        pred = batch["x"] @ params["w"] + params["b"]
        amplify = 1.0 + 1e3 * batch["trigger"] * (step >= STATE_FROM)
        return jnp.mean((pred - batch["y"]) ** 2 * amplify)

    @functools.partial(jax.jit, donate_argnums=(0,) if donate else ())
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, state.step)
        updates, opt_state = opt.update(grads, state.opt_state, state.params, value=loss)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "skipped": any_skipped(opt_state),
            "skip_streak": skip_streak(opt_state),
            "grad_norm": optax.tree.norm(grads),
            "layers": {"grad_norm": {k: jnp.linalg.norm(g) for k, g in grads.items()}},
        }
        return ToyState(state.step + 1, params, opt_state, state.ballast), metrics

    params = {"w": jnp.zeros((4, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}
    state = ToyState(
        step=jnp.zeros([], jnp.int32),
        params=params,
        opt_state=opt.init(params),
        ballast=jnp.arange(extra, dtype=jnp.float32) if extra else None,
    )
    return state, train_step


@functools.cache
def toy_problem():
    """``make_toy()``, built once per process so every test shares one compiled step."""
    return make_toy()


def toy_detectors():
    from stabljax.control import DivergenceDetector, SpikeDetector

    return [SpikeDetector(warmup=10, patience=5), DivergenceDetector(max_skip_streak=4)]


def controller_kwargs(**overrides) -> dict[str, Any]:
    """The controller settings of the toy runs (10-step saves, 3 kept, margin 10)."""
    kw = dict(save_every=10, keep=3, rollback_margin=10, detectors=toy_detectors())
    return kw | dict(max_rollbacks=20) | overrides


def triage_toy():
    """:func:`make_toy` as the triage runs use it: the step donates its state, as real
    ones do, so triage must replay on copies."""
    return make_toy(donate=True)


def triage_batches(bad=(), trigger=()):
    """The triage runs' data: :func:`batch_fn_factory` on ``TRIAGE_SEED``."""
    return batch_fn_factory(bad, trigger=trigger, seed=TRIAGE_SEED)


def triage_controller_kwargs() -> dict[str, Any]:
    """The settings of the triage runs: one spike detector, margin 5, synchronous saves."""
    from stabljax.control import SpikeDetector

    return dict(
        save_every=10,
        keep=3,
        rollback_margin=5,
        detectors=[SpikeDetector(warmup=10, patience=5)],
        async_save=False,
    )


def toy_controller(directory, **kw):
    """A controller in ``directory`` with :func:`controller_kwargs` (``kw`` overrides)."""
    from stabljax.control import RollbackController

    return RollbackController(directory, **controller_kwargs(**kw))


def run_toy(directory, steps, batch_fn, *, state=None, step=None, **kw):
    """Trains the toy for ``steps`` under a controller in ``directory`` (closed after).

    ``kw`` overrides :func:`controller_kwargs`; returns ``(controller, state, data)``.
    """
    from stabljax.control import IndexedBatches

    state0, step0 = toy_problem()
    state, step = state0 if state is None else state, step0 if step is None else step
    with toy_controller(directory, **kw) as ctl:
        state, data = ctl.run(step, state, IndexedBatches(batch_fn), steps, progress=False)
    return ctl, state, data


CTL_WORKER = pathlib.Path(__file__).with_name("ctl_worker.py")


def start_ctl_worker(directory, out, *extra, steps: int = 120) -> subprocess.Popen:
    """Starts ``ctl_worker.py`` on the reference run's data (stdout and stderr piped)."""
    cmd = [sys.executable, str(CTL_WORKER), "--dir", str(directory), "--out", str(out)]
    cmd += ["--steps", str(steps), "--bad", ",".join(map(str, BAD)), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_resumed_exactly(directory, out, reference) -> None:
    """Asserts a worker's final ``out`` is the reference run's, bit for bit, with the same
    ledger, and that ``directory`` holds nothing half-written."""
    from helpers import host

    ref_ctl, ref_state, ref_data = reference
    got, ref = np.load(out), host(ref_state.params)
    np.testing.assert_array_equal(got["w"], ref["w"])
    np.testing.assert_array_equal(got["b"], ref["b"])
    assert int(got["step"]) == 120
    info = json.loads(pathlib.Path(f"{out}.json").read_text())
    assert [tuple(r) for r in info["ranges"]] == ref_ctl.skipped_ranges
    assert info["index"] == ref_data.index
    for line in (directory / "events.jsonl").read_text().splitlines():
        json.loads(line)
    json.loads((directory / "stabljax-rollback.json").read_text())
    assert [p.name for p in directory.iterdir() if "tmp" in p.name] == []


def event_kinds(directory) -> list[str]:
    """The kinds of the events in ``directory/events.jsonl``, in order."""
    from stabljax.control import read_events

    return [e.kind for e in read_events(pathlib.Path(directory) / "events.jsonl")]


def comparable(events) -> list[dict[str, Any]]:
    """Events without their wall-clock fields (``time``, triage's ``seconds``)."""
    out = []
    for e in events:
        d = {k: v for k, v in e.details.items() if k != "seconds"}
        out.append({"kind": e.kind, "step": e.step, "details": d})
    return out


def kill_at(k: int):
    """A triage fault hook that SIGKILLs this process at the ``k``-th replayed step."""
    seen = [0]

    def hook(phase, step, metrics):
        seen[0] += 1
        if seen[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return metrics

    return hook


def ints(s: str) -> list[int]:
    """``"1,2,3"`` as ``[1, 2, 3]`` (the workers' index lists)."""
    return [int(v) for v in s.split(",") if v]
