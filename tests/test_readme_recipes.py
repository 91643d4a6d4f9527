"""Every recipe of the guides runs verbatim, and does what its text says.

The code is taken from the documentation pages themselves (the ```python block after each
``<!-- recipe: name -->`` marker in docs/), so the guides cannot drift from what is tested.
"""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_bitwise_equal, host

import stabljax

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
RECIPE = re.compile(r"<!-- recipe: (\w+) -->\n```python\n(.*?)```", re.S)


@functools.cache
def recipes() -> dict[str, str]:
    found = {}
    for page in sorted(DOCS.rglob("*.md")):
        for name, code in RECIPE.findall(page.read_text()):
            assert name not in found, f"recipe {name} appears twice (again in {page})"
            found[name] = (code, page.relative_to(DOCS).as_posix())
    return {name: code for name, (code, _) in found.items()}


def run(name: str) -> dict:
    scope = {"__name__": f"readme_recipe_{name}"}
    exec(compile(recipes()[name], f"docs[{name}]", "exec"), scope)  # noqa: S102
    return scope


def test_every_recipe_is_tested():
    assert set(recipes()) == {"linen", "nnx_optimizer", "combinators", "batchnorm", "qk_clip"}


def test_linen_train_state_recipe(capsys):
    scope = run("linen")
    assert capsys.readouterr().out.splitlines()[0] == "skipped: True"
    state = scope["state"]
    assert float(scope["loss"]) < 0.05  # from about 15 at init
    assert int(state.step) == 200
    # the skipped step did not advance Adam: 199 of the 200 steps reached it
    assert int(optax.tree_utils.tree_get(state.opt_state, "count")) == 199
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_nnx_optimizer_recipe(capsys):
    scope = run("nnx_optimizer")
    assert "skips 1" in capsys.readouterr().out
    assert float(scope["loss"]) < 0.05
    opt_state = scope["optimizer"].opt_state
    assert int(optax.tree_utils.tree_get(opt_state, "count")[...]) == 199


def _plateau_state(state):
    return optax.tree_utils.tree_get(state.opt_state, "ReduceLROnPlateauState")


def test_combinators_recipe(capsys):
    scope = run("combinators")
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["accumulate", "plateau"]
    assert all(float(line.split()[-1]) < 0.1 for line in out), out
    loss_fn, batch, nan_batch = scope["loss_fn"], scope["batch"], scope["nan_batch"]

    # reduce_on_plateau inside the guard keeps its state bit for bit on a skipped step
    step, state = scope["train_step"], scope["state"]  # the plateau arm ran last
    before = host(_plateau_state(state))
    state, m = step(state, nan_batch)
    assert bool(m["skipped"])
    assert_bitwise_equal(_plateau_state(state), before)
    state, m = step(state, batch)
    assert not bool(m["skipped"])
    after = jax.tree.leaves(host(_plateau_state(state)))
    moved = [not np.array_equal(a, b) for a, b in zip(after, jax.tree.leaves(before), strict=True)]
    assert any(moved)  # a clean step does reach it
    # the control: unguarded, the NaN loss goes into its statistics
    bare = optax.chain(stabljax.safe_adamw(0.1), optax.contrib.reduce_on_plateau(patience=5))
    bare_state = stabljax.TrainState.create({"w": jnp.zeros(4)}, bare)
    bare_state, _ = stabljax.make_train_step(loss_fn, bare)(bare_state, nan_batch)
    assert np.isnan(np.asarray(bare_state.params["w"])).all()
    assert int(_plateau_state(bare_state).plateau_count) == 1  # the NaN counted as a plateau

    # MultiSteps inside the guard: a NaN micro-batch is skipped, the accumulator kept
    acc = scope["accumulate"]
    step = stabljax.make_train_step(loss_fn, acc)
    state = stabljax.TrainState.create({"w": jnp.zeros(4)}, acc)
    state, _ = step(state, batch)
    before = host(state.opt_state.nonfinite_inner_state)  # MultiSteps' accumulator and inner state
    state, m = step(state, nan_batch)
    assert bool(m["skipped"])
    assert_bitwise_equal(state.opt_state.nonfinite_inner_state, before)
    for _ in range(8):
        state, m = step(state, batch)
        assert not bool(m["skipped"])
    # a guard inside MultiSteps (which keeps a NaN for good) fails as soon as stabljax sees
    # the state, naming both fixes, unless MultiSteps drops non-finite micro-batches
    inside = optax.MultiSteps(stabljax.skip_nonfinite(stabljax.safe_adamw(0.1)), 4)
    fixes = r"(?s)a stabljax guard is inside optax.MultiSteps.*skip_nonfinite_micro_batch"
    with pytest.raises(ValueError, match=fixes + r".*optax.skip_not_finite"):
        stabljax.TrainState.create({"w": jnp.zeros(4)}, inside)
    drop = stabljax.skip_nonfinite_micro_batch
    inside = optax.MultiSteps(inside.inner_opt, 4, should_skip_update_fn=drop)
    step = stabljax.make_train_step(loss_fn, inside)
    state = stabljax.TrainState.create({"w": jnp.zeros(4)}, inside)
    state, m = step(state, nan_batch)
    assert bool(m["skipped"])
    for _ in range(11):
        state, m = step(state, batch)
        assert not bool(m["skipped"])
    assert int(optax.tree.get(state.opt_state, "gradient_step")) == 2  # 11 finite, k = 4
    assert np.all(np.asarray(state.params["w"]) != 0.0)


