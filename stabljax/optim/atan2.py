"""Adam-atan2: Adam's moment ratio through ``atan2``, so it needs no ``eps`` at all.

The moments are safe Adam's (see :mod:`stabljax.optim._moments`): float32 statistics
whatever the leaf dtype, gradients shape-checked when traced, hyperparameters checked
when built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from stabljax.optim._moments import (
    check_atan2,
    check_learning_rate,
    check_nonnegative,
    scale_by_moments,
)

__all__ = ["ScaleByAdamAtan2State", "adamw_atan2", "scale_by_adam_atan2"]


class ScaleByAdamAtan2State(NamedTuple):
    """State of :func:`scale_by_adam_atan2`."""

    count: jax.Array  # shape=(), int32
    mu: optax.Updates  # like params, dtype mu_dtype or the param dtype
    nu: optax.Updates  # like params, float32 (float64 for float64 params)


def scale_by_adam_atan2(
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    a: jax.typing.ArrayLike = 1.27,
    b: jax.typing.ArrayLike = 1.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
) -> optax.GradientTransformation:
    r"""Rescales updates by ``a * atan2(m_hat, b * sqrt(v_hat))``: Adam without any eps.

    With the moments and bias corrections of Adam (see :func:`scale_by_safe_adam`),

    .. math::

      u_t = a \cdot \mathrm{atan2}\left(\hat m_t,\; b \sqrt{\hat v_t}\right).

    For small ratios this is :math:`(a/b)\,\hat m_t / \sqrt{\hat v_t}`, Adam's update; it
    needs no ``eps`` at all: :math:`\mathrm{atan2}(0, 0) = 0`, so all-zero gradients give
    exact zeros, every coordinate is bounded by :math:`a \pi / 2`, and multiplying every
    gradient by a constant :math:`c > 0` leaves the updates unchanged. With :math:`b = 1`,
    :math:`a = 1/\arctan(1) \approx 1.27` keeps Adam's magnitude where :math:`|\hat m|
    \approx \sqrt{\hat v}` (in general :math:`a = 1/\arctan(1/b)`).

    Precision: as in :func:`scale_by_safe_adam`, :math:`v_t` is kept in float32 for
    float16/bfloat16 leaves and the update formed in float32, then cast to the gradient
    dtype. Scale invariance holds while :math:`(1-\beta_2) g^2` is a normal float32, i.e.
    for gradients between about 3e-18 and 1.8e19 in magnitude (tested with gradients of
    order 1 scaled by 1e-8 and 1e8; float16 and bfloat16 gradients always fit). A NaN or
    Inf gradient, or one whose square overflows, gives a NaN update in its own
    coordinates (:math:`\mathrm{atan2}(\infty, \infty)` would be a finite
    :math:`\pi/4`), so a guard such as ``skip_nonfinite`` skips the step.

    Args:
      b1: Decay rate of the first moment, in [0, 1).
      b2: Decay rate of the second moment, in [0, 1).
      a: Output scale, > 0; updates are bounded by :math:`a\pi/2`.
      b: Scale of :math:`\sqrt{\hat v}` inside atan2, > 0.
      mu_dtype: Dtype of the first-moment accumulator; ``None`` uses the param dtype
        (float32 for float16 and integer params).

    Returns:
      An :class:`optax.GradientTransformation` whose state is a
      :class:`ScaleByAdamAtan2State`.

    Raises:
      ValueError: If a hyperparameter is outside its allowed range.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.optim.atan2 import scale_by_adam_atan2
      >>> tx = scale_by_adam_atan2()
      >>> grads = jnp.array([1e-8, -1e8, 0.0])
      >>> updates, state = tx.update(grads, tx.init(grads))
      >>> print(jnp.round(updates, 4))  # 1.27 * atan2(+-1, 1) = +-1.27 * pi / 4
      [ 0.9975 -0.9975  0.    ]

    References:
      Everett et al., `Scaling Exponents Across Parameterizations and Optimizers
      <https://arxiv.org/abs/2407.05872>`_, 2024

      Kingma et al., `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014
    """
    check_atan2("scale_by_adam_atan2", b1, b2, a, b)

    def ratio(g, m, v):
        if jnp.iscomplexobj(m):
            raise TypeError(f"scale_by_adam_atan2 needs real gradients, got {g.dtype}.")
        return a * jnp.arctan2(m, b * jnp.sqrt(v))

    return scale_by_moments(
        "scale_by_adam_atan2", ScaleByAdamAtan2State, ratio, b1, b2, mu_dtype, False
    )


def adamw_atan2(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    a: jax.typing.ArrayLike = 1.27,
    b: jax.typing.ArrayLike = 1.0,
    mu_dtype: jax.typing.DTypeLike | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""AdamW-atan2: Adam-atan2 updates with decoupled, learning-rate-scaled weight decay.

    .. math::

      \theta_{t+1} = \theta_t - \alpha_t \left( a \cdot \mathrm{atan2}(\hat m_t,
      b \sqrt{\hat v_t}) + \lambda \theta_t \right),

    i.e. ``chain(scale_by_adam_atan2, add_decayed_weights, scale_by_learning_rate)``; the
    decay is not multiplied by ``a``, as in the reference implementation. Note that the
    defaults here (b2 = 0.999, weight decay 1e-4) are Adam's, not those of the
    adam-atan2-pytorch package (b2 = 0.99, weight decay 0).

    Args:
      learning_rate: A fixed learning rate or a schedule.
      b1: Decay rate of the first moment, in [0, 1).
      b2: Decay rate of the second moment, in [0, 1).
      a: Output scale, > 0; updates before decay are bounded by :math:`a\pi/2`.
      b: Scale of :math:`\sqrt{\hat v}` inside atan2, > 0.
      mu_dtype: Dtype of the first-moment accumulator; ``None`` uses the param dtype
        (float32 for float16 and integer params).
      weight_decay: Decoupled weight decay, >= 0, multiplied by the learning rate.
      mask: A tree of booleans like (or a prefix of) the params, or a callable returning
        one: ``True`` where weight decay applies.

    Returns:
      An :class:`optax.GradientTransformationExtraArgs`.

    Raises:
      ValueError: If a hyperparameter is outside its allowed range.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.optim.atan2 import adamw_atan2
      >>> def f(x): return jnp.sum((x - 1.0) ** 2)
      >>> solver = adamw_atan2(learning_rate=0.1, weight_decay=0.0)
      >>> params = jnp.array([-1.0, 3.0, 1.0])
      >>> state = solver.init(params)
      >>> for _ in range(100):
      ...     updates, state = solver.update(jax.grad(f)(params), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(jnp.round(params, 1))
      [1. 1. 1.]

    References:
      Everett et al., `Scaling Exponents Across Parameterizations and Optimizers
      <https://arxiv.org/abs/2407.05872>`_, 2024

      Loshchilov et al., `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019
    """
    check_learning_rate("adamw_atan2", learning_rate)
    check_atan2("adamw_atan2", b1, b2, a, b)
    check_nonnegative("adamw_atan2", "weight_decay", weight_decay)
    return optax.chain(
        scale_by_adam_atan2(b1=b1, b2=b2, a=a, b=b, mu_dtype=mu_dtype),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
