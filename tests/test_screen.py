"""stabljax.control.screen: screening the batches ahead of a restored position."""

from __future__ import annotations

import functools
import warnings

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stabljax.control.data import GrainDatasetIterator, IndexedBatches, PlainIterator
from stabljax.control.screen import can_screen, screen_ahead

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
    with pytest.raises(ValueError, match="cannot be screened"):
        screen_ahead(step, state0(), plain, is_anomalous=anomalous, max_skip=3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_skip"):
            screen_ahead(step, state0(), _indexed(0), is_anomalous=anomalous, max_skip=bad)
