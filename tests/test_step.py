"""Tests for stabljax.step: TrainState, make_train_step, the nnx and linen paths."""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_bitwise_equal, host, mesh8, shard_leading
from jax.sharding import NamedSharding, PartitionSpec

from stabljax import telemetry
from stabljax.losses import cross_entropy_with_z_loss
from stabljax.optim.guards.skips import skip_nonfinite, skip_spikes
from stabljax.precision import DynamicLossScale, Precision
from stabljax.reference.corpus import default_corpus, lm_batch_fn
from stabljax.step import (
    TrainState,
    lm_loss,
    make_train_step,
    nnx_apply,
    nnx_merge,
    recommended_compiler_options,
)

V, D, H = 256, 16, 32
NAN_TOKEN, SPIKE_TOKEN = -1, -2  # never in the byte corpus; see poisonable_apply
CONTRACT = {
    "loss",
    "ce",
    "z_loss",
    "log_z",
    "log_z_max",
    "grad_norm",
    "update_norm",
    "param_norm",
    "skipped",
    "skip_streak",
    "spike_rebaselines",
    "overflow",
    "loss_scale",
}

# --------------------------------------------------------------------------- a tiny LM


def tiny_params(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "embed": 0.5 * jax.random.normal(k[0], (V, D)),
        "mlp": {
            "w1": jax.random.normal(k[1], (D, H)) / np.sqrt(D),
            "b1": jnp.zeros((H,)),
            "w2": jax.random.normal(k[2], (H, V)) / np.sqrt(H),
        },
    }


def tiny_apply(params, tokens):
    """Embedding, one tanh layer, unembedding: a bigram-ish LM in plain jnp."""
    x = params["embed"][tokens]
    h = jnp.tanh(x @ params["mlp"]["w1"] + params["mlp"]["b1"])
    return h @ params["mlp"]["w2"]


def poisonable_apply(params, tokens):
    """tiny_apply, but a batch whose first token is NAN_TOKEN gives NaN logits (and NaN
    gradients), and one starting with SPIKE_TOKEN gives 30x logits (a finite loss spike)."""
    first = tokens.reshape(-1)[0]
    factor = jnp.where(first == NAN_TOKEN, jnp.nan, jnp.where(first == SPIKE_TOKEN, 30.0, 1.0))
    return tiny_apply(params, tokens) * factor


CORPUS = default_corpus(100_000)
BATCHES = lm_batch_fn(CORPUS, batch_size=8, seq_len=16, seed=0)


def batch(i: int, poison: int | None = None):
    b = {k: jnp.asarray(v) for k, v in BATCHES(i).items()}
    if poison is not None:
        b["inputs"] = b["inputs"].at[0, 0].set(poison)
    return b


@jax.jit
def reference_loss_and_grads(params, b):
    def f(p):
        return cross_entropy_with_z_loss(
            tiny_apply(p, b["inputs"]), b["targets"], z_loss_weight=1e-4, where=b.get("mask")
        )

    return jax.value_and_grad(f, has_aux=True)(params)


# --------------------------------------------------------------------------- shared steps
# XLA's CPU compiler takes seconds per step function: tests share the few they need.


def recorder():
    """A transform that stores the objective it was given (``value=``) in its state."""

    def init(params):
        return {"seen_loss": jnp.zeros([], jnp.float32)}

    def update(updates, state, params=None, *, value=None, **extra):
        return updates, {"seen_loss": jnp.asarray(value, jnp.float32)}

    return optax.GradientTransformationExtraArgs(init, update)


SGD = optax.chain(optax.sgd(0.5), recorder())
GUARDED = optax.chain(
    optax.clip_by_global_norm(10.0),
    skip_nonfinite(skip_spikes(optax.adamw(1e-2), warmup_steps=5, watch=("loss",))),
)
FP16 = Precision(jnp.float32, jnp.float16, DynamicLossScale(2.0**24, growth_interval=3))
FP16_OPT = skip_nonfinite(optax.adam(1e-3))
# Traced at most once in this module, whatever calls the guarded step: no retrace.
TRACED_APPLY = chex.assert_max_traces(poisonable_apply, n=1)


