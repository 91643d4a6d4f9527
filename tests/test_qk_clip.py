"""Tests for stabljax.optim.qk_clip against a float64 numpy reference of Kimi K2's QK-Clip."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import mesh8
from jax.sharding import NamedSharding, PartitionSpec

import stabljax
from stabljax.optim.guards.skips import skip_nonfinite, skip_spikes
from stabljax.optim.qk_clip import (
    QKHeads,
    QKLayer,
    max_logits_over_micro_batches,
    qk_clip,
    qk_logit_proxy,
)
from stabljax.reference import TransformerConfig, TransformerLM
from stabljax.step import TrainState, make_train_step, nnx_apply

TAU, ALPHA = 10.0, 0.5

# ----------------------------------------------------------------------------- reference


def np_head_slice(shape, spec, h):
    """The numpy index of head h of ``spec`` in a leaf of ``shape``."""
    axis = spec.axis % len(shape)
    width = spec.head_width or (shape[axis] - spec.offset) // spec.n_heads
    idx = [slice(None)] * len(shape)
    idx[axis] = slice(spec.offset + h * width, spec.offset + (h + 1) * width)
    return tuple(idx)


def np_qk_clip(params, updates, layers, max_logits, tau=TAU, alpha=ALPHA):
    """Kimi K2's rule in float64, head by head: the new params p + u'."""
    new = {
        k: np.asarray(params[k], np.float64) + np.asarray(updates[k], np.float64) for k in params
    }
    for name, layer in layers.items():
        qs = (layer.q,) if isinstance(layer.q, QKHeads) else layer.q
        ks = (layer.k,) if isinstance(layer.k, QKHeads) else layer.k
        n_q, n_kv = qs[0].n_heads, ks[0].n_heads
        s = np.asarray(max_logits[name], np.float64)
        gamma = [tau / s[h] if np.isfinite(s[h]) and s[h] > tau else 1.0 for h in range(n_q)]
        group = n_q // n_kv
        for h in range(n_q):
            for spec in qs:
                new[spec.path][np_head_slice(new[spec.path].shape, spec, h)] *= gamma[h] ** alpha
        for g in range(n_kv):
            gk = min(gamma[g * group : (g + 1) * group])
            for spec in ks:
                new[spec.path][np_head_slice(new[spec.path].shape, spec, g)] *= gk ** (1 - alpha)
    return new


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


# Each case: (params shapes, layers, n_q heads)
D, HD = 8, 4


def case(name):
    if name == "mha":  # separate [d, H*hd] kernels
        shapes = {"wq": (D, 4 * HD), "wk": (D, 4 * HD), "wv": (D, 4 * HD)}
        layers = {0: QKLayer(QKHeads("wq", 4), QKHeads("wk", 4))}
    elif name == "gqa":  # 4 query heads, 2 KV heads
        shapes = {"wq": (D, 4 * HD), "wk": (D, 2 * HD)}
        layers = {0: QKLayer(QKHeads("wq", 4), QKHeads("wk", 2))}
    elif name == "mqa_heads_axis":  # [d, H, hd] with an explicit heads axis, one KV head
        shapes = {"wq": (D, 4, HD), "wk": (D, 1, HD)}
        layers = {"a": QKLayer(QKHeads("wq", 4, axis=-2, head_width=1), QKHeads("wk", 1, axis=1))}
    elif name == "fused_bias_2layers":  # fused [d, 3·H·hd] kernel and bias, two layers
        shapes = {
            f"l{i}/{n}": (D, 3 * 2 * HD) if n == "k" else (3 * 2 * HD,)
            for i in (0, 1)
            for n in ("k", "b")
        }
        layers = {
            i: QKLayer(
                q=(QKHeads(f"l{i}/k", 2, head_width=HD), QKHeads(f"l{i}/b", 2, head_width=HD)),
                k=(
                    QKHeads(f"l{i}/k", 2, offset=2 * HD, head_width=HD),
                    QKHeads(f"l{i}/b", 2, axis=0, offset=2 * HD, head_width=HD),
                ),
            )
            for i in (0, 1)
        }
    else:
        raise ValueError(name)
    params = {k: rand(i, s) for i, (k, s) in enumerate(sorted(shapes.items()))}
    if name == "fused_bias_2layers":  # nest: paths "l0/k" are dict-of-dict paths
        params = {f"l{i}": {n: params[f"l{i}/{n}"] for n in ("k", "b")} for i in (0, 1)}
    return params, layers


def flat(tree):
    return {
        stabljax.telemetry.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def n_q_of(layer):
    return (layer.q if isinstance(layer.q, QKHeads) else layer.q[0]).n_heads


def logits_for(layers, seed):
    """Per layer: some heads far above tau, one at it, some below, one just above."""
    out = {}
    for j, (name, layer) in enumerate(layers.items()):
        n = n_q_of(layer)
        base = np.array([40.0, 3.0, TAU, 10.5, 250.0, 0.5, 12.0, 9.0])[:n]
        out[name] = jnp.asarray(np.roll(base, seed + j), jnp.float32)
    return out


CASES = ["mha", "gqa", "mqa_heads_axis", "fused_bias_2layers"]


@pytest.mark.parametrize("name", CASES)
def test_matches_float64_reference_under_jit(name):
    chex.clear_trace_counter()
    params, layers = case(name)
    opt = optax.chain(optax.sgd(0.1), qk_clip(layers, tau=TAU, alpha=ALPHA))
    state = opt.init(params)
    update = jax.jit(chex.assert_max_traces(opt.update, n=1))
    p = params
    for i in range(3):
        grads = jax.tree.map(lambda x, i=i: rand(100 + i, x.shape), p)
        ml = logits_for(layers, i)
        u, state = update(grads, state, p, max_logits=ml)
        sgd_u = jax.tree.map(lambda g: -0.1 * g, grads)
        want = np_qk_clip(flat(p), flat(sgd_u), layers, ml)
        got = flat(optax.apply_updates(p, u))
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6, err_msg=k)
        n_clipped = sum(int(np.sum(np.asarray(v) > TAU)) for v in ml.values())
        assert int(state[1].qk_clipped_heads) == n_clipped > 0
        p = optax.apply_updates(p, u)


def test_untouched_entries_get_the_update_bit_for_bit():
    params, layers = case("gqa")
    params["other"] = rand(9, (3,))
    opt = qk_clip(layers, tau=TAU)
    ups = jax.tree.map(lambda x: rand(5, x.shape), params)
    below = {0: jnp.array([1.0, 2.0, 3.0, 4.0])}
    out, _ = jax.jit(opt.update)(ups, opt.init(params), params, max_logits=below)
    chex.assert_trees_all_equal(out, ups)  # nothing over tau: u exactly, not (p + u) - p
    over = {0: jnp.array([1.0, 2.0, 30.0, 4.0])}  # head 2: group 1 (heads 2, 3)
    out, _ = jax.jit(opt.update)(ups, opt.init(params), params, max_logits=over)
    chex.assert_trees_all_equal(out["other"], ups["other"])
    np.testing.assert_array_equal(out["wq"][:, : 2 * HD], ups["wq"][:, : 2 * HD])
    np.testing.assert_array_equal(out["wk"][:, :HD], ups["wk"][:, :HD])
    assert not np.allclose(out["wk"][:, HD:], ups["wk"][:, HD:])


def test_nonfinite_logits_leave_the_head_alone():
    params, layers = case("mha")
    opt = qk_clip(layers, tau=TAU)
    ups = optax.tree.zeros_like(params)
    ml = {0: jnp.array([jnp.nan, jnp.inf, 40.0, 1.0])}
    out, state = jax.jit(opt.update)(ups, opt.init(params), params, max_logits=ml)
    new = optax.apply_updates(params, out)
    chex.assert_tree_all_finite(new)
    np.testing.assert_array_equal(new["wq"][:, : 2 * HD], params["wq"][:, : 2 * HD])
    assert int(state.qk_clipped_heads) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtype_kept(dtype):
    params, layers = case("mha")
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    opt = qk_clip(layers, tau=TAU)
    out, _ = jax.jit(opt.update)(params, opt.init(params), params, max_logits=logits_for(layers, 0))
    assert all(x.dtype == dtype for x in jax.tree.leaves(out))


def test_sharded_equals_unsharded():
    params, layers = case("fused_bias_2layers")
    mesh = mesh8()
    opt = optax.chain(optax.adam(0.1), qk_clip(layers, tau=TAU))
    grads = jax.tree.map(lambda x: rand(7, x.shape), params)
    ml = logits_for(layers, 1)
    want, _ = jax.jit(opt.update)(grads, opt.init(params), params, max_logits=ml)

    def put(x):  # shard the fused axis (24 / 8) of every leaf
        spec = PartitionSpec(*([None] * (x.ndim - 1)), "data")
        return jax.device_put(x, NamedSharding(mesh, spec))

    sp, sg = jax.tree.map(put, params), jax.tree.map(put, grads)
    got, _ = jax.jit(opt.update)(sg, opt.init(sp), sp, max_logits=ml)
    assert got["l0"]["k"].sharding.spec[-1] == "data"
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("guard", ["nonfinite", "spikes"])
def test_inside_the_guards_a_skipped_step_clips_nothing(guard):
    params, layers = case("gqa")
    inner = optax.chain(optax.sgd(0.1), qk_clip(layers, tau=TAU))
    if guard == "nonfinite":
        opt = skip_nonfinite(inner)
    else:
        opt = skip_spikes(inner, warmup_steps=2, watch=("grad_norm",))  # the smallest allowed
    state = opt.init(params)
    update = jax.jit(opt.update)
    ml = logits_for(layers, 0)
    grads = jax.tree.map(lambda x: rand(3, x.shape), params)
    u, state = update(grads, state, params, max_logits=ml)  # a normal step clips
    want = np_qk_clip(flat(params), flat(jax.tree.map(lambda g: -0.1 * g, grads)), layers, ml)
    for k, v in flat(optax.apply_updates(params, u)).items():
        np.testing.assert_allclose(v, want[k], rtol=2e-6, atol=2e-6)
    before = state
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
    u, state = update(bad, state, params, max_logits=ml)  # skipped: nothing at all
    chex.assert_trees_all_equal(u, optax.tree.zeros_like(params))
    assert bool(stabljax.any_skipped(state))
    chex.assert_trees_all_equal(state[0], before[0])


def test_in_inject_hyperparams_with_a_traced_tau():
    params, layers = case("mha")
    opt = optax.inject_hyperparams(qk_clip, static_args=("layers",))(layers=layers, tau=TAU)
    ml = logits_for(layers, 2)
    u, _ = jax.jit(opt.update)(
        optax.tree.zeros_like(params), opt.init(params), params, max_logits=ml
    )
    want = np_qk_clip(params, optax.tree.zeros_like(params), layers, ml)
    for k, v in optax.apply_updates(params, u).items():
        np.testing.assert_allclose(v, want[k], rtol=2e-6, atol=2e-6)


def test_proxy_matches_numpy():
    params, layers = case("gqa")
    got = qk_logit_proxy(layers, params)["0"]
    wq = np.asarray(params["wq"], np.float64).reshape(D, 4, HD)
    wk = np.asarray(params["wk"], np.float64).reshape(D, 2, HD)
    nq = np.sqrt((wq**2).sum(axis=(0, 2)))
    nk = np.repeat(np.sqrt((wk**2).sum(axis=(0, 2))), 2)
    np.testing.assert_allclose(got, np.max(nq * nk) / np.sqrt(HD), rtol=1e-6)


# ----------------------------------------------------------------------------- validation

GOOD = {0: QKLayer(QKHeads("wq", 4), QKHeads("wk", 4))}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(layers={}), "`layers`"),
        (dict(layers=[GOOD[0]]), "`layers`"),
        (dict(layers={0: (QKHeads("wq", 4), QKHeads("wk", 4))}), r"`layers\[0\]`"),
        (dict(layers={0: QKLayer("wq", QKHeads("wk", 4))}), r"`layers\[0\].q`"),
        (dict(layers={0: QKLayer(QKHeads("wq", 0), QKHeads("wk", 4))}), "n_heads"),
        (dict(layers={0: QKLayer(QKHeads("wq", 4, offset=-1), QKHeads("wk", 4))}), "offset"),
        (dict(layers={0: QKLayer(QKHeads("wq", 4, head_width=0), QKHeads("wk", 4))}), "head_width"),
        (dict(layers={0: QKLayer(QKHeads("wq", 4), QKHeads("wk", 3))}), "divide"),
        (dict(layers={0: QKLayer(QKHeads("", 4), QKHeads("wk", 4))}), "path"),
        (dict(layers=GOOD, tau=0.0), "`tau`"),
        (dict(layers=GOOD, tau=float("inf")), "`tau`"),
        (dict(layers=GOOD, alpha=1.5), "`alpha`"),
        (dict(layers=GOOD, alpha=-0.1), "`alpha`"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        qk_clip(**kwargs)


def test_init_and_update_check_the_params_and_logits():
    params, _ = case("mha")
    with pytest.raises(ValueError, match="'nope' is not a parameter path"):
        qk_clip({0: QKLayer(QKHeads("nope", 4), QKHeads("wk", 4))}).init(params)
    with pytest.raises(ValueError, match="do not fit"):
        qk_clip({0: QKLayer(QKHeads("wq", 4, head_width=5), QKHeads("wk", 4))}).init(params)
    with pytest.raises(ValueError, match="do not split"):
        qk_clip({0: QKLayer(QKHeads("wq", 3), QKHeads("wk", 3))}).init(params)
    opt = qk_clip(GOOD)
    state = opt.init(params)
    with pytest.raises(ValueError, match="max_logits="):
        opt.update(params, state, params)
    with pytest.raises(ValueError, match="`params`"):
        opt.update(params, state, max_logits={0: jnp.ones(4)})
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        opt.update(params, state, params, max_logits={0: jnp.ones(3)})


# ----------------------------------------------------------------------------- reference model


def ref_model(n_layers=1, **kw):
    cfg = TransformerConfig(d_model=32, n_layers=n_layers, n_heads=4, max_len=16, **kw)
    model = TransformerLM(cfg, rngs=nnx.Rngs(0))
    aux_apply, params = nnx_apply(model, return_aux=True)
    # Larger q and k weights, so that the heads' max logits spread out.
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: 6.0 * x if "qkv" in stabljax.telemetry.path_str(p) else x, params
    )
    return model, aux_apply, params


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (4, 16), 0, 256)


def head_logits(aux_apply, params, x):
    return np.asarray(aux_apply(params, x)[1]["max_attn_logits"])


def lm_loss_fn(aux_apply):
    def loss_fn(p, batch):
        logits, aux = aux_apply(p, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        return ce, {"max_attn_logits": aux["max_attn_logits"]}

    return loss_fn


@pytest.mark.parametrize("use_bias", [False, True])
def test_after_a_step_every_clipped_head_is_at_most_tau(use_bias):
    """Adam's update u, then the clip of p + u with the logits measured at p + u on the same
    batch: every clipped head's recomputed max logit is tau (<= tau·(1 + 1e-4)), every other
    head is unchanged. One layer: a deeper layer's inputs move when an earlier one is
    clipped (see the next test)."""
    model, aux_apply, params = ref_model(use_bias=use_bias)
    layers, x = model.qk_layers(), tokens()
    grads = jax.grad(lambda p: jnp.mean(aux_apply(p, x)[0] ** 2))(params)
    adam = optax.adam(3e-2)
    u, _ = adam.update(grads, adam.init(params), params)
    s_new = head_logits(aux_apply, optax.apply_updates(params, u), x)
    tau = float(np.median(s_new))  # half the heads pass it
    clip = qk_clip(layers, tau=tau)
    u2, cs = jax.jit(clip.update)(u, clip.init(params), params, max_logits=s_new)
    after = head_logits(aux_apply, optax.apply_updates(params, u2), x)
    clipped = s_new > tau
    assert clipped.sum() == int(cs.qk_clipped_heads) == 2
    assert np.all(after[clipped] <= tau * (1 + 1e-4)), (after[clipped], tau)
    np.testing.assert_allclose(after[clipped], tau, rtol=1e-4)  # at tau, not below
    np.testing.assert_allclose(after[~clipped], s_new[~clipped], rtol=1e-5)


def test_train_step_passes_the_per_head_logits_and_reports_them():
    """A clip-only optimizer in the train step (its update is the clip, so the logits the
    step measured are those at the params it rescales): the first layer's clipped heads end
    at <= tau·(1 + 1e-4) after one step; a deeper layer's inputs moved with the clip of the
    layers below it, so every head of an L-layer model is there after L steps."""
    model, aux_apply, params = ref_model(n_layers=2)
    layers, x = model.qk_layers(), tokens()
    s0 = head_logits(aux_apply, params, x)
    tau = float(np.median(s0))
    opt = skip_nonfinite(optax.chain(optax.set_to_zero(), qk_clip(layers, tau=tau)))
    step = make_train_step(lm_loss_fn(aux_apply), opt, qk_layers=layers)
    state = TrainState.create(params, opt)
    batch = {"inputs": x, "targets": jnp.roll(x, -1, axis=1)}
    state, m = step(state, batch)
    np.testing.assert_allclose(m["max_attn_logit"], s0.max(), rtol=1e-6)
    assert set(m["max_attn_logit_layers"]) == {"0", "1"} and "max_attn_logits" not in m
    np.testing.assert_allclose(m["max_attn_logit_layers"]["1"], s0[1].max(), rtol=1e-6)
    np.testing.assert_allclose(
        m["attn_logit_proxy"]["0"], qk_logit_proxy(layers, params)["0"], rtol=1e-6
    )
    after = head_logits(aux_apply, state.params, x)
    clipped = s0 > tau
    assert clipped[0].sum() >= 1 and clipped[1].sum() >= 1
    assert np.all(after[0][clipped[0]] <= tau * (1 + 1e-4))
    np.testing.assert_allclose(after[0][~clipped[0]], s0[0][~clipped[0]], rtol=1e-5)
    state, m = step(state, batch)  # L = 2 steps
    after = head_logits(aux_apply, state.params, x)
    assert np.all(after <= tau * (1 + 1e-4)), (after, tau)
    state, m = step(state, batch)
    assert float(m["max_attn_logit"]) <= tau * (1 + 1e-4)


def test_clip_after_muon_scales_the_new_logits_by_gamma():
    """Kimi K2's order (logits measured in the forward pass at p, clip applied to p + u):
    a clipped head ends at gamma · S(p + u), not at tau; measured here, not bounded."""
    model, aux_apply, params = ref_model()
    layers, x = model.qk_layers(), tokens()
    s0 = head_logits(aux_apply, params, x)
    tau = float(np.median(s0))
    lr = 1e-2
    opt = optax.chain(optax.contrib.muon(lr), qk_clip(layers, tau=tau))
    bare = optax.contrib.muon(lr)
    batch = {"inputs": x, "targets": jnp.roll(x, -1, axis=1)}
    loss_fn = lm_loss_fn(aux_apply)
    state, _ = make_train_step(loss_fn, opt)(TrainState.create(params, opt), batch)
    plain, _ = make_train_step(loss_fn, bare)(TrainState.create(params, bare), batch)
    s_after = head_logits(aux_apply, state.params, x)
    s_plain = head_logits(aux_apply, plain.params, x)
    clipped = s0 > tau
    assert clipped.sum() == 2 and not np.allclose(s_plain, s0, rtol=1e-3)  # u moved them
    np.testing.assert_allclose(s_after[clipped], tau / s0[clipped] * s_plain[clipped], rtol=1e-4)
    np.testing.assert_allclose(s_after[~clipped], s_plain[~clipped], rtol=1e-5)


def test_qk_layers_refuses_qk_norm():
    cfg = TransformerConfig(d_model=32, n_layers=1, n_heads=4, max_len=8, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm"):
        TransformerLM(cfg, rngs=nnx.Rngs(0)).qk_layers()


def test_in_multisteps_clips_only_when_the_accumulated_update_is_emitted():
    params, layers = case("mha")
    inner = optax.chain(optax.sgd(0.1), qk_clip(layers, tau=TAU))
    opt = optax.MultiSteps(inner, every_k_schedule=2)
    state = opt.init(params)
    update = jax.jit(opt.update)
    g1, g2 = (jax.tree.map(lambda x, s=s: rand(s, x.shape), params) for s in (11, 12))
    ml = logits_for(layers, 0)
    u, state = update(g1, state, params, max_logits=ml)
    chex.assert_trees_all_equal(u, optax.tree.zeros_like(params))  # nothing emitted, no clip
    u, state = update(g2, state, params, max_logits=ml)
    mean = jax.tree.map(lambda a, b: -0.1 * (a + b) / 2, g1, g2)
    want = np_qk_clip(params, mean, layers, ml)
    for k, v in optax.apply_updates(params, u).items():
        np.testing.assert_allclose(v, want[k], rtol=2e-6, atol=2e-6)


def test_make_train_step_checks_qk_layers_eagerly():
    with pytest.raises(ValueError, match="make_train_step: `qk_layers`"):
        make_train_step(lambda p, b: (0.0, None), optax.sgd(0.1), qk_layers={})
    bad = {0: QKLayer(QKHeads("wq", 4), QKHeads("wk", 3))}
    with pytest.raises(ValueError, match=r"make_train_step: `qk_layers\[0\]`"):
        make_train_step(lambda p, b: (0.0, None), optax.sgd(0.1), qk_layers=bad)


# ----------------------------------------------------------------------------- MLA

# DeepSeek-V3 / Kimi K2 layout: wq_b emits [H, d_nope + d_rope] per head, wkv_b emits
# [H, d_nope + d_v] per head, and wkv_a's last d_rope columns are the rotary key k^R that
# every head shares.
H, DC, DN, DR, DV, T = 4, 6, 3, 2, 3, 5
MLA_LAYERS = {
    "mla": QKLayer(
        q=QKHeads("wq_b", H, head_width=DN, head_stride=DN + DR),
        k=QKHeads("wkv_b", H, head_width=DN, head_stride=DN + DV),
        q_rope=QKHeads("wq_b", H, offset=DN, head_width=DR, head_stride=DN + DR),
    )
}


def mla_params(seed=0, scale=3.0):
    shapes = {"wq_b": (DC, H * (DN + DR)), "wkv_a": (D, DC + DR), "wkv_b": (DC, H * (DN + DV))}
    params = {k: scale * rand(seed + i, s) for i, (k, s) in enumerate(sorted(shapes.items()))}
    params["wq_a"] = rand(seed + 7, (D, DC))
    return params


def np_mla_logits(params, x):
    """float64 ``[H]`` max logits of an MLA layer (rotation left out: it is linear in the
    rotary parts and commutes with their scaling)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = np.asarray(x, np.float64)
    q = (x @ p["wq_a"] @ p["wq_b"]).reshape(T, H, DN + DR)
    kv_a = x @ p["wkv_a"]
    k_c = (kv_a[:, :DC] @ p["wkv_b"]).reshape(T, H, DN + DV)[..., :DN]
    k_r = kv_a[:, DC:]  # [T, DR], shared by every head
    logits = np.einsum("thd,shd->hts", q[..., :DN], k_c) + np.einsum(
        "thd,sd->hts", q[..., DN:], k_r
    )
    return (logits / np.sqrt(DN + DR)).max(axis=(1, 2))


