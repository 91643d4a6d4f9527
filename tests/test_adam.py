"""Tests of stabljax.optim.adam: safe Adam (eps = 0 allowed) and Adam-atan2."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    mesh8,
    nested_params,
    parabola_problem,
    rosenbrock_problem,
    run_optimizer,
    shard_leading,
)

from stabljax.optim import adam
from stabljax.optim.guards.skips import skip_nonfinite

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------- helpers


@functools.cache
def _jit_update(tx):
    # One jitted update per transform object, shared by the tests that reuse it.
    return jax.jit(tx.update)


def _run(tx, grads_seq, params=None):
    """Applies jitted ``tx.update`` to each gradient in turn; returns (updates list, state)."""
    # scale_by_* ignore params; passing a tree always keeps one jit signature per tree
    params = grads_seq[0] if params is None else params
    state = tx.init(params)
    update = _jit_update(tx)
    out = []
    for g in grads_seq:
        u, state = update(g, state, params)
        out.append(u)
    return out, state


@functools.cache
def _params(dtype=jnp.float32):
    """helpers.nested_params in ``dtype``, built once (eager jax.random per dtype is slow)."""
    return jax.tree.map(lambda x: x.astype(dtype), nested_params())


def _small_params():
    """Two leaves, for the composition tests, where compiling dominates the runtime."""
    return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}


def _grads_like(params, seed, scale=1.0):
    """Like helpers.random_grads_like, from numpy (no eager jax.random op per leaf)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jnp.asarray(scale * rng.standard_normal(p.shape), jnp.float32).astype(p.dtype),
        params,
    )


def _grad_seq(shape=(64,), steps=6, seed=0, scale=1.0):
    """Gradients with a coordinate that stays 0, one that is 0 only at step 1, and sign flips."""
    rng = np.random.default_rng(seed)
    seq = []
    for t in range(steps):
        g = scale * rng.standard_normal(shape).astype(np.float32)
        g[0] = 0.0  # never used
        if t == 0:
            g[1] = 0.0  # used from step 2 on
        g[2] = scale * (-1.0) ** t  # oscillates
        seq.append(g)
    return seq


def _np_adam_moments(grads_seq, b1, b2, nesterov=False):
    """float64 reference: yields (m_hat, v_hat) of Adam per step (Kingma & Ba Algorithm 1)."""
    m = np.zeros_like(grads_seq[0], np.float64)
    v = np.zeros_like(grads_seq[0], np.float64)
    for t, g in enumerate(grads_seq, start=1):
        g = np.asarray(g, np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        if nesterov:
            m_hat = b1 * m / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        else:
            m_hat = m / (1 - b1**t)
        yield m_hat, v / (1 - b2**t)


def _np_safe_adam(grads_seq, b1=0.9, b2=0.999, eps=0.0, eps_root=0.0, nesterov=False):
    out = []
    for m_hat, v_hat in _np_adam_moments(grads_seq, b1, b2, nesterov):
        d = np.sqrt(v_hat + eps_root) + eps
        out.append(np.where(d == 0, 0.0, m_hat / np.where(d == 0, 1.0, d)))
    return out


def _np_adam_atan2(grads_seq, b1=0.9, b2=0.999, a=1.27, b=1.0):
    return [a * np.arctan2(m, b * np.sqrt(v)) for m, v in _np_adam_moments(grads_seq, b1, b2)]


def _leaves(tree):
    return jax.tree.leaves(tree)


# Module-level instances, so the jitted updates are compiled once per shape and dtype.
TRANSFORMS = {
    "safe_adam": adam.scale_by_safe_adam(),
    "safe_adam_tiny_eps": adam.scale_by_safe_adam(eps=1e-15),
    "adam_atan2": adam.scale_by_adam_atan2(),
}
OPTAX_ADAM = optax.scale_by_adam()  # eps = 1e-8
OPTAX_ADAM_NO_EPS = optax.scale_by_adam(eps=0.0)


# ----------------------------------------------------------------------------- numpy reference


@pytest.mark.parametrize(
    "b1,b2,eps,eps_root,nesterov",
    [
        (0.9, 0.999, 0.0, 0.0, False),
        (0.9, 0.999, 1e-8, 0.0, True),
        (0.5, 0.9, 1e-3, 1e-6, True),
        (0.0, 0.99, 0.0, 0.0, False),
    ],
)
def test_safe_adam_matches_float64_numpy(nesterov, b1, b2, eps, eps_root):
    seq = _grad_seq()
    tx = adam.scale_by_safe_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, nesterov=nesterov)
    got, state = _run(tx, [jnp.asarray(g) for g in seq])
    want = _np_safe_adam(seq, b1, b2, eps, eps_root, nesterov)
    for u, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(u), w, rtol=1e-5, atol=1e-6)
    assert np.asarray(got[-1])[0] == 0.0  # the unused coordinate: exactly 0
    assert int(state.count) == len(seq)


