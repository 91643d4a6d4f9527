"""Language-model losses: cross-entropy with PaLM's z-loss.

Both terms share one ``logsumexp``, computed in float32 whatever the logits' dtype
(bf16 and fp16 logits are upcast before the reduction), and both are averaged over
the unmasked positions only.

Masked means follow one convention everywhere in this module: the mean over an
all-``False`` mask is defined as 0 (not 0/0 = NaN), and its gradient is 0, so a
batch of pure padding neither moves the parameters nor poisons a guard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from stabljax.optim._base import validate

__all__ = ("cross_entropy_with_z_loss", "z_loss")


def _check_coefficient(z_loss: ArrayLike, owner: str = "cross_entropy_with_z_loss") -> None:
    # A traced coefficient is not checked (it is the caller's responsibility).
    validate(owner, "z_loss", z_loss, lambda v: v >= 0, ">= 0 (0 for plain cross-entropy)")


def _mask(where: ArrayLike | None, shape: tuple[int, ...]) -> jax.Array:
    if where is None:
        return jnp.ones(shape, jnp.bool_)
    mask = jnp.asarray(where)
    if mask.shape != shape:
        raise ValueError(f"where must have the shape of the labels {shape}, got {mask.shape}")
    return mask.astype(jnp.bool_)


def _masked_mean(x: jax.Array, mask: jax.Array, count: jax.Array) -> jax.Array:
    # Select, never multiply: a NaN at a masked position must not reach the sum.
    total = jnp.sum(jnp.where(mask, x, 0.0))
    return total / jnp.maximum(count, 1).astype(x.dtype)


def _shifted_log_z(logits: ArrayLike) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (float32 logits, shift m, s) with log Z = m + s, the one logsumexp.

    Keeping m and s apart lets the cross-entropy be (m - label logit) + s: with large
    logits, log Z - label logit would cancel catastrophically in float32.
    """
    logits32 = jnp.asarray(logits).astype(jnp.float32)
    m = jnp.max(logits32, axis=-1)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))  # the gradient is shift-free
    s = jnp.log(jnp.sum(jnp.exp(logits32 - m[..., None]), axis=-1))
    return logits32, m, s


def z_loss(logits: ArrayLike, *, where: ArrayLike | None = None) -> jax.Array:
    r"""Mean squared log-partition function, PaLM's auxiliary z-loss (unweighted).

    .. math::

      \mathcal{L}_z = \frac{1}{|M|} \sum_{i \in M} \log^2 Z_i, \qquad
      Z_i = \sum_v \exp(\ell_{i,v}),

    over the positions :math:`M` where ``where`` is true (all positions by default).
    Pushing :math:`\log Z` toward 0 keeps the softmax normaliser from drifting, the
    output-logit divergence that Wortsman et al. reproduce at small scale. The math
    is float32 for any logits dtype; an all-false mask gives 0.

    Args:
      logits: ``[..., vocab]`` logits, any float dtype.
      where: optional boolean mask of shape ``logits.shape[:-1]``; false positions
        (padding) are left out of the mean.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.losses import z_loss
      >>> logits = jnp.zeros((2, 3, 4))  # log Z = log 4 everywhere
      >>> print(round(float(z_loss(logits)), 4))
      1.9218

    References:
      Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
      <https://arxiv.org/abs/2204.02311>`_, 2022

      Wortsman et al., `Small-scale proxies for large-scale Transformer training
      instabilities <https://arxiv.org/abs/2309.14322>`_, 2023
    """
    _, m, s = _shifted_log_z(logits)
    log_z = m + s
    mask = _mask(where, log_z.shape)
    return _masked_mean(jnp.square(log_z), mask, jnp.sum(mask))


def cross_entropy_with_z_loss(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    z_loss: ArrayLike = 1e-4,
    where: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Softmax cross-entropy with integer labels plus a weighted z-loss.

    With :math:`\log Z_i = \operatorname{logsumexp}_v \ell_{i,v}` computed once,

    .. math::

      \mathrm{CE} = \frac{1}{|M|} \sum_{i \in M} (\log Z_i - \ell_{i, y_i}), \qquad
      \mathcal{L} = \mathrm{CE} + c \cdot \frac{1}{|M|} \sum_{i \in M} \log^2 Z_i,

    where :math:`M` is the set of positions where ``where`` is true and :math:`c` is
    ``z_loss``. All of it is float32 even for bf16 logits. With ``z_loss=0`` the loss
    equals ``optax.softmax_cross_entropy_with_integer_labels`` averaged over the mask.
    An all-false mask gives a loss of 0 with zero gradient (not NaN).

    Args:
      logits: ``[..., vocab]`` logits, any float dtype.
      labels: integer labels of shape ``logits.shape[:-1]``, each in ``[0, vocab)``.
      z_loss: weight :math:`c \ge 0` of the z-loss term; PaLM and T5X use 1e-4,
        OLMo 2 1e-5 .. 1e-4.
      where: optional boolean mask of shape ``labels.shape``; false positions
        (padding) are left out of every mean.

    Returns:
      ``(loss, aux)``: the float32 scalar loss and a dict of float32 scalars,
      ``ce`` (the cross-entropy), ``z_loss`` (the weighted term that was added, so
      ``loss == ce + z_loss``), ``log_z`` (mean :math:`\log Z`) and ``log_z_max``
      (largest :math:`\log Z` over the unmasked positions; 0 if there are none).

    Raises:
      ValueError: if ``z_loss`` is a negative (or NaN) Python number, or ``where``
        does not have the labels' shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.losses import cross_entropy_with_z_loss
      >>> logits = jnp.zeros((2, 3, 4))
      >>> labels = jnp.zeros((2, 3), jnp.int32)
      >>> loss, aux = cross_entropy_with_z_loss(logits, labels, z_loss=1e-4)
      >>> print(round(float(aux["ce"]), 4), round(float(aux["log_z"]), 4))
      1.3863 1.3863
      >>> print(round(float(loss - aux["ce"]), 6))
      0.000192

    References:
      Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
      <https://arxiv.org/abs/2204.02311>`_, 2022
    """
    _check_coefficient(z_loss)
    logits32, m, s = _shifted_log_z(logits)
    log_z = m + s
    labels = jnp.asarray(labels)
    if labels.shape != log_z.shape:
        raise ValueError(f"labels must have shape {log_z.shape}, got {labels.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    mask = _mask(where, log_z.shape)
    count = jnp.sum(mask)

    label_logits = jnp.take_along_axis(logits32, labels[..., None], axis=-1)[..., 0]
    ce = _masked_mean((m - label_logits) + s, mask, count)
    z_term = jnp.asarray(z_loss, jnp.float32) * _masked_mean(jnp.square(log_z), mask, count)
    log_z_max = jnp.max(log_z, where=mask, initial=-jnp.inf)
    aux = {
        "ce": ce,
        "z_loss": z_term,
        "log_z": _masked_mean(log_z, mask, count),
        "log_z_max": jnp.where(count > 0, log_z_max, 0.0),
    }
    return ce + z_term, aux
