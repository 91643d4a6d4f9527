"""Tests for stabljax.reference.nn: the reference Transformer LM against a float64 numpy version."""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import stabljax
from stabljax.init import init_plan, truncated_std_factor
from stabljax.reference import nn
from stabljax.step import nnx_apply

V, T, B = 64, 12, 2

# A: the defaults. B: every option switched. C: DeepNorm (post-norm, α > 1).
CONFIGS = {
    "default": nn.TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_len=16),
    "options": nn.TransformerConfig(
        vocab_size=V,
        d_model=32,
        n_layers=1,
        n_heads=2,
        d_ff=48,
        max_len=16,
        norm="rmsnorm",
        qk_norm=True,
        use_bias=True,
        tie_embeddings=False,
        init_scheme="mitchell",  # attention logits of order 1, so the soft-cap bites
        attn_logit_softcap=1.0,
    ),
    "deepnorm": nn.TransformerConfig(
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_len=16,
        norm_placement="post",
        use_bias=True,
        init_scheme="deepnet",
    ),
}


@functools.partial(jax.jit, static_argnums=0)
def _forward(apply_fn, params, tokens):
    return apply_fn(params, tokens)


def _build(config, seed=0, **kw):
    return nn.TransformerLM(config, rngs=nnx.Rngs(seed), **kw)


def _run(model, tokens):
    apply_fn, params = nnx_apply(model, return_aux=True)
    return _forward(apply_fn, params, tokens)


def _tokens(seed=0, b=B, t=T):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, V)


# ---------------------------------------------------------------------------------------
# A float64 numpy re-implementation, written from the module docstring's math.
# ---------------------------------------------------------------------------------------


def _np(variable):
    return np.asarray(variable[...], np.float64)


def _naive_norm(cfg, mod, x):
    scale = _np(mod.scale)
    if cfg.norm == "rmsnorm":
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale
    mu = np.mean(x, -1, keepdims=True)
    var = np.mean((x - mu) ** 2, -1, keepdims=True)
    y = (x - mu) / np.sqrt(var + cfg.norm_eps) * scale
    return y + _np(mod.bias) if mod.bias is not None else y


def _naive_linear(mod, x):
    y = x @ _np(mod.kernel)
    return y + _np(mod.bias) if mod.bias is not None else y


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _naive_forward(model, tokens, alpha):
    cfg = model.config
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    h = _np(model.embed.embedding)[tokens] + _np(model.pos_embed)[:t]
    if cfg.norm_placement == "post":
        h = _naive_norm(cfg, model.embed_norm, h)
    rms, maxes = [np.sqrt(np.mean(h * h))], []
    causal = np.tril(np.ones((t, t), bool))
    nh, dh = cfg.n_heads, cfg.d_model // cfg.n_heads

    def attn(blk, x):
        qkv = _naive_linear(blk.attn.qkv, x).reshape(b, t, 3, nh, dh)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if cfg.qk_norm:
            q, k = _naive_norm(cfg, blk.attn.q_norm, q), _naive_norm(cfg, blk.attn.k_norm, k)
        s = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dh)
        maxes.append(s[:, :, causal].max())
        if cfg.attn_logit_softcap is not None:
            s = cfg.attn_logit_softcap * np.tanh(s / cfg.attn_logit_softcap)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        y = np.einsum("bhts,bshd->bthd", p, v).reshape(b, t, cfg.d_model)
        return _naive_linear(blk.attn.out, y)

    def mlp(blk, x):
        return _naive_linear(blk.mlp.fc_out, _gelu(_naive_linear(blk.mlp.fc_in, x)))

    for blk in model.blocks:
        if cfg.norm_placement == "post":
            h = _naive_norm(cfg, blk.norm1, alpha * h + attn(blk, h))
            h = _naive_norm(cfg, blk.norm2, alpha * h + mlp(blk, h))
        else:
            h = h + attn(blk, _naive_norm(cfg, blk.norm1, h))
            h = h + mlp(blk, _naive_norm(cfg, blk.norm2, h))
        rms.append(np.sqrt(np.mean(h * h)))
    if cfg.norm_placement == "pre":
        h = _naive_norm(cfg, model.final_norm, h)
    w = _np(model.embed.embedding).T if cfg.tie_embeddings else _np(model.unembed)
    return h @ w, max(maxes), np.array(rms)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_aux_match_a_float64_reimplementation(name):
    cfg = CONFIGS[name]
    model = _build(cfg)
    tokens = _tokens()
    logits, aux = _run(model, tokens)
    alpha = init_plan(cfg.arch_spec(), cfg.init_scheme).residual_alpha
    ref_logits, ref_max, ref_rms = _naive_forward(model, tokens, alpha)

    assert logits.shape == (B, T, V) and logits.dtype == jnp.float32
    assert aux["residual_rms"].shape == (cfg.n_layers + 1,)
    assert aux["residual_rms"].dtype == jnp.float32 and aux["max_attn_logit"].shape == ()
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(aux["residual_rms"], ref_rms, rtol=1e-5)
    np.testing.assert_allclose(aux["max_attn_logit"], ref_max, rtol=1e-5, atol=1e-6)
    if name == "options":
        # The max is the raw logit, before the soft-cap (which would bound it by 1).
        assert float(aux["max_attn_logit"]) > cfg.attn_logit_softcap
    if name == "deepnorm":
        assert alpha == pytest.approx((2 * cfg.n_layers) ** 0.25)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_causal_future_tokens_do_not_change_earlier_logits(name):
    model = _build(CONFIGS[name])
    tokens = _tokens()
    k = 5
    changed = tokens.at[:, k:].set((tokens[:, k:] + 7) % V)
    before, _ = _run(model, tokens)
    after, _ = _run(model, changed)
    np.testing.assert_array_equal(before[:, :k], after[:, :k])
    assert np.abs(np.asarray(before[:, k:] - after[:, k:])).max() > 1e-4  # and later ones do


