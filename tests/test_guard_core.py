"""Tests for the guard core (skip_step): sharding, shard_map, tracing, cost in HLO."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh8, random_grads_like
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import stabljax
from stabljax.optim.guards.skips import (
    SkipNonfiniteState,
    SkipSpikesState,
    SpikeRule,
    any_skipped,
    skip_nonfinite,
    skip_spikes,
    skip_step,
    skip_streak,
)

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")


def collectives(compiled) -> dict[str, int]:
    """How many of each collective the optimized HLO runs (async pairs counted once)."""
    txt = compiled.as_text()
    return {k: len(re.findall(rf"\b{k}(?:-start)?\(", txt)) for k in COLLECTIVES}


def readme_guard(inner):
    return skip_nonfinite(skip_spikes(inner, warmup_steps=2))


def plain_inner():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))


# --------------------------------------------------------------------------- explicit sharding


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("cols", [6, 10, 8])  # 3, 5 and 4 columns a shard
def test_last_axis_sharding_compiles_with_plain_optax_collectives(axis_type, cols):
    mesh = jax.make_mesh((2,), ("m",), axis_types=(axis_type,), devices=jax.devices()[:2])
    rng = np.random.default_rng(cols)
    host = {"w": rng.standard_normal((4, cols)).astype(np.float32), "b": np.ones(6, np.float32)}
    grads_host = [
        {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in host.items()}
        for _ in range(3)
    ]
    grads_host[2]["w"][1, -1] = np.nan  # on the last shard
    specs = {"w": P(None, "m"), "b": P("m")}

    def place(tree):
        return {
            k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, specs[k]))
            for k, v in tree.items()
        }

    results = {}
    with jax.set_mesh(mesh):
        params = place(host)
        for name, opt in (("plain", plain_inner()), ("guard", readme_guard(plain_inner()))):
            opt = optax.with_extra_args_support(opt)
            f = jax.jit(lambda g, s, p, opt=opt: opt.update(g, s, p, value=jnp.float32(1.0)))
            state = opt.init(params)
            results[name] = collectives(f.lower(params, state, params).compile())
            outs = []
            for g in grads_host:
                u, state = f(place(g), state, params)
                outs.append(u)
            assert outs[0]["w"].sharding.spec == P(None, "m")
            results[name + "_out"] = outs
    assert results["guard"] == results["plain"], results
    assert sum(results["plain"].values()) >= 1  # the global norm is one all-reduce
    for i in (0, 1):  # finite steps: the guard is the identity on plain optax
        chex.assert_trees_all_close(results["guard_out"][i], results["plain_out"][i], rtol=1e-6)
    # The NaN step: every shard of every leaf is exactly zero (one global decision).
    for x in jax.tree.leaves(results["guard_out"][2]):
        assert np.asarray(x).tobytes() == np.zeros(x.shape, np.float32).tobytes()


# --------------------------------------------------------------------------- shard_map


def _fsdp_run(axis_name):
    """One FSDP step under shard_map with a NaN in the last device's shard only.

    Returns per-device (skipped, skips, streak, spike_accepted_steps, log loss, log norm) and the
    updates, gathered over the mesh, for two steps: a clean one, then the NaN one.
    """
    mesh = mesh8("data")
    n = 8
    params = {"w": jnp.ones((16, 4)), "b": jnp.ones((8,))}
    opt = skip_step(
        optax.adam(1e-2),
        spikes=SpikeRule(warmup_steps=100, watch=("loss", "grad_norm")),  # gathers only
        axis_name=axis_name,
    )
    shard = P("data")
    state0 = opt.init(params)
    state_specs = jax.tree.map(
        lambda x: shard if np.ndim(x) and x.shape[0] % n == 0 and x.shape[0] >= n else P(), state0
    )
    param_specs = {"w": shard, "b": shard}

    def local(grads, state, params, losses):
        loss = losses[0]  # this device's local loss: they differ across devices
        updates, state = opt.update(grads, state, params, value=loss)
        diag = jnp.stack(
            [
                state.spike_skipped.astype(jnp.float32),
                state.spike_skips.astype(jnp.float32),
                state.spike_streak.astype(jnp.float32),
                state.spike_accepted_steps.astype(jnp.float32),
                state.spike_levels[0, 0],
                state.spike_levels[1, 0],
            ]
        )[None]
        return updates, state, diag

    f = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(param_specs, state_specs, param_specs, shard),
            out_specs=(param_specs, state_specs, shard),
            check_vma=False,
        )
    )
    losses = jnp.arange(1.0, 1.0 + n)  # device i reports loss 1 + i
    g1 = random_grads_like(params, seed=1)
    g2 = random_grads_like(params, seed=2)
    g2 = {**g2, "w": g2["w"].at[15, 0].set(jnp.nan)}  # rows 14-15 live on device 7
    u1, s1, d1 = f(g1, state0, params, losses)
    u2, s2, d2 = f(g2, s1, params, losses)
    return np.asarray(d1), np.asarray(d2), u1, u2, g1


def test_shard_map_axis_name_one_decision_and_identical_counters():
    d1, d2, u1, u2, g1 = _fsdp_run("data")
    # Clean step: applied on every device; the statistics hold the global loss and norm.
    assert (d1[:, 0] == 0).all() and (d1[:, 3] == 1).all()
    np.testing.assert_allclose(d1[:, 4], np.log(np.mean(np.arange(1.0, 9.0))), rtol=1e-6)
    g_norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(g1)))
    np.testing.assert_allclose(d1[:, 5], np.log(g_norm), rtol=1e-5)
    # NaN in one shard: every device skips, and every counter is equal on every device.
    assert (d2[:, 0] == 1).all() and (d2[:, 1] == 1).all() and (d2[:, 2] == 1).all()
    assert (d2 == d2[0]).all()
    for x in jax.tree.leaves(u2):
        assert np.asarray(x).tobytes() == np.zeros(x.shape, np.float32).tobytes()
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(u1))


def test_shard_map_without_axis_name_decides_per_shard():
    # The control: without axis_name each shard sees only its own gradients and loss.
    _, d2, _, u2, _ = _fsdp_run(None)
    assert d2[7, 0] == 1 and (d2[:7, 0] == 0).all()
    assert len(set(d2[:, 4].tolist())) > 1  # per-device statistics drift apart


def test_axis_name_validation():
    for bad in ((), ("a", 1), 3):
        with pytest.raises(ValueError, match="`axis_name`"):
            skip_nonfinite(optax.sgd(0.1), axis_name=bad)


# --------------------------------------------------------------------------- tracing


class _Counting:
    """An sgd whose update counts how often it is traced."""

    def __init__(self):
        self.traces = 0
        base = optax.sgd(0.1)

        def update(updates, state, params=None):
            self.traces += 1
            return base.update(updates, state, params)

        self.tx = optax.GradientTransformation(base.init, update)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("check_update", [False, True])
def test_inner_update_traced_at_most_twice_at_any_depth(depth, check_update):
    counting = _Counting()
    opt = counting.tx
    for level in range(depth):
        if level % 2:
            opt = skip_nonfinite(opt, check_update=check_update)
        else:
            opt = skip_spikes(opt, warmup_steps=2, check_update=check_update)
    params = {"w": jnp.ones((3,))}
    state = opt.init(params)
    jax.jit(opt.update).lower({"w": jnp.ones((3,))}, state, params, value=1.0)
    assert 1 <= counting.traces <= 2, counting.traces


def test_nested_guards_trace_once_and_agree_with_flat_reference():
    # Nesting changes nothing numerically: a finite run equals the bare optimizer.
    params = {"w": jnp.ones((4, 3))}
    bare = optax.adam(1e-2)
    nested = skip_nonfinite(skip_spikes(skip_nonfinite(skip_spikes(optax.adam(1e-2)))))
    sb, sn = bare.init(params), nested.init(params)
    bstep, nstep = jax.jit(bare.update), jax.jit(nested.update)
    for t in range(3):
        g = random_grads_like(params, seed=t)
        ub, sb = bstep(g, sb, params)
        un, sn = nstep(g, sn, params, value=1.0)
        chex.assert_trees_all_close(un, ub, rtol=0, atol=0)
    assert not bool(any_skipped(sn)) and int(skip_streak(sn)) == 0


# --------------------------------------------------------------------------- cost in the HLO


def newton_schulz_like(steps: int = 3) -> optax.GradientTransformation:
    """A Muon-like matrix optimizer: orthogonalize each 2-D gradient by a few dots."""
    a, b, c = 3.4445, -4.7750, 2.0315

    def update(updates, state, params=None):
        del params

        def orth(g):
            x = g / (jnp.linalg.norm(g) + 1e-7)
            for _ in range(steps):
                s = x @ x.T
                x = a * x + (b * s + c * s @ s) @ x
            return -0.02 * x

        return jax.tree.map(orth, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def _dots(compiled) -> int:
    txt = compiled.as_text()
    return len(re.findall(r"\bdot\(", txt)) + len(
        re.findall(r"custom_call_target=\"[^\"]*(?:matmul|gemm|dot)", txt, re.I)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda inner: skip_nonfinite(inner),
        lambda inner: skip_spikes(inner, warmup_steps=2),
        lambda inner: skip_nonfinite(skip_spikes(inner, warmup_steps=2)),
    ],
)
def test_matrix_optimizer_guarded_hlo_has_the_same_dots(make):
    params = {"w": jnp.ones((32, 16)), "v": jnp.ones((16, 8))}
    bare = newton_schulz_like()
    guarded = make(newton_schulz_like())

    def compiled(opt):
        opt = optax.with_extra_args_support(opt)
        state = opt.init(params)
        f = jax.jit(lambda g, s: opt.update(g, s, params, value=jnp.float32(1.0)))
        return f.lower(params, state).compile()

    n_bare, n_guard = _dots(compiled(bare)), _dots(compiled(guarded))
    assert n_bare >= 2 * 3 * 3  # 3 dots per step, 3 steps, 2 leaves
    assert n_guard == n_bare, (n_guard, n_bare)
    # The option that checks the update still computes it once.
    checked = skip_nonfinite(newton_schulz_like(), check_update=True)
    assert _dots(compiled(checked)) == n_bare


# --------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_loss_keyword_is_a_type_error_naming_value(jit):
    params = {"w": jnp.ones((2,))}
    for opt in (skip_nonfinite(optax.sgd(0.1)), skip_spikes(optax.sgd(0.1))):
        update = jax.jit(opt.update) if jit else opt.update
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'loss'.*value="):
            update({"w": jnp.ones(2)}, opt.init(params), params, loss=1.0)
        with pytest.raises(TypeError, match="value="):
            update({"w": jnp.ones(2)}, opt.init(params), params, value=1.0, loss=1.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_eager_nonfinite_value_skips(bad):
    params = {"w": jnp.ones((2,))}
    for opt in (skip_nonfinite(optax.sgd(0.1)), skip_spikes(optax.sgd(0.1))):
        u, s = opt.update({"w": jnp.ones(2)}, opt.init(params), params, value=bad)
        assert bool(any_skipped(s))
        assert np.asarray(u["w"]).tobytes() == np.zeros(2, np.float32).tobytes()


def test_reduce_on_plateau_inside_a_guard_gets_value_and_keeps_state_on_skip():
    params = {"w": jnp.ones((2,))}
    inner = optax.chain(
        optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)
    )
    opt = skip_nonfinite(inner)
    step = jax.jit(opt.update)
    state = opt.init(params)
    for loss in (1.0, 1.0, 1.0, 1.0):
        _, state = step({"w": jnp.ones(2)}, state, params, value=loss)
    scale_before = float(state.nonfinite_inner_state[1].scale)
    assert scale_before < 1.0  # the plateau was seen: value= reached it
    before = state
    _, state = step({"w": jnp.ones(2)}, state, params, value=jnp.nan)
    assert bool(state.nonfinite_skipped)
    chex.assert_trees_all_equal(state.nonfinite_inner_state, before.nonfinite_inner_state)


def test_vector_loss_is_rejected_by_every_guard():
    params = {"w": jnp.ones((2,))}
    for opt in (skip_nonfinite(optax.sgd(0.1)), skip_spikes(optax.sgd(0.1))):
        with pytest.raises(ValueError, match="`value` must be a scalar"):
            opt.update({"w": jnp.ones(2)}, opt.init(params), params, value=jnp.ones(3))


def test_uncalled_factory_is_a_clear_error():
    with pytest.raises(TypeError, match="factory: call it"):
        skip_nonfinite(stabljax.safe_adamw)
    with pytest.raises(TypeError, match="GradientTransformation"):
        skip_spikes(3)


def test_skip_step_configuration_errors():
    with pytest.raises(ValueError, match="nothing to check"):
        skip_step(optax.sgd(0.1), nonfinite=False)
    with pytest.raises(ValueError, match="`nonfinite`"):
        skip_step(optax.sgd(0.1), nonfinite=("loss", "accuracy"))
    with pytest.raises(TypeError, match="SpikeRule"):
        skip_step(optax.sgd(0.1), spikes={"z_threshold": 3.0})
    with pytest.raises(ValueError, match="`warmup_steps`"):
        SpikeRule(warmup_steps=2.5)
    for w in (0, 1):  # one residual has no spread to test against
        with pytest.raises(ValueError, match=r"`warmup_steps` must be an int >= 2"):
            SpikeRule(warmup_steps=w)


def test_nonfinite_selects_what_is_checked():
    params = {"w": jnp.ones((2,))}
    only_grads = skip_step(optax.sgd(0.1), nonfinite=("grad_norm",))
    _, s = jax.jit(only_grads.update)(
        {"w": jnp.ones(2)}, only_grads.init(params), params, value=jnp.nan
    )
    assert isinstance(s, SkipNonfiniteState) and not bool(s.nonfinite_skipped)
    only_loss = skip_step(optax.sgd(0.1), nonfinite=("loss",))
    g = {"w": jnp.array([jnp.nan, 1.0])}
    _, s = jax.jit(only_loss.update)(g, only_loss.init(params), params, value=1.0)
    assert not bool(s.nonfinite_skipped)
    _, s = jax.jit(only_loss.update)(
        {"w": jnp.ones(2)}, only_loss.init(params), params, value=jnp.inf
    )
    assert bool(s.nonfinite_skipped)
    both = skip_step(optax.sgd(0.1), spikes=SpikeRule(watch=("grad_norm",)))
    assert isinstance(both.init(params), SkipSpikesState)
