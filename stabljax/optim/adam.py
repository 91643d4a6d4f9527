"""Adam variants that never divide 0 by 0: safe Adam (eps = 0 allowed) and Adam-atan2.

Both keep the second moment in float32 (or wider) whatever the leaf dtype, the first
moment in float32 for float16 (and integer) leaves, and form the update ratio in
float32, so float16 and bfloat16 leaves neither underflow a moment nor flush a tiny
``eps`` to zero. Updates are cast back to the dtype of the incoming gradients; integer
gradients get float32 updates, as with :func:`optax.adam`.

Inputs are checked: hyperparameters when the transform is built (a negative or NaN
learning rate, a decay outside [0, 1), ...), and gradients when it is traced (a
gradient whose shape differs from its parameter's raises instead of broadcasting into
the moments).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stabljax.optim._base import validate

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


class ScaleByAdamAtan2State(NamedTuple):
    """State of :func:`scale_by_adam_atan2`."""

    count: jax.Array  # shape=(), int32
    mu: optax.Updates  # like params, dtype mu_dtype or the param dtype
    nu: optax.Updates  # like params, float32 (float64 for float64 params)


# ----------------------------------------------------------------------------- validation


def _check_decay(owner: str, name: str, value: Any) -> None:
    validate(owner, name, value, lambda x: (x >= 0) & (x < 1), "in [0, 1)")


def _check_nonnegative(owner: str, name: str, value: Any) -> None:
    validate(owner, name, value, lambda x: x >= 0, ">= 0")


def _check_positive(owner: str, name: str, value: Any) -> None:
    validate(owner, name, value, lambda x: x > 0, "> 0")


def _check_adam(owner: str, b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
    _check_decay(owner, "b1", b1)
    _check_decay(owner, "b2", b2)
    _check_nonnegative(owner, "eps", eps)
    _check_nonnegative(owner, "eps_root", eps_root)
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


def _check_atan2(owner: str, b1: Any, b2: Any, a: Any, b: Any) -> None:
    _check_decay(owner, "b1", b1)
    _check_decay(owner, "b2", b2)
    _check_positive(owner, "a", a)
    _check_positive(owner, "b", b)


def _check_learning_rate(owner: str, value: Any) -> None:
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
    _check_adam("scale_by_safe_adam", b1, b2, eps, eps_root)
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)

    def init_fn(params):
        mu, nu = _init_moments(params, mu_dtype)
        return ScaleBySafeAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        _check_shapes("scale_by_safe_adam", updates, state.nu)
        count_inc = optax.safe_increment(state.count)
        mu, nu, m_hat, v_hat = _update_moments(
            updates, state.mu, state.nu, count_inc, b1, b2, nesterov
        )

        def ratio(g, m, v):
            if g is None:
                return None
            d = jnp.sqrt(v + eps_root) + eps
            zero = d == 0  # NaN compares unequal: a NaN denominator still gives NaN
            safe_d = jnp.where(zero, jnp.ones_like(d), d)
            u = jnp.where(zero, jnp.zeros_like(m), m / safe_d)
            return _nan_where_nonfinite(u, v).astype(_update_dtype(g.dtype))

        new_updates = jax.tree.map(ratio, updates, m_hat, v_hat, is_leaf=_is_none)
        return new_updates, ScaleBySafeAdamState(
            count=count_inc,
            mu=_store(mu, state.mu),
            nu=_store(nu, state.nu),
        )

    return optax.GradientTransformation(init_fn, update_fn)


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
    _check_learning_rate("safe_adam", learning_rate)
    _check_adam("safe_adam", b1, b2, eps, eps_root)
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
    _check_learning_rate("safe_adamw", learning_rate)
    _check_adam("safe_adamw", b1, b2, eps, eps_root)
    _check_nonnegative("safe_adamw", "weight_decay", weight_decay)
    return optax.chain(
        scale_by_safe_adam(
            b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
        ),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


# ----------------------------------------------------------------------------- Adam-atan2


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
      >>> from stabljax.optim.adam import scale_by_adam_atan2
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
    _check_atan2("scale_by_adam_atan2", b1, b2, a, b)
    mu_dtype = None if mu_dtype is None else jax.dtypes.canonicalize_dtype(mu_dtype)

    def init_fn(params):
        mu, nu = _init_moments(params, mu_dtype)
        return ScaleByAdamAtan2State(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        _check_shapes("scale_by_adam_atan2", updates, state.nu)
        count_inc = optax.safe_increment(state.count)
        mu, nu, m_hat, v_hat = _update_moments(
            updates, state.mu, state.nu, count_inc, b1, b2, nesterov=False
        )

        def atan2(g, m, v):
            if g is None:
                return None
            if jnp.iscomplexobj(m):
                raise TypeError(f"scale_by_adam_atan2 needs real gradients, got {g.dtype}.")
            u = a * jnp.arctan2(m, b * jnp.sqrt(v))
            return _nan_where_nonfinite(u, v).astype(_update_dtype(g.dtype))

        new_updates = jax.tree.map(atan2, updates, m_hat, v_hat, is_leaf=_is_none)
        return new_updates, ScaleByAdamAtan2State(
            count=count_inc,
            mu=_store(mu, state.mu),
            nu=_store(nu, state.nu),
        )

    return optax.GradientTransformation(init_fn, update_fn)


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
      >>> from stabljax.optim.adam import adamw_atan2
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
    _check_learning_rate("adamw_atan2", learning_rate)
    _check_atan2("adamw_atan2", b1, b2, a, b)
    _check_nonnegative("adamw_atan2", "weight_decay", weight_decay)
    return optax.chain(
        scale_by_adam_atan2(b1=b1, b2=b2, a=a, b=b, mu_dtype=mu_dtype),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
