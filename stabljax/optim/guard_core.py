"""The guard core: :func:`skip_step`, the one decision behind every stabljax guard.

A guard wraps any Optax transformation ``inner`` and calls ``inner.update`` exactly
once. The decision reads scalars only: the float32 global norm of the incoming
gradients (which clipping computes anyway: the expression is the same, so XLA computes
it once) and the loss. On a skipped step the guard returns exact zeros, selected with
``jnp.where`` (never ``0 * update``, since ``0 * nan = nan``), and selects the inner
state back leafwise, so it is bit-identical to the state before the step (the inner
step count does not advance). The decision is global: under ``jit`` XLA reduces the
norm over every shard (GSPMD); inside ``shard_map``/``pmap`` pass ``axis_name`` to
reduce it over those axes. No host sync. The wrappers ``skip_nonfinite`` and
``skip_spikes`` live in :mod:`stabljax.optim.guards`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stabljax.optim._base import (
    AxisName,
    all_finite,
    global_norm_f32,
    is_nonneg_int,
    rename_fields,
    validate,
    with_extra_args,
)

_WATCHABLE = ("loss", "grad_norm")
# Relative floor on the standard deviation: a constant signal has variance 0, and without a
# floor any value one ulp away from it would be an infinite z-score.
_REL_STD_FLOOR = 1e-6
_TINY = float(np.finfo(np.float32).tiny)
_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
)


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    r"""When :func:`skip_step` calls a value a spike: a z-score against running statistics.

    For each watched value (``"loss"``, the ``value``/``loss`` extra argument, and
    ``"grad_norm"``, the float32 global norm of the incoming gradients), with
    :math:`d` = ``ema_decay`` and :math:`n` the number of accepted steps, the statistics
    are the bias-corrected EMA mean and variance, i.e. the mean and population variance
    of the accepted values :math:`x_1 \dots x_n` weighted by :math:`w_k = d^{\,n-k}`,
    kept by West's weighted Welford recursion (no cancellation, unlike an EMA of
    :math:`x` and of :math:`x^2`):

    .. math::
        a_n = \frac{1 - d}{1 - d^{\,n}}, \quad \delta = x_n - \mu_{n-1}, \quad
        \mu_n = \mu_{n-1} + a_n \delta, \quad
        \sigma^2_n = (1 - a_n)\,(\sigma^2_{n-1} + a_n \delta^2).

    The z-score is :math:`z = (x - \mu) / s` with the floored standard deviation
    :math:`s = \sqrt{\max(\sigma^2, (10^{-6}\,|\mu|)^2)} + \mathrm{tiny}`. Once
    :math:`n \ge` ``warmup_steps`` (and :math:`n \ge 1`), a step with any
    :math:`z >` ``z_threshold`` is a spike (one-sided). A non-finite watched value is
    always skipped, and never enters the statistics.

    Attributes:
      z_threshold: > 0.
      ema_decay: in (0, 1); the window is about :math:`1/(1-d)` accepted steps.
      warmup_steps: accepted steps during which statistics are only gathered; >= 0.
      watch: a non-empty tuple of distinct names from ``("loss", "grad_norm")``.
    """

    z_threshold: float = 6.0
    ema_decay: float = 0.99
    warmup_steps: int = 100
    watch: tuple[str, ...] = ("loss", "grad_norm")

    def __post_init__(self):
        validate("skip_spikes", "z_threshold", self.z_threshold, lambda v: v > 0, "> 0")
        validate(
            "skip_spikes",
            "ema_decay",
            self.ema_decay,
            lambda v: (0 < v) & (v < 1),
            "in the open interval (0, 1)",
        )
        validate(
            "skip_spikes",
            "warmup_steps",
            self.warmup_steps,
            is_nonneg_int,
            "a non-negative integer",
        )
        watch = self.watch
        if isinstance(watch, str) or not isinstance(watch, Sequence):
            raise ValueError(f"skip_spikes: `watch` must be a tuple of names; got {watch!r}.")
        watch = tuple(watch)
        if not watch or any(w not in _WATCHABLE for w in watch) or len(set(watch)) != len(watch):
            raise ValueError(
                f"skip_spikes: `watch` must be a non-empty tuple of distinct names from "
                f"{_WATCHABLE}; got {watch!r}."
            )
        object.__setattr__(self, "watch", watch)


class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite` (and of :func:`skip_step` without a spike rule)."""

    nonfinite_inner_state: optax.OptState
    nonfinite_skipped: jax.Array  # shape=(), bool: this step was skipped
    nonfinite_skips: jax.Array  # shape=(), int32: skipped steps in total
    nonfinite_streak: jax.Array  # shape=(), int32: consecutive skipped steps, 0 after a good one


