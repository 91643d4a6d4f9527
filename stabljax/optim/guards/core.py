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
``skip_spikes`` live in :mod:`stabljax.optim.guards.skips`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from stabljax.base import (
    AxisName,
    all_finite,
    global_norm_f32,
    is_nonneg_int,
    validate,
    with_extra_args,
)
from stabljax.optim.guards.multisteps import check_multisteps_placement, missing_field

# The values a guard can test (skip_step's `nonfinite`, SpikeRule's `watch`).
WATCHABLE = ("loss", "grad_norm")
# The level is the median of this many last accepted values: short, so it follows a trend.
_LEVEL_WINDOW = 16
# The tail scale averages the largest 1/_TAIL_FRACTION of the residuals (at least one).
_TAIL_FRACTION = 32
# Floor of the tail scale in log units (1 %): a constant signal has no spread, and without a
# floor any value one ulp above it would be an infinite z. At z_threshold 7 a rise of less
# than 7 % is never a spike, and a warmup resting on a few residuals is not hair-triggered.
_MIN_SCALE = 1e-2


@dataclasses.dataclass(frozen=True)
class SpikeRule:
    r"""When :func:`skip_step` calls a value a spike: a robust test in log space on a window.

    Each watched value (``"loss"``, the ``value`` extra argument, and
    ``"grad_norm"``, the float32 global norm of the incoming gradients) is tested as
    :math:`y = \log x`, so the rule is scale-free: a 2× spike is the same excess at a loss of
    8 and at 0.08. With the last accepted values of :math:`y` in two ring buffers on device:

    * the *level* :math:`\ell` is the median of the last :math:`\min(n, 16)` accepted
      :math:`y` (a short window, so it follows a falling loss);
    * the *residual* of an accepted value is :math:`r = y - \ell` with the level just before
      it; the last ``window`` residuals are kept. A falling trend makes every residual a
      little negative (the level lags), and that bias is in their median :math:`m_r` too, so
      the test is detrended without a fitted slope (which would overshoot at a learning-rate
      drop);
    * the *tail scale* :math:`s = \max(t - m_r,\ 0.01)`, where :math:`t` is the mean of the
      largest :math:`\max(1, \lfloor n_r/32 \rfloor)` of the :math:`n_r` residuals (the top 3 %).

    Then :math:`z = (e^{r - m_r} - 1)/(e^{s} - 1)`: how many times farther above the expected
    level a value is than the window's top 3 % are (a ratio of relative excesses, so it grows
    linearly with a huge spike, where :math:`(r - m_r)/s` would grow only as its log and a
    noisy window could let a 10^5× spike through). Once :math:`n \ge` ``warmup_steps``, a
    step with any :math:`z >` ``z_threshold`` is a spike (one-sided). The tail scale is what
    lets one threshold serve both kinds of noise: on 3 % Gaussian noise the threshold is
    about 1.6× the level, so a 2× spike is caught; on heavy-tailed noise (Student-t, 3
    degrees of freedom, 5 %) the window's largest values are far out too, the threshold is
    about 3× and healthy steps are not skipped (``experiments/bench/guard_streams.py``;
    figures in BUILD.md). A median and a top-3 % mean are not moved by one outlier, and a
    value is forgotten after ``window`` accepted steps, so an outlier (even one accepted
    during warmup) cannot keep the threshold high for long.

    Values that are skipped, non-finite or :math:`\le 0` never enter the windows; a
    non-finite watched value is always a skip. A value :math:`\le 0` has no logarithm: it is
    never a spike (use ``watch=("grad_norm",)`` for an objective that is not positive).

    **Level shifts, and garbage windows.** Skipped values do not move the statistics, so a
    permanent jump of the loss would be skipped forever. A run of consecutive steps skipped as
    spikes (finite values, no other reason) re-baselines the level when its last
    :math:`K =` ``rebaseline_after`` values *agree* — for every watched value they span at most
    :math:`z_{thr}\,s` (the width the spike test accepts around the level: a new level with the
    old noise) — and their median sits at most a *ratio limit* above the old level that grows
    with the run's length: ``rebaseline_ratio`` once the run is :math:`K` steps long,
    ``rebaseline_max_ratio`` once it is ``rebaseline_max_after`` steps long. The level window
    is then refilled with those :math:`K` values, ``spike_rebaselines`` counts one, and the
    following steps are tested against the new level; the run's steps themselves stay
    skipped. So a small shift (2×) costs :math:`K` skipped steps, a large one (3×) costs
    ``rebaseline_max_after`` (or, under the rollback controller, ends as a skip streak it acts
    on), and a larger jump (a 5× or 10× burst, a divergence) is never absorbed. The
    trade-off: a burst of bad batches is told from a new level only by its height and its
    length. One within ``rebaseline_ratio`` of the level (a 2× garbage window) is taken as a
    new level after :math:`K` steps and its remaining steps are applied; one above it (the 30
    steps at 3.4× recorded from a real run) is skipped whole unless it lasts
    ``rebaseline_max_after`` steps (``experiments/bench/guard_streams.py``; the table is in
    docs/guides/guards.md).

    Attributes:
      z_threshold: > 0.
      window: accepted residuals the median and tail scale are taken over; an int >= 8.
      warmup_steps: accepted steps during which values are only gathered; an int >= 2.
      watch: a non-empty tuple of distinct names from ``("loss", "grad_norm")``.
      rebaseline_after: :math:`K`, an int >= 2, or None to never re-baseline.
      rebaseline_max_ratio: the largest jump ever absorbed, as a ratio to the level; > 1.
      rebaseline_ratio: the largest jump absorbed after :math:`K` steps (at most
        ``rebaseline_max_ratio`` is used); > 1.
      rebaseline_max_after: the run length after which jumps up to ``rebaseline_max_ratio``
        are absorbed; an int >= ``rebaseline_after``.
    """

    z_threshold: float = 9.0
    window: int = 128
    warmup_steps: int = 32
    watch: tuple[str, ...] = ("loss", "grad_norm")
    rebaseline_after: int | None = 6
    rebaseline_max_ratio: float = 4.0
    rebaseline_ratio: float = 2.5
    rebaseline_max_after: int = 64

    def __post_init__(self):
        for name in ("window", "rebaseline_after"):
            if isinstance(getattr(self, name), jax.core.Tracer):
                raise ValueError(
                    f"skip_spikes: `{name}` sets the shape of the state and cannot be traced; "
                    f"with optax.inject_hyperparams pass static_args=('watch', 'window', "
                    "'rebaseline_after')."
                )
        validate("skip_spikes", "z_threshold", self.z_threshold, lambda v: v > 0, "> 0")
        validate("skip_spikes", "window", self.window, _int_at_least(8), "an int >= 8")
        validate(
            "skip_spikes",
            "warmup_steps",
            self.warmup_steps,
            _int_at_least(2),
            "an int >= 2 (the tail scale needs two residuals)",
        )
        if self.rebaseline_after is not None:
            validate(
                "skip_spikes",
                "rebaseline_after",
                self.rebaseline_after,
                _int_at_least(2),
                "an int >= 2, or None",
            )
        validate(
            "skip_spikes",
            "rebaseline_max_ratio",
            self.rebaseline_max_ratio,
            lambda v: v > 1,
            "> 1",
        )
        validate(
            "skip_spikes",
            "rebaseline_ratio",
            self.rebaseline_ratio,
            lambda v: v > 1,
            "> 1",
        )
        validate(
            "skip_spikes",
            "rebaseline_max_after",
            self.rebaseline_max_after,
            _int_at_least(self.rebaseline_after or 2),
            f"an int >= rebaseline_after ({self.rebaseline_after or 2})",
        )
        watch = self.watch
        if isinstance(watch, str) or not isinstance(watch, Sequence):
            raise ValueError(f"skip_spikes: `watch` must be a tuple of names; got {watch!r}.")
        watch = tuple(watch)
        if not watch or any(w not in WATCHABLE for w in watch) or len(set(watch)) != len(watch):
            raise ValueError(
                f"skip_spikes: `watch` must be a non-empty tuple of distinct names from "
                f"{WATCHABLE}; got {watch!r}."
            )
        object.__setattr__(self, "watch", watch)


