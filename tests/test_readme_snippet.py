"""The train-step guide's whole loop (tests/readme_loop.py) runs, trains, and stays short."""

from __future__ import annotations

import pathlib
import runpy

import chex
import jax
import numpy as np
from flax import nnx

from stabljax.reference.nn import TransformerLM

LOOP = pathlib.Path(__file__).with_name("readme_loop.py")
GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "train_step.md"


def test_the_guide_shows_the_loop_verbatim():
    text = GUIDE.read_text()
    section = text[text.index("## The whole loop") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    assert block[: block.index("```")] == LOOP.read_text()


def test_readme_loop_trains_the_reference_model(capsys):
    lines = LOOP.read_text().splitlines()
    assert len(lines) <= 25, "the guide promises the whole loop in 25 lines or fewer"

    scope = runpy.run_path(str(LOOP), run_name="readme_loop")

    history = jax.device_get(scope["history"])
    losses = np.array([m["loss"] for m in history])
    assert len(losses) == int(scope["state"].step) > 0
    assert np.all(np.isfinite(losses))
    assert losses[-5:].mean() < losses[0] - 1.0, losses  # it learns (from ~ln 256 = 5.5)
    assert not any(m["skipped"] or m["overflow"] for m in history)
    printed = capsys.readouterr().out.splitlines()
    assert printed and all(line.startswith("step ") for line in printed)

    model = scope["model"]
    assert isinstance(model, TransformerLM)
    chex.assert_trees_all_equal(nnx.state(model, nnx.Param), scope["state"].params)
