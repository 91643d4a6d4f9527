"""Screening data that cannot move back: read ahead, hold the healthy batch, lose nothing.

``screen_ahead`` used to do nothing on a plain iterator or a packed/filtered Grain loader
(issue 52: the skip then ended inside the bad window and its batches were trained on
again). Such data is now read ahead (``DataIterator.peek``): the anomalous batches are
consumed, as the skip would drain them anyway, and the first healthy one is held for the
next ``next``. The checks: ``peek`` against plain iteration, the screen against the window,
and a controller run on a plain iterator against the same run on ``IndexedBatches``.
"""

from __future__ import annotations

import warnings

import grain
import numpy as np
import pytest
from toy import batch_fn_factory, toy_controller, toy_problem

from stabljax.control import IndexedBatches
from stabljax.control.data.grain_iterators import GrainLoaderIterator
from stabljax.control.data.iterators import PlainIterator
from stabljax.control.diagnose.screen import can_read_ahead, can_screen, screen_ahead


def _plain(n=100):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "skipping drains it": known here
        return PlainIterator(iter(range(n)))


def test_peek_holds_the_batch_for_next_and_moves_nothing():
    it = _plain()
    assert it.peek() == 0 and it.peek() == 0 and it.index == 0
    assert next(it) == 0 and next(it) == 1 and it.index == 2
    it.peek()
    with pytest.raises(RuntimeError, match="batch 2 was read ahead"):
        it.get_state()
    it.skip(3)  # the held batch is the first of the three
    assert it.index == 5 and next(it) == 5
    it.skipped_ranges = [(7, 9)]
    assert it.peek() == 6 and next(it) == 6 and it.peek() == 9 and it.index == 9
    assert [next(it) for _ in range(3)] == [9, 10, 11]
    assert it.get_state() == {"index": 12}


@pytest.mark.parametrize("move", ["rewind", "seek", "set_state"])
def test_peek_then_move_lands_where_plain_iteration_does(move):
    it = IndexedBatches(lambda i: i, start=10)
    it.peek()
    {"rewind": lambda: it.rewind(4), "seek": lambda: it.seek(13)}.get(
        move, lambda: it.set_state({"index": 6})
    )()
    expected = {"rewind": 4, "seek": 13, "set_state": 6}[move]
    assert it.index == expected and next(it) == expected


def _loader(n=64, filtered=False):
    class KeepAll(grain.transforms.Filter):
        def filter(self, element) -> bool:
            return True

    ops = ([KeepAll()] if filtered else []) + [grain.transforms.Batch(4)]
    sampler = grain.samplers.IndexSampler(n, num_epochs=1, shuffle=False)
    return grain.DataLoader(
        data_source=list(range(n)), sampler=sampler, operations=ops, worker_count=0
    )


@pytest.mark.parametrize("filtered", [False, True], ids=["arithmetic", "drained"])
def test_a_grain_loader_read_ahead_then_moved_matches_plain_iteration(filtered):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = GrainLoaderIterator(iter(_loader(filtered=filtered)))
    next(it)
    assert it.peek().tolist() == [4, 5, 6, 7] and it.index == 1
    it.skip(2)  # over the held batch 1 and batch 2
    assert next(it).tolist() == [12, 13, 14, 15]
    if not filtered:
        it.peek()
        it.rewind(1)
        assert next(it).tolist() == [4, 5, 6, 7]


def test_screen_ahead_reads_a_plain_iterator_ahead_and_keeps_the_healthy_batch():
    it = _plain()
    it.seek(3)
    assert not can_screen(it) and can_read_ahead(it)
    s = screen_ahead(lambda st, b: (st, {"loss": float(b)}), None, it,
                     is_anomalous=lambda loss: 3 <= loss < 7, max_skip=10)  # fmt: skip
    assert (s.end, s.indices, s.read_ahead) == (7, (3, 4, 5, 6, 7), True)
    assert it.index == 7 and next(it) == 7  # batch 7 was screened and is not lost
    with pytest.raises(ValueError, match="behind the position"):
        screen_ahead(lambda st, b: (st, {"loss": 0.0}), None, it, is_anomalous=bool,
                     max_skip=3, start=2)  # fmt: skip


WINDOW = range(35, 45)  # ten +50 batches: a bad window


def _run(directory, data, fed):
    state0, step_fn = toy_problem()
    with toy_controller(directory, async_save=False, screen_ahead=32, screen_step=step_fn) as ctl:
        state, data = ctl.restore_or_init(state0, data, total_steps=80)
        for _ in ctl.steps(80):
            batch = next(data)
            fed.append(int(batch["i"]))
            state, metrics = step_fn(state, {k: v for k, v in batch.items() if k != "i"})
            state, data = ctl.step(state, metrics, data)
        state, data = ctl.finish(state, data)
    return ctl, state


def test_one_rollback_passes_the_window_on_data_that_cannot_move_back(tmp_path):
    fn = batch_fn_factory(WINDOW)

    def batch(i):
        return fn(i) | {"i": np.int32(i)}

    fed_plain, fed_indexed = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, state_plain = _run(tmp_path / "plain", (batch(i) for i in range(400)), fed_plain)
    assert any("screen_ahead=32: PlainIterator" in str(w.message) for w in caught)
    indexed, state_indexed = _run(tmp_path / "indexed", IndexedBatches(batch), fed_indexed)
    for ctl in (plain, indexed):
        assert ctl.rollbacks == 1 and int(ctl.current_step) == 80
        (a, b), = ctl.skipped_ranges  # fmt: skip
        assert a <= WINDOW.start and b >= WINDOW.stop, ctl.skipped_ranges
    skip = next(e for e in plain.events if e.kind == "skip").details
    assert skip["screen_read_ahead"] is True and skip["screened"][1] == WINDOW.stop
    # After the rollback, no window batch is fed and none is lost: the plain run feeds
    # exactly range(b, ...) in order, the batch that ended the screening first.
    (a, b), = plain.skipped_ranges  # fmt: skip
    after = fed_plain[fed_plain.index(b) :]
    assert after == list(range(b, b + len(after))) and not set(after) & set(WINDOW)
    # Read ahead against the checkpoint's smoothed loss, the skip is the in-place screen's
    # here, so the two runs fed the same batches in the same order: the same state.
    assert plain.skipped_ranges == indexed.skipped_ranges == [(20, WINDOW.stop)]
    assert fed_plain == fed_indexed
    np.testing.assert_array_equal(state_plain.params["w"], state_indexed.params["w"])
