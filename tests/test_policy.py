"""The controller's pure decisions (stabljax.control.policy): no Orbax, no JAX, microseconds."""

from __future__ import annotations

import ast
import pathlib

import pytest

from stabljax.control import policy


def test_policy_imports_no_orbax_no_jax_no_io():
    tree = ast.parse(pathlib.Path(policy.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "collections", "dataclasses", "math", "typing"}, imported


@pytest.mark.parametrize(
    "steps, onset, margin, want",
    [
        ([0, 10, 20, 30], 35, 10, ([20, 10, 0, 30], True)),
        ([0, 10, 20, 30], 30, 10, ([20, 10, 0, 30], True)),
        ([0, 10, 20, 30], 29, 10, ([10, 0, 20, 30], True)),
        ([20, 30], 35, 100, ([20, 30], False)),
        ([], 35, 10, ([], False)),
    ],
)
def test_restore_order_newest_at_least_margin_before_onset(steps, onset, margin, want):
    assert policy.restore_order(steps, onset=onset, margin=margin) == want


def test_restore_order_best_and_excluded_resume_only_checkpoints():
    assert policy.restore_order([0, 10, 20, 30], onset=35, margin=10, best=10) == ([10, 0], True)
    # A preemption checkpoint (off the grid) is never a target.
    order, met = policy.restore_order([0, 10, 20, 23], onset=35, margin=10, exclude=[23])
    assert order == [20, 10, 0] and met


def test_skip_range_plain_extra_and_doubled():
    s = policy.skip_range(
        start=20, fed_end=37, extra_skip=5, detected=36, last_rollback=None, window=30
    )
    assert (s.start, s.end, s.length, s.doubled) == (20, 42, 22, False)
    last = {"restored": 20, "length": 17}
    s = policy.skip_range(
        start=20, fed_end=25, extra_skip=0, detected=50, last_rollback=last, window=30
    )
    assert (s.start, s.end, s.length, s.doubled) == (20, 54, 34, True)
    s = policy.skip_range(
        start=40, fed_end=60, extra_skip=0, detected=51, last_rollback=last, window=30
    )
    assert not s.doubled and s.length == 20  # 51 - 20 > 30: not consecutive


def test_kept_steps():
    assert policy.kept_steps([0, 10, 20, 30], keep=3, best=None) == [10, 20, 30]
    assert policy.kept_steps([0, 10, 20, 30], keep=2, best=0) == [0, 20, 30]
    assert policy.kept_steps([0, 10, 20, 23], keep=2, best=None, resume_only=[23]) == [10, 20, 23]
    # An older resume-only checkpoint goes once a regular one is newer.
    assert policy.kept_steps([10, 20, 23, 30], keep=2, best=None, resume_only=[23]) == [20, 30]


def test_save_blocker():
    assert policy.save_blocker([None, None], 1.0) is None
    assert "onset 7" in policy.save_blocker([None, 7], 1.0)
    assert "not finite" in policy.save_blocker([None], float("inf"))
    assert policy.save_blocker([], None) is None


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(save_every=10, keep=3, rollback_margin=100),
            "rollback_margin=100.*save_every=10.*keep=3",
        ),
        (dict(save_every=10, keep=3, rollback_margin=30), "rollback_margin=30"),
        (dict(save_every=100, keep=1, rollback_margin=100), "keep=1"),
        (dict(save_every=0, keep=3, rollback_margin=0), "save_every"),
        (dict(save_every=1, keep=3, rollback_margin=0, extra_skip=-1), "extra_skip"),
        (
            dict(save_every=10, keep=3, rollback_margin=0, background_save=True, processes=2),
            "background_save",
        ),
    ],
)
def test_check_config_refuses_what_cannot_work(kw, match):
    with pytest.raises(ValueError, match=match):
        policy.check_config(**kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(save_every=100, keep=3, rollback_margin=100),
        dict(save_every=10, keep=3, rollback_margin=29),
        dict(save_every=10, keep=1, rollback_margin=0),
    ],
)
def test_check_config_accepts_what_can_work(kw):
    policy.check_config(**kw)


def test_check_action():
    for action in policy.ACTIONS:
        policy.check_action(action, "spike")
    with pytest.raises(ValueError, match="'spike'.*'explode'"):
        policy.check_action("explode", "spike")