class SkipSpikesState(NamedTuple):
    """State of :func:`skip_spikes` (and of :func:`skip_step` with a spike rule).

    Vectors are indexed like the rule's ``watch``.
    """

    spike_inner_state: optax.OptState
    spike_skipped: jax.Array  # shape=(), bool: this step was skipped (spike or non-finite)
    spike_skips: jax.Array  # shape=(), int32: skipped steps in total
    spike_streak: jax.Array  # shape=(), int32: consecutive skipped steps, 0 after a good one
    spike_accepted_steps: jax.Array  # shape=(), int32: accepted steps, the n of the statistics
    spike_mean: jax.Array  # shape=(len(watch),), float32: bias-corrected EMA mean
    spike_var: jax.Array  # shape=(len(watch),), float32: bias-corrected EMA variance
    spike_zscore: jax.Array  # shape=(len(watch),), float32: z-score of this step's values


rename_fields(SkipNonfiniteState, inner_state="nonfinite_inner_state")
rename_fields(SkipSpikesState, spike_count="spike_accepted_steps")


def _objective(owner: str, value: Any, loss: Any) -> Any:
    """The objective given as optax's ``value=`` or as ``loss=`` (its alias).

    Both given: they must be equal. Concrete values that differ raise; traced ones
    cannot be compared at trace time (a wrapper such as ``MultiSteps`` hands the two
    names in as distinct tracers of one value), so a mismatch makes the objective NaN
    in-graph and the step is skipped, never taken with the wrong value.
    """
    if value is None:
        return loss
    if loss is None or loss is value:
        return value
    try:
        same = bool(np.all(np.asarray(value) == np.asarray(loss)))
    except _TRACER_ERRORS:
        v, ell = jnp.asarray(value), jnp.asarray(loss)
        return jnp.where(v == ell, v, jnp.full_like(v, jnp.nan))
    except TypeError:
        same = False
    if not same:
        raise ValueError(
            f"{owner}: got both value= and loss= with different values; pass the objective "
            "once, as value= (optax's name) or loss= (its alias)."
        )
    return value


def _scalar_f32(owner: str, objective: Any) -> jax.Array:
    x = jnp.asarray(objective)
    if x.size != 1:
        raise ValueError(
            f"{owner}: `loss` must be a scalar; got shape {x.shape}. Pass the mean loss of "
            "the step (value= or loss=)."
        )
    return x.reshape(()).astype(jnp.float32)


def _check_axis_name(owner: str, axis_name: Any) -> None:
    ok = (
        axis_name is None
        or isinstance(axis_name, str)
        or (
            isinstance(axis_name, tuple)
            and axis_name
            and all(isinstance(a, str) for a in axis_name)
        )
    )
    if not ok:
        raise ValueError(
            f"{owner}: `axis_name` must be None, a mesh axis name or a non-empty tuple of "
            f"names; got {axis_name!r}."
        )


def _counters(skip: jax.Array, total: jax.Array, streak: jax.Array) -> tuple[jax.Array, jax.Array]:
    total = jnp.where(skip, optax.safe_increment(total), total)
    streak = jnp.where(skip, optax.safe_increment(streak), jnp.zeros_like(streak))
    return total, streak


def _spike_init(rule: SpikeRule) -> dict[str, jax.Array]:
    k = len(rule.watch)
    return {
        "spike_accepted_steps": jnp.zeros([], jnp.int32),
        "spike_mean": jnp.zeros([k], jnp.float32),
        "spike_var": jnp.zeros([k], jnp.float32),
        "spike_zscore": jnp.zeros([k], jnp.float32),
    }


def _spike_decision(rule: SpikeRule, state: SkipSpikesState, x: jax.Array):
    """(spike, z) for the watched values ``x`` against the statistics in ``state``."""
    count, mean, var = state.spike_accepted_steps, state.spike_mean, state.spike_var
    have_stats = count > 0
    std = jnp.sqrt(jnp.maximum(var, jnp.square(_REL_STD_FLOOR * jnp.abs(mean)))) + _TINY
    z = jnp.where(have_stats, (x - mean) / std, jnp.zeros_like(x))
    armed = jnp.logical_and(have_stats, count >= rule.warmup_steps)
    return jnp.logical_and(armed, jnp.any(z > rule.z_threshold)), z