@pytest.mark.parametrize("b1,b2,a,b", [(0.9, 0.999, 1.27, 1.0), (0.8, 0.99, 2.0, 0.5)])
def test_adam_atan2_matches_float64_numpy(b1, b2, a, b):
    seq = _grad_seq()
    got, state = _run(
        adam.scale_by_adam_atan2(b1=b1, b2=b2, a=a, b=b), [jnp.asarray(g) for g in seq]
    )
    for u, w in zip(got, _np_adam_atan2(seq, b1, b2, a, b), strict=True):
        np.testing.assert_allclose(np.asarray(u), w, rtol=1e-5, atol=1e-6)
    assert int(state.count) == len(seq)


def test_adam_atan2_first_step_is_a_times_pi_over_4():
    # Step 1: m_hat = g and sqrt(v_hat) = |g|, so u = a * atan2(g, b|g|) = +-a * atan(1/b).
    g = jnp.array([3.0, -1e-3, 0.0])
    u, _ = jax.jit(adam.scale_by_adam_atan2(a=1.5, b=2.0).update)(
        g, adam.scale_by_adam_atan2().init(g)
    )
    # rtol: 1 - b2**t uses float32(0.999), off by 1.3e-5 relative to 1 - 0.999 (as in optax)
    np.testing.assert_allclose(u, [1.5 * np.arctan(0.5), -1.5 * np.arctan(0.5), 0.0], rtol=2e-5)


# ----------------------------------------------------------------------------- equal to optax


@pytest.mark.parametrize("eps,eps_root,nesterov", [(1e-8, 0.0, False), (1e-3, 1e-8, True)])
def test_safe_adam_with_eps_equals_optax_scale_by_adam(eps, eps_root, nesterov):
    params = _params()
    seq = [_grads_like(params, seed=s) for s in range(5)]
    ours, _ = _run(adam.scale_by_safe_adam(eps=eps, eps_root=eps_root, nesterov=nesterov), seq)
    ref, _ = _run(optax.scale_by_adam(eps=eps, eps_root=eps_root, nesterov=nesterov), seq)
    for u, r in zip(ours, ref, strict=True):
        chex.assert_trees_all_close(u, r, rtol=1e-6, atol=1e-7)


def _train(opt, params, steps=5):
    """Jitted steps of ``opt`` on a fixed smooth loss; returns the params after each step."""

    def loss(p):
        return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(p))

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    state, out = opt.init(params), []
    for _ in range(steps):
        params, state = step(params, state)
        out.append(params)
    return out


