"""The pieces safe Adam (:mod:`stabljax.optim.adam`) and Adam-atan2
(:mod:`stabljax.optim.atan2`) share: hyperparameter checks, the moment dtypes and the
moment update. An internal module (see :mod:`stabljax.base`).

Both keep the second moment in float32 (or wider) whatever the leaf dtype, the first
moment in float32 for float16 (and integer) leaves, and form the update ratio in
float32, so float16 and bfloat16 leaves neither underflow a moment nor flush a tiny
``eps`` to zero. Updates are cast back to the dtype of the incoming gradients; integer
gradients get float32 updates, as with :func:`optax.adam`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stabljax.base import validate

# ----------------------------------------------------------------------------- validation


def _check_decay(owner: str, name: str, value: Any) -> None:
    validate(owner, name, value, lambda x: (x >= 0) & (x < 1), "in [0, 1)")


def check_nonnegative(owner: str, name: str, value: Any) -> None:
    validate(owner, name, value, lambda x: x >= 0, ">= 0")


def _check_positive(owner: str, name: str, value: Any) -> None:
    validate(owner, name, value, lambda x: x > 0, "> 0")


def check_adam(owner: str, b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
    _check_decay(owner, "b1", b1)
    _check_decay(owner, "b2", b2)
    check_nonnegative(owner, "eps", eps)
    check_nonnegative(owner, "eps_root", eps_root)
    values = [_concrete_float(x) for x in (b1, b2, eps, eps_root)]
    if any(v is None for v in values):
        return  # traced (inject_hyperparams): checked when first built
    fb1, fb2, feps, feps_root = values
    if feps == 0 and feps_root == 0 and fb1 > 0 and fb1 * fb1 >= fb2:
        raise ValueError(
            f"{owner}: `b2` must be > b1**2 = {fb1 * fb1:.6g} when eps = eps_root = 0; got "
            f"{b2!r}. With b1**2 >= b2 the update m_hat / sqrt(v_hat) has no bound: after "
            f"a gradient stops it grows like (b1 / sqrt(b2))**t. Raise b2 (e.g. 0.999), "
            "lower b1, or set eps > 0."
        )


def _concrete_float(value: Any) -> float | None:
    if callable(value):
        return None
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
        return None
    except jax.errors.TracerArrayConversionError:
        return None


def check_atan2(owner: str, b1: Any, b2: Any, a: Any, b: Any) -> None:
    _check_decay(owner, "b1", b1)
    _check_decay(owner, "b2", b2)
    _check_positive(owner, "a", a)
    _check_positive(owner, "b", b)


def check_learning_rate(owner: str, value: Any) -> None:
    # A negative (or NaN) rate would silently ascend; a schedule is the schedule's business.
    validate(
        owner,
        "learning_rate",
        value,
        lambda x: np.isfinite(x) & (x >= 0),
        "a finite number >= 0 or a schedule (to maximise, negate the loss)",
    )


# ----------------------------------------------------------------------------- moments


def _compute_dtype(dtype) -> jnp.dtype:
    # float16/bfloat16 -> float32; float32, float64 and complex kept; integer (and bool)
    # gradients -> float32, as in optax (whose moments promote them to float).
    if not jnp.issubdtype(dtype, jnp.inexact):
        return jnp.dtype(jnp.float32)
    return jnp.promote_types(dtype, jnp.float32)


def _nu_dtype(dtype) -> jnp.dtype:
    return jnp.finfo(_compute_dtype(dtype)).dtype  # real part of the compute dtype


def _mu_dtype(dtype, mu_dtype) -> jnp.dtype:
    """The first moment's dtype: ``mu_dtype`` if given, else the param dtype, widened.

    A float16 first moment underflows as the second would ((1 - b1) g flushes to 0 for
    |g| below about 6e-7 with b1 = 0.9), and an integer one truncates to 0, so both are
    kept in float32. bfloat16 has float32's exponent range and stays bfloat16, as optax
    keeps it.
    """
    if mu_dtype is not None:
        return mu_dtype
    if dtype == jnp.float16 or not jnp.issubdtype(dtype, jnp.inexact):
        return _compute_dtype(dtype)
    return jnp.dtype(dtype)


def _update_dtype(g_dtype) -> jnp.dtype:
    # Updates keep the gradient dtype; integer gradients get a float update, as optax's.
    return g_dtype if jnp.issubdtype(g_dtype, jnp.inexact) else _compute_dtype(g_dtype)


def _abs_sq(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return jnp.real(x * jnp.conj(x))
    return x**2


def _init_moments(params, mu_dtype):
    mu = jax.tree.map(
        lambda p: jnp.zeros_like(p, dtype=_mu_dtype(jnp.result_type(p), mu_dtype)), params
    )
    nu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=_nu_dtype(jnp.result_type(p))), params)
    return mu, nu


def _is_none(x) -> bool:
    return x is None


def _check_shapes(owner: str, updates, nu) -> None:
    """Gradients must have their parameter's shape: broadcasting would reshape the moments."""
    g_leaves = jax.tree_util.tree_flatten_with_path(updates, is_leaf=_is_none)[0]
    v_leaves = jax.tree.leaves(nu, is_leaf=_is_none)
    if len(g_leaves) != len(v_leaves):
        return  # a structure mismatch: jax.tree.map raises its own error below
    for (path, g), v in zip(g_leaves, v_leaves, strict=True):
        if g is None or v is None:
            continue
        if jnp.shape(g) != jnp.shape(v):
            raise ValueError(
                f"{owner}: the gradient at {jax.tree_util.keystr(path) or 'the root'} has "
                f"shape {jnp.shape(g)}, but the optimizer state (initialised from the params) "
                f"has shape {jnp.shape(v)}; pass gradients shaped like the params."
            )