@functools.cache
def sgd_step():
    """Unguarded SGD (lr 0.5) that records the loss it is given."""
    return make_train_step(lm_loss(poisonable_apply, z_loss_weight=1e-4), SGD)


@functools.cache
def guarded_step():
    """Clipped AdamW inside skip_spikes inside skip_nonfinite, with layer metrics."""
    return make_train_step(lm_loss(TRACED_APPLY), GUARDED, layer_metrics=True)


ADAM = optax.adam(1e-2)


@functools.cache
def sharding_step():
    """Plain Adam for the sharding tests (a new sharding is a new trace and compile)."""
    return make_train_step(lm_loss(tiny_apply), ADAM)


@functools.cache
def fp16_step():
    return make_train_step(lm_loss(poisonable_apply), FP16_OPT, precision=FP16)


# --------------------------------------------------------------------------- the contract


def test_metrics_contract_and_values():
    step = sgd_step()
    params = tiny_params()
    state = TrainState.create(params, SGD)
    b = batch(0)
    b["mask"] = jnp.asarray(np.random.default_rng(0).random(b["targets"].shape) < 0.7)
    (loss, aux), grads = reference_loss_and_grads(params, b)
    new, m = step(state, b)

    assert set(m) == CONTRACT
    assert all(isinstance(v, jax.Array) and v.shape == () for v in m.values())
    assert m["skipped"].dtype == jnp.bool_ and m["overflow"].dtype == jnp.bool_
    assert m["skip_streak"].dtype == jnp.int32 and m["spike_rebaselines"].dtype == jnp.int32
    for k in CONTRACT - {"skipped", "overflow", "skip_streak", "spike_rebaselines"}:
        assert m[k].dtype == jnp.float32, k
    np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)
    for k in ("ce", "z_loss", "log_z", "log_z_max"):
        np.testing.assert_allclose(m[k], aux[k], rtol=1e-6)
    gn = float(telemetry.global_norm(grads))
    np.testing.assert_allclose(m["grad_norm"], gn, rtol=1e-5)
    np.testing.assert_allclose(m["update_norm"], 0.5 * gn, rtol=1e-5)
    np.testing.assert_allclose(m["param_norm"], telemetry.global_norm(params), rtol=1e-6)
    assert not bool(m["skipped"]) and int(m["skip_streak"]) == 0
    assert not bool(m["overflow"]) and float(m["loss_scale"]) == 1.0
    want = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    chex.assert_trees_all_close(new.params, want, rtol=1e-6, atol=1e-7)
    assert int(new.step) == 1 and new.step.dtype == jnp.int32
    assert new.loss_scale_state is None
    # the loss reached the optimizer
    assert float(new.opt_state[1]["seen_loss"]) == float(m["loss"])
    # the mask mattered
    unmasked, _ = reference_loss_and_grads(params, {k: b[k] for k in ("inputs", "targets")})
    assert abs(float(unmasked[0]) - float(m["loss"])) > 1e-4


def test_the_step_lowers_the_loss_on_the_corpus():
    step = guarded_step()
    state = TrainState.create(tiny_params(), GUARDED)
    losses, skipped = [], []
    for i in range(30):
        state, m = step(state, batch(i))
        losses.append(float(m["loss"]))
        skipped.append(bool(m["skipped"]))
    assert losses[0] > np.log(V) - 0.5  # near uniform at init
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses
    assert not any(skipped) and int(state.step) == 30


# --------------------------------------------------------------------------- guards


