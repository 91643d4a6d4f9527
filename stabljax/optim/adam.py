"""Safe Adam and AdamW: Adam that never divides 0 by 0 (``eps = 0`` allowed).

The moments keep float32 (or wider) statistics whatever the leaf dtype (see
:mod:`stabljax.optim._moments`). Inputs are checked: hyperparameters when the
transform is built (a negative or NaN learning rate, a decay outside [0, 1), ...), and
gradients when it is traced (a gradient whose shape differs from its parameter's
raises instead of broadcasting into the moments). Adam-atan2 lives in
:mod:`stabljax.optim.atan2` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stabljax.optim._moments import (
    check_adam,
    check_learning_rate,
    check_nonnegative,
    scale_by_moments,
)
from stabljax.optim.atan2 import ScaleByAdamAtan2State, adamw_atan2, scale_by_adam_atan2

__all__ = [
    "ScaleByAdamAtan2State",
    "ScaleBySafeAdamState",
    "adamw_atan2",
    "ratio_bound",
    "safe_adam",
    "safe_adamw",
    "scale_by_adam_atan2",
    "scale_by_safe_adam",
]


class ScaleBySafeAdamState(NamedTuple):
    """State of :func:`scale_by_safe_adam`."""

    count: jax.Array  # shape=(), int32
    mu: optax.Updates  # like params, dtype mu_dtype or the param dtype
    nu: optax.Updates  # like params, float32 (float64 for float64 params)


def ratio_bound(b1: float, b2: float, t: int | None = None, *, nesterov: bool = False) -> float:
    r"""The largest :math:`|\hat m_t / \sqrt{\hat v_t}|` safe Adam can produce, any gradients.

    By Cauchy–Schwarz, with :math:`r = \beta_1^2 / \beta_2`,

    .. math::

      |m_t| \le (1-\beta_1) \sum_{j<t} \beta_1^j |g_{t-j}|
            \le (1-\beta_1) \Big(\sum_{j<t} r^j\Big)^{1/2}
                 \Big(\sum_{j<t} \beta_2^j g_{t-j}^2\Big)^{1/2}
            = (1-\beta_1) \sqrt{\tfrac{1 - r^t}{1 - r}} \sqrt{\tfrac{v_t}{1-\beta_2}},

    so, after the bias corrections,

    .. math::

      \Big|\frac{\hat m_t}{\sqrt{\hat v_t}}\Big| \le B_t =
      \frac{1-\beta_1}{1-\beta_1^t} \sqrt{\frac{1-\beta_2^t}{1-\beta_2}}
      \sqrt{\frac{1-r^t}{1-r}}
      \;\xrightarrow{t\to\infty}\; \frac{1-\beta_1}{\sqrt{(1-\beta_2)(1-r)}}
      \quad (r < 1).

    The bound is attained (equality in Cauchy–Schwarz) by gradients growing as
    :math:`|g_k| \propto (\beta_2/\beta_1)^k`. For :math:`r < 1` it is uniform in
    :math:`t`, so safe Adam at ``eps = 0`` is bounded whatever the gradients; for
    :math:`r \ge 1` (and :math:`\beta_1 > 0`) it grows without limit, which is why
    :func:`scale_by_safe_adam` rejects :math:`\beta_1^2 \ge \beta_2` at ``eps =
    eps_root = 0``. ``eps > 0`` only lowers the ratio. With ``nesterov=True``,
    :math:`\hat m_t = \beta_1 m_t/(1-\beta_1^{t+1}) + (1-\beta_1) g_t/(1-\beta_1^t)`
    and :math:`|g_t| \le \sqrt{v_t/(1-\beta_2)}` give the sum of the two terms' bounds
    at step :math:`t`, and :math:`\beta_1 B_\infty + 1/\sqrt{1-\beta_2}` over all steps
    (a valid bound, not attained). Every :math:`B_t \le B_\infty` (AM–GM).

    Args:
      b1: :math:`\beta_1`, in [0, 1).
      b2: :math:`\beta_2`, in [0, 1), with :math:`\beta_1^2 < \beta_2` if ``t`` is None.
      t: the step (from 1); None for the limit :math:`t \to \infty`.
      nesterov: the bound of the Nesterov (NAdam) update.

    Returns:
      :math:`B_t` (a float; ``inf`` for ``t=None`` when :math:`r \ge 1`).

    Example:
      >>> from stabljax.optim.adam import ratio_bound
      >>> ratio_bound(0.9, 0.999, t=1), round(ratio_bound(0.9, 0.999), 3)
      (1.0, 7.27)
      >>> round(ratio_bound(0.9, 0.95), 3), ratio_bound(0.99, 0.95)
      (1.165, inf)
    """
    r = 0.0 if b1 == 0 else b1 * b1 / b2
    if t is None:
        if r >= 1:
            return float("inf")
        # B_t <= B_inf for every t: B_t^2 / B_inf^2 = (1 - x)(1 - y) / (1 - sqrt(xy))^2 with
        # x = b2^t, y = r^t, and (1 - x)(1 - y) <= (1 - sqrt(xy))^2 is AM-GM.
        limit = (1.0 - b1) / np.sqrt((1.0 - b2) * (1.0 - r))
        if nesterov:  # each term's sup: b1 B_inf (m_t <= (1 - b1^t) B_inf), 1/sqrt(1 - b2)
            return float(b1 * limit + 1.0 / np.sqrt(1.0 - b2))
        return float(limit)
    s = float(t) if r == 1 else (1.0 - r**t) / (1.0 - r)
    g_bound = np.sqrt((1.0 - b2**t) / (1.0 - b2))  # |g_t| / sqrt(v_hat_t)
    m_bound = (1.0 - b1) * np.sqrt(s) * g_bound  # |m_t| / sqrt(v_hat_t)
    if nesterov:
        return float(b1 * m_bound / (1.0 - b1 ** (t + 1)) + (1.0 - b1) * g_bound / (1.0 - b1**t))
    return float(m_bound / (1.0 - b1**t))


# ----------------------------------------------------------------------------- safe Adam


def scale_by_safe_adam(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 0.0,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformation:
    r"""Rescales updates by Adam's moment ratio, with an update of exactly 0 where 0/0 would be.

    With :math:`g_t` the gradient and :math:`t` the step (from 1),

    .. math::

      \begin{align*}
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) g_t^2, \\
        \hat m_t &= m_t / (1 - \beta_1^t), \qquad \hat v_t = v_t / (1 - \beta_2^t), \\
        d_t &= \sqrt{\hat v_t + \bar\varepsilon} + \varepsilon, \qquad
        u_t = \begin{cases} \hat m_t / d_t & d_t \neq 0 \\ 0 & d_t = 0 \end{cases}
      \end{align*}

    and with ``nesterov=True``, :math:`\hat m_t = \beta_1 m_t / (1 - \beta_1^{t+1}) +
    (1 - \beta_1) g_t / (1 - \beta_1^t)` (Dozat 2016), exactly as
    :func:`optax.scale_by_adam`. The default ``eps`` is 0, as Molybog et al. (2023)
    advise: at scale, gradients of shallow layers shrink to the size of ``eps`` and a
    nonzero ``eps`` then distorts the update. The case :math:`d_t = 0` (a coordinate whose
    gradients have all been exactly 0, such as an unused embedding row) is selected to 0
    instead of :math:`0/0 = \mathrm{NaN}`. A NaN or Inf gradient, or a finite one whose
    square overflows float32 (:math:`|g| \gtrsim 1.8 \cdot 10^{19}`), gives a NaN update in
    its own coordinates only (optax gives a silent 0 for the overflow, and the coordinate
    never moves again); wrap the optimizer in a guard such as ``skip_nonfinite`` to skip
    such steps with the state left as it was.

    Precision: :math:`v_t` is stored in float32 for float16 and bfloat16 leaves (float16
    :math:`(1-\beta_2) g^2` underflows for :math:`|g| \lesssim 10^{-3}`, and the coordinate
    would silently stop moving), and the ratio is formed in float32 and then cast back to
    the gradient dtype, so an ``eps`` such as 1e-15 keeps its value for every leaf dtype.
    :math:`m_t` is stored in ``mu_dtype``; by default in the param dtype, except float16
    (and integer) leaves, where it is float32 too: a float16 :math:`(1-\beta_1) g` flushes
    to 0 for :math:`|g| \lesssim 6 \cdot 10^{-7}`, and a constant gradient of 1e-7 would
    give an update of 0.11 instead of 1. With ``eps > 0`` and
    float32 leaves the updates equal :func:`optax.scale_by_adam`'s. A gradient so small
    that :math:`(1-\beta_2) g^2` flushes to 0 in float32 (:math:`|g| \lesssim 3 \cdot
    10^{-18}` where subnormals are flushed, as on XLA:CPU) gives a zero update rather than
    optax's Inf.

    Boundedness at ``eps = 0``: for :math:`\beta_1^2 < \beta_2` every coordinate of the
    update satisfies :math:`|u_t| \le (1-\beta_1) / \sqrt{(1-\beta_2)(1-\beta_1^2/\beta_2)}`
    whatever the gradients (proof and the per-step bound in :func:`ratio_bound`; 7.27 at
    the defaults, 1.17 for :math:`\beta = (0.9, 0.95)`). For :math:`\beta_1^2 \ge
    \beta_2` there is no bound: after a gradient stops, :math:`\hat m/\sqrt{\hat v}`
    grows like :math:`(\beta_1/\sqrt{\beta_2})^t` (past 1e9 some 1,400 steps after it stops, for
    :math:`\beta = (0.99, 0.95)`), so that combination is rejected unless ``eps`` or
    ``eps_root`` is positive (then the denominator is at least that).

    Args:
      b1: Decay rate of the first moment, in [0, 1).
      b2: Decay rate of the second moment, in [0, 1).
      eps: Added to the denominator outside the square root, >= 0.
      eps_root: Added to the second moment inside the square root, >= 0.
      mu_dtype: Dtype of the first-moment accumulator; ``None`` uses the param dtype
        (float32 for float16 and integer params).
      nesterov: Whether to use Nesterov momentum (NAdam).

    Returns:
      An :class:`optax.GradientTransformation` whose state is a
      :class:`ScaleBySafeAdamState`.

    Raises:
      ValueError: If a hyperparameter is outside its allowed range, or ``eps = eps_root =
        0`` with :math:`\beta_1 > 0` and :math:`\beta_1^2 \ge \beta_2`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.adam import scale_by_safe_adam
      >>> grads = {"used": jnp.array([0.5, -0.1]), "unused": jnp.zeros(2)}
      >>> tx = scale_by_safe_adam()
      >>> updates, state = tx.update(grads, tx.init(grads))
      >>> print(jnp.round(updates["used"], 4), updates["unused"])
      [ 1. -1.] [0. 0.]
      >>> ref = optax.scale_by_adam(eps=0.0)
      >>> print(ref.update(grads, ref.init(grads))[0]["unused"])  # 0/0
      [nan nan]

    References:
      Kingma et al., `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014

      Molybog et al., `A Theory on Adam Instability in Large-Scale Machine Learning
      <https://arxiv.org/abs/2304.09871>`_, 2023

      Dozat, `Incorporating Nesterov Momentum into Adam
      <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016
    """
    check_adam("scale_by_safe_adam", b1, b2, eps, eps_root)

    def ratio(g, m, v):
        d = jnp.sqrt(v + eps_root) + eps
        zero = d == 0  # NaN compares unequal: a NaN denominator still gives NaN
        safe_d = jnp.where(zero, jnp.ones_like(d), d)
        return jnp.where(zero, jnp.zeros_like(m), m / safe_d)

    return scale_by_moments(
        "scale_by_safe_adam", ScaleBySafeAdamState, ratio, b1, b2, mu_dtype, nesterov
    )


def safe_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 0.0,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Adam with ``eps = 0`` by default and exact zeros where the denominator is 0.

    The update is :math:`-\alpha_t u_t` with :math:`u_t` from :func:`scale_by_safe_adam`,
    composed as :func:`optax.adam` is (``chain(scale_by_safe_adam, scale_by_learning_rate)``).
    With ``eps > 0`` it equals :func:`optax.adam` to float32 rounding.

    Args:
      learning_rate: A fixed learning rate or a schedule (see
        :func:`optax.scale_by_learning_rate`).
      b1: Decay rate of the first moment, in [0, 1).
      b2: Decay rate of the second moment, in [0, 1).
      eps: Added to the denominator outside the square root, >= 0.
      eps_root: Added to the second moment inside the square root, >= 0.
      mu_dtype: Dtype of the first-moment accumulator; ``None`` uses the param dtype
        (float32 for float16 and integer params).
      nesterov: Whether to use Nesterov momentum (NAdam).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Raises:
      ValueError: If a hyperparameter is outside its allowed range.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.adam import safe_adam
      >>> def f(x): return jnp.sum((x - 1.0) ** 2)
      >>> solver = safe_adam(learning_rate=0.1)
      >>> params = jnp.array([-1.0, 3.0, 1.0])  # the last coordinate is already optimal
      >>> state = solver.init(params)
      >>> for _ in range(100):
      ...     updates, state = solver.update(jax.grad(f)(params), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(jnp.round(params, 1))
      [1. 1. 1.]

    References:
      Kingma et al., `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014

      Molybog et al., `A Theory on Adam Instability in Large-Scale Machine Learning
      <https://arxiv.org/abs/2304.09871>`_, 2023
    """
    check_learning_rate("safe_adam", learning_rate)
    check_adam("safe_adam", b1, b2, eps, eps_root)
    return optax.chain(
        scale_by_safe_adam(
            b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
        ),
        optax.scale_by_learning_rate(learning_rate),
    )


def safe_adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 0.0,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""AdamW with ``eps = 0`` by default and exact zeros where the denominator is 0.

    The update is :math:`-\alpha_t (u_t + \lambda \theta_t)`, with :math:`u_t` from
    :func:`scale_by_safe_adam` and decoupled weight decay :math:`\lambda` multiplied by the
    learning rate, composed as :func:`optax.adamw` is
    (``chain(scale_by_safe_adam, add_decayed_weights, scale_by_learning_rate)``). With
    ``eps > 0`` it equals :func:`optax.adamw` to float32 rounding.

    Args:
      learning_rate: A fixed learning rate or a schedule.
      b1: Decay rate of the first moment, in [0, 1).
      b2: Decay rate of the second moment, in [0, 1).
      eps: Added to the denominator outside the square root, >= 0.
      eps_root: Added to the second moment inside the square root, >= 0.
      mu_dtype: Dtype of the first-moment accumulator; ``None`` uses the param dtype
        (float32 for float16 and integer params).
      weight_decay: Decoupled weight decay, >= 0, multiplied by the learning rate.
      mask: A tree of booleans like (or a prefix of) the params, or a callable returning
        one: ``True`` where weight decay applies.
      nesterov: Whether to use Nesterov momentum (NAdamW).

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Raises:
      ValueError: If a hyperparameter is outside its allowed range.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.adam import safe_adamw
      >>> params = {"w": jnp.ones(3), "emb": jnp.ones((2, 3))}
      >>> grads = {"w": jnp.array([0.1, -0.2, 0.3]), "emb": jnp.zeros((2, 3))}
      >>> solver = safe_adamw(learning_rate=0.1, weight_decay=0.5)
      >>> updates, state = solver.update(grads, solver.init(params), params)
      >>> print(jnp.round(updates["w"], 3), jnp.round(updates["emb"][0], 3))
      [-0.15  0.05 -0.15] [-0.05 -0.05 -0.05]

    References:
      Loshchilov et al., `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019

      Molybog et al., `A Theory on Adam Instability in Large-Scale Machine Learning
      <https://arxiv.org/abs/2304.09871>`_, 2023
    """
    check_learning_rate("safe_adamw", learning_rate)
    check_adam("safe_adamw", b1, b2, eps, eps_root)
    check_nonnegative("safe_adamw", "weight_decay", weight_decay)
    return optax.chain(
        scale_by_safe_adam(
            b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
        ),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
