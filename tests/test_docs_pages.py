"""The documentation pages run, and say what the code does.

Every ```python block of every page under docs/ is executed, each in a fresh namespace in a
temporary working directory (the rollback guide writes checkpoints). A block right after a
``<!-- recipe: name -->`` marker is run by ``tests/test_readme_recipes.py`` (or, for the
adoption diffs, compared by ``tests/test_adoption.py``) with assertions on what it prints,
and one after ``<!-- tested: tests/file.py -->`` by that file; they are not run twice.

Beside the blocks: the metrics table against a real bf16 step, the triage verdicts against
``VERDICTS``, the errors table against ``stabljax.control.__all__``.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import jax.numpy as jnp
import optax
import pytest

import stabljax
from stabljax import metrics
from stabljax.control.diagnose.triage import VERDICTS

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(?:<!-- (recipe|tested): ([\w./]+) -->\n)?```python\n(.*?)```", re.S)


def blocks():
    """(page, index, marker kind, marker value, code) of every python block of the docs."""
    out = []
    for page in sorted(DOCS.rglob("*.md")):
        if "_build" in page.parts:
            continue
        for i, m in enumerate(BLOCK.finditer(page.read_text())):
            out.append((page.relative_to(DOCS).as_posix(), i, m.group(1), m.group(2), m.group(3)))
    return out


UNMARKED = [(page, i, code) for page, i, kind, _, code in blocks() if kind is None]


def test_the_pages_have_code_and_every_marker_points_somewhere():
    assert len(UNMARKED) >= 7
    pages = {page for page, _, _ in UNMARKED}
    assert {"index.md", "guides/guards.md", "guides/rollback.md", "qk_clip.md"} <= pages
    for page, _, kind, value, _ in blocks():
        if kind == "tested":
            assert (ROOT / value).is_file(), (page, value)


@pytest.mark.parametrize(
    ("page", "index", "code"), UNMARKED, ids=[f"{p}[{i}]" for p, i, _ in UNMARKED]
)
def test_page_block_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": f"docs_{index}"}
    exec(compile(code, f"docs/{page}[{index}]", "exec"), scope)  # noqa: S102


# ------------------------------------------------------------- pages against the code


def _table_keys(section: str) -> set[str]:
    return set(re.findall(r"^\| `(\w+)` \|", section, re.M))


def test_the_metrics_tables_list_what_a_bf16_step_returns():
    text = (DOCS / "guides" / "train_step.md").read_text()
    section = text.split("## The metrics")[1].split("\n## ")[0]
    step_table, lm_table = section.split("With `lm_loss`")
    assert _table_keys(step_table) == set(metrics.STEP_KEYS)
    assert _table_keys(lm_table) == set(metrics.LM_KEYS)

    # A real bf16 step (no loss scaling) returns exactly the step's keys, overflow and
    # loss_scale included, as the table says.
    def loss_fn(params, batch):
        return jnp.mean((batch @ params["w"]) ** 2), None

    opt = stabljax.skip_nonfinite(stabljax.skip_spikes(optax.sgd(0.1)))
    precision = stabljax.Precision.bf16()
    step = stabljax.make_train_step(loss_fn, opt, precision=precision)
    state = stabljax.TrainState.create({"w": jnp.ones(3)}, opt, precision)
    _, m = step(state, jnp.ones((2, 3)))
    assert set(m) == set(metrics.STEP_KEYS)
    assert not bool(m["overflow"]) and float(m["loss_scale"]) == 1.0
    assert "`overflow` | bool | float16 loss scaling" in step_table
    assert "always present, `False` under fp32 and bf16" in step_table


def test_the_triage_guide_names_every_verdict():
    text = (DOCS / "guides" / "triage.md").read_text()
    named = set(re.findall(r"^- `(\w+)`:", text, re.M))
    assert named == set(VERDICTS), named


def test_the_rollback_guide_lists_every_error_a_caller_catches():
    text = (DOCS / "guides" / "rollback.md").read_text()
    table = text.split("## The errors you may catch")[1]
    errors = {
        name
        for name in stabljax.control.__all__
        if inspect.isclass(obj := getattr(stabljax.control, name)) and issubclass(obj, Exception)
    }
    assert {"UnsafePathError", "CheckpointKeyError", "MalformedJSONError"} <= errors
    assert _table_keys(table) == errors | {"Preempted"}  # Preempted is a SystemExit


def test_the_guides_say_lower_lr_needs_inject_hyperparams():
    text = (DOCS / "guides" / "rollback.md").read_text()
    assert re.search(r"`lower_lr\(factor\)`[^\n]*\n[^\n]*\*\*`optax.inject_hyperparams`\*\*", text)
    # and it is true: without inject_hyperparams the remedy refuses, naming the fix
    opt = stabljax.skip_nonfinite(optax.adam(0.1))
    state = stabljax.TrainState.create({"w": jnp.zeros(2)}, opt)
    info = stabljax.control.RollbackInfo(0, 1, 1, (0, 2))
    with pytest.raises(ValueError, match="inject_hyperparams"):
        stabljax.control.lower_lr(0.5)(state.opt_state, info)
