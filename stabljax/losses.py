"""Language-model losses: cross-entropy with PaLM's z-loss.

Both terms share one ``logsumexp``, computed in float32 whatever the logits' dtype
(bf16 and fp16 logits are upcast before the reduction), and both are averaged over
the unmasked positions only.

Masked means follow one convention everywhere in this module: the mean over an
all-``False`` mask is defined as 0 (not 0/0 = NaN), and its gradient is 0, so a
batch of pure padding neither moves the parameters nor poisons a guard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from stabljax import metrics
from stabljax.base import validate

__all__ = ("cross_entropy_with_z_loss", "lm_loss", "z_loss")

LossFn = Callable[..., tuple[jax.Array, Any]]
# A traced weight is not checked (it is the caller's responsibility).
_Z_RANGE = ">= 0 (0 for plain cross-entropy)"


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
    z_loss_weight: ArrayLike = 1e-4,
    where: ArrayLike | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Softmax cross-entropy with integer labels plus a weighted z-loss.

    With :math:`\log Z_i = \operatorname{logsumexp}_v \ell_{i,v}` computed once,

    .. math::

      \mathrm{CE} = \frac{1}{|M|} \sum_{i \in M} (\log Z_i - \ell_{i, y_i}), \qquad
      \mathcal{L} = \mathrm{CE} + c \cdot \frac{1}{|M|} \sum_{i \in M} \log^2 Z_i,

    where :math:`M` is the set of positions where ``where`` is true and :math:`c` is
    ``z_loss_weight``. All of it is float32 even for bf16 logits. With ``z_loss_weight=0``
    the loss
    equals ``optax.softmax_cross_entropy_with_integer_labels`` averaged over the mask.
    An all-false mask gives a loss of 0 with zero gradient (not NaN).

    Args:
      logits: ``[..., vocab]`` logits, any float dtype.
      labels: integer labels of shape ``logits.shape[:-1]``, each in ``[0, vocab)``.
      z_loss_weight: weight :math:`c \ge 0` of the z-loss term (Levanter's name); PaLM
        and T5X use 1e-4, OLMo 2 1e-5 .. 1e-4.
      where: optional boolean mask of shape ``labels.shape``; false positions
        (padding) are left out of every mean.

    Returns:
      ``(loss, aux)``: the float32 scalar loss and a dict of float32 scalars,
      ``ce`` (the cross-entropy), ``z_loss`` (the weighted term that was added, so
      ``loss == ce + z_loss``), ``log_z`` (mean :math:`\log Z`) and ``log_z_max``
      (largest :math:`\log Z` over the unmasked positions; 0 if there are none).

    Raises:
      ValueError: if ``z_loss_weight`` is a negative (or NaN) number, or ``where``
        does not have the labels' shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.losses import cross_entropy_with_z_loss
      >>> logits = jnp.zeros((2, 3, 4))
      >>> labels = jnp.zeros((2, 3), jnp.int32)
      >>> loss, aux = cross_entropy_with_z_loss(logits, labels, z_loss_weight=1e-4)
      >>> print(round(float(aux["ce"]), 4), round(float(aux["log_z"]), 4))
      1.3863 1.3863
      >>> print(round(float(loss - aux["ce"]), 6))
      0.000192

    References:
      Chowdhery et al., `PaLM: Scaling Language Modeling with Pathways
      <https://arxiv.org/abs/2204.02311>`_, 2022
    """
    validate(
        "cross_entropy_with_z_loss", "z_loss_weight", z_loss_weight, lambda v: v >= 0, _Z_RANGE
    )
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
    z_term = jnp.asarray(z_loss_weight, jnp.float32) * _masked_mean(jnp.square(log_z), mask, count)
    log_z_max = jnp.max(log_z, where=mask, initial=-jnp.inf)
    aux = {
        metrics.CE: ce,
        metrics.Z_LOSS: z_term,
        metrics.LOG_Z: _masked_mean(log_z, mask, count),
        metrics.LOG_Z_MAX: jnp.where(count > 0, log_z_max, 0.0),
    }
    return ce + z_term, aux


def lm_loss(
    apply_fn: Callable[..., Any],
    *,
    z_loss_weight: float = 1e-4,
    stateful: bool = False,
) -> LossFn:
    r"""The language-model ``loss_fn`` for :func:`stabljax.make_train_step`: cross-entropy + z-loss.

    ``loss_fn(params, batch, *, rng=None, model_state=None)`` is
    :func:`cross_entropy_with_z_loss` of
    ``apply_fn(params, batch["inputs"])`` against the integer ``batch["targets"]``,
    masked by the optional boolean ``batch["mask"]``; its ``aux`` holds ``ce``,
    ``z_loss``, ``log_z`` and ``log_z_max``, which the step returns as metrics.

    Args:
      apply_fn: ``apply_fn(params, inputs) -> logits`` (``[..., vocab]``): linen's
        ``module.apply``, or the first result of :func:`stabljax.nnx_apply`. With
        ``stateful=True``, ``apply_fn(params, inputs, *, rng, model_state) -> (logits,
        model_state)``, as :func:`stabljax.nnx_apply` with ``stateful=True`` returns; the new
        model state goes into ``aux["model_state"]``.
      z_loss_weight: z-loss weight (>= 0); 0 gives plain cross-entropy.
      stateful: whether ``apply_fn`` takes and returns model state (see above).

    Returns:
      ``loss_fn(params, batch, *, rng=None, model_state=None) -> (loss, aux)``.

    Raises:
      ValueError: if ``z_loss_weight`` is negative or NaN.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.losses import lm_loss
      >>> loss_fn = lm_loss(lambda params, inputs: params[inputs], z_loss_weight=0.0)
      >>> batch = {"inputs": jnp.array([[0, 1]]), "targets": jnp.array([[1, 0]])}
      >>> loss, aux = loss_fn(jnp.zeros((2, 2)), batch)
      >>> print(f"{float(loss):.4f}", sorted(aux))  # ln 2
      0.6931 ['ce', 'log_z', 'log_z_max', 'z_loss']
    """
    validate("lm_loss", "z_loss_weight", z_loss_weight, lambda v: v >= 0, _Z_RANGE)
    if not callable(apply_fn):
        raise TypeError(f"lm_loss: `apply_fn` must be callable; got {apply_fn!r}.")

    def loss_fn(params: Any, batch: Mapping[str, jax.Array], *, rng=None, model_state=None):
        if stateful:
            logits, model_state = apply_fn(
                params, batch["inputs"], rng=rng, model_state=model_state
            )
        else:
            logits = apply_fn(params, batch["inputs"])
        loss, aux = cross_entropy_with_z_loss(
            logits, batch["targets"], z_loss_weight=z_loss_weight, where=batch.get("mask")
        )
        if stateful:
            aux = {**aux, "model_state": model_state}
        return loss, aux

    return loss_fn