class SkipNonfiniteState(NamedTuple):
    """State of :func:`skip_nonfinite` (and of :func:`skip_step` without a spike rule)."""

    nonfinite_inner_state: optax.OptState
    nonfinite_skipped: jax.Array  # shape=(), bool: this step was skipped
    nonfinite_skips: jax.Array  # shape=(), int32: skipped steps in total
    nonfinite_streak: jax.Array  # shape=(), int32: consecutive skipped steps, 0 after a good one

    __getattr__ = missing_field  # opt_state.gradient_step: "use optax.tree.get"


class SkipSpikesState(NamedTuple):
    """State of :func:`skip_spikes` (and of :func:`skip_step` with a spike rule).

    Vectors are indexed like the rule's ``watch``.
    """

    spike_inner_state: optax.OptState
    spike_skipped: jax.Array  # shape=(), bool: this step was skipped (spike or non-finite)
    spike_skips: jax.Array  # shape=(), int32: skipped steps in total
    spike_streak: jax.Array  # shape=(), int32: consecutive skipped steps, 0 after a good one
    spike_accepted_steps: jax.Array  # shape=(), int32: accepted steps, the n of the statistics
    spike_levels: jax.Array  # shape=(len(watch), min(16, window)), float32: last log values
    spike_residuals: jax.Array  # shape=(len(watch), window), float32: last residuals
    spike_run: jax.Array  # shape=(len(watch), rebaseline_after), float32: skipped log values
    spike_run_length: jax.Array  # shape=(), int32: consecutive spike skips of finite values
    spike_rebaselines: jax.Array  # shape=(), int32: level shifts absorbed in total
    spike_zscore: jax.Array  # shape=(len(watch),), float32: z of this step's values

    __getattr__ = missing_field