def test_bf16_compute_and_params_match_float32_within_bf16_precision():
    cfg = CONFIGS["default"]
    ref_model = _build(cfg)
    model = _build(dataclasses.replace(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    kernel = model.blocks[0].attn.qkv.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    # The same draws, rounded: the initializers draw in float32 and cast.
    ref_kernel = ref_model.blocks[0].attn.qkv.kernel[...]
    np.testing.assert_array_equal(kernel, ref_kernel.astype(jnp.bfloat16))
    tokens = _tokens()
    ref_logits, _ = _run(ref_model, tokens)
    logits, aux = _run(model, tokens)
    assert logits.dtype == jnp.float32 and aux["residual_rms"].dtype == jnp.float32
    chex.assert_tree_all_finite((logits, aux))
    # bf16 keeps 8 significant bits (relative step 2^-8); a few roundings per layer.
    err = np.sqrt(np.mean(np.square(np.asarray(logits - ref_logits))))
    assert 0 < err <= 0.05 * np.sqrt(np.mean(np.square(np.asarray(ref_logits))))


def test_split_merge_jit_round_trip_and_no_retrace():
    cfg = CONFIGS["default"]
    model = _build(cfg)
    tokens = _tokens()
    apply_fn, params = nnx_apply(model, return_aux=True)
    merged = nnx.merge(*nnx.split(model))
    apply2, params2 = nnx_apply(merged, return_aux=True)
    chex.assert_trees_all_equal(params, params2)
    assert apply_fn == apply2  # hashable by architecture: jit caches are shared

    out = _forward(apply_fn, params, tokens)
    traces = _forward._cache_size()
    out2 = _forward(apply2, jax.tree.map(lambda x: x * 1.0, params2), tokens)  # new buffers
    assert _forward._cache_size() == traces  # no retrace for an equal model
    np.testing.assert_array_equal(out[0], out2[0])
    logits = out[0]

    # nnx.update writes the params into a model built from another seed.
    other = _build(cfg, seed=1)
    assert np.abs(np.asarray(_run(other, tokens)[0] - logits)).max() > 1e-4
    nnx.update(other, params)
    np.testing.assert_array_equal(_run(other, tokens)[0], logits)


def test_gradients_flow_to_every_parameter():
    model = _build(CONFIGS["options"])
    apply_fn, params = nnx_apply(model)
    tokens = _tokens()

    def loss(p):
        return jnp.mean(jnp.square(apply_fn(p, tokens)))

    grads = jax.jit(jax.grad(loss))(params)
    chex.assert_tree_all_finite(grads)
    zero = [
        jax.tree_util.keystr(path)
        for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
        if not np.any(np.asarray(g))
    ]
    assert zero == [], zero


SCHEMES = [
    "gpt2",
    "olmo2",
    "small_init",
    "depth_scaled",
    "llama_depth",
    "mitchell",
    "fan_in",
    "deepnet",
    "fixed:0.5",
]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_model_built_from_each_plan_has_the_planned_std_in_every_group(scheme):
    cfg = nn.TransformerConfig(
        vocab_size=256,
        d_model=64,
        n_layers=4,
        n_heads=4,
        max_len=64,
        tie_embeddings=False,
        use_bias=True,
        norm_placement="post" if scheme == "deepnet" else "pre",
        init_scheme=scheme,
    )
    model = _build(cfg)
    plan = init_plan(cfg.arch_spec(), scheme)
    groups = model.param_groups()
    expected = {"embed", "pos_embed", "unembed"} | {
        f"blocks.{layer}.{g}"
        for layer in range(4)
        for g in ("attn_q", "attn_k", "attn_v", "attn_out", "mlp_in", "mlp_out")
    }
    assert set(groups) == expected
    for key, w in groups.items():
        entry = plan[key]
        x = np.asarray(w, np.float64).ravel()
        n = x.size
        # Sampling error of a std estimate is about std/sqrt(2n); of the mean, std/sqrt(n).
        assert abs(x.std() / entry.effective_std - 1) < 4 / math.sqrt(2 * n), (key, x.std(), entry)
        assert abs(x.mean()) < 4 * entry.effective_std / math.sqrt(n), key
        if entry.truncated:
            assert np.abs(x).max() <= 3 * entry.std * (1 + 1e-6), key
    # Biases start at 0 and norm scales at 1 in every scheme.
    blk = model.blocks[1]
    np.testing.assert_array_equal(blk.attn.qkv.bias[...], 0.0)
    np.testing.assert_array_equal(blk.mlp.fc_out.bias[...], 0.0)
    np.testing.assert_array_equal(blk.norm1.scale[...], 1.0)


def test_depth_scaled_model_has_a_different_std_per_layer():
    # Guards the test above: the per-layer entries really reach the per-layer weights.
    cfg = nn.TransformerConfig(vocab_size=256, d_model=64, n_layers=4, init_scheme="depth_scaled")
    groups = _build(cfg).param_groups()
    stds = [float(np.std(groups[f"blocks.{i}.attn_out"])) for i in range(4)]
    want = [0.02 / math.sqrt(2 * (i + 1)) * truncated_std_factor(3.0) for i in range(4)]
    np.testing.assert_allclose(stds, want, rtol=4 / math.sqrt(2 * 64 * 64))


def test_explicit_plan_overrides_the_scheme_and_must_fit_the_config():
    cfg = CONFIGS["default"]
    plan = init_plan(cfg.arch_spec(), "fixed:0.25")
    groups = _build(cfg, plan=plan).param_groups()
    assert abs(np.std(groups["embed"]) / 0.25 - 1) < 4 / math.sqrt(2 * V * 32)
    other = init_plan(nn.TransformerConfig(d_model=64).arch_spec(), "gpt2")
    with pytest.raises(ValueError, match="plan was made for"):
        _build(cfg, plan=other)
    post_plan = init_plan(CONFIGS["deepnorm"].arch_spec(), "deepnet")
    with pytest.raises(ValueError, match="plan was made for"):
        _build(cfg, plan=post_plan)


def test_config_and_call_validation():
    with pytest.raises(ValueError, match="norm"):
        nn.TransformerConfig(norm="batchnorm")
    with pytest.raises(ValueError, match="n_heads"):
        nn.TransformerConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="attn_logit_softcap"):
        nn.TransformerConfig(attn_logit_softcap=0.0)
    with pytest.raises(ValueError, match="norm_placement"):
        nn.TransformerConfig(norm_placement="sandwich")
    with pytest.raises(ValueError, match="deepnet"):
        _build(nn.TransformerConfig(d_model=32, init_scheme="deepnet"))  # DeepNorm needs post
    model = _build(CONFIGS["default"])
    with pytest.raises(ValueError, match="max_len"):
        model(jnp.zeros((1, 17), jnp.int32))
    assert CONFIGS["default"].d_ff == 128


def test_remat_gives_the_same_loss_and_gradients():
    import optax

    base = nn.TransformerConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_len=8)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 32)
    grads = {}
    for remat in (False, True):
        cfg = dataclasses.replace(base, remat=remat)
        apply_fn, params = stabljax.nnx_apply(nn.TransformerLM(cfg, rngs=nnx.Rngs(0)))

        def loss(p, apply_fn=apply_fn):
            logits = apply_fn(p, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        grads[remat] = jax.jit(jax.value_and_grad(loss))(params)
    chex.assert_trees_all_close(grads[True], grads[False], rtol=1e-5, atol=1e-6)
