"""stabljax.control.diagnose.screen: screening the batches ahead of a restored position."""

from __future__ import annotations

import functools
import warnings

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabljax.control.data.grain_iterators import GrainDatasetIterator
from stabljax.control.data.iterators import IndexedBatches, PlainIterator
from stabljax.control.diagnose.screen import can_screen, screen_ahead

BAD = range(10, 16)


def value(i):
    return 50.0 if i in BAD else 1.0 + 0.01 * (i % 3)


@functools.partial(jax.jit, donate_argnums=0)
def step(state, batch):
    # loss = batch * w: under the restored w = 1 it is the batch value; the update moves w
    loss = batch * state["w"]
    return {"w": state["w"] - 0.1 * batch, "n": state["n"] + 1}, {"loss": loss}


def state0():
    return {"w": jnp.float32(1.0), "n": jnp.int32(0)}


def anomalous(loss):
    return loss > 3.0


def _indexed(start):
    return IndexedBatches(lambda i: jnp.float32(value(i)), start=start)


def _grain(start):
    ds = grain.MapDataset.source([np.float32(value(i)) for i in range(100)])
    it = GrainDatasetIterator(iter(ds))
    it.seek(start)
    return it


@pytest.mark.parametrize("make", [_indexed, _grain], ids=["IndexedBatches", "Grain"])
def test_screening_finds_the_end_of_the_window_and_moves_nothing(make):
    state = state0()
    data = make(11)
    s = screen_ahead(step, state, data, is_anomalous=anomalous, max_skip=100)
    assert (s.start, s.end, s.capped) == (11, 16, False)
    assert s.indices == (11, 12, 13, 14, 15, 16)
    np.testing.assert_array_equal(s.losses, np.float32([value(i) for i in s.indices]))
    # Each batch was run from the restored state (w = 1), not from the last screened one.
    assert float(state["w"]) == 1.0 and int(state["n"]) == 0  # donated copies only
    assert data.index == 11 and float(next(data)) == value(11)


@pytest.mark.parametrize("make", [_indexed, _grain], ids=["IndexedBatches", "Grain"])
def test_a_healthy_next_batch_screens_one_batch_and_skips_nothing(make):
    data = make(3)
    s = screen_ahead(step, state0(), data, is_anomalous=anomalous, max_skip=5)
    assert (s.end, s.indices) == (3, (3,))
    assert data.index == 3


def test_max_skip_caps_the_screen_and_says_so():
    s = screen_ahead(step, state0(), _indexed(10), is_anomalous=anomalous, max_skip=4)
    assert (s.end, s.capped, s.indices) == (14, True, (10, 11, 12, 13))


def test_skipped_ranges_are_passed_over_and_a_nan_loss_is_anomalous():
    data = IndexedBatches(lambda i: jnp.float32(np.nan if i == 4 else value(i)), start=2)
    data.skipped_ranges = [(2, 4)]
    s = screen_ahead(step, state0(), data, is_anomalous=lambda v: False, max_skip=10)
    assert s.indices == (4, 5) and s.end == 5 and np.isnan(s.losses[0])
    assert s.as_details()["screened_losses"][0] == "nan"


def test_data_that_ends_inside_the_window():
    def fn(i):
        if i >= 13:
            raise IndexError(i)
        return jnp.float32(value(i))

    s = screen_ahead(
        step, state0(), IndexedBatches(fn, start=10), is_anomalous=anomalous, max_skip=9
    )
    assert (s.end, s.indices) == (13, (10, 11, 12))


def test_what_cannot_be_screened_and_bad_arguments():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plain = PlainIterator(iter(range(10)))
    assert not can_screen(plain) and can_screen(_indexed(0)) and can_screen(_grain(0))
    # A plain iterator is read ahead instead (tests/test_read_ahead.py); an iterator with
    # no position to read ahead from cannot be screened at all.
    with pytest.raises(ValueError, match="cannot be screened"):
        screen_ahead(step, state0(), iter(range(10)), is_anomalous=anomalous, max_skip=3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_skip"):
            screen_ahead(step, state0(), _indexed(0), is_anomalous=anomalous, max_skip=bad)


def test_extending_a_plan_extends_its_skip_ledger_and_entry():
    from stabljax.control.decide.policy import Ledger, RollbackSettings, Skip, Target, plan_rollback
    from stabljax.control.detect.detectors import Detection

    spike = Detection("spike", 36, 35, "rollback", "loss 9 > 5", 9.0)
    plan = plan_rollback([spike], Ledger(), Target(20, 20, True), 37, RollbackSettings(10, 0, 30))
    longer = plan.extended_to(50, {"screened": [37, 50]})
    assert longer.skip == Skip(20, 50, 30, False) and longer.resume_at == 50
    assert longer.ledger.ranges == [(20, 50)] and longer.entry["range"] == [20, 50]
    assert longer.entry["screened"] == [37, 50] and longer.ledger.history[-1] == longer.entry
    assert longer.record(0.0)["data_index"] == 50
    same = plan.extended_to(37, {"screened": [37, 37]})  # nothing anomalous ahead
    assert same.skip == plan.skip and same.entry["screened"] == [37, 37]


@pytest.mark.parametrize("screen", [0, 64], ids=["blind", "screened"])
def test_one_rollback_passes_a_whole_bad_window_when_screening(tmp_path, screen):
    from toy import batch_fn_factory, run_toy

    window = range(40, 60)  # 20 garbage batches
    ctl, state, data = run_toy(tmp_path, 100, batch_fn_factory(bad=window), screen_ahead=screen)
    skips = [e for e in ctl.events if e.kind == "skip"]
    if screen:
        assert ctl.rollbacks == 1, [e.details for e in skips]
        (skip,) = skips
        a, b = skip.details["range"]
        assert a <= window.start and b == window.stop  # exactly to the window's end
        assert skip.details["screened"][1] == window.stop
        assert skip.details["screened_indices"][-1] == window.stop  # the healthy one
    else:
        assert ctl.rollbacks >= 2  # doubling, the fallback
    covered = set().union(*(range(a, b) for a, b in ctl.skipped_ranges))
    assert set(window) <= covered
    assert int(state.step) == 100
