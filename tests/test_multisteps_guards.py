"""Guards and ``optax.MultiSteps`` (issue 42): every placement is safe or loud.

Reference: plain ``optax.MultiSteps(optax.adamw(...), k)`` fed the same micro-batches with the
NaN one left out. A safe placement fed all of them must end on the same parameters, report a
skip on the NaN micro-batch only (0 skips after its accumulation window) and emit as many
optimizer steps.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh8, shard_leading

import stabljax
from stabljax.optim.guards.skips import any_skipped, skip_nonfinite, skip_spikes

N = 12  # micro-batches
NAN_AT = 5  # the NaN micro-batch: inside the third window for k = 2
TARGETS = 1.0 + 0.01 * np.random.default_rng(0).standard_normal((N, 7)).astype(np.float32)
TARGETS[NAN_AT, 2] = np.nan


def _params():
    return {"w": jnp.zeros((4,), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}


def _loss(params, target):
    flat = jnp.concatenate([params["w"], params["b"]])
    return 0.5 * jnp.sum((flat - target) ** 2)


def _train(opt, *, drop_nan: bool):
    """(params, per fed micro-batch whether a skip was reported, the last optimizer state)."""
    params = _params()
    state = opt.init(params)

    @jax.jit
    def step(params, state, target):
        loss, grads = jax.value_and_grad(_loss)(params, target)
        updates, state = opt.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state, any_skipped(state)

    skipped = []
    for i in range(N):
        if drop_nan and i == NAN_AT:
            continue
        params, state, flag = step(params, state, jnp.asarray(TARGETS[i]))
        skipped.append(bool(flag))
    return params, skipped, state


def _adamw():
    return optax.adamw(1e-2)  # small steps: the losses stay near their start, no spike


def _reference(k):
    return _train(optax.MultiSteps(_adamw(), every_k_schedule=k), drop_nan=True)


def _inside(guard, fn=stabljax.skip_nonfinite_micro_batch):
    return lambda k: optax.MultiSteps(guard(_adamw()), every_k_schedule=k, should_skip_update_fn=fn)


def _outside(guard):
    return lambda k: guard(optax.MultiSteps(_adamw(), every_k_schedule=k))


NONFINITE = skip_nonfinite
BOTH = lambda inner: skip_nonfinite(skip_spikes(inner, warmup_steps=2))  # noqa: E731 (armed)

SAFE = {
    "inside skip_nonfinite": _inside(NONFINITE),
    "inside skip_nonfinite(skip_spikes)": _inside(BOTH),
    "inside, optax.skip_not_finite": _inside(BOTH, optax.skip_not_finite),
    "inside, a bound axis_name": _inside(
        BOTH, functools.partial(stabljax.skip_nonfinite_micro_batch, axis_name=None)
    ),
    "outside skip_nonfinite": _outside(NONFINITE),
    "outside skip_nonfinite(skip_spikes)": _outside(BOTH),
    "guard outside, guard inside": lambda k: skip_nonfinite(
        optax.MultiSteps(skip_spikes(_adamw(), warmup_steps=2), every_k_schedule=k)
    ),
}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("placement", sorted(SAFE))
def test_safe_placement_drops_the_nan_micro_batch_and_matches_optax(placement, k):
    ref_params, ref_skipped, ref_state = _reference(k)
    assert not any(ref_skipped)
    params, skipped, state = _train(SAFE[placement](k), drop_nan=False)
    chex.assert_tree_all_finite(params)
    # The NaN micro-batch is reported skipped; nothing after it (nor before) is.
    assert skipped == [i == NAN_AT for i in range(N)]
    chex.assert_trees_all_close(params, ref_params, rtol=1e-6, atol=1e-7)
    # As many optimizer steps as the reference: (N - 1) // k, read the optax way.
    steps = int(optax.tree.get(state, "gradient_step"))
    assert steps == int(ref_state.gradient_step) == (N - 1) // k
    chex.assert_tree_all_finite(optax.tree.get(state, "acc_grads"))


def test_the_reference_is_not_trivial():
    # Without the NaN micro-batch left out, plain MultiSteps is poisoned for good: what the
    # safe placements above avoid. And k changes the result, so k is really exercised.
    params, _, state = _train(optax.MultiSteps(_adamw(), every_k_schedule=2), drop_nan=False)
    assert not np.all(np.isfinite(np.asarray(params["w"])))
    assert not np.all(np.isfinite(np.asarray(state.acc_grads["w"])))
    p1, p2 = _reference(1)[0], _reference(2)[0]
    assert not np.allclose(np.asarray(p1["w"]), np.asarray(p2["w"]))


UNSAFE = {
    "skip_nonfinite": lambda k: optax.MultiSteps(skip_nonfinite(_adamw()), k),
    "skip_spikes": lambda k: optax.MultiSteps(skip_spikes(_adamw()), k),
    "skip_nonfinite(skip_spikes)": lambda k: optax.MultiSteps(BOTH(_adamw()), k),
    "in a chain": lambda k: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(1.0), skip_nonfinite(_adamw())), k
    ),
    "skip_large_updates": lambda k: optax.MultiSteps(
        BOTH(_adamw()),
        k,
        should_skip_update_fn=functools.partial(optax.skip_large_updates, max_squared_norm=1e6),
    ),
    # A loss-only guard outside does not drop a NaN gradient before MultiSteps sees it.
    "loss-only guard outside": lambda k: stabljax.skip_step(
        optax.MultiSteps(skip_nonfinite(_adamw()), k), nonfinite=("loss",)
    ),
}


# The placements with a guard around the MultiSteps: that guard's own init refuses them.
GUARD_AROUND = {"loss-only guard outside"}


def _says_what_to_do(err: pytest.ExceptionInfo) -> None:
    msg = str(err.value)
    assert "should_skip_update_fn=stabljax.skip_nonfinite_micro_batch" in msg
    assert "should_skip_update_fn=optax.skip_not_finite" in msg
    assert "(optax.MultiSteps(opt, k))" in msg  # the outside placement


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("placement", sorted(UNSAFE))
def test_unsafe_placement_fails_at_init_saying_what_to_do(placement, k):
    opt = UNSAFE[placement](k)

    def create(params):
        return stabljax.TrainState.create(params, opt)

    for init in (create, jax.jit(create), functools.partial(jax.eval_shape, create)):
        with pytest.raises(ValueError, match="inside optax.MultiSteps") as err:
            init(_params())
        _says_what_to_do(err)
    if placement in GUARD_AROUND:
        for init in (opt.init, jax.jit(opt.init), functools.partial(jax.eval_shape, opt.init)):
            with pytest.raises(ValueError, match="inside optax.MultiSteps") as err:
                init(_params())
            _says_what_to_do(err)
        return
    # optax.MultiSteps.init does not tell its inner init where it sits: a hand-made state
    # is refused by the first stabljax call that sees it whole, the step or any_skipped.
    opt_state = opt.init(_params())
    for read in (any_skipped, jax.jit(any_skipped)):
        with pytest.raises(ValueError, match="inside optax.MultiSteps") as err:
            read(opt_state)
        _says_what_to_do(err)
    state = stabljax.TrainState(
        step=jnp.zeros([], jnp.int32), params=_params(), opt_state=opt_state
    )
    step = stabljax.make_train_step(lambda p, t: (_loss(p, t), None), opt)
    with pytest.raises(ValueError, match="inside optax.MultiSteps") as err:
        step(state, jnp.asarray(TARGETS[0]))
    _says_what_to_do(err)


@pytest.mark.parametrize("placement", sorted(SAFE))
def test_safe_placement_creates_a_train_state(placement):
    state = stabljax.TrainState.create(_params(), SAFE[placement](2))
    assert not bool(any_skipped(state.opt_state))


def test_guard_outside_keeps_the_inner_state_readable_the_optax_way():
    opt = skip_nonfinite(skip_spikes(optax.MultiSteps(_adamw(), every_k_schedule=2)))
    _, _, state = _train(opt, drop_nan=False)
    assert int(optax.tree.get(state, "gradient_step")) == (N - 1) // 2
    assert int(optax.tree.get(state, "mini_step")) == (N - 1) % 2
    # The attribute a trainer wrote for bare MultiSteps fails with a pointer to optax.tree.get.
    with pytest.raises(AttributeError, match=r"optax\.tree\.get\(opt_state, 'gradient_step'\)"):
        _ = state.gradient_step
    with pytest.raises(AttributeError, match="no attribute 'not_a_field'$"):
        _ = state.not_a_field
    assert not hasattr(state.nonfinite_inner_state, "gradient_step")
    assert getattr(state, "__deepcopy__", None) is None


def test_skip_nonfinite_micro_batch_matches_the_guards_test():
    fn = jax.jit(stabljax.skip_nonfinite_micro_batch)
    finite = {"a": jnp.ones((3,), jnp.bfloat16), "b": jnp.full((2,), 1e18, jnp.float32)}
    cases = [
        (finite, False),
        ({**finite, "a": finite["a"].at[1].set(jnp.nan)}, True),
        ({**finite, "b": finite["b"].at[0].set(-jnp.inf)}, True),
        ({**finite, "b": jnp.full((2,), 3e19, jnp.float32)}, True),  # the norm overflows
    ]
    for grads, expected in cases:
        skip, extra = fn(grads, jnp.zeros([], jnp.int32), None)
        assert skip.dtype == jnp.bool_ and skip.shape == () and bool(skip) is expected
        assert set(extra) == {"micro_batch_skipped"} and bool(extra["micro_batch_skipped"]) is (
            expected
        )


def test_sharded_over_8_devices_equals_unsharded():
    mesh = mesh8()
    drop = stabljax.skip_nonfinite_micro_batch
    opt = optax.MultiSteps(BOTH(_adamw()), every_k_schedule=2, should_skip_update_fn=drop)
    params = {"w": jnp.zeros((16,), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
    rng = np.random.default_rng(1)
    seq = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}]
    seq += [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}]
    seq[1]["w"][13] = np.nan  # in one shard only: the decision is still global
    seq *= 3
    step = jax.jit(lambda g, s, p: opt.update(g, s, p, value=jnp.sum(g["b"] ** 2)))

    def run(params, seq):
        state, out = opt.init(params), []
        for g in seq:
            u, state = step(g, state, params)
            params = optax.apply_updates(params, u)
            out.append(bool(any_skipped(state)))
        return params, out

    ref, ref_skips = run(params, seq)
    got, got_skips = run(shard_leading(params, mesh), [shard_leading(g, mesh) for g in seq])
    assert ref_skips == got_skips == [False, True] * 3
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(got, ref, rtol=1e-6, atol=1e-7)


def test_axis_name_under_shard_map_skips_every_shard_together():
    mesh = mesh8()
    spec = jax.sharding.PartitionSpec("data")
    fn = functools.partial(stabljax.skip_nonfinite_micro_batch, axis_name="data")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
    def skips(g):
        local, _ = fn({"g": g}, jnp.zeros([], jnp.int32), None)
        unreduced, _ = stabljax.skip_nonfinite_micro_batch({"g": g}, 0, None)
        return jnp.stack([local, unreduced])[None]

    g = np.ones((16,), np.float32)
    g[3] = np.nan  # in shard 1 of 8
    out = np.asarray(skips(jnp.asarray(g)))
    assert out[:, 0].all()  # reduced over the axis: every shard skips
    assert out[:, 1].tolist() == [i == 1 for i in range(8)]  # local only: one shard would
