"""Runs of the main job at equal compute: every arm gets the same number of train-step calls.

An arm without the controller trains ``steps`` calls straight (many runs side by side,
:func:`experiments.lm_spikes.scan_runs`). An arm under :class:`stabljax.RollbackController`
is stopped after its ``steps``-th call, wherever the controller stands then: the calls it
spent on steps a rollback discarded count, so the arms pay the same. Each run reports the
final held-out loss of the state it ends with, the mean training loss over *every* executed
call (rolled-back ones included), and for each rollback the rise that triggered it,
measured by the experiment's own criterion (:func:`experiments.lm_spikes.rises`), not by
the detector. A run the controller gave up on (``max_rollbacks`` spent) is scored on its
last kept state: the newest state at a save boundary at or before the onset that ended it.
"""

from __future__ import annotations

import collections
import math
import time

import jax
import numpy as np
import optax

import stabljax
from experiments import lm_spikes

#: The loss of a uniform prediction over 256 bytes: a non-finite loss counts as this.
UNIFORM = math.log(256)


class _Budget(Exception):
    """Raised from the train step when the arm's calls are spent."""


class Programs:
    """The compiled steps of the main job (``cfg``: its config), built once."""

    def __init__(self, cfg):
        self.task = cfg.task()
        apply_fn, _ = self.task.model(0)
        loss = lm_spikes.loss_fn(apply_fn)
        self.optimizers = {
            "plain": self.task.optimizer(),
            "cosine": self.task.optimizer(schedule=cfg.steps),
        }
        self.optimizers["guarded"] = stabljax.skip_nonfinite(
            stabljax.skip_spikes(self.optimizers["plain"], warmup_steps=cfg.spike_warmup)
        )
        self.steps = {
            k: stabljax.make_train_step(loss, o, donate=False) for k, o in self.optimizers.items()
        }
        self.heldout = self.task.heldout()
        self.eval = jax.jit(loss)

    def state(self, kind: str, seed: int, lr: float):
        params = self.task.model(seed)[1]
        return lm_spikes.with_lr(stabljax.TrainState.create(params, self.optimizers[kind]), lr)

    def evaluate(self, params) -> float:
        """Held-out loss of ``params`` (nats per byte; NaN if not finite)."""
        v = float(self.eval(params, self.heldout)[0])
        return v if math.isfinite(v) else float("nan")


def record(losses, final: float, *, rollbacks=(), gave_up=False, **extra) -> dict:
    """The fields every run reports. ``losses``: every executed call's training loss, in
    call order; ``rollbacks``: one dict per rollback with its ``rise``."""
    x = np.asarray(losses, float)
    rises = [r["rise"] for r in rollbacks]
    return {
        "final_heldout": final,
        "diverged": bool(gave_up or not math.isfinite(final) or final > UNIFORM),
        "gave_up": bool(gave_up),
        "steps_executed": int(x.size),
        "mean_train": float(np.mean(np.where(np.isfinite(x), x, UNIFORM))),
        "spikes": len(lm_spikes.spikes(x)),
        "rollbacks": len(rises),
        "rollbacks_below_criterion": int(sum(r <= lm_spikes.SPIKE_NATS for r in rises)),
        "rollback_rises": [round(float(r), 4) for r in rises],
        "rollback_detail": list(rollbacks),
        "losses": [float(f"{v:.4g}") for v in x],
        **extra,
    }


def run_scanned(progs: Programs, kind: str, seeds, lrs, steps: int) -> list[dict]:
    """Runs ``(seed, lr)`` pairs of one optimizer ``kind`` side by side, ``steps`` calls."""
    states = [progs.state(kind, sd, lr) for sd, lr in zip(seeds, lrs, strict=True)]
    fns = [progs.task.batches(sd) for sd in seeds]
    state, losses = lm_spikes.scan_runs(progs.steps[kind], states, fns, steps)
    counts = [optax.tree.get(state.opt_state, n) for n in ("nonfinite_skips", "spike_skips")]
    skipped = sum(np.asarray(c) for c in counts if c is not None)  # 0 without guards
    out = []
    for k, (sd, lr) in enumerate(zip(seeds, lrs, strict=True)):
        params = jax.tree.map(lambda v, k=k: v[k], state.params)
        extra = {"seed": sd, "lr": lr, "final_lr": lr}
        extra["guard_skips"] = int(np.broadcast_to(skipped, (len(seeds),))[k])
        out.append(record(losses[k], progs.evaluate(params), **extra))
    return out


