"""Every piece of advice ``check_config`` gives is applied here, and must then pass.

Each refused configuration's message names values to change ("raise keep to >= 5", "lower
rollback_margin to <= 74", "set background_save=False", "must be an int >= 1"). The test
reads them back out of the message, applies each one alone, and checks that the
configuration then passes ``check_config`` and builds a ``RollbackController``; a "raise"
must be above the refused value and a "lower" below it, so advice that points the wrong
way (issue 52: "lower save_every to <= 33" when it was 25) fails here.
"""

from __future__ import annotations

import itertools
import re

import pytest

from stabljax.control import RollbackController
from stabljax.control.decide import policy

_ADVICE = re.compile(r"(raise|lower) (\w+) to (>=|<=) (\d+)")

# A margin against save_every x keep from both sides, keep=1 included: every one refused.
_MARGINS = [
    dict(save_every=s, keep=k, rollback_margin=m)
    for s, k, m in itertools.product((1, 7, 10, 25, 100), (1, 2, 3, 5), (10, 33, 75, 100, 301))
    if m >= s * k
]


def _advice(message: str) -> list[tuple[str, str, int]]:
    found = [(verb, name, int(value)) for verb, name, _, value in _ADVICE.findall(message)]
    assert found, f"no advice in: {message}"
    return found


def _refused(kw) -> str:
    with pytest.raises(ValueError) as err:
        policy.check_config(**kw)
    return str(err.value)


def test_the_sweep_refuses_many_configs():
    assert len(_MARGINS) >= 40  # a sweep, not a handful


@pytest.mark.parametrize("kw", _MARGINS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_each_margin_advice_applied_alone_passes(kw):
    message = _refused(kw)
    advice = _advice(message)
    assert {name for _, name, _ in advice} == {"keep", "save_every", "rollback_margin"}, message
    for verb, name, value in advice:
        assert (value > kw[name]) if verb == "raise" else (value < kw[name]), (verb, name, kw)
        policy.check_config(**(kw | {name: value}))  # the advice works
        # ... and it is the edge: one step short of it is still refused.
        short = value - 1 if verb == "raise" else value + 1
        with pytest.raises(ValueError, match="rollback_margin"):
            policy.check_config(**(kw | {name: short}))


def test_issue_52_case_says_raise_save_every_to_34():
    message = _refused(dict(save_every=25, keep=3, rollback_margin=100))
    assert ("raise", "save_every", 34) in _advice(message)
    assert "lower save_every" not in message


def test_each_margin_advice_builds_a_controller(tmp_path):
    kw = dict(save_every=25, keep=3, rollback_margin=100)
    for i, (_verb, name, value) in enumerate(_advice(_refused(kw))):
        with pytest.raises(ValueError, match="rollback_margin=100"):
            RollbackController(tmp_path / f"refused{i}", **kw)
        ctl = RollbackController(tmp_path / f"ok{i}", **(kw | {name: value}), async_save=False)
        assert getattr(ctl, name) == value
        ctl.close()


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
@pytest.mark.parametrize("bad", [-3, 2.5, True, "10"])
def test_an_int_range_advice_applied_passes(name, low, bad):
    kw = dict(save_every=100, keep=3, rollback_margin=0)
    message = _refused(kw | {name: bad})
    m = re.search(rf"{name} must be an int >= (\d+)", message)
    assert m and int(m.group(1)) == low, message
    policy.check_config(**(kw | {name: int(m.group(1))}))


def test_background_save_advice_applied_passes():
    kw = dict(save_every=10, keep=3, rollback_margin=0, background_save=True, processes=2)
    message = _refused(kw)
    m = re.search(r"set background_save=(\w+)", message)
    assert m and m.group(1) == "False", message
    policy.check_config(**(kw | {"background_save": False}))