def _matrices(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


_NADAMW = dict(b1=0.8, eps=1e-6, weight_decay=0.3, mask=_matrices, nesterov=True)


@pytest.mark.parametrize(
    "ours,ref",
    [
        (
            lambda: adam.safe_adam(0.05, eps=1e-8),
            lambda: optax.adam(0.05, eps=1e-8),
        ),
        (
            lambda: adam.safe_adamw(optax.linear_schedule(0.1, 0.01, 4), **_NADAMW),
            lambda: optax.adamw(optax.linear_schedule(0.1, 0.01, 4), **_NADAMW),
        ),
    ],
    ids=["adam", "nadamw_schedule_mask"],
)
def test_safe_aliases_with_eps_equal_optax(ours, ref):
    params = _small_params()
    for p, r in zip(_train(ours(), params), _train(ref(), params), strict=True):
        chex.assert_trees_all_close(p, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "ours",
    [
        lambda: adam.safe_adamw(0.05, eps=1e-8),
        lambda: skip_nonfinite(adam.adamw_atan2(0.05)),
    ],
    ids=["safe_adamw", "guarded_adamw_atan2"],
)
def test_state_has_optax_field_names(ours):
    # optax's tree_get and tooling that reads Adam's moments find count, mu and nu; the
    # moments are optax's own (its ScaleByAdamState after the same float32 gradients).
    params = _small_params()
    opt, ref = ours(), optax.scale_by_adam(eps=1e-8)
    state, ref_state = opt.init(params), ref.init(params)
    update, ref_update = _jit_update(opt), _jit_update(ref)
    for seed in range(3):
        g = _grads_like(params, seed=seed)
        _, state = update(g, state, params)
        _, ref_state = ref_update(g, ref_state, params)
    assert int(optax.tree_utils.tree_get(state, "count")) == 3
    chex.assert_trees_all_equal(optax.tree_utils.tree_get(state, "mu"), ref_state.mu)
    chex.assert_trees_all_equal(optax.tree_utils.tree_get(state, "nu"), ref_state.nu)


def test_adamw_atan2_decay_is_lr_scaled_and_not_multiplied_by_a():
    params = {"w": jnp.array([2.0, -4.0, 1.0])}
    grads = {"w": jnp.array([0.5, 0.5, 0.0])}
    lr, wd, a = 0.1, 0.25, 3.0
    tx = adam.adamw_atan2(lr, a=a, weight_decay=wd)
    u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    # step 1: atan2(g, |g|) = pi/4 where g != 0, 0 where g == 0
    want = -lr * (a * np.array([np.pi / 4, np.pi / 4, 0.0]) + wd * np.array([2.0, -4.0, 1.0]))
    # rtol: float32(0.999) in 1 - b2**t, as in the first-step test above
    np.testing.assert_allclose(u["w"], want, rtol=2e-5)


# ----------------------------------------------------------------------------- zero gradients


ZERO_ROWS, USED_ROWS = np.array([0, 3]), np.array([1, 2, 4, 5])


@functools.cache
def _emb_params(dtype):
    """An embedding table and a leaf that no loss touches (small: compiling dominates)."""
    emb = np.random.default_rng(0).standard_normal((6, 4))
    return {"emb": jnp.asarray(emb, dtype), "unused": jnp.ones((5,), dtype)}


def _embedding_grads(dtype, steps=4):
    """Grads like _emb_params(dtype): rows 0 and 3 of emb never used, ``unused`` all zero."""
    rng = np.random.default_rng(1)
    seq = []
    for _ in range(steps):
        emb = 1e-2 * rng.standard_normal((6, 4))
        emb[ZERO_ROWS] = 0.0
        seq.append({"emb": jnp.asarray(emb, dtype), "unused": jnp.zeros((5,), dtype)})
    return seq


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_zero_gradients_give_exact_zero_updates_never_nan(name, dtype):
    got, _ = _run(TRANSFORMS[name], _embedding_grads(dtype), _emb_params(dtype))
    for u in got:
        chex.assert_tree_all_finite(u)
        w = np.asarray(u["emb"], np.float32)
        assert u["emb"].dtype == dtype
        np.testing.assert_array_equal(np.asarray(u["unused"], np.float32), 0.0)
        np.testing.assert_array_equal(w[ZERO_ROWS], 0.0)
        assert np.all(w[USED_ROWS] != 0)  # the used rows move


@pytest.mark.parametrize("dtype", DTYPES)
def test_optax_scale_by_adam_without_eps_gives_nan_on_zero_gradients(dtype):
    # The failure case that scale_by_safe_adam fixes: 0 / (sqrt(0) + 0) = NaN.
    got, _ = _run(OPTAX_ADAM_NO_EPS, _embedding_grads(dtype), _emb_params(dtype))
    assert np.all(np.isnan(np.asarray(got[0]["unused"], np.float32)))


def test_optax_eps_underflows_in_float16():
    # optax forms the ratio in the leaf dtype: eps = 1e-8 rounds to 0 in float16.
    got, _ = _run(OPTAX_ADAM, _embedding_grads(jnp.float16), _emb_params(jnp.float16))
    assert np.all(np.isnan(np.asarray(got[0]["unused"], np.float32)))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_tiny_eps_in_low_precision_gives_finite_nonzero_updates(dtype):
    rng = np.random.default_rng(1)
    # |g| in [1e-4, 1e-3]: (1 - b2) g^2 underflows a float16 nu; 1e-15 is 0 in float16.
    seq32 = [
        np.sign(rng.standard_normal(32)) * rng.uniform(1e-4, 1e-3, 32).astype(np.float32)
        for _ in range(4)
    ]
    seq = [jnp.asarray(g, dtype) for g in seq32]
    got, state = _run(adam.scale_by_safe_adam(eps=1e-15), seq)
    want = _np_safe_adam([np.asarray(g, np.float32) for g in seq], eps=1e-15)
    for u, w in zip(got, want, strict=True):
        assert u.dtype == dtype
        chex.assert_tree_all_finite(u)
        assert np.all(np.asarray(u, np.float32) != 0)
        np.testing.assert_allclose(np.asarray(u, np.float32), w, rtol=2e-2, atol=2e-2)
    assert state.nu.dtype == jnp.float32
    if dtype == jnp.float16:  # and the reference failure: optax's nu underflows to Inf updates
        ref, _ = _run(optax.scale_by_adam(eps=1e-15), seq)
        assert not np.all(np.isfinite(np.asarray(ref[0], np.float32)))


# ----------------------------------------------------------------------------- atan2 properties


@pytest.mark.parametrize("a,b", [(1.27, 1.0), (3.0, 0.25)])
def test_adam_atan2_is_bounded_by_a_pi_over_2(a, b):
    rng = np.random.default_rng(2)
    # per-row scales from 1e-15 to 1e18: tiny to huge gradients, all with g**2 in float32
    scales = 10.0 ** rng.uniform(-15, 18, size=(12, 1))
    seq = [jnp.asarray(rng.standard_normal((12, 64)) * scales, jnp.float32) for _ in range(8)]
    seq[3] = seq[3].at[0].set(1e18)  # a spike
    got, _ = _run(adam.scale_by_adam_atan2(a=a, b=b, b1=0.99, b2=0.5), seq)
    bound = a * np.pi / 2 * (1 + 1e-6)  # float32 rounding of pi/2 and of the product
    for u in got:
        chex.assert_tree_all_finite(u)
        assert np.max(np.abs(np.asarray(u))) <= bound
    # b2 < b1 lets m_hat exceed sqrt(v_hat), so the sweep does reach beyond a * pi/4
    assert max(np.max(np.abs(np.asarray(u))) for u in got) > a * np.pi / 4


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_square_overflow_gives_nan_not_a_silent_zero(name):
    # |g| = 1e30: g**2 is Inf in float32. optax's Adam gives 0 there and the coordinate
    # never moves again (v stays Inf); ours says NaN, so a guard skips the step.
    g = jnp.array([1e30, -1.0, 0.0], jnp.float32)
    (u,), _ = _run(TRANSFORMS[name], [g])
    assert np.isnan(u[0]) and np.isfinite(u[1]) and u[2] == 0
    (ref,), _ = _run(OPTAX_ADAM, [g])
    assert ref[0] == 0  # the failure case


@pytest.mark.parametrize("scale", [1e-8, 1e8])
def test_adam_atan2_is_invariant_to_gradient_scale(scale):
    params = _params()
    seq = [_grads_like(params, seed=s) for s in range(6)]
    scaled = [jax.tree.map(lambda g: g * scale, s) for s in seq]
    tx = TRANSFORMS["adam_atan2"]
    base, _ = _run(tx, seq)
    got, state = _run(tx, scaled)
    for u, r in zip(got, base, strict=True):
        chex.assert_trees_all_close(u, r, rtol=1e-5, atol=1e-6)
    # g * 1e-8 squares to ~1e-16 g^2: still a normal float32, nothing flushed to 0
    nu = np.concatenate([np.ravel(x) for x in _leaves(state.nu)])
    assert np.all(nu >= np.finfo(np.float32).tiny) and np.all(np.isfinite(nu))
    # whereas Adam with eps = 1e-8 is not invariant at this scale
    if scale == 1e-8:
        ref, _ = _run(OPTAX_ADAM, scaled)
        ref_base, _ = _run(OPTAX_ADAM, seq)
        assert not np.allclose(_leaves(ref[-1])[0], _leaves(ref_base[-1])[0], rtol=0.1)


# ----------------------------------------------------------------------------- dtypes, pytrees


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["safe_adam", "adam_atan2"])
def test_dtypes_are_kept(name, dtype):
    params = _emb_params(dtype)  # shapes of the zero-gradient test: compiled once
    seq = [_grads_like(params, seed=s) for s in range(3)]
    tx = TRANSFORMS[name]
    state0 = tx.init(params)
    got, state = _run(tx, seq, params)
    for u in got:
        assert jax.tree.map(lambda x: x.dtype, u) == jax.tree.map(lambda x: x.dtype, params)
    # mu in the param dtype but float32 for float16; nu in float32 for every low-precision leaf
    chex.assert_trees_all_equal_dtypes(state, state0)
    mu, nu = state[1], state[2]
    mu_dtype = jnp.float32 if dtype == jnp.float16 else dtype
    assert {x.dtype for x in _leaves(mu)} == {jnp.dtype(mu_dtype)}
    assert {x.dtype for x in _leaves(nu)} == {jnp.dtype(jnp.float32)}
    # low-precision updates agree with the float32 computation on the same inputs
    seq32 = [jax.tree.map(lambda g: g.astype(jnp.float32), s) for s in seq]
    ref, _ = _run(tx, seq32, _emb_params(jnp.float32))
    for u, r in zip(got, ref, strict=True):
        chex.assert_trees_all_close(
            jax.tree.map(lambda x: x.astype(jnp.float32), u), r, rtol=3e-2, atol=3e-2
        )


