"""``python -m experiments.lr_sensitivity --quick``: what it writes and what it must show."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from experiment_runs import run_quick

from experiments import lr_sensitivity as ls
from experiments import proxy, stats

FIGURES = (
    "loss_vs_lr.png",
    "effects.png",
    "sensitivity.png",
    "attn_logit_vs_lr.png",
    "log_z_vs_lr.png",
    "curves_top_lr.png",
)


def _one_step(lr, wd, s=0.5, clip=0.0):
    """One step of independent_adamw at schedule value ``s`` (eps 0: Adam's first update
    is sign(g))."""
    theta = {"w": jnp.array([1.0, -2.0])}
    g = {"w": jnp.array([0.3, -0.1])}
    tx = proxy.independent_adamw(lr, lambda c: s, eps=0.0, weight_decay=wd, clip=clip)
    u, _ = tx.update(g, tx.init(theta), theta)
    return np.asarray(optax.apply_updates(theta, u)["w"])


def test_independent_weight_decay_by_hand():
    # θ1 = θ0 − s·(η·sign(g) + λ·θ0), with s = 0.5, η = 0.1, λ = 0.2
    np.testing.assert_allclose(_one_step(0.1, 0.2), [0.85, -1.75], rtol=1e-6)
    # the decay does not scale with η: with η = 0 it is θ0·(1 − s·λ) ...
    np.testing.assert_allclose(_one_step(0.0, 0.2), [0.9, -1.8], rtol=1e-6)
    # ... and η = 1 adds exactly s·η·sign(g) to that, where optax.adamw would decay by s·η·λ
    np.testing.assert_allclose(_one_step(1.0, 0.2) - _one_step(0.0, 0.2), [-0.5, 0.5], rtol=1e-6)
    # optax.adamw at η = 0.1 decays by s·η·λ: θ0 − 0.05·(sign(g) + 0.2·θ0), not ours
    coupled = optax.adamw(lambda c: 0.5 * 0.1, eps=0.0, b2=0.95, weight_decay=0.2)
    theta, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.3, -0.1])}
    u, _ = coupled.update(g, coupled.init(theta), theta)
    np.testing.assert_allclose(optax.apply_updates(theta, u)["w"], [0.94, -1.93], rtol=1e-6)
    # clipping at 1 comes first and leaves Adam's sign-like first step unchanged
    np.testing.assert_allclose(_one_step(0.1, 0.2, clip=1.0), [0.85, -1.75], rtol=1e-6)


def test_config_is_wortsman_like():
    cfg = ls.Config()
    g = stats.lr_grid(dict.fromkeys(cfg.lrs, 0.0))
    assert g["spans_1e-4_to_1"] and len(cfg.lrs) >= 5 and cfg.seeds == tuple(range(10))
    assert cfg.steps >= 2000 and cfg.clip == 1.0 and cfg.weight_decay == 1e-4
    assert all(z["d_model"] // z["n_heads"] >= 32 for z in cfg.sizes())
    ratios = np.diff(np.log10(sorted(cfg.lrs)))
    np.testing.assert_allclose(ratios, ratios[0], rtol=0.02)  # a log grid
    with pytest.raises(ValueError):
        ls.Config(widths=(32,), depths=(1,), heads=(2,)).sizes()  # head dim 16


@pytest.mark.slow
def test_lr_sensitivity(tmp_path):
    res, cfg, s = run_quick("lr_sensitivity", tmp_path, figures=FIGURES)
    n = len(cfg["widths"]) * len(cfg["arms"]) * len(cfg["lrs"]) * len(cfg["seeds"])
    assert len(res["rows"]) == n and len(s["sizes"]) == len(cfg["widths"])
    assert res["primary_metric"] == ls.PRIMARY and s["primary_metric"] == ls.PRIMARY_TEXT
    assert set(s["lr_grid"]) == {f"{z}/{a}" for z in s["sizes"] for a in cfg["arms"]}
    remedies = [a for a in cfg["arms"] if a != "base"]
    assert s["family_size"] == len(remedies) * len(s["sizes"])
    # the primary metric per seed, recomputed by hand from the rows (Wortsman's definition)
    rows = res["rows"]
    for key, r in s["remedies"].items():
        arm, size = key.split(" vs base, ")

        def sens(a, sd, size=size):
            rr = [x for x in rows if (x["size"], x["arm"], x["seed"]) == (size, a, sd)]
            l0 = rr[0]["init_loss"]
            v = [min(x["final_loss"], l0) if np.isfinite(x["final_loss"]) else l0 for x in rr]
            return float(np.mean(v) - np.min(v))

        want = [sens(arm, sd) - sens("base", sd) for sd in cfg["seeds"]]
        np.testing.assert_allclose(r["per_seed"], want, rtol=1e-9, atol=1e-12)
        assert r["mechanism_moved"] is None  # mechanisms are by construction: not claimed
    # qk-layernorm (in "both") keeps the attention logits below base's at the top LR
    top = max(cfg["lrs"])

    def logit(a):
        return np.mean([x["max_attn_logit"] for x in rows if (x["arm"], x["lr"]) == (a, top)])

    assert logit("both") < logit("base")
