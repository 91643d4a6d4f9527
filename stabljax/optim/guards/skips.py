"""Guards that skip a whole optimizer step: on non-finite values and on spikes.

:func:`skip_nonfinite` and :func:`skip_spikes` are thin wrappers over the one core,
:func:`~stabljax.optim.guards.core.skip_step` (re-exported here with its rule and
states); see :mod:`stabljax.optim.guards.core` for how a step is skipped.

The two helpers :func:`any_skipped` and :func:`skip_streak` read the guards'
flags anywhere in an optimizer state (through ``optax.chain``,
``optax.inject_hyperparams``, ``optax.MultiSteps`` and nested guards); the train
step reports them as ``metrics["skipped"]`` and ``metrics["skip_streak"]``.
:func:`skip_nonfinite_micro_batch` is ``optax.MultiSteps``' ``should_skip_update_fn``
that lets a guard sit inside it (see :mod:`stabljax.optim.guards.multisteps`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from stabljax.base import AxisName
from stabljax.optim.guards.core import (
    WATCHABLE,
    SkipNonfiniteState,
    SkipSpikesState,
    SpikeRule,
    skip_step,
)
from stabljax.optim.guards.multisteps import (
    MICRO_BATCH_SKIPPED,
    check_multisteps_placement,
    skip_nonfinite_micro_batch,
)

__all__ = [
    "SkipNonfiniteState",
    "SkipSpikesState",
    "SpikeRule",
    "any_skipped",
    "skip_nonfinite",
    "skip_nonfinite_micro_batch",
    "skip_spikes",
    "skip_step",
    "skip_streak",
    "spike_rebaselines",
]


def skip_nonfinite(
    inner: optax.GradientTransformation,
    *,
    check_update: bool = False,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Skips the whole step when a gradient or the loss is NaN or Inf.

    :func:`skip_step` with ``nonfinite=True`` and no spike rule: with :math:`g` the
    incoming gradients and :math:`\ell` the optional objective (optax's ``value=``), the
    step is skipped when the float32 global norm of :math:`g` or
    :math:`\ell` is not finite, one global decision (see :func:`skip_step` for
    ``axis_name`` under ``shard_map``). Finite gradients whose norm overflows float32
    (above about 1.8e19) are skipped too. With ``check_update=True`` a non-finite inner
    update is skipped as well, at the cost of one more pass (see :func:`skip_step` for
    why the default is safe for stabljax's optimizers). A skipped step returns exact
    zeros and keeps the inner state bit-for-bit, so the inner step count does not
    advance.

    Unlike :func:`optax.apply_if_finite`, which applies the non-finite update once
    ``max_consecutive_errors`` is exceeded, this guard never gives up: a long run of bad
    steps shows as a growing ``nonfinite_streak`` for a controller (rollback) to act on.
    Unlike Levanter's skip step, the update is selected, not multiplied by 0, so NaN
    never reaches parameters.

    Args:
      inner: the transformation to guard, e.g. a whole optimizer.
      check_update: also skip when the inner update is non-finite.
      axis_name: the ``shard_map``/``pmap`` axes the gradients are sharded over.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose ``update`` is
      ``update(updates, state, params=None, *, value=None, **extra_args)``
      and whose state is a :class:`SkipNonfiniteState`.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards.skips import skip_nonfinite
      >>> opt = skip_nonfinite(optax.adam(1e-3))
      >>> params = {"w": jnp.ones(3)}
      >>> state = opt.init(params)
      >>> grads = {"w": jnp.array([1.0, jnp.nan, 0.0])}
      >>> updates, state = jax.jit(opt.update)(grads, state, params)
      >>> print(updates["w"], bool(state.nonfinite_skipped), int(state.nonfinite_streak))
      [0. 0. 0.] True 1
      >>> print(int(state.nonfinite_inner_state[0].count))  # Adam's count did not advance
      0

    References:
      OLMo-core, `SkipStepOptimizer
      <https://github.com/allenai/OLMo-core/blob/main/src/olmo_core/optim/skip_step_optimizer.py>`_,
      2024

      Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
      <https://arxiv.org/abs/2204.02311>`_, 2022
    """
    return skip_step(inner, nonfinite=WATCHABLE, check_update=check_update, axis_name=axis_name)


