"""Tests for stabljax.init: formulas vs hand-computed numbers, initializers, plans, check_init."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from stabljax import init
from stabljax.init import ArchSpec, check_init, init_plan
from stabljax.reference import nn
from stabljax.step import nnx_apply

SPEC = ArchSpec(d_model=64, n_layers=8, n_heads=4, d_ff=256, vocab_size=256)
POST = ArchSpec(d_model=64, n_layers=8, n_heads=4, d_ff=256, vocab_size=256, norm_placement="post")

# (scheme, spec, key, std, truncated), every std worked out by hand for d=64, L=8, d_ff=256.
HAND = [
    ("gpt2", SPEC, "embed", 0.02, False),
    ("gpt2", SPEC, "blocks.5.attn_q", 0.02, False),
    ("gpt2", SPEC, "attn_out", 0.005, False),  # 0.02 / sqrt(16)
    ("gpt2", SPEC, "blocks.7.mlp_out", 0.005, False),
    ("olmo2", SPEC, "mlp_out", 0.02, True),
    ("olmo2", SPEC, "pos_embed", 0.02, True),
    ("small_init", SPEC, "embed", 0.0790569415, False),  # sqrt(2 / 320)
    ("small_init", SPEC, "mlp_in", 0.0790569415, False),
    ("small_init", SPEC, "attn_out", 0.03125, False),  # 2 / (8 * 8)
    ("depth_scaled", SPEC, "attn_k", 0.02, True),
    ("depth_scaled", SPEC, "blocks.0.attn_out", 0.0141421356, True),  # 0.02 / sqrt(2)
    ("depth_scaled", SPEC, "blocks.7.mlp_out", 0.005, True),  # 0.02 / sqrt(16)
    ("llama_depth", SPEC, "blocks.1.mlp_out", 0.01, True),  # 0.02 / sqrt(4)
    ("mitchell", SPEC, "embed", 0.125, True),  # 1 / 8
    ("mitchell", SPEC, "blocks.1.attn_out", 0.0625, True),  # 1 / sqrt(2 * 64 * 2)
    ("mitchell", SPEC, "blocks.3.mlp_out", 0.0220970869, True),  # 1 / sqrt(2 * 256 * 4)
    ("fan_in", SPEC, "attn_out", 0.125, False),
    ("fan_in", SPEC, "mlp_out", 0.0625, False),  # 1 / sqrt(256)
    ("deepnet", POST, "attn_q", 0.125, False),  # sqrt(2 / 128)
    ("deepnet", POST, "attn_v", 0.0441941738, False),  # 0.125 * 64 ** -0.25
    ("deepnet", POST, "mlp_out", 0.0279508497, False),  # sqrt(2 / 320) * 64 ** -0.25
    ("deepnet", POST, "embed", 0.125, False),
    ("fixed:1.0", SPEC, "blocks.2.mlp_out", 1.0, False),
    ("fixed:0.3", SPEC, "embed", 0.3, False),
]


@pytest.mark.parametrize(("scheme", "spec", "key", "std", "truncated"), HAND)
def test_plan_formulas_match_hand_computed_numbers(scheme, spec, key, std, truncated):
    entry = init_plan(spec, scheme)[key]
    assert entry.std == pytest.approx(std, rel=1e-8)
    assert entry.truncated is truncated


def test_base_std_argument_and_residual_alpha():
    assert init_plan(SPEC, "gpt2", std=0.01)["attn_out"].std == pytest.approx(0.0025)
    assert init_plan(SPEC, "gpt2").residual_alpha == 1.0
    plan = init_plan(POST, "deepnet")
    assert plan.residual_alpha == pytest.approx(2.0)  # (2 * 8) ** 0.25
    assert init.deepnet_alpha(2) == pytest.approx(math.sqrt(2))
    assert init.deepnet_beta(2) == pytest.approx(0.5)
    assert init.deepnet_beta(8) == pytest.approx(0.3535533906)


def test_formulas_show_their_numbers():
    assert init_plan(SPEC, "gpt2")["attn_out"].formula == "σ/√(2L) = 0.02/√(2·8)"
    assert init_plan(SPEC, "small_init")["mlp_out"].formula == "2/(L·√d) = 2/(8·√64)"
    plan = init_plan(SPEC, "mitchell")
    assert plan["blocks.2.attn_out"].formula == "1/√(2·d·(l+1)) = 1/√(2·64·3)"


def test_truncated_std_factor_hand_values():
    # 1 - 2b·φ(b)/(2Φ(b) - 1) at b = 3 and b = 2 (the latter is jax's variance_scaling constant).
    assert init.truncated_std_factor(3.0) == pytest.approx(0.98657839, rel=1e-7)
    assert init.truncated_std_factor(2.0) == pytest.approx(0.87962566103423978, rel=1e-9)


@pytest.mark.parametrize(
    ("initializer", "std", "truncated"),
    [
        (init.small_init(10), 0.2, False),  # sqrt(2 / 50)
        (init.wang_init(16, 5), 0.1, False),  # 2 / (5 * 4)
        (init.scaled_residual(0.02, 8), 0.005, False),
        (init.depth_scaled(0.02, 7), 0.005, False),
        (init.depth_scaled(0.02, 1, truncate=True), 0.01, True),
        (init.mitchell(64), 0.125, True),
        (init.mitchell(128, 1), 0.0441941738, True),  # 1 / sqrt(512)
        (init.fan_in(64), 0.125, False),
        (init.fan_in(), 1 / math.sqrt(400), False),  # read from shape[-2]
        (init.deepnet(0.5), 0.5 * math.sqrt(2 / 700), False),  # (400, 300)
        (init.deepnet(1.0, fan_in_dim=64, fan_out_dim=64), 0.125, False),
        (init.normal(0.7, truncate=True, bound=2.0), 0.7, True),
    ],
)
def test_initializers_draw_the_std_of_their_formula(initializer, std, truncated):
    x = np.asarray(initializer(jax.random.key(3), (400, 300), jnp.float32), np.float64)
    assert x.shape == (400, 300)
    n = x.size
    bound = 2.0 if std == 0.7 else 3.0
    want = std * init.truncated_std_factor(bound) if truncated else std
    assert abs(x.std() / want - 1) < 4 / math.sqrt(2 * n)
    assert abs(x.mean()) < 4 * want / math.sqrt(n)
    if truncated:
        assert np.abs(x).max() <= bound * std * (1 + 1e-6)


def test_truncation_convention_std_is_the_pre_truncation_sigma():
    n = 1_000_000
    key = jax.random.key(0)
    x = np.asarray(init.normal(0.02, truncate=True)(key, (n,)), np.float64)
    tol = 4 / math.sqrt(2 * n)
    assert abs(x.std() / (0.02 * init.truncated_std_factor(3.0)) - 1) < tol
    assert abs(x.std() / 0.02 - 1) > 3 * tol  # distinguishably not 0.02 itself
    assert np.abs(x).max() <= 0.06 * (1 + 1e-6)
    y = np.asarray(init.normal(0.02)(key, (n,)), np.float64)
    assert abs(y.std() / 0.02 - 1) < tol
    assert np.abs(y).max() > 0.06  # ~2700 of a million lie beyond 3σ
    # The same draws as jax.nn.initializers with the same key (float32).
    jax_trunc = jax.nn.initializers.truncated_normal(0.02, lower=-3.0, upper=3.0)
    np.testing.assert_array_equal(
        init.normal(0.02, truncate=True)(key, (64, 8)), jax_trunc(key, (64, 8))
    )
    jax_normal = jax.nn.initializers.normal(0.02)
    np.testing.assert_allclose(init.normal(0.02)(key, (64, 8)), jax_normal(key, (64, 8)), rtol=1e-6)


def test_initializers_keep_dtype_and_plug_into_flax():
    w = init.normal(0.02, truncate=True)(jax.random.key(1), (256, 256), jnp.bfloat16)
    assert w.dtype == jnp.bfloat16
    assert abs(float(jnp.std(w.astype(jnp.float32))) / (0.02 * 0.98658) - 1) < 0.02
    layer = nnx.Linear(64, 32, kernel_init=init.small_init(64), rngs=nnx.Rngs(0))
    assert layer.kernel[...].shape == (64, 32)
    assert np.all(init.normal(0.0)(jax.random.key(0), (4,)) == 0)


def test_plan_groups_lookup_and_table():
    tied = init_plan(SPEC, "depth_scaled")
    assert "unembed" not in tied.entries and "embed" in tied.entries
    untied = init_plan(ArchSpec(64, 2, 4, vocab_size=256, tie_embeddings=False), "gpt2")
    assert untied["unembed"].std == 0.02
    no_pos = init_plan(ArchSpec(64, 2, 4, vocab_size=256, pos_embed=False), "gpt2")
    assert "pos_embed" not in no_pos.entries
    # Per-layer keys fall back to the layer-independent entry, and vice versa not.
    assert tied["blocks.3.attn_q"] is tied["attn_q"]
    assert tied.entry("attn_out", 2) is tied["blocks.2.attn_out"]
    with pytest.raises(KeyError, match="attn_out"):
        tied["attn_out"]  # depends on the layer: there is no layer-free entry
    with pytest.raises(KeyError):
        untied["nope"]
    assert len([k for k in tied.entries if k.endswith("attn_out")]) == 8
    text = str(tied)
    assert text == tied.table()
    for key, entry in tied.entries.items():
        assert any(
            line.startswith(key + " ") and entry.formula in line for line in text.splitlines()
        )
    assert "residual α" in text and "±3σ" in text
    # effective_std and initializer follow the entry.
    e = tied["attn_q"]
    assert e.effective_std == pytest.approx(0.02 * 0.98657839)
    assert init_plan(SPEC, "gpt2")["attn_q"].effective_std == 0.02


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: init.normal(-0.1), "std"),
        (lambda: init.normal(float("nan")), "std"),
        (lambda: init.normal(0.1, bound=0.0), "bound"),
        (lambda: init.small_init(0), "d_model"),
        (lambda: init.wang_init(64, 0), "n_layers"),
        (lambda: init.depth_scaled(0.02, -1), "layer"),
        (lambda: init.mitchell(64, layer=-2), "layer"),
        (lambda: init.truncated_std_factor(0.0), "bound"),
        (lambda: ArchSpec(d_model=30, n_layers=2, n_heads=4), "n_heads"),
        (lambda: ArchSpec(d_model=32, n_layers=0, n_heads=4), "n_layers"),
        (
            lambda: ArchSpec(d_model=32, n_layers=2, n_heads=4, norm_placement="mid"),
            "norm_placement",
        ),
        (lambda: init_plan(SPEC, "xavier"), "unknown init scheme"),
        (lambda: init_plan(SPEC, "fixed:abc"), "fixed"),
        (lambda: init_plan(SPEC, "fixed:-1"), "fixed"),
        (lambda: init_plan(SPEC, "deepnet"), "norm_placement='post'"),
    ],
)
def test_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_schemes_table_every_name_builds_a_plan():
    # SCHEMES is the table init_plan dispatches on: every name in it builds a plan of
    # every group, and the two names of OLMo-core's depth scaling give one plan.
    assert all(callable(fill) for fill in init.SCHEMES.values())
    for name in init.SCHEMES:
        scheme = "fixed:0.5" if name == "fixed:<std>" else name
        plan = init_plan(POST if name == "deepnet" else SPEC, scheme)
        for group in SPEC.groups():
            assert plan.entry(group, 0).std > 0
    a, b = init_plan(SPEC, "depth_scaled"), init_plan(SPEC, "llama_depth")
    assert a.entries == b.entries
    assert init_plan(SPEC, "fixed:0.5")["blocks.3.mlp_out"].std == 0.5


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: init.normal("0.1"), "`std`"),
        (lambda: init.small_init(True), "`d_model`"),
        (lambda: init.depth_scaled(0.02, 1.5), "`layer`"),
        (lambda: ArchSpec(d_model=32, n_layers=2, n_heads=4, d_ff=0), "`d_ff`"),
    ],
)
def test_validation_names_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


# ---------------------------------------------------------------------------------------
# check_init on the reference model: the done-when cases, 24 layers at tiny width.
# ---------------------------------------------------------------------------------------

DEEP = nn.TransformerConfig(vocab_size=256, d_model=32, n_layers=24, n_heads=4, max_len=16)


@pytest.fixture(scope="module")
def deep_reports():
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, DEEP.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    reports = {}
    for scheme in ("gpt2", "fixed:0.02", "fixed:1.0"):
        # plan= (not init_scheme=) keeps one architecture, so check_init compiles once.
        plan = init_plan(DEEP.arch_spec(), scheme)
        model = nn.TransformerLM(DEEP, rngs=nnx.Rngs(0), plan=plan)
        apply_fn, params = nnx_apply(model, return_aux=True)
        reports[scheme] = check_init(apply_fn, params, batch)
    return reports


def test_check_init_passes_the_depth_scaled_plan(deep_reports):
    r = deep_reports["gpt2"]
    assert r.ok, str(r)
    assert abs(r.loss - math.log(256)) < 0.1
    assert r.residual_rms.shape == (25,) and r.grad_rms.shape == (24,)
    assert r.growth_exponent == pytest.approx(math.log(r.residual_rms[-1] / r.residual_rms[0]) / 24)
    assert "init check: ok" in str(r)


def test_check_init_flags_no_depth_scaling_at_24_layers(deep_reports):
    r = deep_reports["fixed:0.02"]
    assert not r.ok
    assert [f.name for f in r.flags] == ["residual_growth"]
    flag = r.flags[0]
    assert flag.value > 2.0 and flag.bound == 2.0
    assert "over 24 layers" in flag.message and "√(2L)" in flag.fix and "'gpt2'" in flag.fix
    # The suggested factor brings the growth to the bound: sqrt((b² - 1) / (R² - 1)).
    factor = math.sqrt(3 / (flag.value**2 - 1))
    assert f"≤ {factor:.2g}" in flag.fix
    assert "FLAG residual_growth" in str(r)


def test_check_init_flags_std_one_everywhere(deep_reports):
    r = deep_reports["fixed:1.0"]
    names = {f.name for f in r.flags}
    assert {"residual_growth", "logit_std", "initial_loss", "attn_logit"} <= names
    assert r.logit_std > 2 and r.loss - r.log_vocab > 1
    for f in r.flags:
        assert f.fix and f.message in str(r)


# ---------------------------------------------------------------------------------------
# check_init's mechanics, on a toy residual model with numbers computed independently.
# ---------------------------------------------------------------------------------------

TV, TD, TL = 16, 8, 3


def _toy_params(scale=0.3, seed=0):
    k = jax.random.split(jax.random.key(seed), TL + 1)
    return {
        "embed": scale * jax.random.normal(k[0], (TV, TD)),
        "blocks": [{"w": scale * jax.random.normal(k[i + 1], (TD, TD))} for i in range(TL)],
    }


def _toy_forward(params, tokens):
    h = params["embed"][tokens]
    rms = [jnp.sqrt(jnp.mean(h * h))]
    for blk in params["blocks"]:
        h = h + jnp.tanh(h @ blk["w"])
        rms.append(jnp.sqrt(jnp.mean(h * h)))
    return h @ params["embed"].T, jnp.stack(rms)


def toy_apply(params, tokens):
    logits, rms = _toy_forward(params, tokens)
    return logits, {"residual_rms": rms}


def toy_logits_only(params, tokens):
    return _toy_forward(params, tokens)[0]


def _toy_batch(mask=False):
    tokens = jax.random.randint(jax.random.key(5), (3, 7), 0, TV)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if mask:
        batch["mask"] = jnp.arange(6)[None, :].repeat(3, 0) < 4
    return batch


@pytest.mark.parametrize("masked", [False, True])
def test_check_init_numbers_match_an_independent_computation(masked):
    params, batch = _toy_params(), _toy_batch(mask=masked)
    r = check_init(toy_apply, params, batch)
    m = np.asarray(batch["mask"]) if masked else np.ones((3, 6), bool)

    def loss(p):
        logits, _ = _toy_forward(p, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(jnp.where(m, ce, 0)) / m.sum()

    (ref_loss, (logits, rms)), grads = jax.jit(
        jax.value_and_grad(lambda p: (loss(p), _toy_forward(p, batch["inputs"])), has_aux=True)
    )(params)
    logits, rms = np.asarray(logits), np.asarray(rms)
    assert r.loss == pytest.approx(float(ref_loss), rel=1e-6)
    assert r.log_vocab == pytest.approx(math.log(TV))
    want_std = np.sqrt(np.mean(np.var(logits.astype(np.float64), axis=-1)[m]))
    assert r.logit_std == pytest.approx(want_std, rel=1e-5)
    np.testing.assert_allclose(r.residual_rms, rms, rtol=1e-6)
    assert r.growth_exponent == pytest.approx(math.log(rms[-1] / rms[0]) / TL, rel=1e-5)
    want_g = [np.sqrt(np.mean(np.square(np.asarray(g["w"])))) for g in grads["blocks"]]
    np.testing.assert_allclose(r.grad_rms, want_g, rtol=1e-5)
    assert r.grad_growth_exponent == pytest.approx(math.log(want_g[0] / want_g[-1]) / TL, rel=1e-5)
    assert r.max_attn_logit is None and r.seq_len == 6 and r.n_layers == TL


def test_check_init_without_aux_skips_the_residual_checks():
    r = check_init(toy_logits_only, _toy_params(), _toy_batch())
    assert r.residual_rms is None and r.growth_exponent is None
    assert len(r.grad_rms) == TL and r.n_layers == TL
    text = str(r)
    assert "n/a" in text and "layer" in text


def test_check_init_uses_loss_fn_and_flags_the_loss():
    def shifted(logits, batch):
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.mean(ce) + 3.0

    r = check_init(toy_apply, _toy_params(scale=0.01), _toy_batch(), loss_fn=shifted)
    assert [f.name for f in r.flags] == ["initial_loss"]
    assert r.loss - r.log_vocab == pytest.approx(3.0, abs=0.05)


def test_check_init_flags_nonfinite_and_dead_layers():
    params = _toy_params()
    params["blocks"][1]["w"] = params["blocks"][1]["w"].at[0, 0].set(jnp.nan)
    names = {f.name for f in check_init(toy_apply, params, _toy_batch()).flags}
    assert {"grad_nonfinite", "initial_loss", "logit_std"} <= names

    def frozen(params, tokens):
        # The last block's output is cut off from the loss: its gradient is exactly zero.
        logits, rms = _toy_forward({**params, "blocks": params["blocks"][:-1]}, tokens)
        return logits, {"residual_rms": rms}

    names = {f.name for f in check_init(frozen, _toy_params(), _toy_batch()).flags}
    assert "grad_zero" in names


def test_check_init_grad_spread_and_string_layer_keys():
    # Layers keyed "0", "1", ... (a dict, as some frameworks name them) are grouped too.
    params = _toy_params(scale=0.3)
    renamed = {
        "embed": params["embed"],
        "layers": {str(i): b for i, b in enumerate(params["blocks"])},
    }

    def apply(p, tokens):
        return toy_apply(
            {"embed": p["embed"], "blocks": [p["layers"][str(i)] for i in range(TL)]}, tokens
        )

    r = check_init(apply, renamed, _toy_batch())
    ref = check_init(toy_apply, params, _toy_batch())
    np.testing.assert_allclose(r.grad_rms, ref.grad_rms, rtol=1e-6)
    spread = float(ref.grad_rms.max() / ref.grad_rms.min())
    tight = check_init(toy_apply, params, _toy_batch(), grad_spread_bound=spread * 0.99)
    assert "grad_spread" in {f.name for f in tight.flags}
    loose = check_init(toy_apply, params, _toy_batch(), grad_spread_bound=spread * 1.01)
    assert "grad_spread" not in {f.name for f in loose.flags}


def test_check_init_accepts_an_unhashable_apply_fn():
    class Apply:
        __hash__ = None

        def __call__(self, params, tokens):
            return toy_apply(params, tokens)

    r = check_init(Apply(), _toy_params(), _toy_batch())
    assert r.residual_rms.shape == (TL + 1,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_bound": 1.0}, "growth_bound"),
        ({"logit_std_bound": 0.0}, "logit_std_bound"),
        ({"loss_excess_bound": -1.0}, "loss_excess_bound"),
        ({"grad_spread_bound": 0.5}, "grad_spread_bound"),
    ],
)
def test_check_init_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_init(toy_apply, _toy_params(), _toy_batch(), **kwargs)


def test_check_init_needs_targets():
    with pytest.raises(ValueError, match="targets"):
        check_init(toy_apply, _toy_params(), {"inputs": _toy_batch()["inputs"]})
