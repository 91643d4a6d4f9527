"""Tests for stabljax.precision: policies, casting and dynamic loss scaling."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabljax.precision import (
    DynamicLossScale,
    LossScaleState,
    Precision,
    all_finite,
    cast_floating,
    scale_loss,
    unscale_grads,
)

# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize(
    "policy, compute, scaled",
    [
        (Precision.fp32(), jnp.float32, False),
        (Precision.bf16(), jnp.bfloat16, False),
        (Precision.fp16(), jnp.float16, True),
        (Precision(), jnp.float32, False),
    ],
)
def test_presets(policy, compute, scaled):
    assert jnp.dtype(policy.param_dtype) == jnp.float32
    assert jnp.dtype(policy.compute_dtype) == jnp.dtype(compute)
    assert (policy.loss_scale is not None) == scaled
    assert (policy.init_loss_scale() is not None) == scaled
    hash(policy)  # static: usable as a jit static argument
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = jnp.float32


def test_fp16_preset_arguments_reach_the_scale():
    p = Precision.fp16(initial_scale=8.0, growth_interval=3, min_scale=2.0, max_scale=64.0)
    assert p.loss_scale == DynamicLossScale(
        initial_scale=8.0, growth_interval=3, min_scale=2.0, max_scale=64.0
    )
    state = p.init_loss_scale()
    chex.assert_trees_all_equal(state, LossScaleState(jnp.float32(8.0), jnp.int32(0)))
    assert state.loss_scale.dtype == jnp.float32
    assert state.loss_scale_good_steps.dtype == jnp.int32
    assert (
        DynamicLossScale().initial_scale == 2.0**15 and DynamicLossScale().growth_interval == 1000
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"param_dtype": jnp.int32},
        {"compute_dtype": jnp.bool_},
        {"loss_scale": 2.0**15},
    ],
)
def test_bad_policy_raises(kwargs):
    with pytest.raises(ValueError):
        Precision(**kwargs)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"growth_factor": float("inf")}, "growth_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"max_scale": 1e39}, "max_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0, "initial_scale": 3.0}, "max_scale"),
        ({"initial_scale": 2.0**30}, "initial_scale"),
        ({"initial_scale": 0.5}, "initial_scale"),
    ],
)
def test_bad_loss_scale_raises(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScale(**kwargs)
    with pytest.raises(ValueError, match=name):
        Precision.fp16(**kwargs)


# --------------------------------------------------------------------------- casting


def test_cast_floating_keeps_other_leaves():
    tree = {
        "w": jnp.ones((2, 3)),
        "h": jnp.ones((2,), jnp.float16),
        "i": jnp.arange(3),
        "b": jnp.array([True]),
        "none": None,
        "key": jax.random.key(0),
    }
    out = jax.jit(lambda t: cast_floating(t, jnp.bfloat16))(tree)
    assert out["w"].dtype == jnp.bfloat16 and out["h"].dtype == jnp.bfloat16
    assert out["i"].dtype == tree["i"].dtype and out["b"].dtype == jnp.bool_
    assert out["none"] is None
    assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)
    chex.assert_trees_all_equal(out["i"], tree["i"])
    back = Precision.bf16().cast_to_param(out)
    assert back["w"].dtype == jnp.float32 and back["h"].dtype == jnp.float32


# --------------------------------------------------------------------------- scaling


def test_scale_and_unscale_round_trip_keeps_dtypes():
    state = DynamicLossScale(initial_scale=1024.0).init()
    loss = jnp.float32(0.75)
    np.testing.assert_equal(float(jax.jit(scale_loss)(loss, state)), 768.0)
    assert float(scale_loss(loss, None)) == 0.75
    grads = {"a": jnp.array([1024.0, -2048.0], jnp.float16), "b": jnp.array([3.0])}
    out = jax.jit(unscale_grads)(grads, state)
    assert out["a"].dtype == jnp.float16 and out["b"].dtype == jnp.float32
    np.testing.assert_array_equal(out["a"], np.array([1.0, -2.0], np.float16))
    np.testing.assert_array_equal(out["b"], np.array([3.0 / 1024.0], np.float32))
    assert unscale_grads(grads, None) is grads


def test_all_finite():
    f = jax.jit(all_finite)
    assert bool(f({"a": jnp.ones(3), "i": jnp.arange(2)}))
    assert not bool(f({"a": jnp.ones(3), "b": jnp.array([0.0, jnp.nan])}))
    assert not bool(f([jnp.array([-jnp.inf], jnp.float16)]))
    assert bool(f({}))


# --------------------------------------------------------------------------- dynamics


def reference_scales(dls: DynamicLossScale, finite_seq):
    """Python float64 reference of the scale after each step."""
    scale, good, out = dls.initial_scale, 0, []
    for ok in finite_seq:
        if ok:
            good += 1
            if good >= dls.growth_interval:
                scale, good = min(scale * dls.growth_factor, dls.max_scale), 0
        else:
            scale, good = max(scale * dls.backoff_factor, dls.min_scale), 0
        out.append((scale, good))
    return out


def run_adjust(dls, finite_seq):
    @jax.jit
    def run(finite):
        def body(state, ok):
            state = dls.adjust(state, ok)
            return state, state

        return jax.lax.scan(body, dls.init(), finite)[1]

    states = run(jnp.asarray(finite_seq))
    return list(
        zip(np.asarray(states.loss_scale), np.asarray(states.loss_scale_good_steps), strict=True)
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_adjust_matches_reference(seed):
    dls = DynamicLossScale(initial_scale=2.0**6, growth_interval=3, min_scale=2.0, max_scale=2.0**9)
    seq = list(np.random.default_rng(seed).random(200) < 0.8)
    got = run_adjust(dls, seq)
    ref = reference_scales(dls, seq)
    assert [(float(s), int(g)) for s, g in got] == ref
    scales = {s for s, _ in ref}
    assert 2.0 in scales or 2.0**9 in scales  # the run does reach a bound


def test_grows_after_exactly_growth_interval_clean_steps():
    dls = DynamicLossScale(initial_scale=4.0, growth_interval=3)
    got = [float(s) for s, _ in run_adjust(dls, [True] * 7)]
    assert got == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0, 16.0]


def test_overflow_halves_and_resets_the_run():
    dls = DynamicLossScale(initial_scale=64.0, growth_interval=3)
    got = run_adjust(dls, [True, True, False, True, True, True])
    assert [(float(s), int(g)) for s, g in got] == [
        (64.0, 1),
        (64.0, 2),
        (32.0, 0),
        (32.0, 1),
        (32.0, 2),
        (64.0, 0),
    ]


def test_scale_never_becomes_inf_or_zero():
    f32max = float(np.finfo(np.float32).max)
    top = DynamicLossScale(
        initial_scale=1.0, growth_interval=1, growth_factor=1e10, max_scale=f32max
    )
    got = np.array([s for s, _ in run_adjust(top, [True] * 300)])
    assert np.all(np.isfinite(got)) and got[-1] == np.float32(f32max)
    tiny = float(np.finfo(np.float32).tiny)
    bottom = DynamicLossScale(initial_scale=1.0, backoff_factor=1e-10, min_scale=tiny)
    got = np.array([s for s, _ in run_adjust(bottom, [False] * 300)])
    assert np.all(got > 0) and got[-1] == np.float32(tiny)


def test_default_policy_is_the_train_steps_default():
    # Precision() used to mean bf16 compute while make_train_step defaulted to fp32
    assert Precision() == Precision.fp32()
    with pytest.raises(ValueError, match="`compute_dtype` must be a floating dtype"):
        Precision(compute_dtype=jnp.int32)