def skip_spikes(
    inner: optax.GradientTransformation,
    *,
    z_threshold: float = 9.0,
    window: int = 128,
    warmup_steps: int = 32,
    watch: Sequence[str] = ("loss", "grad_norm"),
    rebaseline_after: int | None = 6,
    rebaseline_max_ratio: float = 4.0,
    rebaseline_ratio: float = 2.5,
    rebaseline_max_after: int = 64,
    check_update: bool = False,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Skips the whole step when the loss or the gradient norm spikes above its recent level.

    :func:`skip_step` with ``spikes=SpikeRule(...)`` of these arguments; see
    :class:`SpikeRule` for the statistics (log space, a median level over the last 16
    accepted values, a tail scale over the last ``window`` residuals, all on device). The
    watched values are ``"loss"`` (the ``value=`` extra argument) and ``"grad_norm"`` (the
    global norm of the incoming gradients, in float32). The step is skipped when

    * the gradient norm, or a watched objective, is NaN or Inf (always), or
    * :math:`n \ge` ``warmup_steps`` accepted steps have been gathered and any
      :math:`z >` ``z_threshold`` (one-sided: values far below the level are welcome).

    Only accepted steps with finite values enter the windows: a skipped spike or a NaN
    never does (the flaw of MaxText's and Levanter's ports, where one NaN poisons the next
    window), so a normal step right after it is not skipped. A skipped step returns exact
    zeros and keeps the inner state bit-for-bit. A run of consecutive spikes that agree
    with each other (a level shift, not an outlier; see :class:`SpikeRule`) re-baselines the
    level and counts in ``spike_rebaselines``: after ``rebaseline_after`` steps when it sits
    at most ``rebaseline_ratio`` above the level (a permanent 2× shift costs 6 skipped steps
    instead of a stall), after ``rebaseline_max_after`` steps when it sits at most
    ``rebaseline_max_ratio`` above, so a shorter, higher garbage window (30 steps at 3.4×) is
    skipped whole. A larger jump, or a flagged step repeating on a deterministic objective
    that does not agree, keeps ``spike_streak`` growing for a controller (rollback with a
    data skip) to act on.

    Args:
      inner: the transformation to guard, e.g. a whole optimizer.
      z_threshold: skip when a watched value is more than this many standard
        deviations above its mean; > 0.
      window: accepted residuals the median and tail scale are taken over; an int >= 8.
      warmup_steps: accepted steps during which values are only gathered; an int >= 2.
      watch: a non-empty tuple of distinct names from ``("loss", "grad_norm")``. With
        ``"loss"`` watched, ``update`` must be given the objective (a scalar).
      rebaseline_after: consecutive agreeing spikes that re-baseline the level when they
        sit at most ``rebaseline_ratio`` above it; an int >= 2, or None to never re-baseline.
      rebaseline_max_ratio: the largest jump a re-baseline ever absorbs, as a ratio to the
        level; > 1.
      rebaseline_ratio: the largest jump absorbed after ``rebaseline_after`` steps (at most
        ``rebaseline_max_ratio`` is used); > 1.
      rebaseline_max_after: the run length after which jumps up to
        ``rebaseline_max_ratio`` are absorbed; an int >= ``rebaseline_after``.
      check_update: also skip when the inner update is non-finite (see
        :func:`skip_step`).
      axis_name: the ``shard_map``/``pmap`` axes the gradients are sharded over.

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose ``update`` is
      ``update(updates, state, params=None, *, value=None, **extra_args)``
      (the objective and ``extra_args`` are forwarded to ``inner``) and whose state is
      a :class:`SkipSpikesState`.

    Raises:
      ValueError: at construction for an invalid hyperparameter; at trace time when
        ``"loss"`` is watched and no objective is given, or it is not a scalar.
      TypeError: at trace time for a ``loss=`` keyword (the objective is ``value=``).

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards.skips import skip_spikes
      >>> opt = skip_spikes(optax.sgd(0.1), warmup_steps=4, watch=("loss",))
      >>> params = jnp.zeros(2)
      >>> state = opt.init(params)
      >>> step = jax.jit(opt.update)
      >>> for loss in [1.0, 1.1, 0.9, 1.0, 50.0, 1.05]:
      ...     updates, state = step(jnp.ones(2), state, params, value=loss)
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

      Rousseeuw and Croux, `Alternatives to the Median Absolute Deviation
      <https://doi.org/10.1080/01621459.1993.10476408>`_, 1993
    """
    rule = SpikeRule(
        z_threshold=z_threshold,
        window=window,
        warmup_steps=warmup_steps,
        watch=watch,
        rebaseline_after=rebaseline_after,
        rebaseline_max_ratio=rebaseline_max_ratio,
        rebaseline_ratio=rebaseline_ratio,
        rebaseline_max_after=rebaseline_max_after,
    )
    # The gradient norm is always checked; the objective only when watched, so that a
    # grad-norm-only guard works on steps whose loss is not (yet) meaningful.
    return skip_step(
        inner,
        nonfinite=("grad_norm",),
        spikes=rule,
        check_update=check_update,
        axis_name=axis_name,
    )


def _found(opt_state: optax.OptState, names: tuple[str, ...]) -> list[jax.Array]:
    return [
        jnp.asarray(value)
        for name in names
        for _, value in optax.tree.get_all_with_path(opt_state, name)
    ]


def any_skipped(opt_state: optax.OptState) -> jax.Array:
    """Whether any guard in an optimizer state skipped its last step.

    ORs every ``nonfinite_skipped`` (:func:`skip_nonfinite`), ``spike_skipped``
    (:func:`skip_spikes`), ``micro_batch_skipped`` (a micro-batch
    :func:`skip_nonfinite_micro_batch` dropped) and ``should_skip`` (one that optax's
    ``skip_not_finite`` or ``skip_large_updates`` dropped) field found anywhere in
    ``opt_state`` with
    :func:`optax.tree.get_all_with_path`, so it looks through ``optax.chain``,
    ``optax.inject_hyperparams``, ``optax.MultiSteps`` (where the flags describe the
    last emitted update) and nested guards. Runs under ``jax.jit``.

    Args:
      opt_state: any optimizer state.

    Returns:
      A bool scalar ``jax.Array``; False when the state holds no guard.

    Raises:
      ValueError: if a guard in ``opt_state`` sits inside an ``optax.MultiSteps`` that keeps
        non-finite micro-batches (its flags would say "skipped" at every later step; see
        :func:`~stabljax.optim.guards.multisteps.check_multisteps_placement`).

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards.skips import any_skipped, skip_nonfinite
      >>> opt = optax.chain(optax.clip_by_global_norm(1.0), skip_nonfinite(optax.adam(1e-3)))
      >>> state = opt.init(jnp.zeros(2))
      >>> _, state = opt.update(jnp.array([1.0, jnp.inf]), state)
      >>> print(bool(any_skipped(state)), bool(any_skipped(optax.adam(1e-3).init(jnp.zeros(2)))))
      True False
    """
    check_multisteps_placement(opt_state)
    names = ("nonfinite_skipped", "spike_skipped", MICRO_BATCH_SKIPPED, "should_skip")
    flags = [jnp.any(v) for v in _found(opt_state, names)]
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
      >>> from stabljax.optim.guards.skips import skip_nonfinite, skip_streak
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


def spike_rebaselines(opt_state: optax.OptState) -> jax.Array:
    """How many level shifts the :func:`skip_spikes` guards in a state have absorbed.

    The sum of every ``spike_rebaselines`` field found anywhere in ``opt_state`` (see
    :func:`any_skipped`): cumulative, it rises by one on the step whose run of agreeing
    spikes re-baselined a guard (see :class:`SpikeRule`). The train step reports it as
    ``metrics["spike_rebaselines"]``.

    Args:
      opt_state: any optimizer state.

    Returns:
      An int32 scalar ``jax.Array``; 0 when the state holds no spike guard.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.guards.skips import skip_spikes, spike_rebaselines
      >>> opt = skip_spikes(optax.sgd(0.1), warmup_steps=3, watch=("loss",), rebaseline_after=2)
      >>> state = opt.init(jnp.zeros(2))
      >>> for loss in [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]:
      ...     _, state = opt.update(jnp.ones(2), state, value=loss)
      >>> print(int(spike_rebaselines(state)), bool(state.spike_skipped))
      1 False
    """
    counts = [jnp.sum(v).astype(jnp.int32) for v in _found(opt_state, ("spike_rebaselines",))]
    return functools.reduce(jnp.add, counts, jnp.zeros([], jnp.int32))
