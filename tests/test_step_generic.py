"""The generic train step: any loss_fn, model state and RNG kept on a skip, AOT planning."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_bitwise_equal, host, mesh8
from jax.sharding import NamedSharding, PartitionSpec

from stabljax.optim.guards.skips import skip_nonfinite
from stabljax.precision import DynamicLossScale, Precision
from stabljax.step import TrainState, lm_loss, make_train_step, nnx_apply, nnx_merge

LR = 0.1
X = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)
Y = X @ W_TRUE
MOMENTUM = 0.9  # of the running mean kept in model_state


def regression_loss(params, batch, *, rng, model_state):
    """MSE of a linear model; a BatchNorm-like running mean of the inputs; a random draw."""
    pred = batch["x"] @ params["w"]
    loss = jnp.mean((pred - batch["y"]) ** 2)
    mean = MOMENTUM * model_state["mean"] + (1 - MOMENTUM) * jnp.mean(batch["x"], axis=0)
    return loss, {"model_state": {"mean": mean}, "draw": jax.random.uniform(rng)}


def batch(poison=False):
    x = X.copy()
    if poison:
        x[0, 0] = np.nan
    return {"x": jnp.asarray(x), "y": jnp.asarray(Y)}


def np_grad(w, x, y):
    return 2.0 / len(y) * x.T.astype(np.float64) @ (x.astype(np.float64) @ w - y)


def value_recorder():
    """Stores the value= it was given; the step passes the objective once, under that name."""

    def init(params):
        return {"seen_value": jnp.zeros([])}

    def update(updates, state, params=None, *, value, **extra):
        assert "loss" not in extra, "make_train_step passed the loss twice"
        return updates, {"seen_value": value}

    return optax.GradientTransformationExtraArgs(init, update)


OPT = skip_nonfinite(optax.chain(optax.sgd(LR), value_recorder()))
FP16 = Precision(jnp.float32, jnp.float16, DynamicLossScale(2.0**4, growth_interval=100))


@functools.cache
def regression_step(precision=None):
    return make_train_step(regression_loss, OPT, precision=precision or Precision.fp32())


def fresh(precision=None):
    params = {"w": jnp.zeros(3)}
    model_state = {"mean": jnp.zeros(3)}
    return TrainState.create(
        params, OPT, precision or Precision.fp32(), model_state=model_state, rng=0
    )


def test_generic_loss_model_state_and_rng_match_hand_computed():
    step = regression_step()
    state = fresh()
    w, mean, key = np.zeros(3), np.zeros(3), jax.random.key(0)
    for _ in range(3):
        state, m = step(state, batch())
        key, step_key = jax.random.split(key)
        want_loss = np.mean((X.astype(np.float64) @ w - Y) ** 2)
        w = w - LR * np_grad(w, X, Y)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * X.mean(axis=0)
        np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5)
        np.testing.assert_allclose(state.params["w"], w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.model_state["mean"], mean, rtol=1e-5, atol=1e-7)
        # aux entries are metrics; the step's key is the second half of a split
        assert float(m["draw"]) == float(jax.random.uniform(step_key))
        assert_bitwise_equal(state.rng, key)
        # the loss reached the optimizer as value=
        inner = state.opt_state.nonfinite_inner_state[1]
        assert float(inner["seen_value"]) == float(m["loss"])
    assert "model_state" not in m and int(state.step) == 3


def test_a_skipped_step_keeps_model_state_and_rng_bit_for_bit():
    step = regression_step()
    state, _ = step(fresh(), batch())
    before = host(state)
    state, m = step(state, batch(poison=True))
    assert bool(m["skipped"]) and not bool(m["overflow"])
    assert np.isnan(float(m["loss"]))
    assert_bitwise_equal(state.params, before.params)
    assert_bitwise_equal(state.model_state, before.model_state)
    assert_bitwise_equal(state.rng, before.rng)
    assert int(state.step) == 2
    # the next clean step draws the key the skipped one drew, and moves everything
    state, m2 = step(state, batch())
    assert float(m2["draw"]) == float(m["draw"]) and not bool(m2["skipped"])
    assert not np.array_equal(np.asarray(state.model_state["mean"]), before.model_state["mean"])


def test_unguarded_nan_poisons_the_model_state():
    # The control: without a guard the NaN batch's statistics go in, as params do.
    opt = optax.sgd(LR)
    step = make_train_step(regression_loss, opt)
    state = TrainState.create({"w": jnp.zeros(3)}, opt, model_state={"mean": jnp.zeros(3)}, rng=0)
    state, m = step(state, batch(poison=True))
    assert not bool(m["skipped"])
    assert np.isnan(np.asarray(state.model_state["mean"])).any()


def test_fp16_overflow_keeps_model_state_and_rng():
    step = regression_step(FP16)
    state, m = step(fresh(FP16), batch())
    assert not bool(m["overflow"])
    before = host(state)
    state, m = step(state, batch(poison=True))
    assert bool(m["overflow"]) and not bool(m["skipped"])
    assert_bitwise_equal(state.params, before.params)
    assert_bitwise_equal(state.model_state, before.model_state)
    assert_bitwise_equal(state.rng, before.rng)


def test_a_loss_fn_without_rng_or_model_state_is_called_without_them():
    def plain(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2), None

    opt = optax.sgd(LR)
    state = TrainState.create({"w": jnp.zeros(3)}, opt)
    state, m = make_train_step(plain, opt)(state, batch())
    np.testing.assert_allclose(state.params["w"], -LR * np_grad(np.zeros(3), X, Y), rtol=1e-5)
    with pytest.raises(TypeError, match="`rng`.*loss_fn does not take it"):
        make_train_step(plain, opt)(TrainState.create({"w": jnp.zeros(3)}, opt, rng=1), batch())


@pytest.mark.parametrize(
    "loss_fn,match",
    [
        (lambda p, b: (jnp.sum(p["w"]), {"grad_norm": 1.0}), "clash"),
        (lambda p, b: (jnp.sum(p["w"]), [1.0]), "aux a dict"),
        (lambda p, b: (p["w"], None), "float scalar"),
        (lambda p, b: (jnp.sum(p["w"]), {"model_state": {"m": p["w"]}}), "no model_state"),
    ],
    ids=["clash", "aux_list", "vector_loss", "model_state_without_state"],
)
def test_bad_loss_fn_outputs_raise_clearly(loss_fn, match):
    opt = optax.sgd(LR)
    with pytest.raises(ValueError, match=match):
        make_train_step(loss_fn, opt)(TrainState.create({"w": jnp.zeros(3)}, opt), batch())


def test_bad_make_train_step_arguments_raise():
    with pytest.raises(TypeError, match="loss_fn"):
        make_train_step(None, optax.sgd(0.1))
    with pytest.raises(TypeError, match="rng"):
        TrainState.create({"w": jnp.zeros(3)}, optax.sgd(0.1), rng="seed")
    with pytest.raises(ValueError, match="`z_loss_weight` must be >= 0"):
        lm_loss(lambda p, x: x, z_loss_weight=float("nan"))


# --------------------------------------------------------------------------- AOT planning


def test_create_under_eval_shape_and_aot_compile_with_shardings():
    mesh = mesh8()
    data = NamedSharding(mesh, PartitionSpec("data"))
    rep = NamedSharding(mesh, PartitionSpec())
    abstract_params = {
        "w": jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=data),
        "b": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=rep),
    }
    opt = skip_nonfinite(optax.adam(1e-3))

    def create(p):
        return TrainState.create(p, opt, model_state={"mean": jnp.zeros(3)}, rng=jax.random.key(0))

    abstract = jax.eval_shape(create, abstract_params)
    real = create({"w": jnp.zeros((8, 3)), "b": jnp.zeros(3)})
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), abstract)
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), real)

    # MaxText-style: shardings from the abstract state, then AOT lower + compile.
    def sharding_of(x):
        return data if x.shape == (8, 3) else rep

    with_shardings = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(x)), abstract
    )

    def loss_fn(params, batch, *, rng, model_state):
        h = batch["x"] @ params["w"] + params["b"]
        return jnp.mean(h**2), {"model_state": model_state}

    step = make_train_step(loss_fn, opt)
    abstract_batch = {"x": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=rep)}
    compiled = step.lower(with_shardings, abstract_batch).compile()
    placed = jax.device_put(real, jax.tree.map(lambda s: s.sharding, with_shardings))
    new, m = compiled(placed, jax.device_put({"x": jnp.ones((16, 8))}, rep))
    assert int(new.step) == 1 and np.isfinite(float(m["loss"]))
    assert new.params["w"].sharding.is_equivalent_to(data, 2)


# --------------------------------------------------------------------------- nnx, stateful


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))[:, 0]


def test_nnx_stateful_apply_threads_rng_and_keeps_batch_stats_on_a_skip():
    model = Net(nnx.Rngs(0, dropout=1))
    model.train()
    apply_fn, params, model_state = nnx_apply(model, stateful=True)
    assert {
        type(v) for v in jax.tree.leaves(model_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    } >= {nnx.BatchStat}

    def loss_fn(params, batch, *, rng, model_state):
        pred, model_state = apply_fn(params, batch["x"], rng=rng, model_state=model_state)
        return jnp.mean((pred - batch["y"]) ** 2), {"model_state": model_state, "pred": pred}

    opt = skip_nonfinite(optax.adam(1e-2))
    step = make_train_step(loss_fn, opt)
    state = TrainState.create(params, opt, model_state=model_state, rng=0)
    preds = []
    for _ in range(2):
        state, m = step(state, batch())
        preds.append(np.asarray(m["pred"]))
    assert not np.array_equal(preds[0], preds[1])  # a new dropout mask each step
    before = host(state)
    state, m = step(state, batch(poison=True))
    assert bool(m["skipped"])
    assert_bitwise_equal(state.model_state, before.model_state)
    chex.assert_tree_all_finite(state.model_state["bn"])
    # the same seed gives the same run; the statistics are the batch's, as BatchNorm's
    state2 = TrainState.create(params, opt, model_state=model_state, rng=0)
    state2, m2 = step(state2, batch())
    np.testing.assert_array_equal(np.asarray(m2["pred"]), preds[0])
    trained = nnx_merge(model, state.params, state.model_state)
    trained.eval()
    chex.assert_trees_all_equal(trained.bn.mean[...], state.model_state["bn"]["mean"][...])
    assert np.isfinite(np.asarray(trained(batch()["x"]))).all()