def np_mla_clip(new, max_logits, tau):
    """Kimi K2, Algorithm 1, head by head in float64 on p + u: q^C, k^C by sqrt(gamma),
    q^R by gamma, k^R (in wkv_a) untouched."""
    new = {k: np.array(v, np.float64) for k, v in new.items()}
    for h, s in enumerate(np.asarray(max_logits, np.float64)):
        if s > tau:
            g = tau / s
            q0, k0 = h * (DN + DR), h * (DN + DV)
            new["wq_b"][:, q0 : q0 + DN] *= np.sqrt(g)
            new["wq_b"][:, q0 + DN : q0 + DN + DR] *= g
            new["wkv_b"][:, k0 : k0 + DN] *= np.sqrt(g)
    return new


@pytest.mark.parametrize("lr", [0.0, 0.05])
def test_mla_matches_kimi_k2_rule_in_float64(lr):
    params = mla_params()
    x = rand(50, (T, D))
    s = np_mla_logits(params, x)
    tau = float(np.sort(s)[:2].mean())  # three of the four heads over tau, each its gamma
    opt = optax.chain(optax.sgd(lr), qk_clip(MLA_LAYERS, tau=tau))
    grads = jax.tree.map(lambda p: rand(60, p.shape), params)
    u, state = jax.jit(opt.update)(
        grads, opt.init(params), params, max_logits={"mla": jnp.asarray(s, jnp.float32)}
    )
    new = optax.apply_updates(params, u)
    plain = {k: np.asarray(params[k], np.float64) - lr * np.asarray(grads[k]) for k in params}
    want = np_mla_clip(plain, s, tau)
    for k in want:
        np.testing.assert_allclose(new[k], want[k], rtol=2e-6, atol=2e-6, err_msg=k)
    assert int(state[1].qk_clipped_heads) == 3
    np.testing.assert_array_equal(
        new["wkv_a"], optax.apply_updates(params, grads_sgd(grads, lr))["wkv_a"]
    )
    if lr == 0.0:  # at the weights S was measured at, every clipped head's max logit is tau
        after = np_mla_logits(new, x)
        np.testing.assert_allclose(after[s > tau], tau, rtol=1e-5)
        np.testing.assert_allclose(after[s <= tau], s[s <= tau], rtol=1e-5)