@pytest.mark.parametrize("factory", [adam.scale_by_safe_adam, adam.scale_by_adam_atan2])
def test_mu_dtype_is_used_for_the_first_moment(factory):
    params = _emb_params(jnp.bfloat16)
    tx = factory(mu_dtype=jnp.float32)
    _, state = _run(tx, [_grads_like(params, seed=0)], params)
    assert {x.dtype for x in _leaves(state[1])} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_nested_pytree_with_none_leaves_matches_per_leaf(name):
    params = _params()
    seq = [_grads_like(params, seed=s) for s in range(3)]
    got, _ = _run(TRANSFORMS[name], seq, params)
    assert got[-1]["pair"][1] is None
    assert jax.tree.structure(got[-1]) == jax.tree.structure(params)
    # every leaf is updated independently: running one leaf alone gives the same numbers
    leaf_seq = [s["blocks"][1] for s in seq]
    alone, _ = _run(TRANSFORMS[name], leaf_seq)
    chex.assert_trees_all_close(got[-1]["blocks"][1], alone[-1], rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- composition


def test_inside_chain_matches_numpy():
    seq = _grad_seq(scale=3.0)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adam.scale_by_adam_atan2(), optax.scale(-0.1))
    got, _ = _run(tx, [jnp.asarray(g) for g in seq])
    clipped = [g * min(1.0, 1.0 / np.linalg.norm(g.astype(np.float64))) for g in seq]
    for u, w in zip(got, _np_adam_atan2(clipped), strict=True):
        np.testing.assert_allclose(np.asarray(u), -0.1 * w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "factory,kwargs,static",
    [
        (adam.safe_adam, {}, False),
        (adam.safe_adamw, {"weight_decay": 0.1}, True),
        (adam.adamw_atan2, {"weight_decay": 0.1}, False),
    ],
    ids=["safe_adam_all", "safe_adamw_lr", "adamw_atan2_all"],
)
def test_inside_inject_hyperparams(factory, kwargs, static):
    params = _small_params()
    seq = [_grads_like(params, seed=s) for s in range(4)]
    if static:  # only the learning rate (and weight decay) injected: exactly the plain optimizer
        names = ("b1", "b2", "eps", "eps_root", "a", "b")
        statics = [n for n in names if n in factory.__code__.co_varnames]
        injected = optax.inject_hyperparams(factory, static_args=statics)(0.1, **kwargs)
        rtol, atol = 1e-6, 1e-7
    else:  # b1, b2 become float32 arrays, traced in the jitted update (validation must cope):
        injected = optax.inject_hyperparams(factory)(0.1, **kwargs)
        # 1 - b2 in float32 rather than from the Python float (as with optax): 1e-5 relative
        # to the terms of size lr = 0.1, before the weight-decay term cancels part of them
        rtol, atol = 2e-5, 2e-6
    got, state = _run(injected, seq, params)
    ref, _ = _run(factory(0.1, **kwargs), seq, params)
    for u, r in zip(got, ref, strict=True):
        chex.assert_trees_all_close(u, r, rtol=rtol, atol=atol)
    # changing the injected learning rate scales the next update
    update = _jit_update(injected)
    u_full, _ = update(seq[0], state, params)
    state.hyperparams["learning_rate"] = jnp.asarray(0.05)
    u_half, _ = update(seq[0], state, params)
    chex.assert_trees_all_close(u_half, jax.tree.map(lambda x: 0.5 * x, u_full), rtol=1e-6)