def _scalar_f32(owner: str, objective: Any) -> jax.Array:
    x = jnp.asarray(objective)
    if x.size != 1:
        raise ValueError(
            f"{owner}: `value` must be a scalar; got shape {x.shape}. Pass the mean loss of "
            "the step as value=."
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
        "spike_levels": jnp.zeros([k, _level_size(rule)], jnp.float32),
        "spike_residuals": jnp.zeros([k, rule.window], jnp.float32),
        "spike_run": jnp.zeros([k, rule.rebaseline_after or 1], jnp.float32),
        "spike_run_length": jnp.zeros([], jnp.int32),
        "spike_rebaselines": jnp.zeros([], jnp.int32),
        "spike_zscore": jnp.zeros([k], jnp.float32),
    }


def _level_size(rule: SpikeRule) -> int:
    return min(_LEVEL_WINDOW, rule.window)


def _int_at_least(low: int):
    return lambda v: is_nonneg_int(v) and int(v) >= low


def _ranked(ring: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x, rank)``: each row's first ``count`` slots ranked 0.. in order (ties by slot),
    the other slots +inf and ranked after them.

    Ranks by pairwise comparison (W² scalar compares, fused into one reduction) instead of
    ``jnp.sort``: XLA:TPU gives a sort its own temporary buffers, these stay in registers.
    """
    i = jnp.arange(ring.shape[-1])
    x = jnp.where(i < count, ring, jnp.inf)
    a, b = x[..., :, None], x[..., None, :]
    before = (b < a) | ((b == a) & (i[None, :] < i[:, None]))
    return x, jnp.sum(before, axis=-1, dtype=jnp.int32)


def _at_rank(x: jax.Array, rank: jax.Array, r: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(rank == r, x, 0.0), axis=-1)


def _median(ring: jax.Array, count: jax.Array) -> jax.Array:
    """The median of the first ``count`` slots of each row (the mean of the middle two)."""
    x, rank = _ranked(ring, count)
    return 0.5 * (_at_rank(x, rank, (count - 1) // 2) + _at_rank(x, rank, count // 2))


def _window_stats(rule: SpikeRule, state: SkipSpikesState):
    """(level, median residual, tail scale) per watched value, from the two windows."""
    n = state.spike_accepted_steps
    n_level = jnp.clip(n, 1, _level_size(rule))
    level = _median(state.spike_levels, n_level)
    n_res = jnp.clip(n - 1, 1, rule.window)
    res, rank = _ranked(state.spike_residuals, n_res)
    med = 0.5 * (_at_rank(res, rank, (n_res - 1) // 2) + _at_rank(res, rank, n_res // 2))
    top = jnp.maximum(n_res // _TAIL_FRACTION, 1)
    in_tail = (rank >= n_res - top) & (rank < n_res)
    tail = jnp.sum(jnp.where(in_tail, res, 0.0), axis=-1) / top.astype(jnp.float32)
    return level, med, jnp.maximum(tail - med, _MIN_SCALE)


def _put(ring: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``ring`` with column ``slot`` set to ``value``, by selection (no dynamic update slice,
    which on XLA:TPU cost a temporary buffer next to the gradient-norm reduction)."""
    return jnp.where(jnp.arange(ring.shape[-1]) == slot, value[:, None], ring)