def _accuracy(model, test):
    return float(jnp.mean(jnp.argmax(model(test["image"]), -1) == test["label"]))


def test_batchnorm_recipe_survives_a_nan_batch(capsys):
    scope = run("batchnorm")
    assert capsys.readouterr().out.startswith("eval accuracy")
    assert float(scope["accuracy"]) > 0.9
    state, step, batch_fn = scope["state"], scope["train_step"], scope["batch_fn"]
    bn = state.model_state["bn"]
    stats = np.concatenate([np.asarray(bn["mean"][...]), np.asarray(bn["var"][...])])
    assert np.isfinite(stats).all() and not np.all(stats[:32] == 0)  # they did move
    bad = batch_fn(200)
    bad["image"] = bad["image"].at[3, 7].set(jnp.nan)
    kept = host(state)
    ctrl_params = jax.tree.map(jnp.copy, state.params)  # before the step donates them
    ctrl_model_state = jax.tree.map(jnp.copy, state.model_state)
    new, m = step(state, bad)
    assert bool(m["skipped"])
    assert_bitwise_equal(new.model_state, kept.model_state)
    assert_bitwise_equal(new.params, kept.params)
    assert_bitwise_equal(new.rng, kept.rng)

    # the control: the same NaN batch through an unguarded optimizer poisons BatchNorm
    adam = optax.adam(3e-3)
    bare = stabljax.TrainState.create(ctrl_params, adam, model_state=ctrl_model_state, rng=0)
    bare, m = stabljax.make_train_step(scope["loss_fn"], adam)(bare, bad)
    assert not bool(m["skipped"])
    poisoned = stabljax.nnx_merge(scope["model"], bare.params, bare.model_state)
    poisoned.eval()
    assert np.isnan(np.asarray(bare.model_state["bn"]["mean"][...])).any()
    assert _accuracy(poisoned, scope["test"]) < 0.3


@pytest.mark.parametrize("name", ["linen", "nnx_optimizer", "combinators", "batchnorm"])
def test_recipe_has_its_imports(name):
    # Verbatim means self-contained: each block imports what it uses.
    assert "import stabljax" in recipes()[name]


def test_qk_clip_recipe(capsys):
    scope = run("qk_clip")
    out = capsys.readouterr().out
    assert out.startswith("max logit ")
    m, tau = scope["metrics"], scope["tau"]
    assert set(m["max_attn_logit_layers"]) == {"attn"} and set(m["attn_logit_proxy"]) == {"attn"}
    # Held near tau (one update above it at most here); without qk_clip it passes 1000.
    assert float(m["max_attn_logit"]) < 2 * tau
    assert float(m["loss"]) < 1.0
    assert int(optax.tree.get(scope["state"].opt_state, "qk_clipped_heads")) >= 1