def _spike_gather(rule: SpikeRule, state: SkipSpikesState, x: jax.Array, skip: jax.Array, z):
    """The statistics after this step: ``x`` enters them unless the step was skipped."""
    count, mean, var = state.spike_accepted_steps, state.spike_mean, state.spike_var
    n = optax.safe_increment(count)
    decay = jnp.asarray(rule.ema_decay, jnp.float32)
    a = (1.0 - decay) / (1.0 - decay ** n.astype(jnp.float32))
    delta = x - mean
    new_mean = mean + a * delta
    new_var = (1.0 - a) * (var + a * jnp.square(delta))
    # A finite but huge value (|delta| > 1.8e19) would overflow the variance: keep it out.
    gather = jnp.logical_and(
        jnp.logical_not(skip),
        jnp.logical_and(jnp.all(jnp.isfinite(new_mean)), jnp.all(jnp.isfinite(new_var))),
    )
    return {
        "spike_accepted_steps": jnp.where(gather, n, count),
        "spike_mean": jnp.where(gather, new_mean, mean),
        "spike_var": jnp.where(gather, new_var, var),
        "spike_zscore": z,
    }


def skip_step(
    inner: optax.GradientTransformation,
    *,
    nonfinite: bool | Sequence[str] = True,
    spikes: SpikeRule | None = None,
    check_update: bool = False,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Skips the whole step of ``inner`` on a non-finite value or a spike: one decision.

    With :math:`g` the incoming gradients, :math:`\|g\|` their float32 global norm,
    :math:`\ell` the objective (``value=``, or its alias ``loss=``) and
    :math:`(u, s') = \mathrm{inner}(g, s)`, the step is skipped when

    * :math:`\|g\|` (``"grad_norm"`` in ``nonfinite``) or :math:`\ell` (``"loss"``) is
      NaN or Inf. Through the norm, any NaN or Inf in any leaf counts, and so do finite
      gradients whose norm overflows float32 (above about 1.8e19), where Adam's second
      moment would too;
    * ``spikes`` is a :class:`SpikeRule` and a watched value spikes, or is non-finite;
    * ``check_update`` and :math:`u` has a NaN or Inf anywhere.

    A skipped step returns exact zeros and keeps :math:`s` bit-for-bit (the inner step
    count does not advance); otherwise it returns :math:`(u, s')`. ``inner.update`` is
    traced once, so nested guards trace it once at any depth, and the guarded update
    reads the same arrays as the bare one: on XLA:TPU the guard adds only scalar work
    (BUILD.md, Performance, for the compiled bytes of each option).

    **Why the update itself is not checked by default.** Checking :math:`u` needs all
    of it before any of it can be selected, so XLA must write it out and read it back
    (or compute it twice), which costs memory traffic on XLA:TPU (BUILD.md, Performance,
    "check_update"). From finite gradients the update is finite for
    every transformation in stabljax (safe Adam at eps = 0 returns 0 where
    :math:`\hat v = 0`, never 0/0, and its ratio is bounded; atan2 is bounded by
    construction; clipping rescales by a finite factor) and for optax's with eps > 0. Pass
    ``check_update=True`` for an inner transformation that can produce NaN from finite
    input: optax's Adam with ``eps=0``, a custom transform, or an overflowing scale.

    **Where the decision is global.** Under ``jax.jit`` (GSPMD, auto or explicit
    sharding) the norm is one global reduction, so every device takes the same
    decision. Inside ``shard_map``/``pmap`` the gradients a device sees are its shard:
    pass ``axis_name`` (a name or a tuple of names) to ``psum`` the squared norm and
    ``pmean`` the objective over those axes and ``pmax`` the decision, so every shard
    takes the same decision and keeps identical counters and statistics. Name only axes
    over which the gradient leaves are *sharded* (FSDP): gradients already averaged and
    replicated over an axis would be counted once per device in the norm.

    ``value``/``loss`` and ``**extra_args`` are forwarded to ``inner``, the objective
    under both names, so an optax transform that reads ``value=``
    (:func:`optax.contrib.reduce_on_plateau`) and a nested guard both get it.

    Args:
      inner: the transformation to guard, e.g. a whole optimizer.
      nonfinite: the values whose NaN or Inf skips the step: a tuple of names from
        ``("grad_norm", "loss")``; True for both, False for none.
      spikes: a :class:`SpikeRule`, or None for no spike detection.
      check_update: also skip when the inner update is non-finite (costs a pass).
      axis_name: the ``shard_map``/``pmap`` axes the gradients are sharded over.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs`; its state is a
      :class:`SkipNonfiniteState` without a spike rule, a :class:`SkipSpikesState` with
      one.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from stabljax.optim.guard_core import SpikeRule, skip_step
      >>> opt = skip_step(optax.sgd(0.1), spikes=SpikeRule(warmup_steps=2, watch=("loss",)))
      >>> params = jnp.zeros(2)
      >>> state = opt.init(params)
      >>> for loss in [1.0, 1.1, 40.0, jnp.nan, 1.0]:
      ...     updates, state = jax.jit(opt.update)(jnp.ones(2), state, params, value=loss)
      ...     print(bool(state.spike_skipped), int(state.spike_streak), updates)
      False 0 [-0.1 -0.1]
      False 0 [-0.1 -0.1]
      True 1 [0. 0.]
      True 2 [0. 0.]
      False 0 [-0.1 -0.1]
    """
    owner = "skip_spikes" if spikes is not None else "skip_nonfinite"
    if nonfinite is True or nonfinite is False:
        nonfinite = _WATCHABLE if nonfinite else ()
    elif isinstance(nonfinite, str) or not isinstance(nonfinite, Sequence):
        raise ValueError(f"skip_step: `nonfinite` must be a bool or a tuple; got {nonfinite!r}.")
    nonfinite = tuple(nonfinite)
    if any(n not in _WATCHABLE for n in nonfinite):
        raise ValueError(
            f"skip_step: `nonfinite` names must be from {_WATCHABLE}; got {nonfinite!r}."
        )
    if spikes is not None and not isinstance(spikes, SpikeRule):
        raise TypeError(f"skip_step: `spikes` must be a SpikeRule or None; got {spikes!r}.")
    if not nonfinite and spikes is None and not check_update:
        raise ValueError(
            "skip_step: nothing to check; set nonfinite=True, a spike rule or check_update=True."
        )
    _check_axis_name(owner, axis_name)
    inner = with_extra_args(inner)

    def init_fn(params: optax.Params) -> SkipNonfiniteState | SkipSpikesState:
        flags = (jnp.zeros([], jnp.bool_), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))
        if spikes is None:
            return SkipNonfiniteState(inner.init(params), *flags)
        return SkipSpikesState(inner.init(params), *flags, **_spike_init(spikes))

    def update_fn(
        updates: optax.Updates,
        state: SkipNonfiniteState | SkipSpikesState,
        params: optax.Params | None = None,
        *,
        value: jax.typing.ArrayLike | None = None,
        loss: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipNonfiniteState | SkipSpikesState]:
        objective = _objective(owner, value, loss)
        fwd = (
            extra_args
            if objective is None
            else {**extra_args, "value": objective, "loss": objective}
        )
        ell = None if objective is None else _scalar_f32(owner, objective)
        if ell is not None and axis_name is not None:
            ell = jax.lax.pmean(ell, axis_name)
        norm = global_norm_f32(updates, axis_name)

        inner_state = state[0]
        new_updates, new_inner = inner.update(updates, inner_state, params, **fwd)

        skip = jnp.zeros([], jnp.bool_)
        if "grad_norm" in nonfinite:
            skip = jnp.logical_not(jnp.isfinite(norm))
        if "loss" in nonfinite and ell is not None:
            skip = jnp.logical_or(skip, jnp.logical_not(jnp.isfinite(ell)))
        if check_update:
            skip = jnp.logical_or(skip, jnp.logical_not(all_finite(new_updates)))
        if spikes is not None:
            xs = []
            for name in spikes.watch:
                if name == "grad_norm":
                    xs.append(norm)
                elif ell is None:
                    raise ValueError(
                        "skip_spikes watches 'loss' but update() got no objective: pass the "
                        "step's loss as update(..., value=loss) (or loss=loss), or construct "
                        "the guard with watch=('grad_norm',)."
                    )
                else:
                    xs.append(ell)
            x = jnp.stack(xs)
            spike, z = _spike_decision(spikes, state, x)
            skip = jnp.logical_or(
                skip, jnp.logical_or(spike, jnp.logical_not(jnp.all(jnp.isfinite(x))))
            )
        if axis_name is not None:
            # Every input above is already reduced; this also covers check_update's local test.
            skip = jax.lax.pmax(skip.astype(jnp.int32), axis_name).astype(jnp.bool_)

        out = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
        kept = jax.tree.map(lambda o, n: jnp.where(skip, o, n), inner_state, new_inner)
        skips, streak = _counters(skip, state[2], state[3])
        if spikes is None:
            return out, SkipNonfiniteState(kept, skip, skips, streak)
        return out, SkipSpikesState(
            kept, skip, skips, streak, **_spike_gather(spikes, state, x, skip, z)
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
