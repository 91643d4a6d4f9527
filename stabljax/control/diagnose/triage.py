"""Spike triage: after a rollback, replay the suspect window to say why the spike happened.

PaLM's authors found by hand that the batches around a spike, replayed from an earlier
checkpoint, did not spike again: the cause was the batches *together with* the parameter
state. The controller holds what it takes to run that experiment automatically: the
checkpoints before the onset, the exact batch indices fed (the ledger) and a
deterministic step. :func:`triage` runs it on copies of the state, never on the run's own
buffers, and classifies the event:

* ``nondeterministic``: the onset step re-run from the same state on the same batch gives
  a different loss or gradient norm (beyond ``rtol``), or the replay of the window does
  not reproduce the losses the run saw. Hardware, silent data corruption or a race; the
  event names the process and devices.
* ``data``: the spike reproduces from an *earlier* checkpoint too, on the same batches.
  The batches whose one-step replay alone spikes are named (``culprits``).
* ``state``: it reproduces only from the restored checkpoint (PaLM's case): skip, lower
  the learning rate or tighten clipping; the data is not to blame.
* ``inconclusive``: the replay budget ran out, no earlier checkpoint was kept, the data
  cannot fetch a batch by index, or the replay shows no spike at the onset by the rule
  below. The evidence gathered so far is in the event.

The replay's spike rule (independent of the run's detectors, which carry state): a
replayed loss is a spike if it is not finite, or if it exceeds both ``spike_ratio`` times
the median of the reference losses and that median plus ``spike_z`` robust standard
deviations (1.4826 × the median absolute deviation). The reference is the other losses
of the same replay (leave-one-out), or, with fewer than three, the run's own losses
before the onset.

The phases, with ``n = onset - restored + 1`` steps in the window:

1. ``restored``: from the restored checkpoint, the window's batches in order (n steps);
2. ``rerun``: the onset step again from the state just before it (1 step);
3. ``earlier``: from the checkpoint before the restored one, the same batches (n steps);
4. ``culprit``: from that checkpoint, each window batch alone (n steps), on ``data``.

Triage reads checkpoints and writes nothing; the controller logs its event only after
the rollback record is written, so a crash during triage resumes as if it never started.

References:
  Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
  <https://arxiv.org/abs/2204.02311>`_, 2022 (section 5.1).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from stabljax.control.checkpoint.items import device_snapshot
from stabljax.control.checkpoint.store import CheckpointStore
from stabljax.control.decide.policy import first_allowed
from stabljax.control.diagnose import attribution
from stabljax.control.hosts import all_agree, to_host
from stabljax.metrics import GRAD_NORM, LOSS

VERDICTS = ("nondeterministic", "data", "state", "inconclusive")
PHASES = ("restored", "rerun", "earlier", "culprit")

REMEDIES = {
    "nondeterministic": (
        "suspect the hardware (silent data corruption) or a race: re-run on other "
        "devices, check the named host's health; the data and the state are not to blame"
    ),
    "data": (
        "the batches are bad: skip them (narrow_skip=True skips only the culprits) and inspect them"
    ),
    "state": (
        "batch x state, as PaLM saw: skipping the window is enough; if it recurs lower "
        "the learning rate or tighten clipping"
    ),
    "inconclusive": "no verdict: see the evidence; the whole window was skipped",
}


@dataclasses.dataclass(frozen=True)
class TriageConfig:
    """How :class:`~stabljax.control.controller.RollbackController` triages a rollback.

    Args:
      max_steps: replayed steps allowed per rollback (all phases together); past it the
        verdict is ``inconclusive`` with the evidence so far.
      time_budget_s: wall-clock seconds allowed per rollback, likewise.
      narrow_skip: on a ``data`` verdict with culprits, skip only from the first culprit
        to the end of the rollback's range (default: PaLM's whole window).
      rtol: relative tolerance when comparing a re-run's loss and grad norm.
      spike_ratio: a replayed spike is above this many times the reference median...
      spike_z: ...and above the median plus this many robust standard deviations.
      adam_eps: if set, the fraction of Adam coordinates with sqrt(v) below this eps at
        the onset state goes into the attribution (Molybog et al.).
      step_fn: the step to replay with (default: the one given to ``run``); needed in a
        hand-written loop, or to replay without a wrapper's side effects (progress bars,
        counters). It must compute what the run's step computes.
      batch_fn: the batch of a data index (default: the data's ``batch_fn``, as
        :class:`~stabljax.control.IndexedBatches` has).
      _fault_hook: tests only: ``hook(phase, step, host_metrics) -> host_metrics`` sees
        every replayed step's metrics and may perturb them (or kill the process).

    Example:
      >>> from stabljax.control import TriageConfig
      >>> TriageConfig(max_steps=64).narrow_skip
      False
      >>> TriageConfig(max_steps=0)
      Traceback (most recent call last):
      ...
      ValueError: TriageConfig: max_steps must be an int >= 1, got 0
    """

    max_steps: int = 512
    time_budget_s: float = 600.0
    narrow_skip: bool = False
    rtol: float = 1e-5
    spike_ratio: float = 1.5
    spike_z: float = 6.0
    adam_eps: float | None = None
    step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )
    batch_fn: Callable[[int], Any] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )
    _fault_hook: Callable[[str, int, dict[str, Any]], dict[str, Any]] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self):
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"TriageConfig: {name} must be {want}, got {getattr(self, name)!r}")

        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int):
            raise bad("max_steps", "an int >= 1")
        if self.max_steps < 1:
            raise bad("max_steps", "an int >= 1")
        for name, low in (("time_budget_s", 0.0), ("rtol", 0.0), ("spike_z", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v >= low:
                raise bad(name, f"a number >= {low}")
        r = self.spike_ratio
        if isinstance(r, bool) or not isinstance(r, int | float) or not r > 1.0:
            raise bad("spike_ratio", "a number > 1")
        if self.adam_eps is not None and not (
            isinstance(self.adam_eps, int | float) and self.adam_eps > 0
        ):
            raise bad("adam_eps", "None or a number > 0")
        if not isinstance(self.narrow_skip, bool):
            raise bad("narrow_skip", "a bool")
        for name in ("step_fn", "batch_fn", "_fault_hook"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise bad(name, "None or a callable")


def as_config(triage: Any) -> TriageConfig | None:
    """``False``/``None`` → ``None`` (off), ``True`` → defaults, a config → itself."""
    if triage is None or triage is False:
        return None
    if triage is True:
        return TriageConfig()
    if isinstance(triage, TriageConfig):
        return triage
    raise ValueError(f"triage must be a bool or a TriageConfig, got {triage!r}")


def robust_spikes(values: Sequence[float], reference: Sequence[float], cfg: TriageConfig):
    """For each of ``values``: whether it is a spike against the others (leave-one-out),
    or against ``reference`` when fewer than three others are finite.

    Example:
      >>> from stabljax.control.diagnose.triage import TriageConfig, robust_spikes
      >>> robust_spikes([1.0, 1.1, 0.9, 1.0, 9.0], [], TriageConfig())
      [False, False, False, False, True]
      >>> robust_spikes([1.0, float("nan")], [1.0, 1.0, 1.1], TriageConfig())
      [False, True]
    """
    out = []
    for i, v in enumerate(values):
        others = [x for j, x in enumerate(values) if j != i and math.isfinite(x)]
        if len(others) < 3:
            others = [x for x in reference if math.isfinite(x)]
        out.append(is_spike(v, others, cfg))
    return out


def is_spike(value: float, reference: Sequence[float], cfg: TriageConfig) -> bool:
    """The replay's spike rule (module docstring); no reference: only non-finite."""
    if not math.isfinite(value):
        return True
    if len(reference) == 0:
        return False
    ref = np.asarray(reference, np.float64)
    med = float(np.median(ref))
    sigma = 1.4826 * float(np.median(np.abs(ref - med)))
    return value > med + (cfg.spike_ratio - 1.0) * abs(med) and value > med + cfg.spike_z * sigma


