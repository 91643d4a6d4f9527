"""Remedies: what a rollback changes in the restored state before training resumes.

A remedy is any callable ``remedy(state, info) -> state``, passed as
``RollbackController(..., remedy=...)``. The controller calls it at every rollback, on the
state just restored (after triage, if any, so ``info.verdict`` is set), before the
rollback record is written; the change is then part of the state, so the next checkpoint
holds it, and a restart that finds only checkpoints from before the rollback applies the
remedy again from the record. Each application is a ``remedy`` event.

The built-ins are what practitioners do by hand after a spike: OPT-175B's logbook
restarts from an earlier checkpoint with a lower learning rate (:func:`lower_lr`,
:func:`scale_hyperparam`), others reset Adam's second moment
(:func:`reset_second_moment`); :func:`by_verdict` follows triage's verdict (bad data: the
skip alone; the state: lower the LR) and :func:`chain_remedies` applies several.

Hyperparameters live in the state only under :func:`optax.inject_hyperparams`. It
recomputes a *callable* hyperparameter (a schedule) from its step count at every update,
so scaling a scheduled learning rate lasts one step. For a schedule, chain a multiplier
that holds a constant and scale that instead::

    opt = optax.chain(
        optax.adamw(schedule), optax.inject_hyperparams(optax.scale)(step_size=1.0)
    )
    RollbackController(..., remedy=scale_hyperparam(0.5, "step_size"))

References:
  Zhang et al., `OPT: Open Pre-trained Transformer Language Models
  <https://arxiv.org/abs/2205.01068>`_, 2022 (section 2.5 and the logbook).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


@dataclasses.dataclass(frozen=True)
class RollbackInfo:
    """What a remedy is told about the rollback it follows.

    Attributes:
      step: the restored checkpoint's step (``state.step`` of the state given).
      onset: the first anomalous step.
      rollbacks: the run's rollbacks, this one included.
      skip: the half-open data-index range ``[a, b)`` this rollback skips.
      verdict: triage's verdict (``"data"``, ``"state"``, ``"nondeterministic"`` or
        ``"inconclusive"``) when triage ran, else ``None``.
      kinds: the kinds of the detections that triggered it (``"spike"``, ...).
      detected: the step the trigger was detected at.
    """

    step: int
    onset: int
    rollbacks: int
    skip: tuple[int, int]
    verdict: str | None = None
    kinds: tuple[str, ...] = ()
    detected: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "onset": self.onset,
            "rollbacks": self.rollbacks,
            "skip": list(self.skip),
            "verdict": self.verdict,
            "kinds": list(self.kinds),
            "detected": self.detected,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RollbackInfo:
        return cls(
            int(d["step"]),
            int(d["onset"]),
            int(d["rollbacks"]),
            (int(d["skip"][0]), int(d["skip"][1])),
            d.get("verdict"),
            tuple(str(k) for k in d.get("kinds", ())),
            None if d.get("detected") is None else int(d["detected"]),
        )


@dataclasses.dataclass(frozen=True)
class Remedy:
    """A named remedy: ``fn(state, info) -> state`` and how it is described in events.

    Attributes:
      name: the remedy's name (the event's ``remedy`` field).
      fn: the change.
      params: its arguments, JSON-ready (the event's ``params``).
      pick: for a remedy that delegates (:func:`by_verdict`), ``pick(info)`` gives the
        remedy it applies (or None), described as ``applied``.
      parts: for a chain (:func:`chain_remedies`), the remedies it applies in order.
    """

    name: str
    fn: Callable[[Any, RollbackInfo], Any]
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    pick: Callable[[RollbackInfo], Any] | None = None
    parts: tuple[Any, ...] = ()

    def __call__(self, state: Any, info: RollbackInfo) -> Any:
        return self.fn(state, info)


def describe(remedy: Callable[..., Any] | None, info: RollbackInfo) -> dict[str, Any] | None:
    """The event details of ``remedy`` applied after ``info``'s rollback.

    ``{"remedy": name, "params": {...}}``; a delegating remedy adds ``applied`` (what it
    chose, or None), a chain the list of its parts; a plain callable is named by its
    ``__name__``.

    Example:
      >>> from stabljax.control.decide.remedies import RollbackInfo, describe, lower_lr
      >>> describe(lower_lr(0.5), RollbackInfo(30, 35, 1, (30, 40)))
      {'remedy': 'scale_hyperparam', 'params': {'factor': 0.5, 'name': 'learning_rate'}}
    """
    if remedy is None:
        return None
    if not isinstance(remedy, Remedy):
        name = getattr(remedy, "__name__", type(remedy).__name__)
        return {"remedy": str(name), "params": {}}
    out: dict[str, Any] = {"remedy": remedy.name, "params": dict(remedy.params)}
    if remedy.pick is not None:
        out["applied"] = describe(remedy.pick(info), info)
    if remedy.parts:
        out["applied"] = [describe(r, info) for r in remedy.parts]
    return out


def check_remedy(remedy: Any) -> Any:
    """Returns ``remedy`` if it is None or callable, else raises a ``TypeError``."""
    if remedy is not None and not callable(remedy):
        raise TypeError(f"remedy must be a callable(state, info) -> state or None, got {remedy!r}")
    return remedy


def _positive_factor(factor: Any) -> float:
    ok = isinstance(factor, int | float) and not isinstance(factor, bool)
    if not ok or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    return float(factor)


def scale_hyperparam(factor: float, name: str = "learning_rate") -> Remedy:
    """Multiplies hyperparameter ``name`` of every ``optax.inject_hyperparams`` state.

    The value stored in the state's ``hyperparams[name]`` becomes ``factor`` times what
    the checkpoint held, in its dtype. A callable (scheduled) hyperparameter is
    recomputed at every update and so is not changed for good: scale a chained
    ``inject_hyperparams(optax.scale)(step_size=1.0)`` instead (module docstring).

    Args:
      factor: the multiplier, finite and > 0.
      name: the hyperparameter's name as given to the injected optimizer.

    Returns:
      A :class:`Remedy`; applied to a state with no ``inject_hyperparams`` state holding
      ``name`` it raises a ``ValueError`` naming the fix.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from stabljax.control.decide.remedies import RollbackInfo, scale_hyperparam
      >>> opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      >>> state = opt.init({"w": jnp.zeros(2)})
      >>> state = scale_hyperparam(0.5)(state, RollbackInfo(30, 35, 1, (30, 40)))
      >>> print(state.hyperparams["learning_rate"])
      0.05
    """
    factor = _positive_factor(factor)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a hyperparameter's name (a str), got {name!r}")

    def is_holder(x: Any) -> bool:
        return isinstance(x, _INJECTED) and name in x.hyperparams

    def scale(x: Any) -> Any:
        if not is_holder(x):
            return x
        value = x.hyperparams[name]
        scaled = jnp.asarray(value * jnp.asarray(factor, jnp.asarray(value).dtype))
        return x._replace(hyperparams={**x.hyperparams, name: scaled})

    def fn(state: Any, info: RollbackInfo) -> Any:
        found = [x for x in jax.tree.leaves(state, is_leaf=is_holder) if is_holder(x)]
        if not found:
            held = sorted(
                {
                    k
                    for x in jax.tree.leaves(state, is_leaf=_is_injected)
                    if _is_injected(x)
                    for k in x.hyperparams
                }
            )
            raise ValueError(
                f"scale_hyperparam: no optax.inject_hyperparams state in the train state "
                f"holds {name!r} (injected hyperparameters found: {held or 'none'}). Build "
                f"the optimizer with optax.inject_hyperparams(...)({name}=...), or chain "
                "optax.inject_hyperparams(optax.scale)(step_size=1.0) and scale 'step_size'."
            )
        return jax.tree.map(scale, state, is_leaf=is_holder)

    return Remedy("scale_hyperparam", fn, {"factor": factor, "name": name})


def _is_injected(x: Any) -> bool:
    return isinstance(x, _INJECTED)


def lower_lr(factor: float = 0.5) -> Remedy:
    """Lowers the learning rate: :func:`scale_hyperparam` of ``"learning_rate"``.

    Example:
      >>> from stabljax.control.decide.remedies import lower_lr
      >>> lower_lr(0.25).params
      {'factor': 0.25, 'name': 'learning_rate'}
    """
    return scale_hyperparam(factor, "learning_rate")


HALVE_LR = lower_lr(0.5)
"""``lower_lr(0.5)``: :func:`by_verdict`'s remedy for a ``state`` verdict."""


def reset_second_moment() -> Remedy:
    """Sets Adam's second moment ``nu`` (every optax state field so named) to zeros.

    With ``nu = 0`` the next update's bias-corrected denominator comes from that step's
    gradient alone; ``mu`` and the step count are kept.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from stabljax.control.decide.remedies import RollbackInfo, reset_second_moment
      >>> opt = optax.adam(1e-3)
      >>> params = {"w": jnp.ones(2)}
      >>> state = opt.update(params, opt.init(params), params)[1]
      >>> state = reset_second_moment()(state, RollbackInfo(30, 35, 1, (30, 40)))
      >>> print(state[0].nu["w"])
      [0. 0.]
    """

    def has_nu(x: Any) -> bool:
        return isinstance(x, tuple) and "nu" in getattr(x, "_fields", ())

    def reset(x: Any) -> Any:
        return x._replace(nu=optax.tree.zeros_like(x.nu)) if has_nu(x) else x

    def fn(state: Any, info: RollbackInfo) -> Any:
        if not optax.tree.get_all_with_path(state, "nu"):
            raise ValueError(
                "reset_second_moment: the train state has no optimizer state field 'nu' "
                "(optax's scale_by_adam and relatives keep the second moment there)"
            )
        return jax.tree.map(reset, state, is_leaf=has_nu)

    return Remedy("reset_second_moment", fn)


def by_verdict(
    data: Callable[..., Any] | None = None,
    state: Callable[..., Any] | None = HALVE_LR,
    default: Callable[..., Any] | None = None,
) -> Remedy:
    """Chooses the remedy by triage's verdict (``info.verdict``).

    ``data``: the spike came from the batches, so the skip is the remedy (default: nothing
    more). ``state``: the model state is fragile, so lower the LR (default
    ``lower_lr(0.5)``). ``default``: any other verdict (``"nondeterministic"``,
    ``"inconclusive"``) or none (triage off).

    Example:
      >>> from stabljax.control.decide.remedies import RollbackInfo, by_verdict, describe
      >>> info = RollbackInfo(30, 35, 1, (30, 40), verdict="state")
      >>> describe(by_verdict(), info)["applied"]["remedy"]
      'scale_hyperparam'
      >>> print(describe(by_verdict(), RollbackInfo(30, 35, 1, (30, 40), verdict="data")))
      {'remedy': 'by_verdict', 'params': {}, 'applied': None}
    """
    for arg, value in (("data", data), ("state", state), ("default", default)):
        if value is not None and not callable(value):
            raise TypeError(f"by_verdict: {arg} must be a remedy (callable) or None, got {value!r}")

    def pick(info: RollbackInfo) -> Any:
        return {"data": data, "state": state}.get(info.verdict, default)

    def fn(s: Any, info: RollbackInfo) -> Any:
        chosen = pick(info)
        return s if chosen is None else chosen(s, info)

    return Remedy("by_verdict", fn, {}, pick)


def chain_remedies(*remedies: Callable[..., Any]) -> Remedy:
    """Applies ``remedies`` in order, each to the previous one's result.

    Example:
      >>> from stabljax.control.decide.remedies import chain_remedies, lower_lr, reset_second_moment
      >>> from stabljax.control.decide.remedies import RollbackInfo, describe
      >>> chained = chain_remedies(lower_lr(0.5), reset_second_moment())
      >>> describe(chained, RollbackInfo(30, 35, 1, (30, 40)))["applied"][1]
      {'remedy': 'reset_second_moment', 'params': {}}
    """
    for i, r in enumerate(remedies):
        if not callable(r):
            raise TypeError(f"chain_remedies: remedies[{i}] must be callable, got {r!r}")

    def fn(state: Any, info: RollbackInfo) -> Any:
        for r in remedies:
            state = r(state, info)
        return state

    return Remedy("chain", fn, {}, parts=tuple(remedies))


@dataclasses.dataclass(frozen=True)
class WarningResponse:
    r"""Lowers a hyperparameter while a warning is in force, and restores it after: reversible.

    Acts before the spike, where a remedy acts after a rollback. Given to
    ``RollbackController(..., warning_response=WarningResponse())``, it is called once per
    step with the train state; when the named detector (a
    :class:`~stabljax.control.detect.warning.WarningDetector`) has engaged and the state
    does not hold the response yet, it multiplies hyperparameter ``name`` of every
    ``optax.inject_hyperparams`` state by ``factor`` (:func:`scale_hyperparam`); when the
    detector has disengaged (its calm period passed), by ``1 / factor``. Each change is a
    ``warning_response`` event. Whether the state holds the response is the detector's
    checkpointed ``applied`` flag, so a rollback or restart that restores an older state
    restores the matching flag, and the change is never applied twice or lost. With a
    power-of-two ``factor`` (0.5, the default) the restored value is bitwise the original
    (other factors: within a rounding). Rollback stays the fallback: the reactive detectors
    still roll back if the loss rises anyway.

    Attributes:
      detector: the warning detector's ``name``.
      factor: the multiplier while engaged, finite, > 0 and != 1.
      name: the injected hyperparameter (``"learning_rate"``; ``"step_size"`` of a chained
        ``inject_hyperparams(optax.scale)`` for a scheduled LR, as for :func:`lower_lr`).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from stabljax.control.decide.remedies import WarningResponse
      >>> from stabljax.control.detect.warning import Signal, WarningDetector
      >>> det = WarningDetector([Signal("grad_norm", "level")], threshold=5.0, warmup=4)
      >>> opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
      >>> state, events = opt.init({"w": jnp.zeros(2)}), []
      >>> respond = WarningResponse(factor=0.5)
      >>> for step, g in enumerate([1.0, 1.1, 0.9, 1.0, 1.05, 1.6, 2.2]):
      ...     _ = det.update(step, {"grad_norm": g})
      ...     state = respond(state, [det], lambda kind, step, **d: events.append(kind), step)
      >>> print(state.hyperparams["learning_rate"], events, det.applied)
      0.05 ['warning_response'] True
    """

    detector: str = "warning"
    factor: float = 0.5
    name: str = "learning_rate"

    def __post_init__(self):
        if _positive_factor(self.factor) == 1.0:
            raise ValueError("WarningResponse: factor 1 changes nothing; pick another")

    def __call__(self, state: Any, detectors: Any, log: Callable[..., None], step: int) -> Any:
        found = [d for d in detectors if getattr(d, "name", None) == self.detector]
        if not found or not hasattr(found[0], "mark_applied"):
            raise ValueError(
                f"WarningResponse: no warning detector named {self.detector!r} among the "
                f"controller's detectors {[getattr(d, 'name', d) for d in detectors]}"
            )
        det = found[0]
        if det.engaged == det.applied:
            return state
        factor = self.factor if det.engaged else 1.0 / self.factor
        state = scale_hyperparam(factor, self.name)(state, None)
        det.mark_applied(det.engaged)
        change = "lowered" if det.engaged else "restored"
        log("warning_response", step, change=change, name=self.name, factor=factor,
            detector=self.detector)  # fmt: skip
        return state


def remedy_event(entry: Mapping[str, Any], *, reapplied: bool) -> dict[str, Any]:
    """The ``remedy`` event's details for the rollback ledger ``entry`` that applied one."""
    info = entry["remedy_info"]
    details = dict(entry["remedy"], restored_step=entry["restored"], rollbacks=info["rollbacks"])
    return details | {"info": info, "reapplied": reapplied}