@functools.partial(jax.jit, inline=True)
def _bias_correction(decay, count):
    # Jitted (as optax's) so that an eager update with a concrete count does not compile a
    # new integer_pow for every step.
    return 1 - decay**count


def _update_moments(updates, mu, nu, count_inc, b1, b2, nesterov: bool):
    """New (mu, nu) in the compute dtype and their bias-corrected estimates (m_hat, v_hat).

    The arithmetic follows ``optax.scale_by_adam`` operation for operation, so float32
    leaves give optax's values bit for bit; narrower leaves are widened first.
    """

    def new_mu(g, m):
        if g is None:
            return None
        dt = jnp.promote_types(_compute_dtype(g.dtype), m.dtype)
        return (1 - b1) * g.astype(dt) + b1 * m.astype(dt)

    def new_nu(g, v):
        if g is None:
            return None
        return (1 - b2) * _abs_sq(g.astype(_compute_dtype(g.dtype))) + b2 * v

    mu_new = jax.tree.map(new_mu, updates, mu, is_leaf=_is_none)
    nu_new = jax.tree.map(new_nu, updates, nu, is_leaf=_is_none)

    bc1 = _bias_correction(b1, count_inc)
    bc2 = _bias_correction(b2, count_inc)

    def m_hat_fn(m, g):
        if m is None:
            return None
        if nesterov:
            bc1_next = _bias_correction(b1, optax.safe_increment(count_inc))
            g = g.astype(m.dtype)
            return b1 * (m / bc1_next.astype(m.dtype)) + (1 - b1) * (g / bc1.astype(m.dtype))
        return m / bc1.astype(m.dtype)

    m_hat = jax.tree.map(m_hat_fn, mu_new, updates, is_leaf=_is_none)
    v_hat = jax.tree.map(
        lambda v: None if v is None else v / bc2.astype(v.dtype), nu_new, is_leaf=_is_none
    )
    return mu_new, nu_new, m_hat, v_hat


def _nan_where_nonfinite(u: jax.Array, v_hat: jax.Array) -> jax.Array:
    """NaN where the second moment is Inf or NaN, so that no guard misses it.

    An Inf gradient, or a finite one whose square overflows, makes ``v`` Inf for good;
    ``m / sqrt(v)`` would then be a silent 0 and ``atan2(inf, inf)`` a finite pi/4, and
    the coordinate would never move again. A NaN update instead lets a guard such as
    ``skip_nonfinite`` skip the step and keep the state from before it.
    """
    return jnp.where(jnp.isfinite(v_hat), u, jnp.full_like(u, jnp.nan))


def _store(new, old):
    """Casts the new moments to the dtypes of the stored ones (no recompile, dtype kept)."""
    return jax.tree.map(
        lambda n, o: None if n is None else n.astype(o.dtype), new, old, is_leaf=_is_none
    )


def scale_by_moments(
    owner: str,
    state_cls: Any,
    ratio: Any,
    b1: Any,
    b2: Any,
    mu_dtype: Any,
    nesterov: bool,
) -> optax.GradientTransformation:
    """The Adam skeleton: moments, bias correction, then ``ratio(g, m_hat, v_hat)``.

    ``state_cls`` is a ``(count, mu, nu)`` NamedTuple. The update of a leaf is ``ratio``'s,
    NaN where the second moment is not finite, in the gradient's dtype.
    """
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)

    def init_fn(params):
        mu, nu = _init_moments(params, mu_dtype)
        return state_cls(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        _check_shapes(owner, updates, state.nu)
        count_inc = optax.safe_increment(state.count)
        mu, nu, m_hat, v_hat = _update_moments(
            updates, state.mu, state.nu, count_inc, b1, b2, nesterov
        )

        def one(g, m, v):
            if g is None:
                return None
            return _nan_where_nonfinite(ratio(g, m, v), v).astype(_update_dtype(g.dtype))

        new_updates = jax.tree.map(one, updates, m_hat, v_hat, is_leaf=_is_none)
        mu, nu = _store(mu, state.mu), _store(nu, state.nu)
        return new_updates, state_cls(count=count_inc, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)
