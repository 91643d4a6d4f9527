"""Mixed-precision policy: master-weight dtype, compute dtype and dynamic loss scaling.

Master weights and optimizer state stay in ``param_dtype`` (float32 in every preset);
the forward and backward passes run with the floating parameters cast to
``compute_dtype``; the loss (a ``logsumexp``) is always float32 (see
:mod:`stabljax.losses`). bfloat16 has float32's exponent range and needs no loss
scaling; float16 does, and :class:`DynamicLossScale` provides it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from stabljax.base import all_finite, is_nonneg_int, validate

__all__ = (
    "DynamicLossScale",
    "LossScaleState",
    "Precision",
    "all_finite",
    "cast_floating",
    "scale_loss",
    "unscale_grads",
)

_F32_MAX = float(jnp.finfo(jnp.float32).max)


class LossScaleState(NamedTuple):
    """State of :class:`DynamicLossScale`."""

    loss_scale: jax.Array  # shape=(), float32; in [min_scale, max_scale]
    loss_scale_good_steps: jax.Array  # shape=(), int32; finite steps since the last change


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    r"""Dynamic loss scaling for float16 training (static configuration).

    The loss is multiplied by the scale :math:`S` before differentiation, so small
    float16 gradients do not flush to zero, and the gradients are divided by :math:`S`
    before the optimizer sees them. After each step:

    - any non-finite gradient (an overflow): :math:`S \leftarrow \max(S \cdot
      \text{backoff\_factor}, \text{min\_scale})`, the counter resets and the step is
      skipped;
    - otherwise the counter grows, and after ``growth_interval`` clean steps in a row
      :math:`S \leftarrow \min(S \cdot \text{growth\_factor}, \text{max\_scale})`.

    Both bounds are finite and positive, so the scale never becomes Inf or 0 (flax's
    ``DynamicScale`` can grow to Inf, flax issue 2547). The argument names follow
    torch's ``GradScaler`` and flax's ``DynamicScale``.

    Args:
      initial_scale: the first scale, in ``[min_scale, max_scale]``.
      growth_interval: clean steps in a row before the scale grows (>= 1).
      growth_factor: multiplier on growth (> 1).
      backoff_factor: multiplier on overflow (in (0, 1)).
      min_scale: floor of the scale (> 0).
      max_scale: ceiling of the scale (finite in float32, >= min_scale).

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.precision import DynamicLossScale
      >>> dls = DynamicLossScale(initial_scale=8.0, growth_interval=2)
      >>> state = dls.init()
      >>> for finite in (True, True, False):
      ...     state = dls.adjust(state, jnp.asarray(finite))
      ...     print(float(state.loss_scale))
      8.0
      16.0
      8.0

    References:
      Micikevicius et al., `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018
    """

    initial_scale: float = 2.0**15
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self):
        owner = "DynamicLossScale"
        validate(
            owner,
            "growth_interval",
            self.growth_interval,
            lambda v: is_nonneg_int(v) and v >= 1,
            "an integer >= 1",
        )
        validate(
            owner,
            "growth_factor",
            self.growth_factor,
            lambda v: np.isfinite(v) & (v > 1),
            "finite and > 1",
        )
        validate(
            owner,
            "backoff_factor",
            self.backoff_factor,
            lambda v: (0 < v) & (v < 1),
            "in the open interval (0, 1)",
        )
        validate(
            owner,
            "min_scale",
            self.min_scale,
            lambda v: (0 < v) & (v <= _F32_MAX),
            "> 0 and finite in float32",
        )
        validate(
            owner,
            "max_scale",
            self.max_scale,
            lambda v: (self.min_scale <= v) & (v <= _F32_MAX),
            f"finite in float32 and >= min_scale={self.min_scale}",
        )
        validate(
            owner,
            "initial_scale",
            self.initial_scale,
            lambda v: (self.min_scale <= v) & (v <= self.max_scale),
            f"in [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]",
        )

    def init(self) -> LossScaleState:
        """Returns the initial :class:`LossScaleState`."""
        return LossScaleState(
            loss_scale=jnp.asarray(self.initial_scale, jnp.float32),
            loss_scale_good_steps=jnp.zeros([], jnp.int32),
        )

    def adjust(self, state: LossScaleState, finite: ArrayLike) -> LossScaleState:
        """Returns the state after a step whose gradients were ``finite`` (a bool scalar)."""
        finite = jnp.asarray(finite, jnp.bool_)
        good = state.loss_scale_good_steps + 1
        grow = good >= self.growth_interval
        grown = jnp.minimum(state.loss_scale * self.growth_factor, self.max_scale)
        shrunk = jnp.maximum(state.loss_scale * self.backoff_factor, self.min_scale)
        scale = jnp.where(finite, jnp.where(grow, grown, state.loss_scale), shrunk)
        good = jnp.where(finite & ~grow, good, 0)
        return LossScaleState(
            loss_scale=scale.astype(jnp.float32), loss_scale_good_steps=good.astype(jnp.int32)
        )


def _is_float_dtype(dtype: DTypeLike) -> bool:
    try:
        return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))
    except TypeError:
        return False


def _check_float(name: str, dtype: DTypeLike) -> None:
    shown = dtype.__name__ if isinstance(dtype, type) else dtype  # a scalar type is callable
    validate("Precision", name, shown, lambda _: _is_float_dtype(dtype), "a floating dtype")


@dataclasses.dataclass(frozen=True)
class Precision:
    """Mixed-precision policy of the train step (static, hashable).

    Args:
      param_dtype: dtype of the master weights (and so of the optimizer state);
        ``TrainState.create`` casts floating parameters to it.
      compute_dtype: dtype the floating parameters are cast to for the forward and
        backward pass (float32 by default, so ``Precision()`` is :meth:`fp32`, the
        train step's default). Gradients come back in
        ``param_dtype``; the loss is float32.
      loss_scale: a :class:`DynamicLossScale` (float16) or ``None``.

    Presets: :meth:`fp32`, :meth:`bf16` and :meth:`fp16`.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.precision import Precision
      >>> p = Precision.bf16()
      >>> params = {"w": jnp.ones((2,)), "step": jnp.zeros((), jnp.int32)}
      >>> {k: str(v.dtype) for k, v in p.cast_to_compute(params).items()}
      {'step': 'int32', 'w': 'bfloat16'}
      >>> float(Precision.fp16().loss_scale.initial_scale)
      32768.0

    References:
      Micikevicius et al., `Mixed Precision Training
      <https://arxiv.org/abs/1710.03740>`_, 2018
    """

    param_dtype: DTypeLike = jnp.float32
    compute_dtype: DTypeLike = jnp.float32
    loss_scale: DynamicLossScale | None = None

    def __post_init__(self):
        _check_float("param_dtype", self.param_dtype)
        _check_float("compute_dtype", self.compute_dtype)
        if self.loss_scale is not None and not isinstance(self.loss_scale, DynamicLossScale):
            raise ValueError(
                "Precision: `loss_scale` must be a DynamicLossScale or None; got "
                f"{self.loss_scale!r}."
            )

    @classmethod
    def fp32(cls) -> Precision:
        """Everything float32."""
        return cls(param_dtype=jnp.float32, compute_dtype=jnp.float32)

    @classmethod
    def bf16(cls) -> Precision:
        """float32 master weights and optimizer state, bfloat16 compute, float32 loss."""
        return cls(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16)

    @classmethod
    def fp16(
        cls,
        initial_scale: float = 2.0**15,
        growth_interval: int = 1000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> Precision:
        """float32 master weights, float16 compute, dynamic loss scaling.

        The arguments are those of :class:`DynamicLossScale`.
        """
        return cls(
            param_dtype=jnp.float32,
            compute_dtype=jnp.float16,
            loss_scale=DynamicLossScale(
                initial_scale=initial_scale,
                growth_interval=growth_interval,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                min_scale=min_scale,
                max_scale=max_scale,
            ),
        )

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
        return cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of ``tree`` to ``param_dtype``."""
        return cast_floating(tree, self.param_dtype)

    def init_loss_scale(self) -> LossScaleState | None:
        """The initial loss-scale state, or ``None`` without loss scaling."""
        return None if self.loss_scale is None else self.loss_scale.init()