def test_guarded_skips_leave_params_and_opt_state_bit_identical():
    step = guarded_step()
    state = TrainState.create(tiny_params(), GUARDED)
    for i in range(8):
        state, m = step(state, batch(i))
        assert not bool(m["skipped"])

    def inner(opt_state):  # the guarded optimizer's own state
        return opt_state[1].nonfinite_inner_state.spike_inner_state

    # The outer guard restores the inner one's state on a NaN, so the spike after two NaNs
    # starts a new spike streak of 1 while the non-finite streak ends: the max is 1.
    for streak, poison in [(1, NAN_TOKEN), (2, NAN_TOKEN), (1, SPIKE_TOKEN)]:
        before = host(state)
        state, m = step(state, batch(8, poison))
        assert bool(m["skipped"]) and int(m["skip_streak"]) == streak
        assert not bool(m["overflow"]) and float(m["update_norm"]) == 0.0
        assert int(state.step) == before.step + 1
        assert_bitwise_equal(state.params, before.params)
        assert_bitwise_equal(inner(state.opt_state), inner(before.opt_state))
    assert np.isfinite(float(m["grad_norm"])) and float(m["loss"]) > 10.0  # the spike

    before = host(state)
    state, m = step(state, batch(9))
    assert not bool(m["skipped"]) and int(m["skip_streak"]) == 0
    assert float(m["update_norm"]) > 0
    assert not np.array_equal(np.asarray(state.params["embed"]), before.params["embed"])


def test_unguarded_nan_reaches_the_params():
    # The control for the test above: without a guard the same batch does poison them.
    state, m = sgd_step()(TrainState.create(tiny_params(), SGD), batch(0, NAN_TOKEN))
    assert np.isnan(float(m["loss"])) and not bool(m["skipped"])
    assert np.isnan(np.asarray(state.params["embed"])).any()


# --------------------------------------------------------------------------- precision


def test_fp16_loss_scale_grows_shrinks_skips_and_stays_bounded():
    # initial_scale 2**24 overflows float16 on this model at once; growth_interval 3.
    step = fp16_step()
    state = TrainState.create(tiny_params(), FP16_OPT, FP16)
    assert float(state.loss_scale_state.loss_scale) == 2.0**24

    scale, good, overflows, grew, checked_grads = 2.0**24, 0, 0, 0, False
    for i in range(45):
        poison = NAN_TOKEN if i >= 20 else None
        before = host(state)
        state, m = step(state, batch(i, poison))
        assert float(m["loss_scale"]) == scale  # the scale this step ran at
        assert not bool(m["skipped"])  # an overflow is not a guard skip
        assert int(state.step) == i + 1
        if bool(m["overflow"]):
            overflows += 1
            assert_bitwise_equal(state.params, before.params)
            assert_bitwise_equal(state.opt_state, before.opt_state)
            assert float(m["update_norm"]) == 0.0
            scale, good = max(scale / 2, 1.0), 0
        else:
            assert poison is None
            assert float(m["update_norm"]) > 0
            if not checked_grads:  # unscaled before the optimizer: fp32's norm, not S times it
                _, grads = reference_loss_and_grads(before.params, batch(i))
                gn = float(telemetry.global_norm(grads))
                np.testing.assert_allclose(m["grad_norm"], gn, rtol=2e-2)
                checked_grads = True
            good += 1
            if good == 3:
                scale, good, grew = min(scale * 2, 2.0**24), 0, grew + 1
        assert float(state.loss_scale_state.loss_scale) == scale
        assert int(state.loss_scale_state.loss_scale_good_steps) == good
        assert 1.0 <= scale < np.inf
    assert overflows >= 2 and grew >= 1 and checked_grads
    assert float(state.loss_scale_state.loss_scale) == 1.0  # the floor after 25 NaN steps
    assert bool(m["overflow"]) and int(m["skip_streak"]) == 0


def test_mismatched_precision_raises():
    with pytest.raises(ValueError, match="loss_scale_state"):
        fp16_step()(TrainState.create(tiny_params(), FP16_OPT), batch(0))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="z_loss"):
        lm_loss(tiny_apply, z_loss_weight=-1.0)
    with pytest.raises(ValueError, match="precision"):
        make_train_step(lm_loss(tiny_apply), optax.sgd(0.1), precision="bf16")
    with pytest.raises(ValueError, match="compiler_options must be None or a mapping.*got str"):
        make_train_step(lm_loss(tiny_apply), optax.sgd(0.1), compiler_options="fast")