def test_inject_hyperparams_validates_at_init():
    with pytest.raises(ValueError, match="eps"):
        optax.inject_hyperparams(adam.safe_adam)(learning_rate=0.1, eps=-1.0).init(jnp.ones(3))


@pytest.mark.parametrize("factory", [adam.safe_adam, adam.adamw_atan2])
def test_inside_multi_steps(factory):
    params = _small_params()
    seq = [_grads_like(params, seed=s) for s in range(6)]
    k = 3
    got, _ = _run(optax.MultiSteps(factory(0.1), every_k_schedule=k), seq, params)
    means = [jax.tree.map(lambda *g: sum(g) / k, *seq[i : i + k]) for i in range(0, len(seq), k)]
    ref, _ = _run(factory(0.1), means, params)
    for i, u in enumerate(got):
        if (i + 1) % k:
            chex.assert_trees_all_equal(u, jax.tree.map(jnp.zeros_like, u))
        else:
            chex.assert_trees_all_close(u, ref[i // k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: adam.safe_adamw(0.1, nesterov=True),
        lambda: adam.adamw_atan2(0.1),
    ],
)
def test_no_recompile_on_second_call(make):
    tx = make()
    params = _params()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(g, s, p):
        return tx.update(g, s, p)

    chex.clear_trace_counter()
    state = tx.init(params)
    for s in range(3):
        _, state = step(_grads_like(params, seed=s), state, params)