def controller(cfg, ckpt, remedy: bool, **kw) -> stabljax.RollbackController:
    """The controller (default detectors unless ``kw`` gives ``detectors``); ``remedy``: it
    also multiplies the restored LR by ``cfg.remedy_factor`` at every rollback; ``kw``: more
    controller arguments (``detectors``, ``warning_response``)."""
    if remedy:
        from stabljax.control.decide import remedies

        kw["remedy"] = remedies.lower_lr(cfg.remedy_factor)
    return stabljax.RollbackController(
        ckpt,
        save_every=cfg.save_every,
        keep=(cfg.margin + 2 * cfg.save_every) // cfg.save_every + 2,
        rollback_margin=cfg.margin,
        max_rollbacks=cfg.max_rollbacks,
        **kw,
    )


def run_controlled(
    cfg, progs: Programs, seed: int, lr: float, ckpt, *, remedy: bool, kind: str = "plain", **kw
) -> dict:
    """One seed under the controller, stopped after exactly ``cfg.steps`` calls (or when
    the controller gives up). ``kind``: the optimizer and step of ``progs``; ``kw``: more
    controller arguments (:func:`controller`). ``event_counts``: the controller's events by
    kind."""
    state = progs.state(kind, seed, lr)
    step = progs.steps[kind]
    ctl = controller(cfg, ckpt, remedy, **kw)
    calls, losses, tagged, snaps, end = [], [], [], {}, {}

    def tick(state, batch):
        tagged.extend((len(calls), e) for e in ctl.events[len(tagged) :])  # seen before it
        end["state"] = state
        if len(calls) >= cfg.steps:
            raise _Budget
        at = int(state.step)
        if at % cfg.save_every == 0:
            snaps[at] = state
        state, m = step(state, batch)
        calls.append(at)
        losses.append(m["loss"])
        return state, m

    t0, gave_up = time.perf_counter(), False
    data = stabljax.control.IndexedBatches(progs.task.batches(seed))
    try:
        ctl.run(tick, state, data, cfg.steps * (cfg.max_rollbacks + 2), progress=False)
    except _Budget:
        pass
    except stabljax.control.TrainingDiverged:
        gave_up = True
    finally:
        ctl.close(quiet=True)
    events = [(k, _event(e)) for k, e in tagged]
    events += [(len(calls), _event(e)) for e in ctl.events[len(tagged) :]]
    x = np.asarray(jax.device_get(losses), float)
    final_state = end["state"]
    if gave_up:
        onset = max((e.get("onset") or 0 for _, e in events if "onset" in e), default=0)
        kept = [s for s in snaps if s <= onset] or [0]
        final_state = snaps.get(max(kept), final_state)
    final_lr = float(np.asarray(optax.tree.get(final_state.opt_state, "learning_rate")))
    return record(
        x,
        progs.evaluate(final_state.params),
        rollbacks=rollback_rises(calls, x, events),
        gave_up=gave_up,
        seed=seed,
        lr=lr,
        final_lr=final_lr,
        event_counts=dict(collections.Counter(e["kind"] for _, e in events)),
        wall_s=round(time.perf_counter() - t0, 1),
    )


def _event(e) -> dict:
    """An event as one flat dict: ``kind``, ``step`` and its details."""
    d = e.to_dict() if hasattr(e, "to_dict") else dict(e)
    return {**d.get("details", {}), "kind": d["kind"], "step": int(d["step"])}


def rollback_rises(calls: list[int], losses: np.ndarray, events: list[tuple[int, dict]]):
    """Per rollback event, the rise that triggered it, by the experiment's criterion: the
    largest :func:`~experiments.lm_spikes.rises` value of the executed calls from the
    episode's onset to its detection (the last calls of those steps before the rollback),
    with the detector's kinds and reason beside it.

    ``calls[k]``: the step call ``k`` trained; ``events``: ``(calls made when the event was
    seen, event)``.
    """
    rise = lm_spikes.rises(losses)
    out = []
    for n, e in events:
        if e.get("kind") != "rollback":
            continue
        onset, detected = int(e["onset"]), int(e["step"])
        last = {}  # step -> the last call that trained it, among the first n calls
        for k in range(n):
            last[calls[k]] = k
        idx = [last[s] for s in range(onset, detected + 1) if s in last]
        triggers = [d for m, d in events if m == n and d.get("action") in ("rollback", "raise")]
        out.append(
            {
                "step": detected,
                "onset": onset,
                "call": n,
                "rise": float(max(rise[idx])) if idx else float("nan"),
                "kinds": sorted({d["kind"] for d in triggers}),
                "reason": e.get("reason", ""),
            }
        )
    return out