def grads_sgd(grads, lr):
    return jax.tree.map(lambda g: -lr * g, grads)


def test_mla_one_alpha_on_every_part_would_miss_tau():
    """The reason for the per-component rule: scaling q^R by sqrt(gamma) (as the content
    parts) leaves the clipped heads' logits above tau, the declared q_rope lands on it."""
    params = mla_params(seed=3)
    x = rand(51, (T, D))
    s = np_mla_logits(params, x)
    tau = float(np.min(s)) * 0.5
    as_content = {
        "mla": QKLayer(q=(MLA_LAYERS["mla"].q, MLA_LAYERS["mla"].q_rope), k=MLA_LAYERS["mla"].k)
    }
    for layers, hits_tau in ((MLA_LAYERS, True), (as_content, False)):
        opt = qk_clip(layers, tau=tau)
        u, _ = jax.jit(opt.update)(
            optax.tree.zeros_like(params), opt.init(params), params, max_logits={"mla": s}
        )
        after = np_mla_logits(optax.apply_updates(params, u), x)
        assert np.allclose(after, tau, rtol=1e-5) == hits_tau, (after, tau)


def test_mla_proxy_counts_the_strided_content_heads():
    params = mla_params()
    got = qk_logit_proxy(MLA_LAYERS, params)["mla"]
    wq = np.asarray(params["wq_b"], np.float64).reshape(DC, H, DN + DR)[..., :DN]
    wk = np.asarray(params["wkv_b"], np.float64).reshape(DC, H, DN + DV)[..., :DN]
    nq, nk = np.sqrt((wq**2).sum(axis=(0, 2))), np.sqrt((wk**2).sum(axis=(0, 2)))
    np.testing.assert_allclose(got, np.max(nq * nk) / np.sqrt(DN), rtol=1e-6)


