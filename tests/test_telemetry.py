"""Tests for stabljax.telemetry: norms, per-layer metrics and the Adam-epsilon report."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import nested_params, random_grads_like

from stabljax import telemetry
from stabljax.optim.adam import ScaleBySafeAdamState, safe_adamw
from stabljax.optim.guards.skips import skip_nonfinite
from stabljax.telemetry import (
    adam_eps_report,
    global_norm,
    layer_metrics,
    layer_metrics_to_host,
    path_str,
)


def paths(tree):
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


# --------------------------------------------------------------------------- paths


def test_path_str_of_nested_params():
    assert paths(nested_params()) == ["blocks/0", "blocks/1", "dense/b", "dense/w", "pair/0"]
    assert path_str(()) == ""


def test_path_str_drops_the_nnx_variable_payload():
    class Model(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
            self.blocks = nnx.List([nnx.Linear(3, 3, use_bias=False, rngs=nnx.Rngs(1))])

    _, params = nnx.split(Model(), nnx.Param)
    assert paths(params) == ["blocks/0/kernel", "linear/bias", "linear/kernel"]


def test_path_str_of_a_named_tuple():
    state = optax.adam(1.0).init({"w": jnp.zeros(2)})
    assert paths(state) == ["0/count", "0/mu/w", "0/nu/w"]


# --------------------------------------------------------------------------- norms


def test_global_norm_matches_float64():
    params = nested_params()
    ref = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(params)))
    np.testing.assert_allclose(jax.jit(global_norm)(params), ref, rtol=1e-6)
    assert float(global_norm({})) == 0.0 and global_norm({}).dtype == jnp.float32


def test_global_norm_of_low_precision_does_not_overflow():
    # squares in float16 overflow above 256; the norm is taken in float32
    h = {"h": jnp.full((4,), 60000.0, jnp.float16), "b": jnp.full((1,), 1e19, jnp.bfloat16)}
    out = jax.jit(global_norm)(h)
    assert out.dtype == jnp.float32
    ref = np.sqrt(4 * 60000.0**2 + float(h["b"][0]) ** 2)
    np.testing.assert_allclose(out, ref, rtol=1e-6)


# --------------------------------------------------------------------------- layer metrics


def test_layer_metrics_match_numpy():
    params = nested_params()
    grads = random_grads_like(params, seed=1)
    updates = random_grads_like(params, seed=2, scale=1e-2)
    grads["dense"]["b"] = grads["dense"]["b"].at[3].set(jnp.inf)
    out = jax.jit(layer_metrics)(grads, params, updates)
    assert set(out) == {"grad_norm", "param_norm", "update_ratio", "nonfinite_grad"}
    for name, p, g, u in zip(
        paths(params),
        jax.tree.leaves(params),
        jax.tree.leaves(grads),
        jax.tree.leaves(updates),
        strict=True,
    ):
        p, g, u = (np.asarray(x, np.float64) for x in (p, g, u))
        pn = np.linalg.norm(p)
        with np.errstate(invalid="ignore"):
            np.testing.assert_allclose(out["grad_norm"][name], np.linalg.norm(g), rtol=1e-6)
        np.testing.assert_allclose(out["param_norm"][name], pn, rtol=1e-6)
        ratio = np.linalg.norm(u) / pn if pn > 0 else np.inf
        np.testing.assert_allclose(out["update_ratio"][name], ratio, rtol=1e-6)
        assert bool(out["nonfinite_grad"][name]) == (not np.all(np.isfinite(g)))
    assert bool(out["nonfinite_grad"]["dense/b"])  # the one Inf
    assert out["update_ratio"]["dense/b"] == np.inf  # zero-initialised bias
    assert out["nonfinite_grad"]["dense/b"].dtype == jnp.bool_


def test_update_ratio_zero_over_zero_is_zero():
    z = {"b": jnp.zeros(3)}
    assert float(layer_metrics(z, z, z)["update_ratio"]["b"]) == 0.0


def test_layer_metrics_to_host_flattens_to_floats():
    params = {"dense": {"w": jnp.array([3.0, 4.0])}}
    grads = {"dense": {"w": jnp.array([jnp.nan, 1.0])}}
    metrics = {"loss": jnp.float32(1.0), "layers": layer_metrics(grads, params, params)}
    host = layer_metrics_to_host(metrics)
    np.testing.assert_equal(host, layer_metrics_to_host(metrics["layers"]))  # NaN == NaN
    assert set(host) == {
        "grad_norm/dense/w",
        "param_norm/dense/w",
        "update_ratio/dense/w",
        "nonfinite_grad/dense/w",
    }
    assert all(type(v) is float for v in host.values())
    assert host["param_norm/dense/w"] == 5.0 and host["nonfinite_grad/dense/w"] == 1.0
    assert np.isnan(host["grad_norm/dense/w"])


# --------------------------------------------------------------------------- adam_eps_report


def known_nu(b2, count):
    """nu and the expected fractions for eps = 1e-3: sqrt(v_hat) in {1e-4, 1e-2}."""
    corr = 1.0 - b2**count
    small, large = (1e-4) ** 2 * corr, (1e-2) ** 2 * corr
    nu = {
        "a": jnp.array([small, large, large, large]),  # 1/4 below eps
        "b": {"c": jnp.array([[small, small], [small, large]])},  # 3/4
        "d": jnp.full((5,), large),  # 0
    }
    return nu, {"a": 0.25, "b/c": 0.75, "d": 0.0}


@pytest.mark.parametrize("b2, count", [(0.999, 1), (0.999, 10), (0.95, 1000)])
def test_report_on_optax_adam_state(b2, count):
    nu, expected = known_nu(b2, count)
    state = optax.ScaleByAdamState(
        count=jnp.int32(count), mu=jax.tree.map(jnp.zeros_like, nu), nu=nu
    )
    assert adam_eps_report(state, 1e-3, b2=b2) == expected


def test_report_with_the_wrong_bias_correction_differs():
    # The control: at count 1 with b2 = 0.999, v_hat = 1000 nu; corrected with b2 = 0.5
    # instead (v_hat = 2 nu), the large coordinates fall below eps too.
    nu, expected = known_nu(0.999, 1)
    state = optax.ScaleByAdamState(count=jnp.int32(1), mu=nu, nu=nu)
    assert adam_eps_report(state, 1e-3, b2=0.5) != expected


def test_report_on_safe_adam_state_inside_guards_and_chains():
    nu, expected = known_nu(0.999, 7)
    params = jax.tree.map(jnp.zeros_like, nu)
    opt = skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), safe_adamw(1e-3)))
    state = opt.init(params)
    ((path, adam_state),) = [
        (p, s)
        for p, s in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, ScaleBySafeAdamState)
        )[0]
        if isinstance(s, ScaleBySafeAdamState)
    ]
    adam_state = adam_state._replace(count=jnp.int32(7), nu=nu)
    state = _replace_at(state, path, adam_state)
    assert adam_eps_report(state, 1e-3) == expected


def _replace_at(tree, path, value):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, ScaleBySafeAdamState)
    )
    new = [value if p == path else x for p, x in leaves]
    return jax.tree.unflatten(treedef, new)


def test_report_on_a_real_optax_run_and_inject_hyperparams():
    params = {"w": jnp.zeros(4)}
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, b2=0.5)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for _ in range(3):
        _, state = update({"w": jnp.array([0.0, 1e-9, 1.0, 1.0])}, state)
    assert adam_eps_report(state, 1e-8, b2=0.5) == {"w": 0.5}
    assert adam_eps_report(state, 0.0, b2=0.5) == {"w": 0.0}


def test_report_before_the_first_update_and_without_adam():
    state = optax.adam(1e-3).init({"w": jnp.zeros(3)})
    assert adam_eps_report(state, 1e-8) == {"w": 1.0}  # nu = 0, count 0: no NaN
    assert adam_eps_report(optax.sgd(0.1).init({"w": jnp.zeros(3)}), 1e-8) == {}


def test_report_prefixes_clashing_paths():
    params = {"w": jnp.zeros(2)}
    state = (optax.adam(1e-3).init(params), optax.adam(1e-3).init(params))
    report = adam_eps_report(state, 1e-8)
    assert report == {"0/0:w": 1.0, "1/0:w": 1.0}


def test_report_on_multi_transform_merges_disjoint_paths():
    params = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    opt = optax.multi_transform(
        {"x": optax.adam(1e-3), "y": optax.adam(1e-3)}, {"a": "x", "b": "y"}
    )
    assert adam_eps_report(opt.init(params), 1e-8) == {"a": 1.0, "b": 1.0}


def test_report_bad_b2_raises():
    with pytest.raises(ValueError, match="b2"):
        adam_eps_report(optax.adam(1e-3).init(jnp.zeros(2)), 1e-8, b2=1.0)


# --------------------------------------------------------------------------- spike score


def loop_spike_score(x, window=1000, n_sigma=7.0, min_history=100):
    """The definition, value by value, in float64."""
    spikes = scored = 0
    for t in range(len(x)):
        past = [v for v in x[max(0, t - window) : t] if np.isfinite(v)]
        if len(past) < min_history:
            continue
        scored += 1
        mu, sd = np.mean(past), np.std(past)
        dev = abs(x[t] - mu)
        spikes += (not np.isfinite(x[t])) or (dev >= n_sigma * sd and dev > 1e-9 * max(1, abs(mu)))
    return 100.0 * spikes / scored if scored else float("nan")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spike_score_matches_the_loop_definition(seed):
    rng = np.random.default_rng(seed)
    n = 1500
    x = 3.0 - np.log1p(np.arange(n)) * 0.1 + 0.02 * rng.standard_normal(n)
    idx = rng.choice(np.arange(150, n), 12, replace=False)
    x[idx] += rng.uniform(0.05, 2.0, 12)  # some pass 7 sigma, some do not
    x[idx[:2]] = [np.nan, np.inf]
    got = telemetry.spike_score(x)
    want = loop_spike_score(x)
    assert 0 < want < 2
    np.testing.assert_allclose(got, want, rtol=1e-12)
    small = telemetry.spike_score(x, window=50, min_history=20, n_sigma=3.0)
    np.testing.assert_allclose(small, loop_spike_score(x, 50, 3.0, 20), rtol=1e-12)


def test_spike_score_edge_cases():
    assert telemetry.spike_score(np.full(300, 2.5)) == 0.0  # constant: no spikes
    assert np.isnan(telemetry.spike_score(np.ones(50)))  # nothing scored yet
    x = np.ones(200)
    x[150] = 1.0 + 1e-6  # any deviation of a constant window is infinitely many sigma
    np.testing.assert_allclose(telemetry.spike_score(x), 100.0 / 100)
    with pytest.raises(ValueError, match="min_history"):
        telemetry.spike_score(x, window=10, min_history=20)
