"""Guards that skip a whole optimizer step: on non-finite values and on spikes.

A guard wraps any Optax transformation ``inner``. On a skipped step it returns
exact zeros, selected with ``jnp.where`` (never ``0 * update``, since
``0 * nan = nan``), and the inner state is selected back leafwise, so it is
bit-identical to the state before the step (the inner step count does not
advance). Every decision is one global, on-device decision: no host sync.

The two helpers :func:`any_skipped` and :func:`skip_streak` read the guards'
flags anywhere in an optimizer state (through ``optax.chain``,
``optax.inject_hyperparams``, ``optax.MultiSteps`` and nested guards); the train
step reports them as ``metrics["skipped"]`` and ``metrics["skip_streak"]``.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

_WATCHABLE = ("loss", "grad_norm")
# Relative floor on the standard deviation: a constant signal has variance 0, and without a
# floor any value one ulp away from it would be an infinite z-score.
_REL_STD_FLOOR = 1e-6
_TINY = float(np.finfo(np.float32).tiny)
_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite`."""

    inner_state: optax.OptState
    nonfinite_skipped: jax.Array  # shape=(), bool: this step was skipped
    nonfinite_skips: jax.Array  # shape=(), int32: skipped steps in total
    nonfinite_streak: jax.Array  # shape=(), int32: consecutive skipped steps, 0 after a good one


class SkipSpikesState(NamedTuple):
    """State of :func:`skip_spikes`; vectors are indexed like ``watch``."""

    spike_inner_state: optax.OptState
    spike_skipped: jax.Array  # shape=(), bool: this step was skipped (spike or non-finite)
    spike_skips: jax.Array  # shape=(), int32: skipped steps in total
    spike_streak: jax.Array  # shape=(), int32: consecutive skipped steps, 0 after a good one
    spike_count: jax.Array  # shape=(), int32: accepted steps, the n of the statistics
    spike_mean: jax.Array  # shape=(len(watch),), float32: bias-corrected EMA mean
    spike_var: jax.Array  # shape=(len(watch),), float32: bias-corrected EMA variance
    spike_zscore: jax.Array  # shape=(len(watch),), float32: z-score of this step's values


def _with_extra_args(inner: Any) -> optax.GradientTransformationExtraArgs:
    """Like ``optax.with_extra_args_support``, but keeps extra args an ``update`` can take.

    ``optax.MultiSteps`` (and its ``gradient_transformation()``) is not a
    ``GradientTransformationExtraArgs`` although its ``update`` takes ``**extra_args``;
    ``optax.with_extra_args_support`` would silently drop ``loss`` on its way in.
    """
    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return inner
    try:
        params = inspect.signature(inner.update).parameters.values()
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    except (TypeError, ValueError):
        takes_kwargs = False
    if takes_kwargs:
        return optax.GradientTransformationExtraArgs(inner.init, inner.update)
    return optax.with_extra_args_support(inner)


def _forwarded(loss: Any, extra_args: dict[str, Any]) -> dict[str, Any]:
    # The loss goes on to the inner transform, so that a nested skip_spikes sees it.
    return extra_args if loss is None else {**extra_args, "loss": loss}


def _norm_finite(tree: Any) -> jax.Array:
    """Whether the float32 global norm of ``tree`` is finite (True for an empty tree).

    False when any leaf holds NaN or Inf, and also when finite values overflow the
    float32 norm (a global norm above about 1.8e19): no step is meaningful then, and
    Adam's second moment would overflow to Inf. It is the expression :func:`skip_spikes`
    uses for ``"grad_norm"``, so XLA computes it once for nested guards (one pass over
    the gradients fewer than a separate finiteness check).
    """
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return jnp.array(True)
    return jnp.isfinite(_global_norm_f32(leaves))


# Update functions of guards whose output is finite by construction (they return zeros
# whenever their inner update is not finite): an outer guard need not check it again.
_FINITE_OUTPUT: weakref.WeakSet = weakref.WeakSet()