# ----------------------------------------------------------------------------- micro-batches


def test_multisteps_bare_clips_with_the_last_micro_batch_only():
    """The gap max_logits_over_micro_batches closes: a bare MultiSteps drops micro-batch 1's
    logits."""
    params, layers = case("mha")
    opt = optax.MultiSteps(optax.chain(optax.sgd(0.1), qk_clip(layers, tau=TAU)), 2)
    g = jax.tree.map(lambda x: rand(11, x.shape), params)
    ml1, ml2 = {0: jnp.array([40.0, 1.0, 1.0, 1.0])}, {0: jnp.array([1.0, 1.0, 1.0, 1.0])}
    state = opt.init(params)
    _, state = opt.update(g, state, params, max_logits=ml1)
    u, _ = opt.update(g, state, params, max_logits=ml2)
    want = np_qk_clip(params, grads_sgd(g, 0.1), layers, ml2)  # no clip at all
    for k, v in optax.apply_updates(params, u).items():
        np.testing.assert_allclose(v, want[k], rtol=2e-6, atol=2e-6)


def test_max_logits_over_micro_batches_k2_matches_reference():
    """k = 2: each emitted update is clipped with the elementwise max of its two
    micro-batches' logits; the max restarts after each emission; a micro-batch MultiSteps
    drops (non-finite gradients) does not enter it."""
    chex.clear_trace_counter()
    params, layers = case("gqa")
    inner = optax.chain(optax.sgd(0.1), qk_clip(layers, tau=TAU))
    ms = optax.MultiSteps(inner, 2, should_skip_update_fn=optax.skip_not_finite)
    opt = max_logits_over_micro_batches(ms, layers)
    state = opt.init(params)
    update = jax.jit(chex.assert_max_traces(opt.update, n=1))
    gs = [jax.tree.map(lambda x, s=s: rand(s, x.shape), params) for s in range(20, 24)]
    mls = [
        np.array([40.0, 3.0, 12.0, 1.0]),
        np.array([5.0, 30.0, 11.0, 2.0]),
        np.array([1.0, 1.0, 1.0, 50.0]),
        np.array([9.0, 1.0, 15.0, 1.0]),
    ]
    p = params
    for cycle in range(2):
        ga, gb = gs[2 * cycle], gs[2 * cycle + 1]
        mla, mlb = mls[2 * cycle], mls[2 * cycle + 1]
        u, state = update(ga, state, p, max_logits={0: jnp.asarray(mla)})
        chex.assert_trees_all_equal(u, optax.tree.zeros_like(p))
        if cycle == 1:  # a dropped micro-batch with huge logits in the middle
            bad = jax.tree.map(lambda x: x.at[0].set(jnp.nan), gb)
            u, state = update(bad, state, p, max_logits={0: jnp.full(4, 1e6, jnp.float32)})
            chex.assert_trees_all_equal(u, optax.tree.zeros_like(p))
        u, state = update(gb, state, p, max_logits={0: jnp.asarray(mlb)})
        mean = jax.tree.map(lambda a, b: -0.1 * (np.asarray(a, np.float64) + b) / 2, ga, gb)
        want = np_qk_clip(flat(p), flat(mean), layers, {0: np.maximum(mla, mlb)})
        got = flat(optax.apply_updates(p, u))
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-6, atol=2e-6, err_msg=k)
        p = optax.apply_updates(p, u)
    chex.assert_trees_all_equal(state.micro_max_logits, {0: jnp.full(4, -jnp.inf)})