def cast_floating(tree: Any, dtype: DTypeLike) -> Any:
    """Casts every floating-point leaf of ``tree`` to ``dtype``; other leaves are kept.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.precision import cast_floating
      >>> out = cast_floating({"w": jnp.ones(2), "i": jnp.ones(2, jnp.int32)}, jnp.float16)
      >>> out["w"].dtype, out["i"].dtype
      (dtype('float16'), dtype('int32'))
    """

    def cast(x):
        if x is None:
            return None
        if isinstance(x, float) or hasattr(x, "dtype"):
            x_dtype = jnp.result_type(x)
            if jnp.issubdtype(x_dtype, jnp.floating) and x_dtype != jnp.dtype(dtype):
                return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(cast, tree, is_leaf=lambda x: x is None)


def scale_loss(loss: ArrayLike, state: LossScaleState | None) -> jax.Array:
    """Returns ``loss * loss_scale`` in float32 (``loss`` itself without a scale)."""
    loss = jnp.asarray(loss, jnp.float32)
    return loss if state is None else loss * state.loss_scale


def unscale_grads(grads: Any, state: LossScaleState | None) -> Any:
    """Divides the gradients by the loss scale, keeping each leaf's dtype.

    The division happens in float32, so a float16 gradient is not rounded twice.
    """
    if state is None:
        return grads
    scale = state.loss_scale

    def unscale(g):
        if g is None:
            return None
        return (g.astype(jnp.float32) / scale).astype(g.dtype)

    return jax.tree.map(unscale, grads, is_leaf=lambda x: x is None)
