"""Tests for stabljax.losses: z_loss and cross_entropy_with_z_loss against float64 numpy."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stabljax.losses import cross_entropy_with_z_loss, z_loss

# --------------------------------------------------------------------------- reference


def naive(logits, labels, c, mask=None):
    """float64 numpy: (loss, ce, z term, mean log Z, max log Z, d loss / d logits)."""
    x = np.asarray(logits, np.float64)
    labels = np.asarray(labels)
    mask = np.ones(labels.shape, bool) if mask is None else np.asarray(mask, bool)
    n = mask.sum()
    log_z = np.log(np.sum(np.exp(x), axis=-1))  # the naive way: no max shift
    label_logit = np.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
    w = mask / max(n, 1)
    ce = np.sum(w * (log_z - label_logit))
    zt = c * np.sum(w * log_z**2)
    softmax = np.exp(x - log_z[..., None])
    onehot = np.eye(x.shape[-1])[labels]
    grad = w[..., None] * (softmax - onehot + 2 * c * log_z[..., None] * softmax)
    lz_max = log_z[mask].max() if n else 0.0
    return ce + zt, ce, zt, np.sum(w * log_z), lz_max, grad


def random_case(shape=(3, 5), vocab=7, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    logits = scale * rng.standard_normal((*shape, vocab)).astype(np.float32)
    labels = rng.integers(0, vocab, size=shape).astype(np.int32)
    mask = rng.random(shape) < 0.6
    mask.flat[0] = True
    return logits, labels, mask


ce_jit = jax.jit(cross_entropy_with_z_loss)


@jax.jit
def value_and_grad(logits, labels, c, mask):
    # c is traced, so one compilation serves every weight
    f = lambda x: cross_entropy_with_z_loss(x, labels, z_loss_weight=c, where=mask)
    return jax.value_and_grad(f, has_aux=True)(logits)


# --------------------------------------------------------------------------- values, gradients


@pytest.mark.parametrize("c", [0.0, 1e-4, 0.3])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("shape", [(11,), (2, 2, 3)])
def test_values_and_grads_match_float64(c, masked, shape):
    logits, labels, mask = random_case(shape)
    mask = mask if masked else None
    (loss, aux), grad = value_and_grad(logits, labels, c, mask)
    ref_loss, ce, zt, lz, lz_max, ref_grad = naive(logits, labels, c, mask)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aux["ce"], ce, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aux["z_loss"], zt, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(aux["log_z"], lz, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(aux["log_z_max"], lz_max, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss, aux["ce"] + aux["z_loss"], rtol=1e-7)
    for v in (loss, *aux.values()):
        assert v.shape == () and v.dtype == jnp.float32


def test_z_loss_function_is_the_unweighted_term():
    logits, labels, mask = random_case((4, 6), seed=1)
    _, _, zt, *_ = naive(logits, labels, 1.0, mask)
    np.testing.assert_allclose(jax.jit(z_loss)(logits, where=mask), zt, rtol=1e-6)
    _, aux = ce_jit(logits, labels, z_loss_weight=0.25, where=mask)
    np.testing.assert_allclose(aux["z_loss"], 0.25 * z_loss(logits, where=mask), rtol=1e-6)
    # its gradient: d/dx mean(log^2 Z) = 2 log Z softmax / n
    g = jax.jit(jax.grad(lambda x: z_loss(x)))(logits)
    x = logits.astype(np.float64)
    log_z = np.log(np.exp(x).sum(-1, keepdims=True))
    ref = 2 * log_z * np.exp(x - log_z) / np.prod(logits.shape[:-1])
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-8)


def test_large_logits_are_stable():
    # the float64 naive sum of exp overflows float32 at ~88: ours must not
    logits = np.array([[1000.0, 999.0, -1000.0]], np.float32)
    loss, aux = ce_jit(logits, np.array([1], np.int32), z_loss_weight=1e-4)
    ref_lz = 1000.0 + np.log1p(np.exp(-1.0))
    np.testing.assert_allclose(aux["log_z"], ref_lz, rtol=1e-6)
    np.testing.assert_allclose(aux["ce"], ref_lz - 999.0, rtol=1e-5)
    chex.assert_tree_all_finite((loss, aux))


# --------------------------------------------------------------------------- z_loss = 0 and optax


@jax.jit
def optax_masked_mean(logits, labels, mask):
    def f(x):
        per = optax.softmax_cross_entropy_with_integer_labels(x, labels)
        return jnp.sum(jnp.where(mask, per, 0.0)) / jnp.sum(mask)

    return jax.value_and_grad(f)(logits)


@pytest.mark.parametrize("masked", [False, True])
def test_zero_weight_equals_optax(masked):
    logits, labels, mask = random_case((4, 9), vocab=13, seed=2)
    mask = mask if masked else np.ones(labels.shape, bool)
    (loss, aux), grad = value_and_grad(logits, labels, 0.0, mask)
    ref, ref_grad = optax_masked_mean(logits, labels, mask)
    np.testing.assert_allclose(loss, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert float(aux["z_loss"]) == 0.0


def test_positive_weight_differs_from_optax():
    logits, labels, _ = random_case((4, 9), vocab=13, seed=2, scale=5.0)
    loss, _ = ce_jit(logits, labels, z_loss_weight=1e-2)
    ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    assert float(loss) > float(ref) + 1e-3


# --------------------------------------------------------------------------- low precision


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_logits_use_float32_math(dtype):
    rng = np.random.default_rng(3)
    # large, close logits over a big vocabulary: a bf16 logsumexp loses ~2 digits here
    logits = (40.0 + rng.standard_normal((4, 512))).astype(np.float32)
    labels = rng.integers(0, 512, size=(4,)).astype(np.int32)
    low = jnp.asarray(logits, dtype)
    (loss, aux), grad = value_and_grad(low, labels, 1e-4, None)
    ref_loss, ce, _, lz, _, ref_grad = naive(np.asarray(low.astype(jnp.float32)), labels, 1e-4)
    assert loss.dtype == jnp.float32 and aux["log_z"].dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["log_z"], lz, rtol=1e-6)
    np.testing.assert_allclose(aux["ce"], ce, rtol=1e-5)
    assert grad.dtype == dtype
    np.testing.assert_allclose(grad.astype(np.float32), ref_grad, rtol=1e-2, atol=1e-5)


def test_bf16_math_would_fail_the_tolerance():
    # The control for the test above: a logsumexp done in bf16 misses the reference by far
    # more than its tolerance, so that test can tell float32 math from bf16 math.
    rng = np.random.default_rng(3)
    low = jnp.asarray((40.0 + rng.standard_normal((4, 512))).astype(np.float32), jnp.bfloat16)
    lz_bf16 = jax.nn.logsumexp(low, axis=-1).astype(jnp.float32)
    lz_ref = np.log(np.exp(np.asarray(low, np.float64)).sum(-1))
    assert np.max(np.abs(lz_bf16 - lz_ref) / lz_ref) > 1e-6 * 10


# --------------------------------------------------------------------------- masks


def test_mask_equals_loss_on_selected_positions():
    logits, labels, mask = random_case((5, 4), seed=4)
    loss, aux = ce_jit(logits, labels, z_loss_weight=0.1, where=mask)
    sel, _ = ce_jit(logits[mask], labels[mask], z_loss_weight=0.1)
    np.testing.assert_allclose(loss, sel, rtol=1e-6)
    np.testing.assert_allclose(aux["log_z_max"], ce_jit(logits[mask], labels[mask])[1]["log_z_max"])


def test_nan_at_masked_position_does_not_reach_the_loss():
    logits, labels, mask = random_case((5, 4), seed=5)
    mask[0, 1] = False
    poisoned = logits.copy()
    poisoned[0, 1, :] = np.nan
    a = ce_jit(poisoned, labels, z_loss_weight=0.1, where=mask)
    b = ce_jit(logits, labels, z_loss_weight=0.1, where=mask)
    chex.assert_trees_all_close(a, b, rtol=0, atol=0)


def test_masked_positions_get_zero_gradient():
    logits, labels, mask = random_case((5, 4), seed=6)
    _, grad = value_and_grad(logits, labels, 0.1, mask)
    assert np.all(np.asarray(grad)[~mask] == 0.0)
    assert np.all(np.abs(np.asarray(grad)[mask]).sum(-1) > 0)


def test_all_false_mask_gives_zero_not_nan():
    logits, labels, _ = random_case((3, 4), seed=7)
    mask = np.zeros(labels.shape, bool)
    (loss, aux), grad = value_and_grad(logits, labels, 1e-4, mask)
    chex.assert_trees_all_equal((loss, aux), (jnp.float32(0), dict.fromkeys(aux, jnp.float32(0))))
    chex.assert_trees_all_equal(grad, jnp.zeros_like(grad))
    assert float(jax.jit(z_loss)(logits, where=mask)) == 0.0


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("c", [-1e-4, float("nan")])
def test_negative_weight_raises(c):
    logits, labels, _ = random_case()
    with pytest.raises(ValueError, match="`z_loss_weight` must be >= 0"):
        cross_entropy_with_z_loss(logits, labels, z_loss_weight=c)


def test_bad_shapes_and_dtypes_raise():
    logits, labels, _ = random_case((3, 5))
    with pytest.raises(ValueError, match="labels must have shape"):
        cross_entropy_with_z_loss(logits, labels[:, :4])
    with pytest.raises(ValueError, match="labels must be integers"):
        cross_entropy_with_z_loss(logits, labels.astype(np.float32))
    with pytest.raises(ValueError, match="where must have the shape"):
        cross_entropy_with_z_loss(logits, labels, where=np.ones((3,), bool))
    with pytest.raises(ValueError, match="where must have the shape"):
        z_loss(logits, where=np.ones((5, 3), bool))


def test_traced_weight_is_accepted():
    logits, labels, _ = random_case()
    f = jax.jit(lambda c: cross_entropy_with_z_loss(logits, labels, z_loss_weight=c)[0])
    ref_loss = naive(logits, labels, 0.5)[0]
    np.testing.assert_allclose(f(jnp.float32(0.5)), ref_loss, rtol=1e-6)