def test_max_logits_over_micro_batches_checks_its_arguments():
    params, layers = case("mha")
    with pytest.raises(ValueError, match="`multi_steps` must be an optax.MultiSteps"):
        max_logits_over_micro_batches(optax.sgd(0.1), layers)
    with pytest.raises(ValueError, match="`layers`"):
        max_logits_over_micro_batches(optax.MultiSteps(optax.sgd(0.1), 2), {})
    opt = max_logits_over_micro_batches(optax.MultiSteps(qk_clip(layers, tau=TAU), 2), layers)
    state = opt.init(params)
    with pytest.raises(ValueError, match="max_logits="):
        opt.update(params, state, params)
    with pytest.raises(ValueError, match="no entry for layer 0"):
        opt.update(params, state, params, max_logits={1: jnp.ones(4)})
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        opt.update(params, state, params, max_logits={0: jnp.ones(3)})


# ----------------------------------------------------------------------------- clear errors


def test_a_missing_layer_is_a_clear_error_not_a_keyerror():
    params, _ = case("fused_bias_2layers")
    _, layers = case("fused_bias_2layers")
    opt = qk_clip(layers, tau=TAU)
    state = opt.init(params)
    with pytest.raises(ValueError, match="no entry for layer 1"):
        opt.update(params, state, params, max_logits={0: jnp.ones(2)})
    with pytest.raises(ValueError, match="no entry for layer 1"):  # [n_layers, n_heads] too
        opt.update(params, state, params, max_logits=jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="no entry for layer 1"):  # and a list of layers
        opt.update(params, state, params, max_logits=[jnp.ones(2)])
    with pytest.raises(ValueError, match="no entry for layer 0"):
        opt.update(params, state, params, max_logits=jnp.ones(()))
    ml = [jnp.array([40.0, 1.0]), jnp.array([1.0, 1.0])]  # a full list is accepted
    u, _ = jax.jit(opt.update)(optax.tree.zeros_like(params), state, params, max_logits=ml)
    new = optax.apply_updates(params, u)
    np.testing.assert_allclose(new["l0"]["k"][:, :HD], params["l0"]["k"][:, :HD] * 0.5, rtol=1e-6)