@pytest.mark.parametrize(
    "make", [lambda: adam.safe_adamw(0.1, weight_decay=0.1), lambda: adam.adamw_atan2(0.1)]
)
def test_sharded_equals_unsharded(make):
    tx, mesh = make(), mesh8()
    params = _params()
    seq = [_grads_like(params, seed=s) for s in range(3)]
    got, state = _run(tx, [shard_leading(g, mesh) for g in seq], shard_leading(params, mesh))
    ref, ref_state = _run(tx, seq, params)
    assert len(got[-1]["dense"]["w"].sharding.device_set) == 8
    for u, r in zip(got, ref, strict=True):
        chex.assert_trees_all_close(u, r, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(state, ref_state, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- validation


BAD = [
    (adam.scale_by_safe_adam, {"eps": -1e-8}, "eps", ">= 0"),
    (adam.scale_by_safe_adam, {"eps_root": -1.0}, "eps_root", ">= 0"),
    (adam.scale_by_safe_adam, {"b1": 1.0}, "b1", "[0, 1)"),
    (adam.scale_by_safe_adam, {"b1": -0.1}, "b1", "[0, 1)"),
    (adam.scale_by_safe_adam, {"b2": 1.0}, "b2", "[0, 1)"),
    (adam.scale_by_safe_adam, {"b2": 1.5}, "b2", "[0, 1)"),
    (lambda **k: adam.safe_adam(0.1, **k), {"eps": -1.0}, "eps", ">= 0"),
    (lambda **k: adam.safe_adam(0.1, **k), {"b2": -0.5}, "b2", "[0, 1)"),
    (lambda **k: adam.safe_adamw(0.1, **k), {"weight_decay": -1e-4}, "weight_decay", ">= 0"),
    (lambda **k: adam.safe_adamw(0.1, **k), {"eps_root": -1e-9}, "eps_root", ">= 0"),
    (adam.scale_by_adam_atan2, {"a": 0.0}, "a", "> 0"),
    (adam.scale_by_adam_atan2, {"a": -1.27}, "a", "> 0"),
    (adam.scale_by_adam_atan2, {"b": 0.0}, "b", "> 0"),
    (adam.scale_by_adam_atan2, {"b1": 1.0}, "b1", "[0, 1)"),
    (adam.scale_by_adam_atan2, {"b2": jnp.asarray(1.0)}, "b2", "[0, 1)"),
    (lambda **k: adam.adamw_atan2(0.1, **k), {"weight_decay": -0.1}, "weight_decay", ">= 0"),
    (lambda **k: adam.adamw_atan2(0.1, **k), {"b": -1.0}, "b", "> 0"),
    (lambda **k: adam.safe_adamw(0.1, **k), {"b1": float("nan")}, "b1", "[0, 1)"),
    (lambda **k: adam.safe_adamw(0.1, **k), {"weight_decay": float("nan")}, "weight_decay", ">= 0"),
]
LR_FACTORIES = {
    "safe_adam": adam.safe_adam,
    "safe_adamw": adam.safe_adamw,
    "adamw_atan2": adam.adamw_atan2,
}


@pytest.mark.parametrize("lr", [-1e-3, float("nan"), float("inf"), jnp.asarray(-0.1)])
@pytest.mark.parametrize("name", sorted(LR_FACTORIES))
def test_negative_or_nonfinite_learning_rate_raises(name, lr):
    with pytest.raises(ValueError) as err:
        LR_FACTORIES[name](lr)
    msg = str(err.value)
    assert msg.startswith(f"{name}: `learning_rate` must be") and "negate the loss" in msg


@pytest.mark.parametrize("name", sorted(LR_FACTORIES))
def test_zero_learning_rate_and_schedules_are_accepted(name):
    LR_FACTORIES[name](0.0)
    LR_FACTORIES[name](optax.linear_schedule(-1.0, 1.0, 10))  # a schedule is not evaluated


@pytest.mark.parametrize("int_params", [True, False])
def test_integer_gradients_give_a_float_update_like_optax(int_params):
    # optax.adamw promotes integer gradients to float32; safe_adamw used to cast its Adam
    # update back to int32, which made it 0. Reference: float64 numpy Adam.
    p = jnp.array([1, 2, 3, 4], jnp.int32)
    params = p if int_params else p.astype(jnp.float32)
    seq = [np.array([1, -2, 0, 3]), np.array([2, -1, 0, 3]), np.array([0, 4, 0, -3])]
    lr, wd = 0.1, 0.0
    opt = adam.safe_adamw(lr, weight_decay=wd)
    got, state = _run(opt, [jnp.asarray(g, jnp.int32) for g in seq], params)
    want = [-lr * u for u in _np_safe_adam([g.astype(np.float64) for g in seq])]
    for u, w in zip(got, want, strict=True):
        assert u.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(u), w, rtol=1e-5, atol=1e-7)
    assert {x.dtype for x in _leaves((state[0].mu, state[0].nu))} == {jnp.dtype(jnp.float32)}
    # optax.adamw (eps = 1e-8) agrees to float32 rounding; with integer params only on the
    # first step, since optax then stores its second moment as int32 and truncates it.
    ref_got, _ = _run(
        optax.adamw(lr, weight_decay=wd), [jnp.asarray(g, jnp.int32) for g in seq], params
    )
    for u, r in list(zip(got, ref_got, strict=True))[: 1 if int_params else None]:
        np.testing.assert_allclose(np.asarray(u), np.asarray(r), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_wrong_shaped_gradient_raises_naming_the_leaf(name):
    # A (1, 4) gradient for a (3, 4) parameter broadcasts, and would silently make the
    # moments (3, 4) again by accident, or (n, 4) -> a changed state shape. It is rejected.
    params = {"w": jnp.zeros((3, 4)), "b": jnp.zeros(4)}
    tx = TRANSFORMS[name]
    state = tx.init(params)
    grads = {"w": jnp.ones((1, 4)), "b": jnp.ones(4)}
    with pytest.raises(ValueError) as err:
        jax.jit(tx.update)(grads, state, params)
    msg = str(err.value)
    assert "['w']" in msg and "(1, 4)" in msg and "(3, 4)" in msg, msg
    with pytest.raises(ValueError, match=r"\(4,\).*\(\)"):
        jax.jit(tx.update)(jnp.ones(4), tx.init(jnp.zeros(())))


@pytest.mark.parametrize("factory,kwargs,name,allowed", BAD)
def test_bad_hyperparameter_raises_naming_it(factory, kwargs, name, allowed):
    with pytest.raises(ValueError) as err:
        factory(**kwargs)
    assert f"`{name}`" in str(err.value) and allowed in str(err.value)


def test_edge_hyperparameters_are_accepted():
    adam.scale_by_safe_adam(b1=0.0, b2=0.0, eps=0.0, eps_root=0.0)
    adam.safe_adamw(0.1, weight_decay=0.0)
    adam.adamw_atan2(0.1, b1=0.0, a=1e-3, b=1e-3, weight_decay=0.0)


# ----------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_nonfinite_gradient_stays_in_its_leaf(name, bad):
    # Documented behaviour: a transform does not hide NaN/Inf (guards skip such steps).
    params = _params()
    seq = [_grads_like(params, seed=s) for s in range(3)]
    poisoned = list(seq)
    poisoned[1] = {**seq[1], "blocks": [seq[1]["blocks"][0].at[3].set(bad), seq[1]["blocks"][1]]}
    got, _ = _run(TRANSFORMS[name], poisoned, params)
    clean, _ = _run(TRANSFORMS[name], seq, params)
    for u, c in zip(got[1:], clean[1:], strict=True):
        leaf = np.asarray(u["blocks"][0])
        assert not np.isfinite(leaf[3])
        np.testing.assert_allclose(np.delete(leaf, 3), np.delete(np.asarray(c["blocks"][0]), 3))
        others = {"dense": u["dense"], "b1": u["blocks"][1], "pair": u["pair"]}
        others_clean = {"dense": c["dense"], "b1": c["blocks"][1], "pair": c["pair"]}
        chex.assert_trees_all_close(others, others_clean, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- convergence


# optax/_src/alias_test.py: adam and adamw at learning rate 1e-1, 10000 steps, rtol=atol=3e-2.
@pytest.mark.parametrize("problem", [parabola_problem, rosenbrock_problem])
@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.adam(1e-1),
        lambda: adam.safe_adam(1e-1),
        lambda: adam.adamw_atan2(1e-1),
    ],
    ids=["optax_adam", "safe_adam", "adamw_atan2"],
)
def test_converges_like_optax_adam(make, problem):
    initial, loss, final = problem()
    params = run_optimizer(make(), initial, loss, steps=10_000)
    chex.assert_trees_all_close(params, final, rtol=3e-2, atol=3e-2)


# ----------------------------------------------------------------------------- boundedness


def _bound_sequences(b1, b2, steps):
    """Columns: the Cauchy-Schwarz-tight sequence, a spike then silence, heavy tails, signs."""
    rng = np.random.default_rng(7)
    k = np.arange(1, steps + 1, dtype=np.float64)
    tight = (b2 / b1) ** k if b1 > 0 else (k == steps).astype(np.float64)
    spike = np.where(k == 3, 1e3, np.where(k < 3, 1.0, 0.0))
    heavy = rng.standard_cauchy(steps)
    flips = (-1.0) ** k * 10.0 ** rng.uniform(-3, 3, steps)
    return np.stack([tight, spike, heavy, flips], axis=1).astype(np.float32)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("b1,b2", [(0.9, 0.999), (0.9, 0.95), (0.5, 0.3), (0.95, 0.91), (0.0, 0.5)])
def test_safe_adam_at_eps_zero_is_bounded_by_ratio_bound(b1, b2, nesterov):
    steps = 60
    cols = _bound_sequences(b1, b2, steps)
    seq = list(cols)
    tx = adam.scale_by_safe_adam(b1=b1, b2=b2, nesterov=nesterov)
    got, _ = _run(tx, [jnp.asarray(g) for g in seq])
    want = _np_safe_adam(seq, b1, b2, nesterov=nesterov)  # float64
    for t, (u, w) in enumerate(zip(got, want, strict=True), start=1):
        bound = adam.ratio_bound(b1, b2, t, nesterov=nesterov)
        np.testing.assert_allclose(np.asarray(u), w, rtol=2e-4, atol=1e-6)
        assert np.max(np.abs(w)) <= bound * (1 + 1e-9), (t, w, bound)
        assert np.max(np.abs(np.asarray(u))) <= bound * (1 + 1e-5), (t, u, bound)
        assert bound <= adam.ratio_bound(b1, b2, nesterov=nesterov) * (1 + 1e-12)
    if not nesterov:  # the bound is attained, so it is the least one
        assert abs(want[-1][0]) >= (1 - 1e-9) * adam.ratio_bound(b1, b2, steps)
        assert abs(float(got[-1][0])) >= (1 - 1e-4) * adam.ratio_bound(b1, b2, steps)


def test_ratio_bound_by_hand():
    # t = 1: m_hat = g, v_hat = g^2, so |u| = 1; the limit (1-b1)/sqrt((1-b2)(1-b1^2/b2)).
    assert adam.ratio_bound(0.9, 0.95, 1) == pytest.approx(1.0, rel=1e-12)
    assert adam.ratio_bound(0.9, 0.95) == pytest.approx(0.1 / np.sqrt(0.05 * (1 - 0.81 / 0.95)))
    assert adam.ratio_bound(0.99, 0.95) == np.inf
    assert adam.ratio_bound(0.99, 0.95, 2000) > 1e9  # finite for each t, growing


def _np_stop_after(b1, b2, on=100, steps=1600):
    return _np_safe_adam([np.ones(1)] * on + [np.zeros(1)] * (steps - on), b1, b2)


@pytest.mark.parametrize(
    "factory",
    [
        adam.scale_by_safe_adam,
        lambda **k: adam.safe_adam(1e-3, **k),
        lambda **k: adam.safe_adamw(1e-3, **k),
    ],
    ids=["scale_by_safe_adam", "safe_adam", "safe_adamw"],
)
@pytest.mark.parametrize("b1,b2", [(0.99, 0.95), (0.9, 0.81), (0.5, 0.0)])
def test_eps_zero_with_b1_squared_at_least_b2_is_rejected(factory, b1, b2):
    with pytest.raises(ValueError) as err:
        factory(b1=b1, b2=b2)
    msg = str(err.value)
    assert "`b2` must be > b1**2" in msg and "no bound" in msg and "eps > 0" in msg, msg
    factory(b1=b1, b2=b2, eps=1e-8)  # a positive eps bounds the denominator
    factory(b1=b1, b2=b2, eps_root=1e-16)


def test_the_rejected_case_really_diverges_in_float64():
    # Why the rule: b = (0.99, 0.95) at eps = 0 passes 1e9 after the gradient stops,
    # while b = (0.9, 0.95) stays under its bound.
    assert max(abs(u[0]) for u in _np_stop_after(0.99, 0.95)) > 1e9
    assert max(abs(u[0]) for u in _np_stop_after(0.9, 0.95)) <= adam.ratio_bound(0.9, 0.95)


@pytest.mark.parametrize(
    "name,want", [("safe_adam", 1.0), ("adam_atan2", 1.27 * np.pi / 4)], ids=str
)
def test_float16_constant_tiny_gradient_gives_the_full_update(name, want):
    # A constant gradient g gives m_hat / sqrt(v_hat) = 1 (atan2: a * pi/4) at any scale.
    # With a float16 first moment, (1 - b1) * 1e-7 flushes to 0 and the update was 0.11.
    g = jnp.full((3,), 1e-7, jnp.float16)
    got, state = _run(TRANSFORMS[name], [g] * 10)
    assert {x.dtype for x in _leaves((state.mu, state.nu))} == {jnp.dtype(jnp.float32)}
    assert got[-1].dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(got[-1], np.float32), want, rtol=1e-3)
    factory = {"safe_adam": adam.scale_by_safe_adam, "adam_atan2": adam.scale_by_adam_atan2}
    old, _ = _run(factory[name](mu_dtype=jnp.float16), [g] * 10)  # the failure it fixes
    assert np.all(np.asarray(old[-1], np.float32) < 0.5 * want)