def _log_positive(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log x where x > 0 and finite else 0, whether it was)."""
    ok = jnp.isfinite(x) & (x > 0)
    return jnp.log(jnp.where(ok, x, 1.0)), ok


def _spike_decision(rule: SpikeRule, state: SkipSpikesState, x: jax.Array):
    """(spike, z, y, ok, level, scale) for the watched values ``x`` against ``state``."""
    y, ok = _log_positive(x)
    level, med, scale = _window_stats(rule, state)
    armed = state.spike_accepted_steps >= rule.warmup_steps
    z = jnp.where(armed & ok, jnp.expm1(y - level - med) / jnp.expm1(scale), 0.0)
    return jnp.any(z > rule.z_threshold), z, y, ok, level, scale


def _spike_gather(rule, state, decision, skip: jax.Array, spike: jax.Array):
    """The statistics after this step: accepted values enter the windows; runs re-baseline."""
    _, z, y, ok, level, scale = decision
    n = state.spike_accepted_steps
    # A value <= 0 enters as the level (neutral): the rows stay aligned on one count n.
    y_in = jnp.where(ok, y, jnp.where(n > 0, level, 0.0))
    r_in = jnp.where(ok & (n > 0), y - level, 0.0)
    gather = jnp.logical_not(skip)
    levels = _put(state.spike_levels, n % _level_size(rule), y_in)
    residuals = _put(state.spike_residuals, (n - 1) % rule.window, r_in)
    out = {
        "spike_accepted_steps": jnp.where(gather, optax.safe_increment(n), n),
        "spike_levels": jnp.where(gather, levels, state.spike_levels),
        "spike_residuals": jnp.where(gather & (n > 0), residuals, state.spike_residuals),
        "spike_run": state.spike_run,
        "spike_run_length": jnp.zeros([], jnp.int32),
        "spike_rebaselines": state.spike_rebaselines,
        "spike_zscore": z,
    }
    k = rule.rebaseline_after
    if k is None:
        return out
    # Only a skip that is a spike of finite, positive values alone extends the run.
    extend = skip & spike & jnp.all(ok)
    length = state.spike_run_length
    run = _put(state.spike_run, length % k, y)
    length = jnp.where(extend, optax.safe_increment(length), 0)
    span = jnp.max(run, axis=-1) - jnp.min(run, axis=-1)
    # The ratio limit grows with persistence: a garbage window is usually short and high.
    jump = _median(run, jnp.asarray(k)) - level
    low = jump <= jnp.log(jnp.minimum(rule.rebaseline_ratio, rule.rebaseline_max_ratio))
    high = (length >= rule.rebaseline_max_after) & (jump <= jnp.log(rule.rebaseline_max_ratio))
    agree = (span <= rule.z_threshold * scale) & (low | high)
    rebase = (length >= k) & jnp.all(agree)
    tiled = run[:, jnp.arange(_level_size(rule)) % k]
    out.update(
        spike_levels=jnp.where(rebase, tiled, out["spike_levels"]),
        spike_run=jnp.where(extend, run, state.spike_run),
        spike_run_length=jnp.where(rebase, 0, length),
        spike_rebaselines=jnp.where(
            rebase, optax.safe_increment(state.spike_rebaselines), state.spike_rebaselines
        ),
    )
    return out


def _checked_args(
    nonfinite: bool | Sequence[str], spikes: SpikeRule | None, check_update: bool
) -> tuple[str, ...]:
    """``skip_step``'s ``nonfinite`` as a tuple of names; raises on a bad or empty setting."""
    if nonfinite is True or nonfinite is False:
        nonfinite = WATCHABLE if nonfinite else ()
    elif isinstance(nonfinite, str) or not isinstance(nonfinite, Sequence):
        raise ValueError(f"skip_step: `nonfinite` must be a bool or a tuple; got {nonfinite!r}.")
    nonfinite = tuple(nonfinite)
    if any(n not in WATCHABLE for n in nonfinite):
        raise ValueError(
            f"skip_step: `nonfinite` names must be from {WATCHABLE}; got {nonfinite!r}."
        )
    if spikes is not None and not isinstance(spikes, SpikeRule):
        raise TypeError(f"skip_step: `spikes` must be a SpikeRule or None; got {spikes!r}.")
    if not nonfinite and spikes is None and not check_update:
        raise ValueError(
            "skip_step: nothing to check; set nonfinite=True, a spike rule or check_update=True."
        )
    return nonfinite


