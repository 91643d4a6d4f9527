"""The controller's pure decisions (control.decide.policy): no Orbax, no JAX, microseconds."""

from __future__ import annotations

import ast
import math
import pathlib

import pytest

from stabljax.control.decide import policy


def test_policy_imports_no_orbax_no_jax_no_io():
    tree = ast.parse(pathlib.Path(policy.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {
        "__future__",
        "bisect",
        "collections",
        "dataclasses",
        "math",
        "numbers",
        "typing",
    }, imported


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


# ------------------------------------------------------------------------------------- the plan


class _Found:
    """A detection as the plan reads it (policy.Finding), without the detectors module."""

    def __init__(self, step, onset, reason="loss spike", kind="spike", action="rollback"):
        self.kind, self.step, self.onset, self.action, self.reason = (
            kind,
            step,
            onset,
            action,
            reason,
        )

    @property
    def rolls_back(self):
        return self.action in ("rollback", "rollback_best")


SETTINGS = policy.RollbackSettings(margin=10, extra_skip=0, window=30)


def test_plan_rollback_by_hand():
    found = [_Found(36, 35, "a"), _Found(36, 34, "b")]
    ledger = policy.Ledger(ranges=[(50, 55)])
    target = policy.Target(step=20, data_index=21, margin_met=True)
    plan = policy.plan_rollback(
        found, ledger, target, 38, SETTINGS, active_onsets=[None, 33], losses=[[35, 9.0, False]]
    )
    # onset: min(35, 34, open episode at 33); skip [21, 38); resume at 38.
    assert (plan.target, plan.detected, plan.onset, plan.margin_met) == (20, 36, 33, True)
    assert plan.skip == policy.Skip(21, 38, 17, False) and plan.resume_at == 38
    assert plan.ledger.ranges == [(21, 38), (50, 55)] and plan.ledger.rollbacks == 1
    assert plan.entry == {
        "detected": 36,
        "onset": 33,
        "restored": 20,
        "range": [21, 38],
        "length": 17,
        "doubled": False,
        "reason": "a; b",
        "losses": [[35, 9.0, False]],
    }
    assert plan.ledger.history == [plan.entry]
    record = plan.record(time=5.0)
    assert record["target_step"] == 20 and record["data_index"] == 38
    assert record["skipped_ranges"] == [[21, 38], [50, 55]] and record["rollbacks"] == 1
    assert ledger.rollbacks == 0 and ledger.ranges == [(50, 55)]  # the input is not changed


def test_plan_rollback_doubles_a_consecutive_skip_and_resumes_past_old_ranges():
    ledger = policy.Ledger([(20, 37)], 1, {"restored": 20, "length": 17}, [{"restored": 20}])
    plan = policy.plan_rollback([_Found(40, 39)], ledger, policy.Target(20, 20, True), 25, SETTINGS)
    assert plan.skip == policy.Skip(20, 54, 34, True)  # 2 x 17, not 25 - 20
    assert plan.resume_at == 54 and plan.ledger.rollbacks == 2
    assert len(plan.ledger.history) == 2
    far = policy.plan_rollback([_Found(90, 89)], ledger, policy.Target(60, 60, True), 70, SETTINGS)
    assert far.skip == policy.Skip(60, 70, 10, False)  # 90 - 20 > window: not consecutive


@pytest.mark.parametrize(
    "verdict, culprits, narrow, want_skip, want_resume",
    [
        ("data", [27, 25], True, (25, 38), 20),  # from the first culprit; back to the ckpt
        ("data", [27, 25], False, (20, 38), 38),  # narrow_skip off
        ("data", [20], True, (20, 38), 38),  # a culprit at the start narrows nothing
        ("data", [], True, (20, 38), 38),
        ("state", [25], True, (20, 38), 38),
    ],
)
def test_plan_rollback_narrows_on_a_data_verdict(verdict, culprits, narrow, want_skip, want_resume):
    cfg = policy.RollbackSettings(margin=10, extra_skip=0, window=30, narrow_skip=narrow)
    report = {"verdict": verdict, "culprits": culprits}
    plan = policy.plan_rollback(
        [_Found(36, 35)], policy.Ledger(), policy.Target(20, 20, True), 38, cfg, triage=report
    )
    assert (plan.skip.start, plan.skip.end) == want_skip and plan.resume_at == want_resume
    assert plan.narrowed == (want_resume == 20)
    assert plan.entry["verdict"] == verdict and plan.entry["culprits"] == culprits


def test_a_plan_with_a_remedy_carries_it_into_the_record():
    plan = policy.plan_rollback(
        [_Found(36, 35)], policy.Ledger(), policy.Target(20, 20, False), 37, SETTINGS
    )
    applied, info = {"remedy": "lower_lr", "params": {"factor": 0.5}}, {"rollbacks": 1}
    with_it = plan.with_remedy(applied, info)
    assert with_it.entry["remedy"] == applied and with_it.entry["remedy_info"] == info
    assert with_it.ledger.history == [with_it.entry]
    assert with_it.record(time=0.0)["last_rollback"]["remedy"] == applied
    assert "remedy" not in plan.entry and not with_it.margin_met


# ----------------------------------------------------------------------------- config checks

_GOOD = dict(save_every=10, keep=3, rollback_margin=5, extra_skip=0, max_rollbacks=2)


@pytest.mark.parametrize("name", sorted(_GOOD))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1.5, 10.0, True, False, "3"])
def test_every_integer_setting_refuses_a_non_int_naming_it(name, bad):
    with pytest.raises(ValueError, match=rf"^{name} must be an int >= \d") as e:
        policy.check_config(**(_GOOD | {name: bad}))
    assert repr(bad) in str(e.value)


@pytest.mark.parametrize(
    "name, low",
    [
        ("save_every", 1),
        ("keep", 1),
        ("rollback_margin", 0),
        ("extra_skip", 0),
        ("max_rollbacks", 0),
    ],
)
def test_every_integer_setting_has_a_floor(name, low):
    policy.check_config(**(_GOOD | {name: low, "rollback_margin": 0}))
    with pytest.raises(ValueError, match=name):
        policy.check_config(**(_GOOD | {name: low - 1}))


def test_max_rollbacks_none_is_unlimited_and_numpy_ints_are_ints():
    import numpy as np

    policy.check_config(**(_GOOD | {"max_rollbacks": None, "save_every": np.int64(10)}))
    with pytest.raises(ValueError, match="save_every"):
        policy.check_config(**(_GOOD | {"save_every": None}))
    with pytest.raises(ValueError, match=r"max_rollbacks must be an int >= 0 or None"):
        policy.check_config(**(_GOOD | {"max_rollbacks": math.inf}))
    ledger = policy.Ledger(rollbacks=10**6)
    assert policy.decide([_Found(5, 4)], ledger, step=5, max_rollbacks=None).action == "rollback"
    assert policy.decide([_Found(5, 4)], ledger, step=5, max_rollbacks=10).action == "give_up"
