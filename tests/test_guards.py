"""Tests for stabljax.optim.guards.skips: skip_nonfinite, skip_spikes, any_skipped, skip_streak."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    assert_bitwise_equal,
    mesh8,
    nested_params,
    random_grads_like,
    shard_leading,
)

import stabljax
from stabljax.optim.guards.skips import (
    SkipNonfiniteState,
    SkipSpikesState,
    any_skipped,
    skip_nonfinite,
    skip_spikes,
    skip_streak,
)

STATS = ("spike_accepted_steps", "spike_levels", "spike_residuals")


# --------------------------------------------------------------------------- helpers


def assert_exact_zeros(tree):
    leaves = jax.tree.leaves(tree)
    assert leaves
    for x in leaves:
        x = np.asarray(x)
        assert x.tobytes() == np.zeros_like(x).tobytes(), x


def poison(tree, value, path=("dense", "w"), index=(3, 5)):
    """Copy of ``tree`` with one element of one leaf set to ``value``."""
    leaf = tree[path[0]][path[1]]
    new = {**tree, path[0]: {**tree[path[0]], path[1]: leaf.at[index].set(value)}}
    return new


def jit_update(opt):
    return jax.jit(opt.update)


def np_window_stats(accepted, window=128):
    """(level, median residual, tail scale) of SpikeRule from the accepted values: float64.

    Recomputed from the whole history (no ring buffers): the level is the median of the last
    min(16, window) log values; each value's residual is taken against the level of the
    values before it; the last ``window`` residuals give the median and the tail scale (the
    mean of the largest max(1, n // 32) minus the median, floored at 0.01).
    """
    y = np.log(np.asarray(accepted, np.float64))
    m = min(16, window)
    res = np.array([y[i] - np.median(y[max(0, i - m) : i]) for i in range(1, len(y))])[-window:]
    med = np.median(res)
    top = max(1, len(res) // 32)
    return np.median(y[-m:]), med, max(np.mean(np.sort(res)[-top:]) - med, 1e-2)


def np_z(x, accepted, window=128):
    level, med, scale = np_window_stats(accepted, window)
    return np.expm1(np.log(np.float64(x)) - level - med) / np.expm1(scale)


def np_global_norm(tree):
    return np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(tree)))


@functools.cache
def warmed_spike_guard(watch=("loss", "grad_norm"), n=12, warmup=10):
    """A skip_spikes(adam) guard fed ``n`` normal steps: (step, params, state), shared by tests.

    Cached so that the tests reusing it compile its update once; states are immutable.
    """
    params = nested_params()
    opt = skip_spikes(optax.adam(1e-2), warmup_steps=warmup, watch=watch)
    step = jit_update(opt)
    state = opt.init(params)
    rng = np.random.default_rng(0)
    for i in range(n):
        grads = random_grads_like(params, seed=100 + i)
        _, state = step(grads, state, params, value=1.0 + 0.05 * rng.standard_normal())
    assert not bool(state.spike_skipped) and int(state.spike_accepted_steps) == n
    return step, params, state


# --------------------------------------------------------------------------- skip_nonfinite

# Shared so that parametrized cases compile once.
ADAM = optax.adam(1e-2)
ADAM_STEP = jax.jit(ADAM.update)
ADAM_GUARD = skip_nonfinite(optax.adam(1e-2))
ADAM_GUARD_STEP = jax.jit(ADAM_GUARD.update)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_skip_nonfinite_bad_leaf_exact_zeros_and_frozen_state(bad):
    params = nested_params()
    g1, g2, g3 = (random_grads_like(params, seed=s) for s in (1, 2, 3))
    opt, step = ADAM_GUARD, ADAM_GUARD_STEP
    state0 = opt.init(params)
    u1, state1 = step(g1, state0, params)
    assert not bool(state1.nonfinite_skipped)

    u2, state2 = step(poison(g2, bad), state1, params)
    assert_exact_zeros(u2)
    assert u2["pair"][1] is None
    assert_bitwise_equal(state2.nonfinite_inner_state, state1.nonfinite_inner_state)
    assert bool(state2.nonfinite_skipped)
    assert int(state2.nonfinite_skips) == 1 and int(state2.nonfinite_streak) == 1

    u3, state3 = step(g3, state2, params)
    assert not bool(state3.nonfinite_skipped)
    assert int(state3.nonfinite_skips) == 1 and int(state3.nonfinite_streak) == 0
    assert int(state3.nonfinite_inner_state[0].count) == 2  # the skipped step did not count

    # Reference: plain Adam that never saw the bad step.
    r_state = ADAM.init(params)
    r1, r_state = ADAM_STEP(g1, r_state, params)
    r3, r_state = ADAM_STEP(g3, r_state, params)
    chex.assert_trees_all_close(u1, r1, rtol=0, atol=0)
    chex.assert_trees_all_close(u3, r3, rtol=0, atol=0)
    chex.assert_trees_all_close(state3.nonfinite_inner_state, r_state, rtol=0, atol=0)


@pytest.mark.parametrize("loss", [np.nan, np.inf])
def test_skip_nonfinite_nonfinite_loss_skips(loss):
    params = nested_params()
    opt, step = ADAM_GUARD, ADAM_GUARD_STEP
    state0 = opt.init(params)
    grads = random_grads_like(params, seed=1)
    u, state1 = step(grads, state0, params, value=jnp.float32(loss))
    assert_exact_zeros(u)
    assert_bitwise_equal(state1.nonfinite_inner_state, state0.nonfinite_inner_state)
    assert bool(state1.nonfinite_skipped)
    u, state2 = step(grads, state1, params, value=jnp.float32(0.5))
    assert not bool(state2.nonfinite_skipped)
    assert int(state2.nonfinite_inner_state[0].count) == 1
    chex.assert_tree_all_finite(u)


def test_skip_nonfinite_inf_in_inner_output_skips():
    params = nested_params()
    # Finite gradients, but the inner output overflows float32 (0.01 * 1e60).
    inner = optax.chain(optax.adam(1e-2), optax.scale(1e30), optax.scale(1e30))
    opt = skip_nonfinite(inner, check_update=True)
    step = jit_update(opt)
    state0 = opt.init(params)
    u, state1 = step(random_grads_like(params, seed=1), state0, params)
    assert_exact_zeros(u)
    assert bool(state1.nonfinite_skipped)
    assert_bitwise_equal(state1.nonfinite_inner_state, state0.nonfinite_inner_state)
    assert int(state1.nonfinite_inner_state[0][0].count) == 0


@pytest.mark.parametrize("shape", [(), (1,), (3,), (4,), (2, 6), (3, 5), (2, 3, 4)])
def test_skip_nonfinite_finds_one_nonfinite_inner_value_at_any_position(shape):
    # The probe ANDs adjacent pairs along the last axis before reducing: every position,
    # odd and even, first and last, must still count. The inner update is g * params.
    inner = optax.stateless(lambda u, p: jax.tree.map(jnp.multiply, u, p))
    opt = skip_nonfinite(inner, check_update=True)
    step = jit_update(opt)
    grads = {"w": jnp.ones(shape)}
    state = opt.init(grads)
    _, s = step(grads, state, {"w": jnp.full(shape, 2.0)})
    assert not bool(s.nonfinite_skipped)  # the control
    for i in range(int(np.prod(shape))):
        for bad in (np.inf, -np.inf, np.nan):
            p = np.full(int(np.prod(shape)), 2.0, np.float32)
            p[i] = bad
            u, s = step(grads, state, {"w": jnp.asarray(p.reshape(shape))})
            assert bool(s.nonfinite_skipped), (i, bad)
            assert_exact_zeros(u)


def test_skip_nonfinite_skips_finite_gradients_whose_float32_norm_overflows():
    # The gradients are checked through their float32 global norm: float32 max is
    # 3.40e38, so a norm of 3e19 (norm² 9e38) overflows while 1.5e19 (norm² 2.25e38) does not.
    opt = skip_nonfinite(optax.sgd(1e-20))
    step = jit_update(opt)
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    state0 = opt.init(params)
    huge = {"a": jnp.array([3e19, 0.0]), "b": jnp.zeros(3)}
    u, state1 = step(huge, state0, params)
    assert_exact_zeros(u)
    assert bool(state1.nonfinite_skipped)
    large = {"a": jnp.array([1.5e19, 0.0]), "b": jnp.zeros(3)}
    u, state2 = step(large, state1, params)
    assert not bool(state2.nonfinite_skipped)
    np.testing.assert_allclose(u["a"], [-0.15, 0.0], rtol=1e-6)


def test_skip_nonfinite_never_gives_up_unlike_apply_if_finite():
    params = {"w": jnp.ones((4,))}
    nan_grads = {"w": jnp.array([1.0, jnp.nan, 1.0, 1.0])}

    def run(opt, steps):
        step = jax.jit(opt.update)
        state = opt.init(params)
        p = params
        for _ in range(steps):
            u, state = step(nan_grads, state, p)
            p = optax.apply_updates(p, u)
        return p, state

    p_ours, state = run(skip_nonfinite(optax.sgd(0.1)), 10)
    assert_bitwise_equal(p_ours, params)
    assert int(state.nonfinite_streak) == 10 and int(state.nonfinite_skips) == 10
    assert int(skip_streak(state)) == 10

    # The failure case: optax.apply_if_finite gives up after max_consecutive_errors.
    p_optax, _ = run(optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3), 10)
    assert np.isnan(np.asarray(p_optax["w"])).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_skip_nonfinite_keeps_dtypes(dtype):
    params = {"a": jnp.ones((8,), dtype), "b": jnp.ones((2, 3), jnp.float32), "c": None}
    opt = skip_nonfinite(optax.adam(1e-2))
    step = jit_update(opt)
    state = opt.init(params)
    good = {"a": jnp.full((8,), 0.5, dtype), "b": jnp.full((2, 3), -0.5), "c": None}
    bad = {**good, "a": good["a"].at[0].set(jnp.nan)}
    for grads in (good, bad):
        u, state = step(grads, state, params)
        assert u["a"].dtype == dtype and u["b"].dtype == jnp.float32 and u["c"] is None
    assert bool(state.nonfinite_skipped)
    assert_exact_zeros(u)


# --------------------------------------------------------------------------- skip_spikes


@pytest.mark.parametrize("window", [8, 128])
def test_skip_spikes_statistics_match_numpy_reference(window):
    """z of every step against a float64 recomputation of the windows (8: the rings wrap)."""
    params = nested_params()
    warmup = 5
    opt = skip_spikes(optax.sgd(0.1), window=window, warmup_steps=warmup)
    step = jit_update(opt)
    state = opt.init(params)
    rng = np.random.default_rng(0)
    losses, norms = [], []
    for t in range(40):
        grads = random_grads_like(params, seed=t, scale=1.0 + 0.03 * rng.standard_normal())
        loss = np.float32((2.0 - 0.02 * t) * (1 + 0.03 * rng.standard_normal()))
        x = np.array([loss, np_global_norm(grads)])
        if t < warmup:
            z_ref = np.zeros(2)
        else:
            z_ref = np.array([np_z(x[i], v, window) for i, v in enumerate((losses, norms))])
        u, state = step(grads, state, params, value=loss)
        assert not bool(state.spike_skipped), t  # gentle noise: no spike
        losses.append(x[0])
        norms.append(x[1])
        np.testing.assert_allclose(np.asarray(state.spike_zscore), z_ref, rtol=1e-3, atol=1e-3)
        assert int(state.spike_accepted_steps) == t + 1
        chex.assert_trees_all_close(u, jax.tree.map(lambda g: -0.1 * g, grads), rtol=1e-6)
    assert int(state.spike_rebaselines) == 0


@pytest.mark.parametrize("noise", ["gauss_3pct", "student_t3_5pct"])
def test_skip_spikes_catches_2x_on_a_falling_loss_and_heavy_tails_stay_quiet(noise):
    """The two cases an EMA rule got wrong: a 2x spike on a falling loss (3 % Gaussian noise)
    is caught at its step (z > 9 by the float64 reference too); Student-t(3) noise at 5 % of
    the level, with no spike, skips nothing."""
    opt = skip_spikes(optax.sgd(0.1), watch=("loss",))
    step = jit_update(opt)
    params, g = {"w": jnp.zeros(2)}, {"w": jnp.ones(2)}
    rng = np.random.default_rng(3)
    t = np.arange(600)
    trend = 0.1 + 2.0 * np.exp(-t / 100)
    if noise == "gauss_3pct":
        factor = (1 + 0.03 * rng.standard_normal(600)) * np.where(t % 150 == 149, 2.0, 1.0)
    else:
        factor = 1 + 0.05 * rng.standard_t(3, 600)
    state, accepted = opt.init(params), []
    for i in t:
        spike = noise == "gauss_3pct" and i % 150 == 149
        loss = np.float32(trend[i] * factor[i])
        _, state = step(g, state, params, value=loss)
        if spike:
            assert np_z(loss, accepted) > 9.0, i
        assert bool(state.spike_skipped) == spike, (i, float(state.spike_zscore[0]))
        if not spike:
            accepted.append(loss)


@pytest.mark.parametrize("which", ["loss", "grad_norm"])
def test_skip_spikes_spike_skipped_then_normal_steps_applied(which):
    step, params, state = warmed_spike_guard()
    rng = np.random.default_rng(1)
    grads = random_grads_like(params, seed=7)
    loss = 1.0
    if which == "loss":
        loss = 10.0
    else:
        grads = jax.tree.map(lambda g: 100.0 * g, grads)
    before = state
    u, state = step(grads, state, params, value=loss)
    i = ("loss", "grad_norm").index(which)
    assert float(state.spike_zscore[i]) > 9.0
    assert bool(state.spike_skipped) and int(state.spike_streak) == 1
    assert_exact_zeros(u)
    assert_bitwise_equal(state.spike_inner_state, before.spike_inner_state)
    for field in STATS:
        assert_bitwise_equal(getattr(state, field), getattr(before, field))

    for t in range(5):
        grads = random_grads_like(params, seed=200 + t)
        u, state = step(grads, state, params, value=1.0 + 0.05 * rng.standard_normal())
        assert not bool(state.spike_skipped), t
        assert int(state.spike_streak) == 0
        assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(u))
    assert int(state.spike_skips) == 1 and int(state.spike_accepted_steps) == 12 + 5


def test_skip_spikes_is_one_sided():
    step, params, state = warmed_spike_guard()
    grads = jax.tree.map(lambda g: 1e-3 * g, random_grads_like(params, seed=7))
    _, state = step(grads, state, params, value=1e-3)
    assert float(state.spike_zscore[0]) < 0.0 and float(state.spike_zscore[1]) < 0.0
    assert not bool(state.spike_skipped)
    # A loss <= 0 has no logarithm: never a spike, and the windows stay finite.
    _, state = step(grads, state, params, value=-50.0)
    assert not bool(state.spike_skipped) and float(state.spike_zscore[0]) == 0.0
    chex.assert_tree_all_finite((state.spike_levels, state.spike_residuals))


@pytest.mark.parametrize("bad", ["nan_loss", "inf_loss", "nan_grad"])
def test_skip_spikes_nonfinite_does_not_poison_statistics(bad):
    """MaxText/Levanter let a NaN into the history; here it is skipped and kept out."""
    step, params, state = warmed_spike_guard()
    rng = np.random.default_rng(1)
    grads = random_grads_like(params, seed=7)
    loss = {"nan_loss": np.nan, "inf_loss": np.inf}.get(bad, 1.0)
    if bad == "nan_grad":
        grads = poison(grads, jnp.nan)
    before = state
    u, state = step(grads, state, params, value=loss)
    assert bool(state.spike_skipped)
    assert_exact_zeros(u)
    assert_bitwise_equal(state.spike_inner_state, before.spike_inner_state)
    for field in STATS:
        assert_bitwise_equal(getattr(state, field), getattr(before, field))
    chex.assert_tree_all_finite((state.spike_levels, state.spike_residuals))
    for t in range(3):
        grads = random_grads_like(params, seed=300 + t)
        u, state = step(grads, state, params, value=1.0 + 0.05 * rng.standard_normal())
        assert not bool(state.spike_skipped), t
        chex.assert_tree_all_finite(u)


def test_skip_spikes_warmup_only_gathers_but_skips_nonfinite():
    params = {"w": jnp.ones((3,))}
    opt = skip_spikes(optax.sgd(1.0), warmup_steps=5, watch=("loss",))
    step = jit_update(opt)
    state = opt.init(params)
    g = {"w": jnp.ones((3,))}
    wild = [1.0, 1e4, 1.0, 1e8]
    for loss in wild:
        u, state = step(g, state, params, value=loss)
        assert not bool(state.spike_skipped)
        np.testing.assert_array_equal(np.asarray(u["w"]), -np.ones(3))
    # A NaN during warmup is still skipped and not counted.
    u, state = step(g, state, params, value=np.nan)
    assert bool(state.spike_skipped) and int(state.spike_accepted_steps) == 4
    assert_exact_zeros(u)
    y = np.log(wild)
    np.testing.assert_allclose(np.asarray(state.spike_levels[0, :4]), y, rtol=1e-6)
    res = [y[1] - y[0], y[2] - np.median(y[:2]), y[3] - np.median(y[:3])]
    np.testing.assert_allclose(np.asarray(state.spike_residuals[0, :3]), res, rtol=1e-6)


def test_skip_spikes_skips_nonfinite_inner_output_during_warmup():
    params = {"w": jnp.ones((3,))}
    inner = optax.chain(optax.sgd(1.0), optax.scale(1e30), optax.scale(1e30))
    opt = skip_spikes(inner, watch=("grad_norm",), check_update=True)
    state0 = opt.init(params)
    u, state = jit_update(opt)({"w": jnp.ones((3,))}, state0, params)
    assert bool(state.spike_skipped) and int(state.spike_accepted_steps) == 0
    assert_exact_zeros(u)


def test_skip_spikes_constant_signal_deterministic_repeat_then_rebaseline():
    params = {"w": jnp.ones((2,))}
    opt = skip_spikes(optax.sgd(1.0), warmup_steps=3, watch=("loss",), rebaseline_after=6)
    step = jit_update(opt)
    state = opt.init(params)
    g = {"w": jnp.ones((2,))}
    for _ in range(4):  # constant signal: residuals 0, tail scale at its floor 0.01
        _, state = step(g, state, params, value=2.0)
        assert not bool(state.spike_skipped)
    # A value exactly at the level is never skipped.
    _, state = step(g, state, params, value=2.0)
    assert not bool(state.spike_skipped) and float(state.spike_zscore[0]) == 0.0
    # A flagged step repeats on a deterministic objective: the windows do not move...
    for streak in range(1, 6):
        before = state
        _, state = step(g, state, params, value=2.5)
        assert bool(state.spike_skipped) and int(state.spike_streak) == streak
        # z = (2.5 / 2 - 1) / expm1(0.01)
        np.testing.assert_allclose(float(state.spike_zscore[0]), 0.25 / np.expm1(0.01), rtol=1e-3)
        for field in STATS:
            assert_bitwise_equal(getattr(state, field), getattr(before, field))
        assert int(skip_streak(state)) == streak and int(state.spike_rebaselines) == 0
    # ...until the 6th agreeing skip: still skipped, but the level is now log 2.5.
    _, state = step(g, state, params, value=2.5)
    assert bool(state.spike_skipped) and int(state.spike_rebaselines) == 1
    np.testing.assert_allclose(np.asarray(state.spike_levels[0]), np.log(2.5), rtol=1e-6)
    _, state = step(g, state, params, value=2.5)
    assert not bool(state.spike_skipped) and int(state.spike_streak) == 0
    assert int(state.spike_skips) == 6 and int(state.spike_rebaselines) == 1


def _shifted_losses(jump, *, n_before=60, n_after=30, seed=0):
    rng = np.random.default_rng(seed)
    level = np.r_[np.ones(n_before), np.full(n_after, jump)]
    return (level * (1 + 0.03 * rng.standard_normal(level.size))).astype(np.float32)


@pytest.mark.parametrize("k", [2, 6, 8])
def test_skip_spikes_level_shift_rebaselined_after_k_agreeing_skips(k):
    opt = skip_spikes(optax.sgd(1.0), watch=("loss",), rebaseline_after=k)
    step = jit_update(opt)
    params, g = {"w": jnp.ones((2,))}, {"w": jnp.ones((2,))}
    state = opt.init(params)
    skipped = []
    for loss in _shifted_losses(2.0):
        _, state = step(g, state, params, value=loss)
        skipped.append(bool(state.spike_skipped))
    assert skipped == [False] * 60 + [True] * k + [False] * (30 - k)
    assert int(state.spike_rebaselines) == 1 and int(state.spike_skips) == k


def test_skip_spikes_burst_above_max_ratio_and_disagreeing_runs_are_not_absorbed():
    opt = skip_spikes(optax.sgd(1.0), watch=("loss",))
    step = jit_update(opt)
    params, g = {"w": jnp.ones((2,))}, {"w": jnp.ones((2,))}
    # A 10x burst agrees with itself but is more than rebaseline_max_ratio (4) above.
    state = opt.init(params)
    for loss in _shifted_losses(10.0, n_after=20):
        _, state = step(g, state, params, value=loss)
    assert int(state.spike_streak) == 20 and int(state.spike_rebaselines) == 0
    # Spikes that do not agree with each other (2x and 3.5x alternating) are outliers.
    state = opt.init(params)
    for loss in [*_shifted_losses(1.0, n_after=0), *[2.0, 3.5] * 10]:
        _, state = step(g, state, params, value=loss)
    assert int(state.spike_streak) == 20 and int(state.spike_rebaselines) == 0
    # rebaseline_after=None never re-baselines.
    opt = skip_spikes(optax.sgd(1.0), watch=("loss",), rebaseline_after=None)
    state = opt.init(params)
    for loss in _shifted_losses(2.0):
        _, state = jax.jit(opt.update)(g, state, params, value=loss)
    assert int(state.spike_streak) == 30 and int(state.spike_rebaselines) == 0


def _run_skips(opt, losses):
    step = jit_update(opt)
    params, g = {"w": jnp.ones((2,))}, {"w": jnp.ones((2,))}
    state, skipped = opt.init(params), []
    for loss in losses:
        _, state = step(g, state, params, value=loss)
        skipped.append(bool(state.spike_skipped))
    return skipped, state


def test_skip_spikes_recorded_garbage_window_is_skipped_whole():
    # Issue 37's recorded stream: ~150 steps near 2.7, 30 garbage batches near 9.2 (3.4x, above
    # rebaseline_ratio 2.5 and shorter than rebaseline_max_after 64), then back near 2.7.
    losses = 2.7 * np.r_[_shifted_losses(9.2 / 2.7, n_before=150), _shifted_losses(1.0, seed=1)]
    skipped, state = _run_skips(skip_spikes(optax.sgd(1.0), watch=("loss",)), losses)
    assert skipped == [False] * 150 + [True] * 30 + [False] * 90
    assert int(state.spike_rebaselines) == 0 and int(state.spike_skips) == 30


@pytest.mark.parametrize(
    "jump, kwargs, cost",
    [
        (2.4, {}, 6),  # log 2.4 = 0.875 <= log 2.5 = 0.916: absorbed after K = 6
        (2.6, {}, 64),  # above 2.5, below 4: absorbed after rebaseline_max_after = 64
        (3.9, {}, 64),
        (4.1, {}, None),  # above rebaseline_max_ratio: never
        (3.0, {"rebaseline_max_after": 10}, 10),
        (3.0, {"rebaseline_ratio": 3.5}, 6),
        (2.2, {"rebaseline_max_ratio": 2.0}, None),  # rebaseline_ratio is capped at the max
        (1.9, {"rebaseline_max_ratio": 2.0}, 6),
    ],
)
def test_skip_spikes_ratio_limit_grows_with_the_run_length(jump, kwargs, cost):
    # A constant signal (scale at its 0.01 floor, the run's span 0) isolates the ratio limit.
    opt = skip_spikes(optax.sgd(1.0), warmup_steps=3, watch=("loss",), **kwargs)
    skipped, state = _run_skips(opt, [1.0] * 8 + [jump] * 100)
    if cost is None:
        assert skipped == [False] * 8 + [True] * 100
        assert int(state.spike_rebaselines) == 0 and int(state.spike_streak) == 100
    else:
        assert skipped == [False] * 8 + [True] * cost + [False] * (100 - cost)
        assert int(state.spike_rebaselines) == 1 and int(state.spike_skips) == cost


def test_skip_spikes_nan_resets_a_run_and_never_enters_it():
    opt = skip_spikes(optax.sgd(1.0), watch=("loss",), rebaseline_after=3)
    step = jit_update(opt)
    params, g = {"w": jnp.ones((2,))}, {"w": jnp.ones((2,))}
    state = opt.init(params)
    for loss in _shifted_losses(1.0, n_after=0):
        _, state = step(g, state, params, value=loss)
    for loss, length in [(2.0, 1), (2.0, 2), (np.nan, 0), (2.0, 1), (2.0, 2)]:
        _, state = step(g, state, params, value=loss)
        assert bool(state.spike_skipped) and int(state.spike_run_length) == length
        chex.assert_tree_all_finite(state.spike_run)
    _, state = step(g, state, params, value=2.0)
    assert bool(state.spike_skipped) and int(state.spike_rebaselines) == 1


def test_skip_spikes_grad_norm_only_needs_no_loss():
    params = nested_params()
    opt = skip_spikes(optax.sgd(0.1), warmup_steps=3, watch=("grad_norm",))
    step = jit_update(opt)
    state = opt.init(params)
    for t in range(4):
        _, state = step(random_grads_like(params, seed=t), state, params)
    assert not bool(state.spike_skipped) and state.spike_levels.shape == (1, 16)
    big = jax.tree.map(lambda g: 50.0 * g, random_grads_like(params, seed=9))
    u, state = step(big, state, params)
    assert bool(state.spike_skipped)
    assert_exact_zeros(u)


def test_skip_spikes_missing_loss_raises_at_trace_time():
    params = {"w": jnp.ones((2,))}
    opt = skip_spikes(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"value=loss.*watch=\('grad_norm',\)"):
        jax.jit(opt.update)({"w": jnp.ones((2,))}, opt.init(params), params)
    with pytest.raises(ValueError, match="`value` must be a scalar"):
        jax.jit(opt.update)({"w": jnp.ones((2,))}, opt.init(params), params, value=jnp.ones((3,)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_skip_spikes_keeps_dtypes_and_none_leaves(dtype):
    # Cast f32 trees rather than drawing bf16 ones: same tree, fewer eager compiles.
    params = jax.tree.map(lambda x: x.astype(dtype), nested_params())
    opt = skip_spikes(optax.sgd(1e-2), warmup_steps=2)
    step = jit_update(opt)
    state = opt.init(params)
    grads = jax.tree.map(lambda x: x.astype(dtype), random_grads_like(nested_params(), seed=1))
    u, state = step(grads, state, params, value=jnp.asarray(1.0, dtype))
    log_norm = np.log(np_global_norm(grads))
    np.testing.assert_allclose(float(state.spike_levels[1, 0]), log_norm, rtol=1e-6)
    u2, state = step(poison(grads, jnp.nan), state, params, value=jnp.asarray(1.0, dtype))
    for out in (u, u2):
        assert out["pair"][1] is None
        chex.assert_trees_all_equal_dtypes(out, grads)
    assert bool(state.spike_skipped)
    assert_exact_zeros(u2)


# --------------------------------------------------------------------------- nesting and helpers


def test_nested_guards_and_helpers():
    params = nested_params()
    opt = skip_nonfinite(skip_spikes(optax.adam(1e-2), warmup_steps=3))
    step = jit_update(opt)
    state = opt.init(params)
    for t in range(4):
        _, state = step(random_grads_like(params, seed=t), state, params, value=1.0 + 0.01 * t)
    assert not bool(any_skipped(state)) and int(skip_streak(state)) == 0

    # A loss spike: the inner skip_spikes skips (zeros are finite, so the outer does not).
    u, state = step(random_grads_like(params, seed=9), state, params, value=100.0)
    assert_exact_zeros(u)
    assert bool(state.nonfinite_inner_state.spike_skipped) and not bool(state.nonfinite_skipped)
    assert bool(any_skipped(state)) and int(skip_streak(state)) == 1

    # A NaN loss: the outer guard skips and keeps the whole inner state, spike guard included.
    before = state
    u, state = step(random_grads_like(params, seed=10), state, params, value=np.nan)
    assert_exact_zeros(u)
    assert bool(state.nonfinite_skipped)
    assert_bitwise_equal(state.nonfinite_inner_state, before.nonfinite_inner_state)
    assert bool(jax.jit(any_skipped)(state)) and int(jax.jit(skip_streak)(state)) == 1


def test_helpers_without_guards_and_through_wrappers():
    params = {"w": jnp.ones((2,))}
    plain = optax.adam(1e-2).init(params)
    assert jax.jit(any_skipped)(plain).dtype == jnp.bool_
    assert not bool(any_skipped(plain))
    assert int(skip_streak(plain)) == 0 and skip_streak(plain).dtype == jnp.int32

    opt = optax.chain(
        skip_nonfinite(optax.scale(1.0)),
        optax.inject_hyperparams(
            lambda learning_rate: skip_spikes(optax.sgd(learning_rate), watch=("grad_norm",))
        )(learning_rate=0.1),
    )
    opt = optax.MultiSteps(opt, 1, should_skip_update_fn=stabljax.skip_nonfinite_micro_batch)
    state = opt.init(params)
    step = jax.jit(opt.update)
    g = {"w": jnp.array([1.0, 1.0])}
    _, state = step(g, state, params, value=np.nan)
    assert bool(any_skipped(state)) and int(skip_streak(state)) == 1
    assert isinstance(state.inner_opt_state[0], SkipNonfiniteState)
    assert isinstance(state.inner_opt_state[1].inner_state, SkipSpikesState)
    assert not bool(state.inner_opt_state[1].inner_state.spike_skipped)
    _, state = step(g, state, params, value=np.nan)
    assert int(skip_streak(state)) == 2
    _, state = step(g, state, params, value=1.0)
    assert not bool(any_skipped(state)) and int(skip_streak(state)) == 0


def test_inside_chain_loss_reaches_guard():
    params = nested_params()
    guarded = optax.chain(optax.clip_by_global_norm(1.0), skip_nonfinite(optax.adam(1e-2)))
    plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    g_step, p_step = jit_update(guarded), jit_update(plain)
    gs, ps = guarded.init(params), plain.init(params)
    for t in range(3):
        grads = random_grads_like(params, seed=t)
        gu, gs = g_step(grads, gs, params, value=1.0)
        pu, ps = p_step(grads, ps, params)
        chex.assert_trees_all_close(gu, pu, rtol=0, atol=0)
    u, gs = g_step(random_grads_like(params, seed=5), gs, params, value=np.nan)
    assert_exact_zeros(u)
    assert bool(gs[1].nonfinite_skipped)


def test_inside_inject_hyperparams():
    params = {"w": jnp.ones((2,))}
    # The documented composition: inject around an optimizer built with the guard.
    opt = optax.inject_hyperparams(lambda learning_rate: skip_nonfinite(optax.sgd(learning_rate)))(
        learning_rate=0.1
    )
    step = jit_update(opt)
    state = opt.init(params)
    u, state = step({"w": jnp.ones((2,))}, state, params, value=1.0)
    np.testing.assert_allclose(np.asarray(u["w"]), [-0.1, -0.1], rtol=1e-7)
    u, state = step({"w": jnp.ones((2,))}, state, params, value=np.nan)  # extra arg reached it
    assert_exact_zeros(u)
    assert bool(any_skipped(state))
    # inject's own count sits outside the guard: it counts every call, skipped or not.
    assert int(state.count) == 2

    # The guard's own numeric hyperparameters can be injected too.
    with pytest.raises(ValueError, match="`window` sets the shape"):
        bad = optax.inject_hyperparams(skip_spikes)(optax.sgd(0.1), watch=("loss",))
        jax.jit(bad.init)(params)
    static = ("watch", "window", "rebaseline_after")
    opt = optax.inject_hyperparams(skip_spikes, static_args=static)(
        optax.sgd(0.1), z_threshold=3.0, warmup_steps=2, watch=("loss",)
    )
    step = jit_update(opt)
    state = jax.jit(opt.init)(params)  # the factory then sees traced hyperparameters
    assert float(state.hyperparams["z_threshold"]) == 3.0
    skipped = []
    for loss in (1.0, 1.1, 0.9, 50.0, 1.0):
        _, state = step({"w": jnp.ones((2,))}, state, params, value=loss)
        skipped.append(bool(any_skipped(state)))
    assert skipped == [False, False, False, True, False]


def test_with_multisteps():
    params = {"dense": {"w": jnp.ones((4, 6))}, "b": jnp.zeros((3,))}
    grads = [random_grads_like(params, seed=t) for t in range(4)]
    # Guard inside MultiSteps (which drops non-finite micro-batches; without that filter
    # init raises, tests/test_multisteps_guards.py) equals MultiSteps of the bare optimizer.
    drop = stabljax.skip_nonfinite_micro_batch
    inside = optax.MultiSteps(skip_nonfinite(optax.adam(1e-2)), 2, should_skip_update_fn=drop)
    bare = optax.MultiSteps(optax.adam(1e-2), 2)
    i_step, b_step = jax.jit(inside.update), jax.jit(bare.update)
    i_state, b_state = inside.init(params), bare.init(params)
    for g in grads:
        iu, i_state = i_step(g, i_state, params)
        bu, b_state = b_step(g, b_state, params)
        chex.assert_trees_all_close(iu, bu, rtol=0, atol=0)
    # A NaN mini-step inside is dropped: the next two finite ones emit as the bare one does.
    iu, i_state = i_step(poison(grads[0], jnp.nan), i_state, params)
    assert_exact_zeros(iu)
    for g in grads:
        iu, i_state = i_step(g, i_state, params)
        bu, b_state = b_step(g, b_state, params)
        chex.assert_trees_all_close(iu, bu, rtol=0, atol=0)

    # Guard around MultiSteps: a NaN mini-step leaves the accumulator untouched, and
    # value= is forwarded through MultiSteps to a nested skip_spikes.
    outside = skip_nonfinite(
        optax.MultiSteps(skip_spikes(optax.adam(1e-2), watch=("loss",), warmup_steps=2), 2)
    )
    step = jax.jit(outside.update)
    state = outside.init(params)
    _, state = step(grads[0], state, params, value=1.0)
    before = state
    u, state = step(poison(grads[1], jnp.nan), state, params, value=1.0)
    assert_exact_zeros(u)
    assert_bitwise_equal(state.nonfinite_inner_state, before.nonfinite_inner_state)
    u, state = step(grads[1], state, params, value=1.0)  # emits the mean of grads[0], grads[1]
    assert int(state.nonfinite_inner_state.inner_opt_state.spike_accepted_steps) == 1
    assert not bool(any_skipped(state))
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(u))


@pytest.mark.parametrize(
    "make", [lambda: skip_nonfinite(optax.adam(1e-2)), lambda: skip_spikes(optax.adam(1e-2))]
)
def test_no_recompile(make):
    opt = make()
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(grads, state, loss):
        return opt.update(grads, state, params, value=loss)

    state = opt.init(params)
    for t, loss in enumerate([1.0, np.nan, 1.1]):
        _, state = step(random_grads_like(params, seed=t), state, jnp.float32(loss))
    chex.clear_trace_counter()


def test_sharded_equals_unsharded_and_one_global_decision():
    mesh = mesh8()
    params = {
        "w": jax.random.normal(jax.random.key(0), (16, 8)),
        "b": jax.random.normal(jax.random.key(1), (8,)),
        "s": jnp.ones((3,)),  # not divisible by 8: replicated
    }
    opt = skip_nonfinite(skip_spikes(optax.adam(1e-2), warmup_steps=2))
    step = jit_update(opt)
    # One direction at norms 1, 1.02, 0.98, 1: with warmup 2 the test rests on one residual.
    base = random_grads_like(params, seed=0)
    grads = [jax.tree.map(lambda g, c=c: c * g, base) for c in (1.0, 1.02, 0.98, 1.0)]
    nan = dict(grads[3], w=grads[3]["w"].at[15, 7].set(jnp.nan))  # lives on the last device
    spike = dict(grads[3], w=grads[3]["w"].at[15, 7].set(1e4))  # a spike in one shard only
    seq = [*grads[:3], nan, spike, grads[3]]
    losses = [1.0, 1.1, 0.9, 1.0, 1.0, 1.0]

    def run(p, gs):
        state = opt.init(p)
        outs = []
        for g, loss in zip(gs, losses, strict=True):
            u, state = step(g, state, p, value=loss)
            outs.append((u, state))
        return outs

    plain = run(params, seq)
    sharded = run(shard_leading(params, mesh), [shard_leading(g, mesh) for g in seq])
    assert "data" in str(sharded[0][0]["w"].sharding.spec)
    for (pu, ps), (su, ss) in zip(plain, sharded, strict=True):
        chex.assert_trees_all_close(su, pu, rtol=1e-6, atol=1e-7)
        # A residual is a difference of two float32 logs: its error is absolute, an ulp of
        # the log (the sharded norm sums in another order), so it is compared apart.
        # z divides that by the tail scale (floored at 0.01): 1e-4, or 1e-5 of a large z.
        inner = [s.nonfinite_inner_state for s in (ss, ps)]
        chex.assert_trees_all_close(*[i.spike_residuals for i in inner], rtol=0, atol=1e-6)
        chex.assert_trees_all_close(*[i.spike_zscore for i in inner], rtol=1e-5, atol=1e-4)
        rest = [
            s._replace(nonfinite_inner_state=i._replace(spike_residuals=0, spike_zscore=0))
            for s, i in zip((ss, ps), inner, strict=True)
        ]
        chex.assert_trees_all_close(*rest, rtol=1e-6, atol=1e-7)
    flags = [
        (bool(s.nonfinite_skipped), bool(s.nonfinite_inner_state.spike_skipped)) for _, s in sharded
    ]
    assert flags == [(False, False)] * 3 + [(True, False), (False, True), (False, False)]
    for i in (3, 4):  # every leaf, on every device, is zero; the inner state is kept
        assert_exact_zeros(sharded[i][0])
    assert_bitwise_equal(sharded[3][1].nonfinite_inner_state, sharded[2][1].nonfinite_inner_state)
    assert_bitwise_equal(
        sharded[4][1].nonfinite_inner_state.spike_inner_state,
        sharded[2][1].nonfinite_inner_state.spike_inner_state,
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"z_threshold": 0.0}, "z_threshold"),
        ({"z_threshold": -1.0}, "z_threshold"),
        ({"z_threshold": float("nan")}, "z_threshold"),
        ({"window": 7}, "window"),
        ({"window": 128.0}, "window"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"warmup_steps": 1}, "warmup_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"rebaseline_after": 1}, "rebaseline_after"),
        ({"rebaseline_after": 0}, "rebaseline_after"),
        ({"rebaseline_after": 2.5}, "rebaseline_after"),
        ({"rebaseline_max_ratio": 1.0}, "rebaseline_max_ratio"),
        ({"rebaseline_max_ratio": float("nan")}, "rebaseline_max_ratio"),
        ({"rebaseline_ratio": 1.0}, "rebaseline_ratio"),
        ({"rebaseline_ratio": float("nan")}, "rebaseline_ratio"),
        ({"rebaseline_max_after": 5}, "rebaseline_max_after"),
        ({"rebaseline_max_after": 64.0}, "rebaseline_max_after"),
        ({"rebaseline_after": None, "rebaseline_max_after": 1}, "rebaseline_max_after"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"watch": ()}, "watch"),
        ({"watch": ("loss", "accuracy")}, "watch"),
        ({"watch": ("loss", "loss")}, "watch"),
        ({"watch": "loss"}, "watch"),
    ],
)
def test_skip_spikes_bad_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        skip_spikes(optax.sgd(0.1), **kwargs)


def test_skip_spikes_valid_edge_hyperparameters():
    edges = (
        {"warmup_steps": 2, "window": 8},
        {"rebaseline_after": None, "z_threshold": 0.1},
        {"rebaseline_after": 2, "rebaseline_max_ratio": 1.01},
        {"rebaseline_after": 8, "rebaseline_max_after": 8, "rebaseline_ratio": 1.01},
    )
    for kwargs in edges:
        opt = skip_spikes(optax.sgd(0.1), watch=("grad_norm",), **kwargs)
        params = {"w": jnp.ones((2,))}
        u, state = jit_update(opt)({"w": jnp.ones((2,))}, opt.init(params), params)
        assert not bool(state.spike_skipped)  # first step: no statistics yet, only gathers
        np.testing.assert_allclose(np.asarray(u["w"]), [-0.1, -0.1], rtol=1e-7)


def test_spike_rebaselines_reads_nested_guards_and_reaches_the_step_metrics():
    inner = skip_spikes(optax.sgd(0.1), watch=("loss",), rebaseline_after=2)
    opt = skip_nonfinite(optax.chain(optax.identity(), inner))
    step = jit_update(opt)
    params, g = {"w": jnp.ones((2,))}, {"w": jnp.ones((2,))}
    state = opt.init(params)
    assert int(stabljax.optim.guards.skips.spike_rebaselines(state)) == 0
    counts = []
    for loss in _shifted_losses(2.0, n_after=4):
        _, state = step(g, state, params, value=loss)
        counts.append(int(stabljax.optim.guards.skips.spike_rebaselines(state)))
    assert counts == [0] * 61 + [1] * 3  # the 2nd agreeing spike re-baselines
    assert int(stabljax.optim.guards.skips.spike_rebaselines(optax.sgd(0.1).init(params))) == 0

    def loss_fn(p, batch, **_):
        return batch + 0.0 * jnp.sum(p["w"]), {}  # the loss is the batch: the stream

    train = stabljax.make_train_step(loss_fn, opt)
    ts = stabljax.TrainState.create({"w": jnp.ones((2,))}, opt)
    seen = []
    for loss in _shifted_losses(2.0, n_after=4):
        ts, m = train(ts, jnp.float32(loss))
        seen.append(int(m["spike_rebaselines"]))
    assert m["spike_rebaselines"].dtype == jnp.int32 and seen == counts
