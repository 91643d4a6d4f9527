"""docs/guides/trainer_guards.md runs: its Python blocks, in order, in one namespace.

The page's own asserts check what its text says (the run reaches 60 through a rollback, the
NaN batch is skipped and not aborted on, ``gradient_step`` lags ``state.step``). Then the
literal port it warns about is run on the same trainer and data: it ends short, and says so.
"""

from __future__ import annotations

import pathlib
import re
import tempfile
import warnings

import pytest

GUIDE = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "trainer_guards.md"


def _run_guide() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert len(blocks) == 2, len(blocks)
    scope = {"__name__": "trainer_guards_guide"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{GUIDE.name}[{i}]", "exec"), scope)  # noqa: S102
    return scope


def test_the_guide_runs_and_its_asserts_hold(capsys):
    scope = _run_guide()
    assert scope["ctl"].rollbacks == 1
    assert capsys.readouterr().out.startswith("1 [(")


def test_the_literal_port_the_guide_warns_about_ends_short_and_says_so():
    s = _run_guide()
    stabljax, train_step = s["stabljax"], s["train_step"]
    ctl = stabljax.RollbackController(
        tempfile.mkdtemp(),
        save_every=10,
        rollback_margin=5,
        async_save=False,
        detectors=[stabljax.SpikeDetector(warmup=10)],
    )
    state, data = ctl.restore_or_init(s["state0"], stabljax.IndexedBatches(s["batch_fn"]))
    with pytest.warns(RuntimeWarning, match=r"ctl\.steps\(N\)"):
        for _ in range(60):
            state, metrics = train_step(state, next(data))
            state, data = ctl.step(state, metrics, data)
    back = next(e for e in ctl.events if e.kind == "rollback").details["steps_back"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state, data = ctl.finish(state, data)
    ctl.close()
    assert back > 0 and int(state.step) == 60 - back
