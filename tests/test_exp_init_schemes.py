"""``python -m experiments.init_schemes --quick``: what it writes and what it must show,
and Takase et al.'s embedding options of the proxy model (``Setup.embed``)."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from experiment_runs import run_quick

from experiments import init_schemes, proxy

FIGURES = ("init.png", "lr_scan.png", "effects.png")


def _setup(embed):
    return proxy.Setup(
        d_model=16, n_layers=2, n_heads=2, seq_len=8, init_scheme="fixed:0.02", embed=embed
    )


def test_scaled_embed_multiplies_the_lookup_by_sqrt_d_and_keeps_the_parameters():
    plain, p0 = proxy.initial_model(_setup("plain"))
    scaled, p1 = proxy.initial_model(_setup("scaled"))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), p0, p1))
    tokens = jnp.arange(8)[None]
    ref = plain.embed.embedding[...][tokens] * math.sqrt(16)  # by hand
    np.testing.assert_allclose(scaled.embed(tokens), ref, rtol=1e-6)
    assert float(jnp.std(plain.embed.embedding[...])) == pytest.approx(0.02, rel=0.1)
    # The tied unembedding is not scaled, so the logits differ only through the blocks.
    assert not np.allclose(plain(tokens), scaled(tokens))


def test_embed_layernorm_gives_the_first_block_unit_std_inputs():
    model, _ = proxy.initial_model(_setup("layernorm"))
    tokens = jnp.arange(8)[None]
    h = model.embed(tokens) + model.pos_embed[...][:8]
    normed = np.asarray(model.embed_norm(h))
    var = np.asarray(h).var(-1)  # LayerNorm by hand: std var / (var + eps), eps 1e-5
    np.testing.assert_allclose(normed.std(-1), np.sqrt(var / (var + 1e-5)), rtol=1e-3)
    assert normed.std(-1).min() > 0.95
    np.testing.assert_allclose(normed.mean(-1), 0.0, atol=1e-5)
    assert float(np.std(np.asarray(h))) < 0.1  # the plain embedding is ~0.03


def test_embed_is_checked():
    with pytest.raises(ValueError, match="embed must be"):
        proxy.initial_model(_setup("bogus"))


def test_grad_spikes_by_hand():
    g = np.ones(60)
    g[30] = 3.5  # > 3x the median of the 30 before it
    g[40] = 2.9  # not
    g[50] = np.nan
    assert init_schemes.grad_spikes(g) == 2


def test_init_schemes(tmp_path):
    res, cfg, s = run_quick("init_schemes", tmp_path, figures=FIGURES)
    lrs = res["compare_lrs"]
    assert lrs and all(x <= cfg["max_compare_lr"] for x in lrs)
    assert s["lr_grid"]["lrs"] == sorted(cfg["scan_lrs"])
    assert lrs[0] == min(s["lr_grid"]["best_lr"], max(x for x in cfg["scan_lrs"] if x <= 1e-2))
    assert len(res["rows"]) == len(cfg["arms"]) * len(lrs) * len(cfg["seeds"])
    assert s["primary_metric"] == init_schemes.PRIMARY
    assert len(s["remedies"]) == (len(cfg["arms"]) - 1) * len(lrs)
    for r in res["rows"]:
        assert r["arm"] in init_schemes.ARMS and r["grad_spikes"] >= 0
    assert set(res["losses"]) == {f"{r['arm']}@{r['lr']:g}@{r['seed']}" for r in res["rows"]}

    # rescan: more scan seeds on the stored run, nothing else re-run; the grid's scores are
    # the seed means of every scan seed, computed here by hand.
    out = tmp_path / "init_schemes"
    before = (out / "results.json").read_text()
    grid = init_schemes.rescan(out, (5,))
    after = json.loads((out / "results.json").read_text())
    scan = after["results"]["scan"]
    assert sorted({r["seed"] for r in scan}) == [0, 5] and len(scan) == 2 * len(cfg["scan_lrs"])
    for lr, score in zip(grid["lrs"], grid["score"], strict=True):
        want = np.mean([r["final_loss"] for r in scan if r["lr"] == lr])
        assert score == pytest.approx(want)
    assert after["summary"]["lr_grid"]["arm"].startswith("fixed:0.02, 2 seeds")
    assert after["summary"]["lr_grid"]["compare_lrs_follow"] == (
        init_schemes.compare_lrs(init_schemes.Config.quick(), grid) == res["compare_lrs"]
    )
    assert after["results"]["rows"] == json.loads(before)["results"]["rows"]
