"""What the controller watches: the detectors, the smoothed loss and the recent losses.

:class:`Monitor` turns one step's device metrics into host scalars (only the ones some
detector reads), feeds them to every detector in order, and keeps what a checkpoint
carries besides the state: the detectors' states and a bias-corrected EMA of the loss.
It also keeps the last 64 losses for the messages of events and of
:class:`~stabljax.control.errors.TrainingDiverged`; a rollback trims them to the restored
branch, so an event never mixes steps from an abandoned one.

A ``skip_spikes`` guard that re-baselines on a level shift accepts the new level on
device; the step reports it as a rise of ``metrics["spike_rebaselines"]``, and the
monitor turns each rise into a ``rebaseline`` event, so under the controller a level the
guard absorbed is on record, never a silent acceptance.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stabljax.control.decide import policy
from stabljax.control.decide.policy import losses_before
from stabljax.control.detect.detectors import Detection, Detector
from stabljax.control.errors import warn
from stabljax.control.hosts import host_scalars, to_host
from stabljax.metrics import LOSS, SKIPPED, SPIKE_REBASELINES

EMA_DECAY = 0.98
_copy = jax.jit(jnp.copy)


class Monitor:
    """Feeds the detectors and keeps the loss EMA and the recent losses."""

    def __init__(self, detectors: Sequence[Detector], log: Callable[..., None]):
        self.detectors = list(detectors)
        names = [getattr(d, "name", None) for d in self.detectors]
        for d in self.detectors:
            if not all(hasattr(d, a) for a in ("name", "update", "get_state", "set_state")):
                raise TypeError(f"detectors: {d!r} lacks the Detector interface")
        if len(set(names)) != len(names):
            raise ValueError(f"detector names must be unique, got {names}")
        # Only the metrics some detector reads, and the ones read here, are fetched (each
        # fetch is a host transfer).
        wanted = [getattr(d, "keys", None) for d in self.detectors]
        self.keys = (
            None
            if any(k is None for k in wanted)
            else frozenset({LOSS, SKIPPED, SPIKE_REBASELINES}.union(*wanted))
        )
        self.rolls_back_to_best = any(
            getattr(d, "action", "") == "rollback_best" for d in self.detectors
        )
        self._log = log
        self.ema = [0.0, 0]
        self.recent: collections.deque = collections.deque(maxlen=64)
        self.last_loss: float | None = None
        # The guards' cumulative re-baseline count last seen (None: not seen since a load).
        self.rebaselines: int | None = None

    @staticmethod
    def check_metrics(metrics: Any, step: int | None = None) -> None:
        """Raises ``ValueError`` unless ``metrics`` is a dict with a scalar loss (``metrics.LOSS``).

        Checked on the call that passes them (shapes need no device sync), so a wrong
        train step fails on its first step, naming it, not when the metrics are read.
        """
        at = "" if step is None else f" (step {step})"
        if not isinstance(metrics, Mapping) or LOSS not in metrics:
            keys = sorted(metrics) if isinstance(metrics, Mapping) else type(metrics).__name__
            raise ValueError(
                f"metrics{at} must be a dict with a scalar {LOSS!r} entry (the train step's "
                f"loss); got {keys}"
            )
        shape = getattr(metrics[LOSS], "shape", None)
        if shape is not None and tuple(shape) != ():
            raise ValueError(
                f"metrics[{LOSS!r}]{at} must be a scalar, got shape {tuple(shape)}: reduce the "
                "per-example or per-token loss (e.g. jnp.mean) before returning it"
            )

    @staticmethod
    def snapshot_step(value: Any) -> Any:
        """A copy of ``state.step`` for :meth:`check_step` on the next call: on device (the
        next train step may donate the original; a jitted copy costs 5 µs a step where
        ``jnp.array(copy=True)`` costs 29), or on the host for a host counter."""
        return _copy(value) if isinstance(value, jax.Array) else np.array(value)

    @staticmethod
    def check_step(expected: int, value: Any) -> None:
        """Raises ``ValueError`` unless ``value`` (a state's step, read one call late from a
        device copy, so the check never waits) is ``expected``: the ledger counts the
        batches fed by ``state.step``."""
        if (actual := int(to_host(value))) != expected:
            raise ValueError(
                f"state.step is {actual} but the controller counted {expected} steps (train "
                f"step {expected - 1}): the train step must increment state.step by one on "
                "every call, skipped or not. A step counter taken from the optimizer state "
                "(optax.MultiSteps' gradient_step, or a count a guard freezes on a skipped "
                "step) does not advance on every call; count calls instead "
                "(state.replace(step=state.step + 1))."
            )

    @property
    def smoothed_loss(self) -> float | None:
        m, n = self.ema
        return m / (1 - EMA_DECAY**n) if n else None

    def active_onsets(self) -> list[int | None]:
        return [getattr(d, "active_onset", None) for d in self.detectors]

    def observe(self, step: int, metrics: Mapping[str, Any]) -> list[Detection]:
        """Feeds step ``step``'s metrics to every detector; returns the detections.

        Each detection is an event (a warning too for ``"warn"``); an action the
        controller does not know is a ``ValueError`` here.
        """
        host = host_scalars(metrics, self.keys)
        loss = self.last_loss = float(host[LOSS])
        self.recent.append((step, loss, bool(host.get(SKIPPED, False))))
        if math.isfinite(loss):
            self.ema[0] = EMA_DECAY * self.ema[0] + (1 - EMA_DECAY) * loss
            self.ema[1] += 1
        self._observe_rebaselines(step, host)
        found = []
        for det in self.detectors:
            d = det.update(step, host)
            if d is None:
                continue
            policy.check_action(d.action, det.name)
            found.append(d)
            self._log(
                d.kind,
                d.step,
                action=d.action,
                onset=d.onset,
                value=d.value,
                reason=d.reason,
                detector=det.name,
                **d.details,
            )
            if d.action == "warn":
                warn(d.reason, stacklevel=4)  # observe < _process < ctl.step < the user
        return found

    def _observe_rebaselines(self, step: int, host: Mapping[str, Any]) -> None:
        """A ``rebaseline`` event when the guards' cumulative count rose at ``step``."""
        if SPIKE_REBASELINES not in host:
            return
        total = int(host[SPIKE_REBASELINES])
        # Equal or lower after a load or rollback: the count restored with the state.
        if self.rebaselines is not None and total > self.rebaselines:
            added = total - self.rebaselines
            self._log(
                "rebaseline",
                step,
                added=added,
                total=total,
                loss=self.last_loss,
                recent=[[s, v] for s, v, _ in list(self.recent)[-8:]],
                reason=(
                    f"skip_spikes accepted a new loss level at step {step} "
                    f"(loss {self.last_loss:.6g}) after consecutive agreeing skips"
                ),
            )
        self.rebaselines = total

    def losses_before(self, step: int) -> list[list[Any]]:
        return losses_before(self.recent, step)

    def to_meta(self) -> dict[str, Any]:
        return {
            "detectors": {d.name: d.get_state() for d in self.detectors},
            "ema": list(self.ema),
            "spike_rebaselines": self.rebaselines,
        }

    def load(self, meta: Mapping[str, Any]) -> None:
        """Takes the detectors' states and the EMA of a checkpoint's meta item."""
        states = meta.get("detectors", {})
        for d in self.detectors:
            d.set_state(states.get(d.name, {}))
        self.ema = [float(meta["ema"][0]), int(meta["ema"][1])]
        self.last_loss = None
        # The count the saved state carries: a re-baseline on the first step after a
        # restore is then still an event. Absent (None) in checkpoints without guards.
        saved = meta.get("spike_rebaselines")
        self.rebaselines = None if saved is None else int(saved)

    def trim(self, before: int) -> None:
        """Forgets the losses of steps ``>= before`` (a rollback to checkpoint ``before``)."""
        kept = [r for r in self.recent if r[0] < before]
        self.recent = collections.deque(kept, maxlen=64)