@pytest.mark.parametrize(
    "layer, match",
    [
        (QKLayer(QKHeads("wq", 4), QKHeads("wk", 4), q_rope=QKHeads("wq", 2)), "q_rope"),
        (QKLayer(QKHeads("wq", 4), QKHeads("wk", 4), q_rope="wq"), r"`layers\[0\].q_rope`"),
        (QKLayer(QKHeads("wq", 4, head_stride=4), QKHeads("wk", 4)), "head_stride"),
        (QKLayer(QKHeads("wq", 4, head_width=4, head_stride=3), QKHeads("wk", 4)), "head_stride"),
    ],
)
def test_bad_mla_declarations_raise(layer, match):
    with pytest.raises(ValueError, match=match):
        qk_clip({0: layer})


def test_tau_inf_message_says_finite():
    with pytest.raises(ValueError, match=r"`tau` must be finite and > 0; got inf"):
        qk_clip(GOOD, tau=float("inf"))


def test_strided_heads_that_do_not_fit_raise_in_init():
    params = mla_params()
    bad = {
        0: QKLayer(QKHeads("wq_b", H, head_width=DN, head_stride=DN + DR + 1), MLA_LAYERS["mla"].k)
    }
    with pytest.raises(ValueError, match="stride 6"):
        qk_clip(bad).init(params)