def _state_sized_copies(step, state) -> int:
    """Copy instructions on arrays the size of a parameter, in the compiled step."""
    text = step.lower(state, batch(0)).compile().as_text()
    entry = text[text.index("\nENTRY") :]
    sizes = {f"f32[{','.join(map(str, x.shape))}]" for x in jax.tree.leaves(state.params)}
    return sum(
        1 for line in entry.splitlines() if " copy(" in line and any(z in line for z in sizes)
    )


def test_cpu_compiler_options_remove_the_state_copies_and_change_no_result():
    """XLA:CPU's default copy insertion copies the guarded update's donated moments."""
    assert jax.default_backend() == "cpu"
    auto = make_train_step(
        lm_loss(poisonable_apply), GUARDED, compiler_options=recommended_compiler_options("cpu")
    )
    plain = make_train_step(lm_loss(poisonable_apply), GUARDED)
    s_auto = TrainState.create(tiny_params(), GUARDED)
    s_plain = TrainState.create(tiny_params(), GUARDED)
    assert _state_sized_copies(plain, s_plain) > 0  # the control: XLA's default copies
    assert _state_sized_copies(auto, s_auto) == 0
    for i, poison in [(0, None), (1, None), (2, NAN_TOKEN), (3, None)]:
        s_auto, m_auto = auto(s_auto, batch(i, poison))
        s_plain, m_plain = plain(s_plain, batch(i, poison))
        assert bool(m_auto["skipped"]) == (poison is not None)
        assert_bitwise_equal(host(s_auto), host(s_plain))
        assert_bitwise_equal(host(m_auto), host(m_plain))


# --------------------------------------------------------------------------- donation, retracing


def shared_zeros_optimizer():
    """An optimizer whose init puts one zeros array into two state fields."""

    def init(params):
        z = jnp.zeros([], jnp.float32)
        return (z, z)

    def update(updates, state, params=None):
        return jax.tree.map(lambda g: -0.1 * g, updates), (state[0] + 1, state[1] + 2)

    return optax.GradientTransformation(init, update)


def tied_apply(params, tokens):
    return (params["a"] + params["b"])[tokens % 4]


def test_create_is_safe_to_donate():
    opt = shared_zeros_optimizer()
    w = jnp.ones((4, V))
    params = {"a": w, "b": w}  # tied weights: the same buffer twice
    step = make_train_step(lm_loss(tied_apply), opt)  # donate=True by default
    state = TrainState.create(params, opt)
    new, _ = step(state, batch(0))
    assert state.params["a"].is_deleted()  # donated
    new, _ = step(new, batch(1))
    assert float(new.opt_state[0]) == 2.0 and float(new.opt_state[1]) == 4.0
    # the control: the same state without TrainState.create's copies cannot be donated
    bad = TrainState(jnp.zeros([], jnp.int32), params, opt.init(params), None)
    with pytest.raises(Exception, match="donate the same buffer twice"):
        jax.block_until_ready(step(bad, batch(0)))


@pytest.mark.parametrize("donate", [True, False])
def test_donate_flag_donates_the_state_only(donate):
    state = TrainState.create(tiny_params(), SGD)
    step = make_train_step(lm_loss(poisonable_apply), SGD, donate=donate)
    (state_info, batch_info), _ = step.lower(state, batch(0)).args_info  # lowered, not compiled
    assert {a.donated for a in jax.tree.leaves(state_info)} == {donate}
    assert {a.donated for a in jax.tree.leaves(batch_info)} == {False}


def test_no_recompile_across_steps():
    step = guarded_step()  # its apply_fn raises if traced twice in this module
    state = TrainState.create(tiny_params(), GUARDED)
    state, _ = step(state, batch(0))
    size = step._cache_size()
    for i in range(1, 4):
        state, _ = step(state, batch(i, SPIKE_TOKEN if i == 2 else None))
    assert step._cache_size() == size
    traced = chex.assert_max_traces(tiny_apply, n=1)
    step = make_train_step(lm_loss(traced), SGD)  # the control: a changed shape does retrace
    state = TrainState.create(tiny_params(), SGD)
    step.trace(state, batch(0))  # trace without compiling
    with pytest.raises(AssertionError, match="traced"):
        step.trace(state, {k: v[:, :8] for k, v in batch(1).items()})


