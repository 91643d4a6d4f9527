"""Muon (optax.contrib.muon) inside stabljax's guards, and clipping that does not stall it."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stabljax.optim.clipping import clip_by_percentile, clip_by_zscore
from stabljax.optim.guards.skips import any_skipped, skip_nonfinite, skip_spikes


def params():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "w1": jax.random.normal(k[0], (32, 32)) / 6,
        "w2": jax.random.normal(k[1], (32, 64)) / 6,
        "b": jnp.zeros((32,)),
        "scale": jnp.ones((64,)),
    }


def grads(seed, scale=1.0):
    return jax.tree.map(
        lambda x: scale * jax.random.normal(jax.random.key(seed), x.shape), params()
    )


def not_orthogonalized(tree):
    """optax.contrib.muon's default labels: 2-D leaves are Muon's, the rest Adam's."""
    return jax.tree.map(lambda x: x.ndim != 2, tree)


def run(opt, grad_seq, **kw):
    p = params()
    state = opt.init(p)
    update = jax.jit(opt.update)
    outs = []
    for g in grad_seq:
        u, state = update(g, state, p, **kw)
        outs.append(u)
        p = optax.apply_updates(p, u)
    return outs, state, p


def test_muon_inside_skip_nonfinite_skips_exactly_and_otherwise_is_muon():
    muon = optax.contrib.muon(0.02)
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads(1))
    guarded_updates, state, p_guarded = run(skip_nonfinite(muon), [grads(0), bad, grads(2)])
    plain_updates, _, p_plain = run(muon, [grads(0), grads(2)])
    chex.assert_trees_all_equal(guarded_updates[1], optax.tree.zeros_like(params()))
    chex.assert_trees_all_close(guarded_updates[0], plain_updates[0], rtol=1e-6, atol=1e-7)
    # The skipped step left Muon's momentum and Adam's counts alone: step 3 is plain step 2.
    chex.assert_trees_all_close(guarded_updates[2], plain_updates[1], rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(p_guarded, p_plain, rtol=1e-5, atol=1e-7)
    assert int(state.nonfinite_skips) == 1 and not bool(any_skipped(state))


def test_muon_inside_skip_spikes_skips_a_spike_and_keeps_its_state():
    muon = optax.contrib.muon(0.02)
    opt = skip_spikes(muon, warmup_steps=3, watch=("loss", "grad_norm"))
    p = params()
    state = opt.init(p)
    update = jax.jit(opt.update)
    for i, loss in enumerate([2.0, 2.1, 1.9, 2.0]):
        u, state = update(grads(i), state, p, value=loss)
        assert not bool(state.spike_skipped)
    before = state
    u, state = update(grads(9, scale=50.0), state, p, value=40.0)
    assert bool(state.spike_skipped) and bool(any_skipped(state))
    chex.assert_trees_all_equal(u, optax.tree.zeros_like(p))
    chex.assert_trees_all_equal(state.spike_inner_state, before.spike_inner_state)
    u, state = update(grads(5), state, p, value=2.0)
    assert not bool(state.spike_skipped)
    assert float(optax.tree.norm(u)) > 0


@pytest.mark.parametrize(
    "clip",
    [
        lambda mask: clip_by_zscore(max_norm=1.0, mask=mask),
        # optax's own clip: the mask is optax.masked around it.
        lambda mask: (
            optax.clip_by_global_norm(1.0)
            if mask is None
            else optax.masked(optax.clip_by_global_norm(1.0), mask)
        ),
    ],
    ids=["clip_by_zscore", "optax.clip_by_global_norm"],
)
def test_a_global_clip_of_the_orthogonalized_update_stalls_muon_and_a_mask_fixes_it(clip):
    """Muon's update is scale-invariant (Newton-Schulz of the momentum, rescaled by shape):
    a global-norm clip after it divides it by the norm of all groups together."""
    muon = optax.contrib.muon(1.0)
    seq = [grads(i) for i in range(6)]
    plain, _, _ = run(muon, seq)
    stalled, _, _ = run(optax.chain(muon, clip(None)), seq)
    fixed, _, _ = run(optax.chain(muon, clip(not_orthogonalized)), seq)
    attenuation = [
        float(optax.tree.norm({k: a[k] for k in ("w1", "w2")}))
        / float(optax.tree.norm({k: b[k] for k in ("w1", "w2")}))
        for a, b in zip(plain, stalled, strict=True)
    ]
    assert max(attenuation) > 4.0, attenuation  # the stall
    for a, b in zip(plain, fixed, strict=True):  # the fix: Muon's groups untouched
        chex.assert_trees_all_equal(a["w1"], b["w1"])
        chex.assert_trees_all_equal(a["w2"], b["w2"])


def test_mask_selects_the_norm_and_the_rescaled_leaves():
    g = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([100.0])}
    clip = clip_by_zscore(max_norm=1.0, mask={"a": True, "b": False})
    out, state = jax.jit(clip.update)(g, clip.init(g))
    np.testing.assert_allclose(float(state.zclip_norm), 5.0)
    np.testing.assert_allclose(out["a"], [0.6, 0.8], rtol=1e-6)
    np.testing.assert_array_equal(out["b"], g["b"])
    clip = clip_by_percentile(percentile=50.0, history=2, mask=lambda t: {"a": False, "b": True})
    state = clip.init(g)
    _, state = jax.jit(clip.update)({"a": g["a"], "b": jnp.array([1.0])}, state)
    out, state = jax.jit(clip.update)(g, state)
    np.testing.assert_allclose(float(state.pclip_norm), 100.0)
    np.testing.assert_allclose(out["b"], [50.5], rtol=1e-6)  # the median of 1 and 100
    np.testing.assert_array_equal(out["a"], g["a"])


@pytest.mark.parametrize("mask", [{"a": 1}, {}, "w"])
def test_bad_mask_raises(mask):
    with pytest.raises(ValueError, match="`mask`"):
        clip_by_zscore(mask=mask)
    with pytest.raises(ValueError, match="`mask`"):
        clip_by_percentile(mask=mask)