def _watched(rule: SpikeRule, norm: jax.Array, ell: jax.Array | None) -> jax.Array:
    """The values ``rule`` watches, in its order; raises if it watches a loss not given."""
    xs = []
    for name in rule.watch:
        if name == "grad_norm":
            xs.append(norm)
        elif ell is None:
            raise ValueError(
                "skip_spikes watches 'loss' but update() got no objective: pass the "
                "step's loss as update(..., value=loss), or construct the guard with "
                "watch=('grad_norm',)."
            )
        else:
            xs.append(ell)
    return jnp.stack(xs)


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
    :math:`\ell` the objective (optax's ``value=``) and
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

    ``value`` and ``**extra_args`` are forwarded to ``inner``, so an optax transform that
    reads ``value=`` (:func:`optax.contrib.reduce_on_plateau`) and a nested guard both get
    it. A ``loss=`` keyword is a ``TypeError``: the objective has one name, optax's.

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
      >>> from stabljax.optim.guards.core import SpikeRule, skip_step
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
    nonfinite = _checked_args(nonfinite, spikes, check_update)
    _check_axis_name(owner, axis_name)
    inner = with_extra_args(inner)

    def init_fn(params: optax.Params) -> SkipNonfiniteState | SkipSpikesState:
        inner_state = inner.init(params)
        if "grad_norm" not in nonfinite:  # else it drops a NaN micro-batch before MultiSteps
            check_multisteps_placement(inner_state, owner)
        flags = (jnp.zeros([], jnp.bool_), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))
        if spikes is None:
            return SkipNonfiniteState(inner_state, *flags)
        return SkipSpikesState(inner_state, *flags, **_spike_init(spikes))

    def update_fn(
        updates: optax.Updates,
        state: SkipNonfiniteState | SkipSpikesState,
        params: optax.Params | None = None,
        *,
        value: jax.typing.ArrayLike | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipNonfiniteState | SkipSpikesState]:
        if "loss" in extra_args:
            raise TypeError(
                f"{owner}: update() got an unexpected keyword argument 'loss'; pass the "
                "objective as value= (optax's name for it)."
            )
        fwd = extra_args if value is None else {**extra_args, "value": value}
        ell = None if value is None else _scalar_f32(owner, value)
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
            x = _watched(spikes, norm, ell)
            decision = _spike_decision(spikes, state, x)
            spike = decision[0]
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
            kept, skip, skips, streak, **_spike_gather(spikes, state, decision, skip, spike)
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
