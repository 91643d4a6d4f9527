"""Adaptive gradient clipping: ZClip, AutoClip, SPAM-style and AdaGC-style clipping.

Every transform here is an :class:`optax.GradientTransformation` that rescales
the incoming updates and keeps its statistics in float32, whatever the leaf
dtypes. Each makes one global decision per step (sharded leaves are reduced by
XLA), and a non-finite gradient never enters a statistic: such a step passes
through unchanged and leaves the state's statistics untouched, so that a guard
(``skip_nonfinite``) further out can skip it. For the unitwise AGC of Brock et
al. use :func:`optax.adaptive_grad_clip`.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stabljax.base import (
    all_finite,
    global_norm_f32,
    is_nonneg_int,
    validate,
)

__all__ = [
    "ClipByAdagcState",
    "ClipByPercentileState",
    "ClipByZScoreState",
    "ClipSpikesPerCoordinateState",
    "clip_by_adagc",
    "clip_by_percentile",
    "clip_by_zscore",
    "clip_spikes_per_coordinate",
]

_F32 = jnp.float32
# ZClip's eps in z = (g - mu) / (sigma + eps), as in the reference code.
_ZCLIP_EPS = 1e-6


# --------------------------------------------------------------------------- helpers


def _is_integral(a: np.ndarray) -> bool:
    return bool(a.ndim == 0 and a >= 0 and a == np.floor(a))


def _rescale(tree, scale: jax.Array, mask: Any = None):
    """Multiplies every leaf (every leaf ``mask`` selects) by ``scale``, keeping its dtype."""
    if mask is None:
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), tree)
    return jax.tree.map(lambda t, m: t * scale.astype(t.dtype) if m else t, tree, mask)


def _check_mask(owner: str, mask: Any) -> None:
    if mask is not None and not callable(mask):
        bad = [m for m in jax.tree.leaves(mask) if not isinstance(m, bool | np.bool_)]
        if bad or not jax.tree.leaves(mask):
            raise ValueError(
                f"{owner}: `mask` must be None, a pytree of Python bools like the params, or "
                f"a callable params -> such a pytree; got {mask!r}."
            )


def _resolve_mask(mask: Any, updates: Any) -> Any:
    """The bool tree of ``mask`` for ``updates`` (``None``: every leaf)."""
    if mask is None:
        return None
    tree = mask(updates) if callable(mask) else mask
    return jax.tree.map(lambda _, m: bool(m), updates, tree)


def _selected_norm(updates: Any, mask: Any) -> jax.Array:
    """The float32 global norm of the leaves ``mask`` selects (all for ``None``)."""
    if mask is None:
        return global_norm_f32(updates)
    return global_norm_f32(jax.tree.map(lambda t, m: t if m else None, updates, mask))


# --------------------------------------------------------------------------- ZClip


class ClipByZScoreState(NamedTuple):
    """State of :func:`clip_by_zscore`.

    During warmup ``zclip_mean`` and ``zclip_var`` hold the running mean and
    population variance (Welford) of the norms seen so far; once
    ``zclip_count`` reaches the warmup length they are ZClip's EMA statistics.
    """

    zclip_count: jax.Array  # shape=(), int32: finite norms that entered the statistics
    zclip_mean: jax.Array  # shape=(), float32: mu
    zclip_var: jax.Array  # shape=(), float32: sigma^2
    zclip_norm: jax.Array  # shape=(), float32: this step's pre-clip global norm
    zclip_threshold: jax.Array  # shape=(), float32: norm rescaled to this step, +inf if none
    zclip_clipped: jax.Array  # shape=(), bool: the z-score rule fired this step


def clip_by_zscore(
    z_threshold: float = 2.5,
    ema_decay: float = 0.97,
    warmup_steps: int = 25,
    max_norm: float | None = None,
    *,
    mask: Any = None,
) -> optax.GradientTransformation:
    r"""Clips the global gradient norm when its z-score is an outlier (ZClip).

    ZClip's adaptive mode. With :math:`g` the global L2 norm (float32) and
    :math:`\alpha` = ``ema_decay``: during the first :math:`W` = ``warmup_steps``
    finite norms nothing is clipped (except by ``max_norm``); when the
    :math:`W`-th arrives, :math:`\mu` and :math:`\sigma^2` are the mean and the
    population variance of those :math:`W` norms. From the next step on

    .. math::
        z = \frac{g - \mu}{\sigma + 10^{-6}}, \qquad
        g_c = \begin{cases}
            \mu + \dfrac{z_{thr}\,\sigma}{z / z_{thr}} & z > z_{thr} \\
            g & \text{otherwise,}
        \end{cases}

    the gradients are rescaled to norm :math:`\min(g_c, \text{max\_norm})`,
    and then, in this order,

    .. math::
        \mu \leftarrow \alpha\mu + (1-\alpha)\,g_c, \qquad
        \sigma^2 \leftarrow \alpha\sigma^2 + (1-\alpha)(g_c - \mu)^2

    with the new :math:`\mu`. Larger outliers are clipped harder. The absolute
    cap does not enter the statistics. ``warmup_steps=0`` behaves as 1.

    A non-finite norm (NaN or Inf in any leaf) passes the gradients through
    unchanged and neither counts toward warmup nor updates the statistics
    (the reference code would let it poison them); pair this with a guard such
    as ``skip_nonfinite`` to skip that step. The rescaling is
    ``t * (target / g)`` in each leaf's dtype, so a bf16 leaf's post-clip norm
    meets the target to bf16 rounding. Unlike the reference code (``target /
    (g + 1e-6)``) the factor is exact. All four hyperparameters may be injected
    with :func:`optax.inject_hyperparams`.

    Args:
      z_threshold: z-score above which a norm is clipped, > 0.
      ema_decay: :math:`\alpha` of the mean and variance EMAs, in (0, 1).
      warmup_steps: number of norms whose plain mean and variance start the
        EMAs, an integer >= 0 (under :func:`optax.inject_hyperparams`, an integral
        array of any dtype).
      max_norm: optional absolute cap on the global norm, applied at every
        step (warmup included), > 0; ``None`` for no cap.
      mask: which leaves the rule sees and rescales: ``None`` for all, a pytree of
        Python bools with the structure of the params, or a callable
        ``params -> such a pytree`` (as :func:`optax.masked`). The global norm is
        taken over the selected leaves only and the others pass unchanged: leave
        out the orthogonalized groups of Muon (:func:`optax.contrib.muon`), whose
        update is scale-invariant (docs/guides/guards.md, "Muon, and clipping with it").

    Returns:
      A :class:`optax.GradientTransformation` whose state is a
      :class:`ClipByZScoreState`; ``zclip_norm`` is the pre-clip norm and
      ``zclip_threshold`` the norm the gradients were rescaled to (``+inf`` when
      they were left alone), so the post-clip norm is
      ``min(zclip_norm, zclip_threshold)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.clipping import clip_by_zscore
      >>> clip = clip_by_zscore(warmup_steps=3)
      >>> state = clip.init({"w": jnp.zeros(2)})
      >>> for norm in [1.0, 1.2, 0.8, 1.1, 10.0]:
      ...     g, state = clip.update({"w": jnp.array([norm, 0.0])}, state)
      >>> print(f"{float(state.zclip_norm):.1f} -> {float(optax.tree.norm(g)):.3f}")
      10.0 -> 1.021
      >>> print(bool(state.zclip_clipped), f"{float(state.zclip_threshold):.3f}")
      True 1.021

    References:
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025
    """
    owner = "clip_by_zscore"
    validate(owner, "z_threshold", z_threshold, lambda v: v > 0, "> 0")
    validate(
        owner, "ema_decay", ema_decay, lambda v: (0 < v) & (v < 1), "in the open interval (0, 1)"
    )
    # optax.inject_hyperparams hands numbers in as arrays of its hyperparam_dtype, which may
    # be floating (4.0); a value given directly must be an integer, as skip_spikes wants.
    integer = _is_integral if isinstance(warmup_steps, jax.Array) else is_nonneg_int
    validate(owner, "warmup_steps", warmup_steps, integer, "a non-negative integer")
    if max_norm is not None:
        validate(owner, "max_norm", max_norm, lambda v: v > 0, "> 0 or None")
    _check_mask(owner, mask)

    def init_fn(params):
        del params
        return ClipByZScoreState(
            zclip_count=jnp.zeros([], jnp.int32),
            zclip_mean=jnp.zeros([], _F32),
            zclip_var=jnp.zeros([], _F32),
            zclip_norm=jnp.zeros([], _F32),
            zclip_threshold=jnp.full([], jnp.inf, _F32),
            zclip_clipped=jnp.zeros([], bool),
        )

    def update_fn(updates, state, params=None):
        del params
        z_thr = jnp.asarray(z_threshold, _F32)
        alpha = jnp.asarray(ema_decay, _F32)
        # 1 - decay before the cast: for a Python float it is exact to float32 rounding.
        one_minus_alpha = jnp.asarray(1 - ema_decay, _F32)
        warmup = jnp.maximum(jnp.asarray(warmup_steps, jnp.int32), 1)
        count, mean, var = state.zclip_count, state.zclip_mean, state.zclip_var

        selected = _resolve_mask(mask, updates)
        g = _selected_norm(updates, selected)
        finite = jnp.isfinite(g)
        in_warmup = count < warmup

        # Warmup: Welford's running mean / population variance (stable in float32).
        k = (count + 1).astype(_F32)
        delta = g - mean
        warm_mean = mean + delta / k
        warm_var = var + (delta * (g - warm_mean) - var) / k

        # After warmup: adaptive z-score clipping, then the EMAs of the clipped norm.
        std = jnp.sqrt(var)
        z = (g - mean) / (std + _ZCLIP_EPS)
        spike = jnp.logical_and(~in_warmup, z > z_thr)
        target = mean + z_thr * std / (z / z_thr)
        g_c = jnp.where(spike, target, g)
        ema_mean = alpha * mean + one_minus_alpha * g_c
        ema_var = alpha * var + one_minus_alpha * jnp.square(g_c - ema_mean)

        bound = jnp.where(spike, target, jnp.inf)
        if max_norm is not None:
            bound = jnp.minimum(bound, jnp.asarray(max_norm, _F32))
        rescale = jnp.logical_and(finite, g > bound)
        # Where not rescaling, the denominator is replaced so no inf/NaN is formed.
        scale = jnp.where(rescale, bound / jnp.where(rescale, g, 1.0), 1.0)

        new_mean = jnp.where(in_warmup, warm_mean, ema_mean)
        new_var = jnp.where(in_warmup, warm_var, ema_var)
        new_state = ClipByZScoreState(
            zclip_count=jnp.where(finite, optax.safe_increment(count), count),
            zclip_mean=jnp.where(finite, new_mean, mean),
            zclip_var=jnp.where(finite, new_var, var),
            zclip_norm=g,
            zclip_threshold=jnp.where(rescale, bound, jnp.inf),
            zclip_clipped=jnp.logical_and(finite, spike),
        )
        return _rescale(updates, scale, selected), new_state

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- AutoClip


class ClipByPercentileState(NamedTuple):
    """State of :func:`clip_by_percentile`: a ring buffer of the last finite norms."""

    pclip_history: jax.Array  # shape=(history,), float32: ring buffer of finite norms
    pclip_count: jax.Array  # shape=(), int32: finite norms seen (slot = count % history)
    pclip_norm: jax.Array  # shape=(), float32: this step's pre-clip global norm
    pclip_threshold: jax.Array  # shape=(), float32: this step's percentile, +inf if none


def _percentile_linear(buf: jax.Array, n: jax.Array, q: jax.Array) -> jax.Array:
    """``numpy.percentile(buf[:n], q, method='linear')`` for traced ``n``; +inf if n == 0."""
    size = buf.shape[0]
    s = jnp.sort(jnp.where(jnp.arange(size) < n, buf, jnp.inf))
    last = jnp.maximum(n, 1) - 1
    pos = q / 100.0 * last.astype(_F32)
    lo = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, last)
    hi = jnp.minimum(lo + 1, last)
    t = pos - lo.astype(_F32)
    a, b = s[lo], s[hi]
    diff = b - a
    # numpy's _lerp: interpolate from the nearer end (exact at t = 0 and t = 1).
    value = jnp.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
    return jnp.where(n > 0, value, jnp.inf)


def clip_by_percentile(
    percentile: float = 10.0, history: int = 1000, *, mask: Any = None
) -> optax.GradientTransformation:
    r"""Clips the global gradient norm to a percentile of the recent norms (AutoClip).

    With :math:`g_t` the global L2 norm (float32) and :math:`H_t` the last
    ``history`` finite norms, the current one included,

    .. math::
        \eta_t = \operatorname{percentile}_p(H_t), \qquad
        u \leftarrow u \cdot \min\!\left(1, \frac{\eta_t}{g_t}\right),

    where the percentile interpolates linearly between order statistics, as
    ``numpy.percentile(H_t, p, method="linear")`` does. Until the buffer is
    full only the filled slots count. A non-finite norm never enters the
    history; that step's gradients pass through unchanged and its threshold is
    the percentile of the history without it (``+inf`` if empty).

    Args:
      percentile: :math:`p`, in (0, 100]. The paper recommends 10; 100 never
        clips.
      history: size of the ring buffer of past norms, >= 1. It fixes an array
        shape, so it must be a static Python int (with
        :func:`optax.inject_hyperparams` list it in ``static_args``).
      mask: which leaves the rule sees and rescales, as in :func:`clip_by_zscore`.

    Returns:
      A :class:`optax.GradientTransformation` whose state is a
      :class:`ClipByPercentileState`; ``pclip_norm`` is the pre-clip norm and
      ``pclip_threshold`` the percentile, so the post-clip norm is
      ``min(pclip_norm, pclip_threshold)``.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.clipping import clip_by_percentile
      >>> clip = clip_by_percentile(percentile=50.0, history=4)
      >>> state = clip.init({"w": jnp.zeros(1)})
      >>> for norm in [1.0, 3.0, 2.0, 9.0]:
      ...     g, state = clip.update({"w": jnp.array([norm])}, state)
      >>> print(float(state.pclip_norm), float(state.pclip_threshold), float(g["w"][0]))
      9.0 2.5 2.5

    References:
      Seetharaman et al., `AutoClip: Adaptive Gradient Clipping for Source
      Separation Networks <https://arxiv.org/abs/2007.14469>`_, 2020
    """
    validate(
        "clip_by_percentile",
        "percentile",
        percentile,
        lambda v: (0 < v) & (v <= 100),
        "in the interval (0, 100]",
    )
    try:
        history = operator.index(history)
    except TypeError as e:
        raise TypeError(
            f"clip_by_percentile: `history` must be a static Python int; got {history!r}. "
            "With optax.inject_hyperparams pass static_args=('history',)."
        ) from e
    validate("clip_by_percentile", "history", history, lambda v: v >= 1, ">= 1")
    _check_mask("clip_by_percentile", mask)

    def init_fn(params):
        del params
        return ClipByPercentileState(
            pclip_history=jnp.zeros([history], _F32),
            pclip_count=jnp.zeros([], jnp.int32),
            pclip_norm=jnp.zeros([], _F32),
            pclip_threshold=jnp.full([], jnp.inf, _F32),
        )

    def update_fn(updates, state, params=None):
        del params
        q = jnp.asarray(percentile, _F32)
        selected = _resolve_mask(mask, updates)
        g = _selected_norm(updates, selected)
        finite = jnp.isfinite(g)
        count = state.pclip_count
        slot = count % history
        hist = jnp.where(finite, state.pclip_history.at[slot].set(g), state.pclip_history)
        count = jnp.where(finite, optax.safe_increment(count), count)
        threshold = _percentile_linear(hist, jnp.minimum(count, history), q)
        rescale = jnp.logical_and(finite, g > threshold)
        scale = jnp.where(rescale, threshold / jnp.where(rescale, g, 1.0), 1.0)
        new_state = ClipByPercentileState(
            pclip_history=hist, pclip_count=count, pclip_norm=g, pclip_threshold=threshold
        )
        return _rescale(updates, scale, selected), new_state

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- SPAM


class ClipSpikesPerCoordinateState(NamedTuple):
    """State of :func:`clip_spikes_per_coordinate`."""

    spam_nu: Any  # pytree like params, float32: EMA of the clipped squared gradient
    spam_clipped_coords: jax.Array  # shape=(), int32: coordinates clipped this step


def clip_spikes_per_coordinate(
    theta: float = 5000.0, b2: float = 0.999
) -> optax.GradientTransformation:
    r"""Clips gradient coordinates that spike above their running second moment (SPAM).

    SPAM's spike-aware clipping, as a transform in front of any optimizer. It
    keeps its own EMA :math:`v` of the (clipped) squared gradient, in float32:

    .. math::
        g_i \leftarrow \begin{cases}
            \operatorname{sign}(g_i)\sqrt{\theta\, v_{t-1,i}} &
                g_i^2 > \theta\, v_{t-1,i} \text{ and } v_{t-1,i} > 0 \\
            g_i & \text{otherwise,}
        \end{cases} \qquad
        v_t = b_2\, v_{t-1} + (1 - b_2)\, g^2.

    :math:`v` is not bias-corrected, as in the reference code (with the
    defaults, the first clip level is :math:`\sqrt{5}` times the first gradient).
    A coordinate with no history yet (:math:`v = 0`, e.g. the first step or an
    embedding row never used before) is left alone: clipping it to 0 would
    keep :math:`v` at 0 and freeze it for good. SPAM's periodic momentum reset
    belongs to the optimizer and is not part of this transform. A step with any
    non-finite gradient passes through unchanged and leaves :math:`v` as it was.

    Args:
      theta: spike threshold :math:`\theta` on :math:`g^2 / v`, > 0.
      b2: decay of the EMA :math:`v`, in [0, 1).

    Returns:
      A :class:`optax.GradientTransformation` whose state is a
      :class:`ClipSpikesPerCoordinateState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.optim.clipping import clip_spikes_per_coordinate
      >>> clip = clip_spikes_per_coordinate(theta=4.0, b2=0.5)
      >>> state = clip.init(jnp.zeros(2))
      >>> _, state = clip.update(jnp.array([1.0, 1.0]), state)  # v = [0.5, 0.5]
      >>> g, state = clip.update(jnp.array([-10.0, 1.0]), state)
      >>> print(g.tolist(), int(state.spam_clipped_coords))
      [-1.4142135381698608, 1.0] 1

    References:
      Huang et al., `SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
      Training <https://arxiv.org/abs/2501.06842>`_, 2025
    """
    validate("clip_spikes_per_coordinate", "theta", theta, lambda v: v > 0, "> 0")
    validate("clip_spikes_per_coordinate", "b2", b2, lambda v: (0 <= v) & (v < 1), "in [0, 1)")

    def init_fn(params):
        return ClipSpikesPerCoordinateState(
            spam_nu=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _F32), params),
            spam_clipped_coords=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state, params=None):
        del params
        th = jnp.asarray(theta, _F32)
        beta = jnp.asarray(b2, _F32)
        one_minus_beta = jnp.asarray(1 - b2, _F32)
        finite = all_finite(updates)

        def leaf(g, v):
            g32 = g.astype(_F32)
            limit_sq = th * v
            mask = jnp.logical_and(jnp.square(g32) > limit_sq, v > 0)
            clipped32 = jnp.where(mask, jnp.sign(g32) * jnp.sqrt(limit_sq), g32)
            # Unclipped coordinates are returned bit-exactly in their own dtype.
            out = jnp.where(mask, clipped32.astype(g.dtype), g)
            new_v = beta * v + one_minus_beta * jnp.square(out.astype(_F32))
            return out, new_v, jnp.sum(mask, dtype=jnp.int32)

        leaves, treedef = jax.tree.flatten(updates)
        res = [
            leaf(g, v) for g, v in zip(leaves, treedef.flatten_up_to(state.spam_nu), strict=True)
        ]
        clipped = treedef.unflatten([r[0] for r in res])
        nu = treedef.unflatten([r[1] for r in res])
        n_clipped = sum((r[2] for r in res), jnp.zeros([], jnp.int32))

        out = jax.tree.map(lambda c, g: jnp.where(finite, c, g), clipped, updates)
        new_state = ClipSpikesPerCoordinateState(
            spam_nu=jax.tree.map(lambda n, o: jnp.where(finite, n, o), nu, state.spam_nu),
            spam_clipped_coords=jnp.where(finite, n_clipped, 0).astype(jnp.int32),
        )
        return out, new_state

    return optax.GradientTransformation(init_fn, update_fn)


# --------------------------------------------------------------------------- AdaGC


class ClipByAdagcState(NamedTuple):
    """State of :func:`clip_by_adagc`."""

    adagc_gamma: Any  # pytree like params of shape=() float32: EMA of each clipped tensor norm
    adagc_clipped_tensors: jax.Array  # shape=(), int32: tensors clipped this step


def clip_by_adagc(lambda_rel: float = 1.05, beta: float = 0.98) -> optax.GradientTransformation:
    r"""Clips each tensor's gradient norm relative to its own running norm (AdaGC).

    Per tensor (leaf) :math:`i`, with :math:`\gamma_i` an EMA of its clipped
    norm (float32):

    .. math::
        h = \min\!\left(\frac{\lambda_{rel}\,\gamma_{t-1}}{\lVert g\rVert}, 1\right),
        \qquad \hat g = h\, g, \qquad
        \gamma_t = \beta\,\gamma_{t-1} + (1 - \beta)\,\lVert \hat g\rVert.

    :math:`\gamma` starts at the tensor's first norm (no clipping that step).
    A tensor whose :math:`\gamma` is still 0 (its gradients have been exactly 0
    so far) is treated the same way, as clipping against 0 would zero it for
    good. The paper's warmup with global-norm clipping is left to the user
    (chain :func:`optax.clip_by_global_norm`). A step with any non-finite
    gradient passes through unchanged and leaves :math:`\gamma` as it was.

    Args:
      lambda_rel: relative threshold :math:`\lambda_{rel}`, > 0.
      beta: decay :math:`\beta` of the norm EMA, in [0, 1).

    Returns:
      A :class:`optax.GradientTransformation` whose state is a
      :class:`ClipByAdagcState`.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.optim.clipping import clip_by_adagc
      >>> clip = clip_by_adagc(lambda_rel=1.05, beta=0.98)
      >>> state = clip.init({"w": jnp.zeros(2)})
      >>> _, state = clip.update({"w": jnp.array([3.0, 4.0])}, state)  # gamma = 5
      >>> g, state = clip.update({"w": jnp.array([30.0, 40.0])}, state)
      >>> print([round(x, 3) for x in g["w"].tolist()], round(float(state.adagc_gamma["w"]), 3))
      [3.15, 4.2] 5.005

    References:
      Wang et al., `AdaGC: Improving Training Stability for Large Language
      Model Pretraining <https://arxiv.org/abs/2502.11034>`_, 2025
    """
    validate("clip_by_adagc", "lambda_rel", lambda_rel, lambda v: v > 0, "> 0")
    validate("clip_by_adagc", "beta", beta, lambda v: (0 <= v) & (v < 1), "in [0, 1)")

    def init_fn(params):
        return ClipByAdagcState(
            adagc_gamma=jax.tree.map(lambda p: jnp.zeros([], _F32), params),
            adagc_clipped_tensors=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state, params=None):
        del params
        lam = jnp.asarray(lambda_rel, _F32)
        b = jnp.asarray(beta, _F32)
        one_minus_b = jnp.asarray(1 - beta, _F32)
        finite = all_finite(updates)

        def leaf(g, gamma):
            norm = jnp.sqrt(jnp.sum(jnp.square(g.astype(_F32))))
            fresh = gamma == 0
            limit = lam * gamma
            clip = jnp.logical_and(~fresh, norm > limit)
            h = jnp.where(clip, limit / jnp.where(clip, norm, 1.0), 1.0)
            new_gamma = jnp.where(fresh, norm, b * gamma + one_minus_b * jnp.minimum(norm, limit))
            return g * h.astype(g.dtype), new_gamma, clip.astype(jnp.int32)

        leaves, treedef = jax.tree.flatten(updates)
        res = [
            leaf(g, c)
            for g, c in zip(leaves, treedef.flatten_up_to(state.adagc_gamma), strict=True)
        ]
        clipped = treedef.unflatten([r[0] for r in res])
        gamma = treedef.unflatten([r[1] for r in res])
        n_clipped = sum((r[2] for r in res), jnp.zeros([], jnp.int32))

        out = jax.tree.map(lambda c, g: jnp.where(finite, c, g), clipped, updates)
        new_state = ClipByAdagcState(
            adagc_gamma=jax.tree.map(
                lambda n, o: jnp.where(finite, n, o), gamma, state.adagc_gamma
            ),
            adagc_clipped_tensors=jnp.where(finite, n_clipped, 0).astype(jnp.int32),
        )
        return out, new_state

    return optax.GradientTransformation(init_fn, update_fn)
