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

    With :math:`r = \beta_1^2 / \beta_2`,

    .. math::

      B_t = \frac{1-\beta_1}{1-\beta_1^t} \sqrt{\frac{1-\beta_2^t}{1-\beta_2}}
      \sqrt{\frac{1-r^t}{1-r}}
      \;\xrightarrow{t\to\infty}\; \frac{1-\beta_1}{\sqrt{(1-\beta_2)(1-r)}}
      \quad (r < 1),

    attained by gradients growing as :math:`|g_k| \propto (\beta_2/\beta_1)^k`; for
    :math:`r \ge 1` (and :math:`\beta_1 > 0`) there is no bound. With ``nesterov=True``,
    the sum of the bounds of NAdam's two terms. The proof (Cauchy–Schwarz, then AM–GM for
    :math:`B_t \le B_\infty`) is in docs/safe_adam.md.

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
        # B_t <= B_inf for every t (AM-GM, docs/safe_adam.md): the limit bounds every step.
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

    with ``nesterov=True`` using NAdam's :math:`\hat m_t`, as :func:`optax.scale_by_adam`
    does. ``eps`` defaults to 0 (Molybog et al., 2023); a coordinate whose gradients have
    all been exactly 0 gets an update of 0, not 0/0. A non-finite gradient gives a NaN
    update in its own coordinates: guard the optimizer (``skip_nonfinite``). :math:`v_t`
    and the ratio are float32 for low-precision leaves, so neither underflows. At
    ``eps = 0`` every coordinate of the update is bounded by :func:`ratio_bound` (7.27 at
    the defaults) when :math:`\beta_1^2 < \beta_2`, and that combination is required
    unless ``eps`` or ``eps_root`` is positive. The derivations: docs/safe_adam.md.

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