class _OutOfBudget(Exception):
    def __init__(self, message: str, partial: tuple[str, list[dict[str, Any]]] = ("", [])):
        super().__init__(message)
        self.partial = partial  # the phase cut short, its steps


def _host(tree: Any) -> Any:
    """Nested host copy of a metrics dict: 0-d arrays become Python numbers."""
    if jax.process_count() == 1 and not isinstance(tree, np.ndarray | float | int):
        tree = jax.device_get(tree)  # one transfer for the whole dict
    return _to_python(tree)


def _to_python(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {str(k): _to_python(v) for k, v in tree.items() if v is not None}
    arr = to_host(tree)
    if arr.size != 1:
        return None
    item = arr.reshape(()).item()
    return item if isinstance(item, bool | int | float) else None


def _close(a: Any, b: Any, rtol: float) -> bool:
    if a is None or b is None:
        return a is b
    a, b = float(a), float(b)
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def window_indices(start: int, n: int, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The data indices fed for ``n`` steps from data position ``start`` past ``ranges``.

    Example:
      >>> from stabljax.control.diagnose.triage import window_indices
      >>> window_indices(20, 5, [(22, 24)])
      [20, 21, 24, 25, 26]
    """
    out, i = [], start
    for _ in range(n):
        i = first_allowed(i, ranges)
        out.append(i)
        i += 1
    return out


def device_info() -> dict[str, Any]:
    """The process and its devices, for a ``nondeterministic`` verdict."""
    devices = jax.local_devices()
    return {
        "process_index": jax.process_index(),
        "platform": devices[0].platform if devices else None,
        "device_kind": devices[0].device_kind if devices else None,
        "device_ids": [d.id for d in devices],
    }


class _Replayer:
    """Runs the step on copies, counts and times every replayed step, keeps the log."""

    def __init__(self, step_fn, batch_at, cfg: TriageConfig):
        self.step_fn, self.batch_at, self.cfg = step_fn, batch_at, cfg
        self.start = time.monotonic()
        self.steps = 0
        self.log: list[dict[str, Any]] = []

    def _charge(self, n: int) -> None:
        over_steps = self.steps + n > self.cfg.max_steps
        over_time = time.monotonic() - self.start > self.cfg.time_budget_s
        if jax.process_count() > 1:  # every host stops together or none does
            over_steps = not all_agree(not (over_steps or over_time))
            over_time = False
        if over_steps or over_time:
            what = "max_steps" if over_steps else "time_budget_s"
            raise _OutOfBudget(f"triage stopped: {what} reached after {self.steps} steps")
        self.steps += n

    def run(self, phase: str, state: Any, first_step: int, indices: Sequence[int], keep=False):
        """Steps a copy of ``state`` through ``indices``; returns host metrics per step, the
        state before the last step (a copy) and, with ``keep``, full metrics."""
        state = device_snapshot(state)
        pending, before_last = [], None
        try:
            for k, index in enumerate(indices):
                self._charge(1)
                if k == len(indices) - 1:
                    before_last = device_snapshot(state)
                if k >= 2:  # at most two replayed steps in flight, so the time budget is
                    # charged for work done, and XLA:CPU's launch queue stays bounded
                    jax.block_until_ready(pending[k - 2][2])
                state, metrics = self.step_fn(state, self.batch_at(index))
                pending.append((first_step + k, index, metrics))
        except _OutOfBudget as e:  # the steps so far are logged, and evidence
            raise _OutOfBudget(str(e), (phase, self._fetch(phase, pending, keep))) from None
        return self._fetch(phase, pending, keep), before_last

    def _fetch(self, phase: str, pending, keep: bool) -> list[dict[str, Any]]:
        out = []
        wanted = (LOSS, GRAD_NORM)
        for step, index, metrics in pending:
            host = _host(metrics if keep else {k: metrics[k] for k in wanted if k in metrics})
            if self.cfg._fault_hook is not None:
                host = self.cfg._fault_hook(phase, step, host)
            loss, gnorm = host.get(LOSS), host.get(GRAD_NORM)
            entry = {"phase": phase, "step": step, "index": index, "loss": loss}
            entry["grad_norm"] = gnorm
            self.log.append(entry)
            out.append(host if keep else {LOSS: loss, GRAD_NORM: gnorm})
        return out

    def one(self, phase: str, state: Any, step: int, index: int) -> dict[str, Any]:
        return self.run(phase, state, step, [index])[0][0]


def _loss(m: Mapping[str, Any]) -> float:
    v = m.get(LOSS)
    return float("nan") if v is None else float(v)


def _attribution(
    replayed: Sequence[Mapping[str, Any]], onset_state: Any, cfg: TriageConfig
) -> dict[str, Any]:
    """The onset's hints (:func:`attribution.attribute`), with Adam's eps report if asked."""
    eps = None
    if cfg.adam_eps is not None and hasattr(onset_state, "opt_state"):
        from stabljax.telemetry import adam_eps_report

        eps = adam_eps_report(onset_state.opt_state, cfg.adam_eps)
    return attribution.attribute(replayed[:-1], replayed[-1], eps_fraction=eps)


def _nondeterminism(
    replayed: Sequence[Mapping[str, Any]],
    rerun: Mapping[str, Any],
    original: Mapping[int, float],
    first_step: int,
    onset: int,
    cfg: TriageConfig,
) -> str | None:
    """Why the replay is not deterministic, or None when it is.

    ``replayed`` holds the metrics of steps ``first_step..onset`` replayed from the
    restored checkpoint and ``rerun`` the onset step run again from the same state and
    batch; ``original`` the losses the run itself saw. The re-run must match the replay's
    onset step (loss and grad norm), and the replay the run, within ``cfg.rtol``.
    """
    last = replayed[-1]
    same = _close(rerun.get(LOSS), last.get(LOSS), cfg.rtol) and _close(
        rerun.get(GRAD_NORM), last.get(GRAD_NORM), cfg.rtol
    )
    if not same:
        return (
            f"the onset step {onset} re-run from the same state and batch gave loss "
            f"{rerun.get(LOSS)!r} / grad norm {rerun.get(GRAD_NORM)!r}, first "
            f"{last.get(LOSS)!r} / {last.get(GRAD_NORM)!r}"
        )
    losses = [_loss(m) for m in replayed]
    mismatch = [
        s
        for s, got in zip(range(first_step, onset + 1), losses, strict=True)
        if s in original and not _close(got, original[s], cfg.rtol)
    ]
    if mismatch:
        s = mismatch[0]
        return (
            f"the replay from checkpoint {first_step} gave loss {losses[s - first_step]!r} at "
            f"step {s}, the run saw {original[s]!r} ({len(mismatch)} step(s) differ)"
        )
    return None


def triage(
    *,
    step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]],
    batch_at: Callable[[int], Any],
    restored: tuple[int, Any, Mapping[str, Any]],
    earlier: Callable[[], tuple[int, Any, Mapping[str, Any]] | None],
    onset: int,
    ranges: Sequence[tuple[int, int]],
    history: Sequence[tuple[int, float, bool]],
    cfg: TriageConfig,
) -> dict[str, Any]:
    """Classifies a rollback's spike by replaying its window; returns the event details.

    Args:
      step_fn: the run's train step, ``(state, batch) -> (state, metrics)``.
      batch_at: the batch of a data index.
      restored: ``(step, state, meta)`` of the checkpoint the rollback restored.
      earlier: returns the checkpoint before it as ``(step, state, meta)``, or ``None``.
      onset: the step of the first anomalous loss.
      ranges: the skipped ranges in force when the window was first fed.
      history: the run's own ``(step, loss, skipped)`` records before the rollback.
      cfg: the config.

    Returns:
      A JSON-able dict: ``verdict``, ``reason``, ``window``, ``indices``, ``evidence``
      (replayed losses per phase and the run's own), ``culprits``, ``host``,
      ``attribution``, ``remedy``, ``replayed`` (every replayed step) and ``steps``.
    """
    c_step, c_state, c_meta = restored
    n = max(onset - c_step + 1, 1)
    indices = window_indices(int(c_meta["data_index"]), n, ranges)
    original = {s: loss for s, loss, _ in history if c_step <= s <= onset}
    before = [loss for s, loss, _ in history if s < onset][-32:]
    rep = _Replayer(step_fn, batch_at, cfg)
    out: dict[str, Any] = {
        "window": [c_step, onset],
        "indices": indices,
        "restored_step": c_step,
        "earlier_step": None,
        "culprits": [],
        "host": device_info(),
        "attribution": None,
        "evidence": {"run": [original.get(s) for s in range(c_step, onset + 1)]},
    }

    def finish(verdict: str, reason: str) -> dict[str, Any]:
        out.update(verdict=verdict, reason=reason, remedy=REMEDIES[verdict])
        out.update(replayed=rep.log, steps=rep.steps, seconds=time.monotonic() - rep.start)
        return out

    try:
        a, s_onset = rep.run("restored", c_state, c_step, indices, keep=True)
        a_losses = [_loss(m) for m in a]
        out["evidence"]["restored"] = a_losses
        out["attribution"] = _attribution(a, s_onset, cfg)
        rerun = rep.one("rerun", s_onset, onset, indices[-1])
        out["evidence"]["rerun"] = _loss(rerun)
        differs = _nondeterminism(a, rerun, original, c_step, onset, cfg)
        if differs is not None:
            return finish("nondeterministic", differs)
        if not robust_spikes(a_losses, before, cfg)[-1]:
            return finish(
                "inconclusive",
                f"the replay's loss at the onset ({a_losses[-1]!r}) is not a spike by the "
                "triage rule (a slow divergence, or a spike detector more sensitive)",
            )
        found = earlier()
        if found is None:
            return finish("inconclusive", f"no checkpoint before {c_step} to replay from")
        e_step, e_state, _ = found
        out["earlier_step"] = e_step
        b = rep.run("earlier", e_state, e_step, indices)[0]
        b_losses = [_loss(m) for m in b]
        out["evidence"]["earlier"] = b_losses
        if not any(robust_spikes(b_losses, before, cfg)):
            return finish(
                "state",
                f"the spike reproduces from checkpoint {c_step} but not from {e_step} on the "
                "same batches: this batch with this state",
            )
        singles = [_loss(rep.one("culprit", e_state, e_step, i)) for i in indices]
        out["evidence"]["culprit"] = singles
        flags = robust_spikes(singles, before, cfg)
        out["culprits"] = [i for i, f in zip(indices, flags, strict=True) if f]
        return finish(
            "data",
            f"the spike reproduces from checkpoint {e_step} too, on the same batches; "
            f"alone, batches {out['culprits']} reproduce it",
        )
    except _OutOfBudget as e:
        phase, partial = e.partial
        if partial:
            out["evidence"][f"{phase} (partial)"] = [_loss(m) for m in partial]
        return finish("inconclusive", str(e))


def unavailable(reason: str, *, onset: int, restored_step: int) -> dict[str, Any]:
    """The event details of a triage that could not replay at all."""
    return {
        "verdict": "inconclusive",
        "reason": reason,
        "remedy": REMEDIES["inconclusive"],
        "window": [restored_step, onset],
        "indices": [],
        "restored_step": restored_step,
        "earlier_step": None,
        "culprits": [],
        "host": device_info(),
        "attribution": None,
        "evidence": {},
        "replayed": [],
        "steps": 0,
        "seconds": 0.0,
    }


def for_rollback(
    cfg: TriageConfig,
    *,
    step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]] | None,
    data: Any,
    store: CheckpointStore,
    abstract: Any,
    verify: bool | str,
    history: Sequence[tuple[int, float, bool]],
    target: int,
    state: Any,
    meta: Mapping[str, Any],
    onset: int,
    ranges: Sequence[tuple[int, int]],
) -> dict[str, Any]:
    """:func:`triage` with the controller's parts: its checkpoints, data and history.

    The earlier checkpoint is the newest of ``store``'s before ``target``, read into the
    run's structure ``abstract`` (checked as ``verify`` says); it is restored only
    if the replay from ``target`` reproduces the spike, and a failure to read it is an
    ``inconclusive`` verdict (nothing is set aside: triage changes nothing on disk).
    """
    where = dict(onset=onset, restored_step=target)
    step_fn = cfg.step_fn or step_fn
    if step_fn is None:
        reason = "no train step: triage runs under RollbackController.run or with step_fn="
        return unavailable(reason, **where)
    batch_fn = cfg.batch_fn or getattr(data, "batch_fn", None)
    if not callable(batch_fn):
        name = type(data).__name__
        return unavailable(f"{name} cannot fetch a batch by index (IndexedBatches can)", **where)

    def earlier():
        prior = [s for s in store.steps() if s < target]
        if not prior:
            return None
        try:
            e_state, e_meta, _ = store.restore(prior[-1], abstract, verify=verify)
        except Exception:  # noqa: BLE001 - an unreadable checkpoint only ends the triage
            return None
        return prior[-1], e_state, e_meta

    return triage(
        step_fn=step_fn,
        batch_at=batch_fn,
        restored=(target, state, meta),
        earlier=earlier,
        onset=onset,
        ranges=ranges,
        history=[h for h in history if h[0] <= onset],
        cfg=cfg,
    )