# --------------------------------------------------------------------------- no host round-trip


def primitive_names(jaxpr) -> set[str]:
    """Every primitive in a jaxpr, sub-jaxprs (jit, cond, scan, custom_vjp) included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names |= primitive_names(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names |= primitive_names(sub)
    return names


def host_primitives(names: set[str]) -> set[str]:
    """The primitives that talk to the host: callbacks (pure, io, debug) and debug_print."""
    return {n for n in names if "callback" in n or n in ("debug_print", "outfeed", "infeed")}


def step_primitives(apply_fn, opt, precision=None):
    precision = precision or Precision.fp32()
    step = make_train_step(lm_loss(apply_fn), opt, precision=precision, layer_metrics=True)
    state = TrainState.create(tiny_params(), opt, precision)
    return primitive_names(jax.make_jaxpr(step)(state, batch(0)).jaxpr)


@pytest.mark.parametrize("precision", [Precision.fp32(), FP16])
def test_jaxpr_has_no_callback(precision):
    names = step_primitives(poisonable_apply, GUARDED, precision)
    assert "cond" in names or precision.loss_scale is None  # sub-jaxprs were walked
    assert "pjit" in names or "jit" in names
    assert not host_primitives(names), names


def test_callback_detector_finds_host_calls():
    # The control for the test above.
    def chatty(params, tokens):
        jax.debug.print("tokens {}", tokens[0, 0])
        return tiny_apply(params, tokens)

    def fetching(params, tokens):
        like = jax.ShapeDtypeStruct(tokens.shape, tokens.dtype)
        return tiny_apply(params, jax.pure_callback(np.asarray, like, tokens))

    assert host_primitives(step_primitives(chatty, SGD)) == {"debug_print"}
    assert host_primitives(step_primitives(fetching, SGD)) == {"pure_callback"}


@pytest.mark.parametrize("which", ["guarded", "fp16"])
def test_no_transfer_inside_the_step(which):
    step, opt, prec = {
        "guarded": (guarded_step(), GUARDED, Precision.fp32()),
        "fp16": (fp16_step(), FP16_OPT, FP16),
    }[which]
    state = jax.block_until_ready(TrainState.create(tiny_params(), opt, prec))
    batches = [jax.block_until_ready(jax.device_put(batch(i))) for i in range(4)]
    for level, b in zip(["disallow_explicit", "disallow"] * 2, batches, strict=True):
        with jax.transfer_guard(level):
            state, metrics = step(state, b)
        assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(metrics))
    # the control: the guard is live, and a host batch is refused
    with pytest.raises(Exception, match="[Dd]isallowed"):
        with jax.transfer_guard("disallow"):
            step(state, {k: np.asarray(v) for k, v in BATCHES(5).items()})


# --------------------------------------------------------------------------- sharding


def same_sharding(x, sharding):
    return x.sharding.is_equivalent_to(sharding, x.ndim)


@functools.cache
def single_device_run(steps: int = 3):
    step = sharding_step()
    state = TrainState.create(tiny_params(), ADAM)
    metrics = []
    for i in range(steps):
        state, m = step(state, batch(i))
        metrics.append(m)
    return state, metrics


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp"])
def test_sharded_equals_single_device(layout):
    mesh = mesh8()
    step = sharding_step()
    single, single_metrics = single_device_run()
    if layout == "fsdp":
        params = shard_leading(tiny_params(), mesh)
        assert params["embed"].sharding.spec == PartitionSpec("data", None)
    else:
        params = jax.device_put(tiny_params(), NamedSharding(mesh, PartitionSpec()))
    state = TrainState.create(params, ADAM)
    want = jax.tree.map(lambda x: x.sharding, state)
    if layout == "fsdp":
        assert state.opt_state[0].mu["embed"].sharding.spec == PartitionSpec("data")
    data = NamedSharding(mesh, PartitionSpec("data", None))

    size = None
    for i, m1 in enumerate(single_metrics):
        state, m8 = step(state, jax.device_put(batch(i), data))
        assert jax.tree.all(jax.tree.map(same_sharding, state, want))
        chex.assert_trees_all_close(m8, m1, rtol=1e-5, atol=1e-6)
        size = step._cache_size() if size is None else size
    assert step._cache_size() == size  # compiled once for this layout, not once per step
    chex.assert_trees_all_close(state, single, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- flax


class NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.hidden = nnx.Linear(D, H, rngs=rngs)
        self.out = nnx.Linear(H, V, use_bias=False, rngs=rngs)
        self.rngs = rngs  # non-param state: closed over by nnx_apply
        self.seen_dtypes = []  # plain Python attribute: static, kept in the graphdef

    def __call__(self, tokens):
        self.seen_dtypes.append(self.embed.embedding[...].dtype)
        return self.out(jnp.tanh(self.hidden(self.embed(tokens))))


def test_nnx_module_trains_in_bf16_and_merges_back():
    model = NnxLM(nnx.Rngs(0))
    original = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    apply_fn, params = nnx_apply(model)
    opt = optax.adam(3e-2)
    prec = Precision.bf16()
    step = make_train_step(lm_loss(apply_fn), opt, precision=prec, layer_metrics=True)
    state = TrainState.create(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), opt, prec)
    masters = jax.tree.leaves((state.params, state.opt_state[0].mu, state.opt_state[0].nu))
    assert all(x.dtype == jnp.float32 for x in masters)  # cast back to param_dtype

    @jax.jit
    def fp32_loss(p, b):
        return cross_entropy_with_z_loss(apply_fn(p, b["inputs"]), b["targets"])[0]

    losses = []
    for i in range(15):
        ref = fp32_loss(state.params, batch(i))
        state, m = step(state, batch(i))
        losses.append(float(m["loss"]))
        np.testing.assert_allclose(m["loss"], ref, rtol=2e-2)  # bf16 compute, f32 loss
    assert losses[-1] < losses[0] - 1.0, losses
    assert m["loss"].dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert jnp.bfloat16 in model.seen_dtypes and jnp.float32 in model.seen_dtypes

    layers = telemetry.layer_metrics_to_host(m)
    assert {k for k in layers if k.startswith("grad_norm/")} == {
        "grad_norm/embed/embedding",
        "grad_norm/hidden/bias",
        "grad_norm/hidden/kernel",
        "grad_norm/out/kernel",
    }
    sq = sum(v**2 for k, v in layers.items() if k.startswith("grad_norm/"))
    np.testing.assert_allclose(np.sqrt(sq), float(m["grad_norm"]), rtol=1e-5)

    trained = nnx_merge(model, state.params)
    tokens = batch(20)["inputs"]
    chex.assert_trees_all_close(trained(tokens), apply_fn(state.params, tokens), rtol=0, atol=0)
    assert isinstance(trained.rngs, nnx.Rngs)
    chex.assert_trees_all_equal(nnx.state(model, nnx.Param), original)  # model untouched
    graphdef, _ = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    lin_params = nnx.state(nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
    assert isinstance(nnx_merge(graphdef, lin_params), nnx.Linear)


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, D)(tokens)
        return nn.Dense(V)(jnp.tanh(nn.Dense(H)(x)))


def test_linen_module_apply_trains():
    module = LinenLM()
    variables = module.init(jax.random.key(0), batch(0)["inputs"])
    opt = optax.adam(3e-2)
    step = make_train_step(lm_loss(module.apply), opt)
    state = TrainState.create(variables, opt)
    losses = []
    for i in range(15):
        state, m = step(state, batch(i))
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 1.0, losses
    assert set(state.params) == {"params"}