def _probe_finite(tree: Any) -> jax.Array:
    """Whether every inexact leaf is finite, for a tree computed only to be checked.

    ``all(isfinite(x))`` lets XLA fuse the whole computation of ``x`` into the check, which
    then writes one byte per value at most; a float sum would fuse only simple producers
    on XLA:CPU and materialize ``x`` first. XLA:CPU writes the predicate array before it
    reduces it, so adjacent pairs along the last axis are ANDed first (a reshape that
    splits that axis, which keeps its sharding): the array written is half as long.
    """
    checks = [
        jnp.all(_pairs_and(jnp.isfinite(x)))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return functools.reduce(jnp.logical_and, checks, jnp.array(True))


def _pairs_and(f: jax.Array) -> jax.Array:
    """``f[..., 0::2] & f[..., 1::2]`` for an even last axis (else ``f``): same ``all``."""
    if f.ndim == 0 or f.shape[-1] % 2:
        return f
    f = f.reshape(*f.shape[:-1], f.shape[-1] // 2, 2)
    return jnp.logical_and(f[..., 0], f[..., 1])


def _update_unless(skip, inner, updates, inner_state, params, extra_args):
    """``inner.update(...)``, or exact zeros and ``inner_state`` kept bit-for-bit where ``skip``.

    The update is computed a second time from inputs passed through an optimization
    barrier: the first evaluation (the probe) is only reduced to the decision and fuses
    into one read pass, this one into the read-and-write pass of the update. Computed once,
    the update would have two consumers and XLA would materialize its intermediates. (The
    barrier only keeps CSE from merging the two evaluations: XLA:CPU expands barriers
    before fusion, so it cannot order fusions.)
    """
    fresh = jax.lax.optimization_barrier(updates)
    new_updates, new_inner = inner.update(fresh, inner_state, params, **extra_args)
    zeros = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
    kept = jax.tree.map(lambda o, n: jnp.where(skip, o, n), inner_state, new_inner)
    return zeros, kept


def _counters(skip: jax.Array, total: jax.Array, streak: jax.Array) -> tuple[jax.Array, jax.Array]:
    total = jnp.where(skip, optax.safe_increment(total), total)
    streak = jnp.where(skip, optax.safe_increment(streak), jnp.zeros_like(streak))
    return total, streak


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    r"""Skips the whole step when a gradient, the inner update or the loss is NaN or Inf.

    With :math:`g` the incoming gradients, :math:`(u, s') = \mathrm{inner}(g, s)` and
    :math:`\ell` the optional ``loss``, the step is skipped when

    .. math::
        \neg\big(\mathrm{finite}(g) \wedge \mathrm{finite}(u) \wedge \mathrm{finite}(\ell)\big),

    each a single global reduction over all leaves (and all devices). :math:`g` is
    checked through its float32 global norm, so finite gradients whose norm overflows
    float32 (above about 1.8e19) are skipped too. A skipped step returns exact zeros and
    keeps ``s`` bit-for-bit, so the inner step count does not advance; otherwise it
    returns :math:`(u, s')`.

    Unlike :func:`optax.apply_if_finite`, which checks only the incoming gradients and
    applies the non-finite update once ``max_consecutive_errors`` is exceeded, this
    guard never gives up: a long run of bad steps shows as a growing
    ``nonfinite_streak`` for a controller (rollback) to act on. Unlike Levanter's skip
    step, the update is selected, not multiplied by 0, so NaN never reaches parameters.

    ``loss`` and ``**extra_args`` are forwarded to ``inner`` (wrapped with
    :func:`optax.with_extra_args_support`; an ``update`` that takes ``**kwargs``, such
    as :class:`optax.MultiSteps`, receives them as well).

    Args:
      inner: the transformation to guard, e.g. a whole optimizer.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose ``update`` is
      ``update(updates, state, params=None, *, loss=None, **extra_args)`` and whose
      state is a :class:`SkipNonfiniteState`.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards import skip_nonfinite
      >>> opt = skip_nonfinite(optax.adam(1e-3))
      >>> params = {"w": jnp.ones(3)}
      >>> state = opt.init(params)
      >>> grads = {"w": jnp.array([1.0, jnp.nan, 0.0])}
      >>> updates, state = jax.jit(opt.update)(grads, state, params)
      >>> print(updates["w"], bool(state.nonfinite_skipped), int(state.nonfinite_streak))
      [0. 0. 0.] True 1
      >>> print(int(state.inner_state[0].count))  # Adam's count did not advance
      0

    References:
      OLMo-core, `SkipStepOptimizer
      <https://github.com/allenai/OLMo-core/blob/main/src/olmo_core/optim/skip_step_optimizer.py>`_,
      2024

      Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
      <https://arxiv.org/abs/2204.02311>`_, 2022
    """
    inner = _with_extra_args(inner)
    # An inner guard's output is finite by construction: checking it again costs a pass.
    trusted = inner.update in _FINITE_OUTPUT

    def init_fn(params: optax.Params) -> SkipNonfiniteState:
        return SkipNonfiniteState(
            inner_state=inner.init(params),
            nonfinite_skipped=jnp.zeros([], jnp.bool_),
            nonfinite_skips=jnp.zeros([], jnp.int32),
            nonfinite_streak=jnp.zeros([], jnp.int32),
        )

    def update_fn(
        updates: optax.Updates,
        state: SkipNonfiniteState,
        params: optax.Params | None = None,
        *,
        loss: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipNonfiniteState]:
        fwd = _forwarded(loss, extra_args)
        finite = _norm_finite(updates)
        if loss is not None:
            finite = jnp.logical_and(finite, jnp.all(jnp.isfinite(jnp.asarray(loss))))
        if not trusted:
            # Only reduced to the decision: XLA fuses this evaluation into one read pass.
            probe, _ = inner.update(updates, state.inner_state, params, **fwd)
            finite = jnp.logical_and(finite, _probe_finite(probe))
        skip = jnp.logical_not(finite)
        new_updates, new_inner = _update_unless(
            skip, inner, updates, state.inner_state, params, fwd
        )
        skips, streak = _counters(skip, state.nonfinite_skips, state.nonfinite_streak)
        return new_updates, SkipNonfiniteState(
            inner_state=new_inner,
            nonfinite_skipped=skip,
            nonfinite_skips=skips,
            nonfinite_streak=streak,
        )

    _FINITE_OUTPUT.add(update_fn)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _validate(name: str, value: Any, ok: Callable[[Any], Any], allowed: str) -> None:
    # inject_hyperparams may hand numeric hyperparameters in as tracers: nothing to check then.
    if isinstance(value, getattr(jax.core, "Tracer", ())):
        return
    try:
        good = bool(ok(value))
    except _TRACER_ERRORS:
        return
    except (TypeError, ValueError):
        good = False
    if not good:
        raise ValueError(f"skip_spikes: `{name}` must be {allowed}; got {value!r}.")


def _is_nonneg_int(v: Any) -> bool:
    return np.ndim(v) == 0 and np.asarray(v).dtype.kind in "iu" and int(v) >= 0


def _global_norm_f32(tree: Any) -> jax.Array:
    squares = [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)]
    return jnp.sqrt(functools.reduce(jnp.add, squares, jnp.zeros([], jnp.float32)))


def skip_spikes(
    inner: optax.GradientTransformation,
    *,
    z_threshold: float = 6.0,
    ema_decay: float = 0.99,
    warmup_steps: int = 100,
    watch: Sequence[str] = ("loss", "grad_norm"),
) -> optax.GradientTransformationExtraArgs:
    r"""Skips the whole step when the loss or the gradient norm spikes above its running mean.

    The watched values are ``"loss"`` (the ``loss`` extra argument) and ``"grad_norm"``
    (the global norm of the incoming gradients, computed in float32). For each, with
    :math:`d` = ``ema_decay`` and :math:`n` the number of accepted steps, the statistics
    are the bias-corrected EMA mean and variance, i.e. the mean and population variance
    of the accepted values :math:`x_1 \dots x_n` weighted by :math:`w_k = d^{\,n-k}`.
    They are updated by West's weighted Welford recursion (no cancellation, unlike an
    EMA of :math:`x` and of :math:`x^2`):

    .. math::
        a_n = \frac{1 - d}{1 - d^{\,n}}, \quad \delta = x_n - \mu_{n-1}, \quad
        \mu_n = \mu_{n-1} + a_n \delta, \quad
        \sigma^2_n = (1 - a_n)\,(\sigma^2_{n-1} + a_n \delta^2),

    so :math:`\mu_1 = x_1`, :math:`\sigma^2_1 = 0`, and :math:`\mu_n` equals Adam-style
    :math:`m_n / (1 - d^{\,n})` with :math:`m_n = d\,m_{n-1} + (1-d)\,x_n`. The z-score
    of a new value is :math:`z = (x - \mu) / s` with the floored standard deviation
    :math:`s = \sqrt{\max(\sigma^2, (10^{-6}\,|\mu|)^2)} + \mathrm{tiny}`, so a constant
    signal does not turn every step into a spike; a value exactly equal to the mean has
    :math:`z = 0` and is never skipped. The step is skipped when

    * any watched value is NaN or Inf, or the inner update is non-finite (always), or
    * :math:`n \ge` ``warmup_steps`` (and :math:`n \ge 1`) and any :math:`z >`
      ``z_threshold`` (one-sided: values far below the mean are welcome).

    Only accepted steps with finite values update the statistics and :math:`n`: a
    skipped spike or a NaN never enters them (the flaw of MaxText's and Levanter's
    ports, where one NaN poisons the next window), so a normal step right after it is
    not skipped. A skipped step returns exact zeros and keeps the inner state
    bit-for-bit. On a deterministic objective a flagged step therefore repeats on
    every call (the statistics do not move): ``spike_streak`` grows, and a controller
    (rollback with a data skip) acts on it. With ``warmup_steps`` 0 the first step
    still only gathers, since there are no statistics yet.

    Args:
      inner: the transformation to guard, e.g. a whole optimizer.
      z_threshold: skip when a watched value is more than this many standard
        deviations above its mean; > 0.
      ema_decay: decay :math:`d` of the statistics, in (0, 1); the window is about
        :math:`1/(1-d)` accepted steps.
      warmup_steps: accepted steps during which statistics are only gathered; >= 0.
      watch: a non-empty tuple of distinct names from ``("loss", "grad_norm")``. With
        ``"loss"`` watched, ``update`` must be given ``loss=`` (a scalar).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose ``update`` is
      ``update(updates, state, params=None, *, loss=None, **extra_args)`` (``loss``
      and ``extra_args`` are forwarded to ``inner``) and whose state is a
      :class:`SkipSpikesState`.

    Raises:
      ValueError: at construction for an invalid hyperparameter; at trace time when
        ``"loss"`` is watched and ``loss`` is not given, or is not a scalar.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards import skip_spikes
      >>> opt = skip_spikes(optax.sgd(0.1), warmup_steps=4, watch=("loss",))
      >>> params = jnp.zeros(2)
      >>> state = opt.init(params)
      >>> step = jax.jit(opt.update)
      >>> for loss in [1.0, 1.1, 0.9, 1.0, 50.0, 1.05]:
      ...     updates, state = step(jnp.ones(2), state, params, loss=loss)
      ...     print(f"loss={loss:5.2f} skipped={bool(state.spike_skipped)} updates={updates}")
      loss= 1.00 skipped=False updates=[-0.1 -0.1]
      loss= 1.10 skipped=False updates=[-0.1 -0.1]
      loss= 0.90 skipped=False updates=[-0.1 -0.1]
      loss= 1.00 skipped=False updates=[-0.1 -0.1]
      loss=50.00 skipped=True updates=[0. 0.]
      loss= 1.05 skipped=False updates=[-0.1 -0.1]

    References:
      OLMo-core, `SkipStepOptimizer
      <https://github.com/allenai/OLMo-core/blob/main/src/olmo_core/optim/skip_step_optimizer.py>`_,
      2024

      Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
      <https://arxiv.org/abs/2204.02311>`_, 2022

      West, `Updating mean and variance estimates: an improved method
      <https://doi.org/10.1145/359146.359153>`_, 1979
    """
    _validate("z_threshold", z_threshold, lambda v: v > 0, "> 0")
    _validate("ema_decay", ema_decay, lambda v: 0 < v < 1, "in the open interval (0, 1)")
    _validate("warmup_steps", warmup_steps, _is_nonneg_int, "a non-negative integer")
    if isinstance(watch, str) or not isinstance(watch, Sequence):
        raise ValueError(f"skip_spikes: `watch` must be a tuple of names; got {watch!r}.")
    watch = tuple(watch)
    if not watch or any(w not in _WATCHABLE for w in watch) or len(set(watch)) != len(watch):
        raise ValueError(
            f"skip_spikes: `watch` must be a non-empty tuple of distinct names from "
            f"{_WATCHABLE}; got {watch!r}."
        )
    inner = _with_extra_args(inner)
    k = len(watch)

    def init_fn(params: optax.Params) -> SkipSpikesState:
        return SkipSpikesState(
            spike_inner_state=inner.init(params),
            spike_skipped=jnp.zeros([], jnp.bool_),
            spike_skips=jnp.zeros([], jnp.int32),
            spike_streak=jnp.zeros([], jnp.int32),
            spike_count=jnp.zeros([], jnp.int32),
            spike_mean=jnp.zeros([k], jnp.float32),
            spike_var=jnp.zeros([k], jnp.float32),
            spike_zscore=jnp.zeros([k], jnp.float32),
        )

    def watched_values(updates: optax.Updates, loss: Any) -> jax.Array:
        values = []
        for name in watch:
            if name == "grad_norm":
                values.append(_global_norm_f32(updates))
                continue
            if loss is None:
                raise ValueError(
                    "skip_spikes watches 'loss' but update() got loss=None: pass the "
                    "step's loss as update(..., loss=loss), or construct the guard with "
                    "watch=('grad_norm',)."
                )
            loss = jnp.asarray(loss)
            if loss.size != 1:
                raise ValueError(f"skip_spikes: `loss` must be a scalar; got shape {loss.shape}.")
            values.append(loss.reshape(()).astype(jnp.float32))
        return jnp.stack(values)

    def update_fn(
        updates: optax.Updates,
        state: SkipSpikesState,
        params: optax.Params | None = None,
        *,
        loss: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipSpikesState]:
        x = watched_values(updates, loss)
        fwd = _forwarded(loss, extra_args)
        # Only reduced to the decision: XLA fuses this evaluation into one read pass.
        probe, _ = inner.update(updates, state.spike_inner_state, params, **fwd)
        count, mean, var = state.spike_count, state.spike_mean, state.spike_var
        have_stats = count > 0
        std = jnp.sqrt(jnp.maximum(var, jnp.square(_REL_STD_FLOOR * jnp.abs(mean)))) + _TINY
        z = jnp.where(have_stats, (x - mean) / std, jnp.zeros_like(x))
        armed = jnp.logical_and(have_stats, count >= warmup_steps)
        spike = jnp.logical_and(armed, jnp.any(z > z_threshold))
        finite = jnp.logical_and(jnp.all(jnp.isfinite(x)), _probe_finite(probe))
        skip = jnp.logical_or(spike, jnp.logical_not(finite))
        new_updates, new_inner = _update_unless(
            skip, inner, updates, state.spike_inner_state, params, fwd
        )

        n = optax.safe_increment(count)
        decay = jnp.asarray(ema_decay, jnp.float32)
        a = (1.0 - decay) / (1.0 - decay ** n.astype(jnp.float32))
        delta = x - mean
        new_mean = mean + a * delta
        new_var = (1.0 - a) * (var + a * jnp.square(delta))
        # A finite but huge value (|delta| > 1.8e19) would overflow the variance: keep it out.
        gather = jnp.logical_and(
            jnp.logical_not(skip),
            jnp.logical_and(jnp.all(jnp.isfinite(new_mean)), jnp.all(jnp.isfinite(new_var))),
        )
        skips, streak = _counters(skip, state.spike_skips, state.spike_streak)
        return new_updates, SkipSpikesState(
            spike_inner_state=new_inner,
            spike_skipped=skip,
            spike_skips=skips,
            spike_streak=streak,
            spike_count=jnp.where(gather, n, count),
            spike_mean=jnp.where(gather, new_mean, mean),
            spike_var=jnp.where(gather, new_var, var),
            spike_zscore=z,
        )

    _FINITE_OUTPUT.add(update_fn)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _found(opt_state: optax.OptState, names: tuple[str, ...]) -> list[jax.Array]:
    return [
        jnp.asarray(value)
        for name in names
        for _, value in optax.tree.get_all_with_path(opt_state, name)
    ]


def any_skipped(opt_state: optax.OptState) -> jax.Array:
    """Whether any guard in an optimizer state skipped its last step.

    ORs every ``nonfinite_skipped`` (:func:`skip_nonfinite`) and ``spike_skipped``
    (:func:`skip_spikes`) field found anywhere in ``opt_state`` with
    :func:`optax.tree.get_all_with_path`, so it looks through ``optax.chain``,
    ``optax.inject_hyperparams``, ``optax.MultiSteps`` (where the flags describe the
    last emitted update) and nested guards. Runs under ``jax.jit``.

    Args:
      opt_state: any optimizer state.

    Returns:
      A bool scalar ``jax.Array``; False when the state holds no guard.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards import any_skipped, skip_nonfinite
      >>> opt = optax.chain(optax.clip_by_global_norm(1.0), skip_nonfinite(optax.adam(1e-3)))
      >>> state = opt.init(jnp.zeros(2))
      >>> _, state = opt.update(jnp.array([1.0, jnp.inf]), state)
      >>> print(bool(any_skipped(state)), bool(any_skipped(optax.adam(1e-3).init(jnp.zeros(2)))))
      True False
    """
    flags = [jnp.any(v) for v in _found(opt_state, ("nonfinite_skipped", "spike_skipped"))]
    return functools.reduce(jnp.logical_or, flags, jnp.zeros([], jnp.bool_))


def skip_streak(opt_state: optax.OptState) -> jax.Array:
    """The longest current run of consecutive skipped steps among the guards in a state.

    The maximum of every ``nonfinite_streak`` and ``spike_streak`` field found anywhere
    in ``opt_state`` (see :func:`any_skipped`). The rollback controller acts on it.

    Args:
      opt_state: any optimizer state.

    Returns:
      An int32 scalar ``jax.Array``; 0 when the state holds no guard.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards import skip_nonfinite, skip_streak
      >>> opt = skip_nonfinite(optax.sgd(0.1))
      >>> state = opt.init(jnp.zeros(2))
      >>> for _ in range(3):
      ...     _, state = opt.update(jnp.array([jnp.nan, 1.0]), state)
      >>> print(int(skip_streak(state)))
      3
    """
    streaks = [
        jnp.max(v).astype(jnp.int32)
        for v in _found(opt_state, ("nonfinite_streak", "spike_streak"))
    ]
    return functools.reduce(jnp.maximum, streaks, jnp.zeros([], jnp.int32))
