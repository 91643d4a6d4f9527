"""Tests of the leading-indicator signals (stabljax.telemetry.leading_signals) and of the
step that returns them (make_train_step(signals=...))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stabljax import metrics
from stabljax.optim.guards.skips import skip_nonfinite
from stabljax.step import TrainState, lm_loss, make_train_step
from stabljax.telemetry import Signals, leading_signals, path_str

B2 = 0.95


def params_tree():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "dense": {"w": jax.random.normal(k1, (5, 3)), "b": jnp.zeros(3)},
        "head": jax.random.normal(k2, (3,)),
    }


def grads_at(t: int, params):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(100 + t), len(leaves))
    scale = 40.0 if t == 5 else 1.0  # step 5's gradient outruns the second moment
    return treedef.unflatten(
        [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
    )


def numpy_reference(grad_seq, params, updates, b2):
    """adam_rms and update_rms_ratio per path, float64, nu summed from its definition."""
    t = len(grad_seq)
    out_adam, out_ratio = {}, {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, p in flat:
        key = path_str(path)
        gs = [np.asarray(_at(g, path), np.float64) for g in grad_seq]
        nu = sum((1 - b2) * b2 ** (t - 1 - i) * gs[i] ** 2 for i in range(t))
        v_hat = nu / (1 - b2**t)
        g = gs[-1]
        ratio = np.divide(g * g, v_hat, out=np.zeros_like(g), where=v_hat > 0)
        out_adam[key] = np.sqrt(ratio.mean())
        u = np.asarray(_at(updates, path), np.float64)
        with np.errstate(divide="ignore"):  # the zero-initialised bias: Inf, as documented
            out_ratio[key] = np.linalg.norm(u) / np.linalg.norm(np.asarray(p, np.float64))
    return out_adam, out_ratio


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optax.adam(1e-2, b2=B2),
        lambda: optax.chain(optax.clip_by_global_norm(1e6), optax.adamw(1e-2, b2=B2)),
        lambda: skip_nonfinite(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b2=B2)),
    ],
    ids=["adam", "chain", "guard_inject"],
)
def test_signals_match_a_float64_reference(make_opt):
    opt = make_opt()
    params = params_tree()
    state = opt.init(params)
    signals = jax.jit(lambda g, p, u, s: leading_signals(g, p, u, s, b2=B2))
    update = jax.jit(opt.update)
    grad_seq = []
    for t in range(1, 8):
        g = grads_at(t, params)
        grad_seq.append(g)
        u, state = update(g, state, params)
        m = signals(g, params, u, state)
        want_adam, want_ratio = numpy_reference(grad_seq, params, u, B2)
        for key in want_adam:
            np.testing.assert_allclose(m[metrics.ADAM_RMS_LAYERS][key], want_adam[key], rtol=1e-5)
            np.testing.assert_allclose(
                m[metrics.UPDATE_RMS_RATIO_LAYERS][key], want_ratio[key], rtol=1e-5
            )
        np.testing.assert_allclose(m[metrics.ADAM_RMS], max(want_adam.values()), rtol=1e-5)
        np.testing.assert_allclose(m[metrics.UPDATE_RMS_RATIO], max(want_ratio.values()), rtol=1e-5)
        if t == 5:  # the outrunning gradient: g^2 / v_hat near its bound (1 - b2^t)/(1 - b2)
            assert float(m[metrics.ADAM_RMS]) > 2.0
        elif t < 5:
            assert float(m[metrics.ADAM_RMS]) < 2.0


def test_adam_rms_hand_computed():
    # One coordinate, b2 = 0.5, g = 1 then 3: nu = 0.5, then 0.25 + 4.5 = 4.75; the bias
    # correction 1 - 0.25 = 0.75 gives v_hat = 19/3, and sqrt(9 / (19/3)) = sqrt(27/19).
    opt = optax.adam(0.1, b2=0.5)
    p = {"w": jnp.array([2.0])}
    state = opt.init(p)
    for g in (1.0, 3.0):
        grads = {"w": jnp.array([g])}
        u, state = opt.update(grads, state)
    m = leading_signals(grads, p, u, state, b2=0.5)
    np.testing.assert_allclose(m[metrics.ADAM_RMS], np.sqrt(27 / 19), rtol=1e-6)
    # the wrong b2 gives another value: the bias correction is really applied
    wrong = leading_signals(grads, p, u, state, b2=0.9)
    assert abs(float(wrong[metrics.ADAM_RMS]) - np.sqrt(27 / 19)) > 0.1


def test_zero_second_moment_and_no_adam_state():
    p = {"w": jnp.ones(4), "unused": jnp.ones(2)}
    opt = optax.adam(0.1)
    g = {"w": jnp.ones(4), "unused": jnp.zeros(2)}
    u, state = opt.update(g, opt.init(p))
    m = leading_signals(g, p, u, state)
    assert float(m[metrics.ADAM_RMS_LAYERS]["unused"]) == 0.0  # 0 / v_hat floored: 0, not NaN
    assert np.isfinite(float(m[metrics.ADAM_RMS]))
    sgd = optax.sgd(0.1)
    m = leading_signals(g, p, g, sgd.init(p))
    assert metrics.ADAM_RMS not in m and metrics.UPDATE_RMS_RATIO in m


def test_signals_validate_b2():
    with pytest.raises(ValueError, match="b2"):
        Signals(b2=1.0)
    with pytest.raises(ValueError, match="b2"):
        Signals(b2=True)


def bigram(params, inputs):
    return params["table"][inputs]


BATCH = {"inputs": jnp.array([[0, 1, 2, 3]]), "targets": jnp.array([[1, 2, 3, 0]])}


def test_step_returns_signals_as_device_values_without_a_host_call():
    opt = optax.adam(0.1, b2=B2)
    step = make_train_step(lm_loss(bigram), opt, signals=Signals(b2=B2))
    plain = make_train_step(lm_loss(bigram), opt)
    state = TrainState.create({"table": jnp.zeros((4, 4))}, opt)
    jaxpr = jax.make_jaxpr(step)(state, BATCH).jaxpr
    names = {e.primitive.name for e in jaxpr.eqns}
    assert not {n for n in names if "callback" in n or n == "debug_print"}
    batch = jax.device_put(BATCH)
    with jax.transfer_guard("disallow_explicit"):
        state, m = step(state, batch)
        state, m = step(state, batch)
    assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(m))
    assert metrics.ADAM_RMS in m and metrics.UPDATE_RMS_RATIO in m
    assert set(m[metrics.ADAM_RMS_LAYERS]) == {"table"}
    assert (
        metrics.ADAM_RMS
        not in plain(TrainState.create({"table": jnp.zeros((4, 4))}, opt), BATCH)[1]
    )
    for key in metrics.SIGNAL_KEYS:
        metrics.check_key("test", "metric", key)


@pytest.mark.slow  # an XLA:TPU compile, like tests/test_bench_tpu.py's
def test_signals_aot_quick(tmp_path, monkeypatch):
    pytest.importorskip("libtpu")
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another worker may hold libtpu
    from experiments.bench import signals_aot

    res = signals_aot.main(["--quick", "--out", str(tmp_path), "--no-progress"])
    ratio = res["ratios"]["bytes_signals/guarded (tiny-data)"]
    # the signals read the gradients and the second moment once more: more bytes, not fewer
    assert 1.0 < ratio < 2.0
    assert (tmp_path / "signals_aot.json").exists()
