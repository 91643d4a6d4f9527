"""A hand-written loop never ends short, loses its last state or screens nothing in silence.

Issue 52: a trainer ported literally (``for step in range(N)``) kept counting after a
rollback moved ``state.step`` back and ended 126 steps short, without a word. Here the same
port runs on the toy with a poisoned batch that forces a rollback: the safe form
(``for step in ctl.steps(N)``) reaches N; the literal form warns at the first rollback,
naming the fix, and with the target declared ``finish`` raises. Then the other silences:
a controller closed or collected without ``finish``, ``screen_ahead`` on data that cannot
move back, and a Grain pipeline whose resume is not exact.
"""

from __future__ import annotations

import gc
import re
import warnings

import grain
import jax
import numpy as np
import pytest
from toy import batch_fn_factory, toy_controller, toy_problem

from stabljax.control import IndexedBatches, read_events

N = 60
BAD = (35,)  # a +50 target batch: a spike, and a rollback to step 20 (margin 10)
FIX = r"for step in ctl\.steps\(N\).*total_steps=N"


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if "stabljax" not in w.filename]


def test_a_literal_range_loop_warns_at_the_first_rollback_naming_the_fix(tmp_path):
    state0, step_fn = toy_problem()
    ctl = toy_controller(tmp_path, async_save=False)
    state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory(BAD)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(N):  # the literal port
            state, metrics = step_fn(state, next(data))
            state, data = ctl.step(state, metrics, data)
            if ctl.rollbacks and not caught:
                pytest.fail(f"step {step}: a rollback and no warning")
    rollback_warnings = [w for w in caught if "ctl.steps(N)" in str(w.message)]
    assert len(rollback_warnings) == 1  # loud once, at the first rollback
    w = rollback_warnings[0]
    assert w.filename == __file__  # points at the user's line, not at stabljax
    assert re.search(FIX, str(w.message), re.S), w.message
    rollback = next(e for e in ctl.events if e.kind == "rollback")
    back = rollback.details["steps_back"]
    assert rollback.details["target_steps"] is None and back > 0
    assert f"{back} steps short" in str(w.message)
    # What it warns about: the loop ran N times and the state is `back` steps short of N.
    assert ctl.current_step == N - back == int(state.step)
    state, data = ctl.finish(state, data)  # no target declared: finish cannot know N
    ctl.close()


def test_a_literal_range_loop_with_total_steps_raises_at_finish_after_saving(tmp_path):
    state0, step_fn = toy_problem()
    ctl = toy_controller(tmp_path, async_save=False)
    data = IndexedBatches(batch_fn_factory(BAD))
    state, data = ctl.restore_or_init(state0, data, total_steps=N)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(N):
            state, metrics = step_fn(state, next(data))
            state, data = ctl.step(state, metrics, data)
        assert ctl.rollbacks == 1
        assert not [m for m in _ours(caught) if "ctl.steps" in m]  # the target is declared
        reached = ctl.current_step
        with pytest.raises(RuntimeError, match=rf"step {reached}, {N - reached} steps short"):
            ctl.finish(state, data)
    assert reached in ctl.checkpoint_steps()  # saved before it raised
    ctl.close()
    # The advice, applied: a restart that loops with ctl.steps(N) reaches N.
    with toy_controller(tmp_path, async_save=False) as ctl:
        state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory(BAD)))
        assert ctl.current_step == reached
        for _ in ctl.steps(N):
            state, metrics = step_fn(state, next(data))
            state, data = ctl.step(state, metrics, data)
        state, data = ctl.finish(state, data)
    assert int(state.step) == N


def test_the_safe_form_reaches_n_through_a_rollback_without_a_warning(tmp_path):
    state0, step_fn = toy_problem()
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with toy_controller(tmp_path, async_save=False) as ctl:
            state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory(BAD)))
            for step in ctl.steps(N):
                seen.append(step)
                state, metrics = step_fn(state, next(data))
                state, data = ctl.step(state, metrics, data)
            state, data = ctl.finish(state, data)
    assert ctl.rollbacks == 1 and int(state.step) == N == ctl.current_step
    assert not _ours(caught), _ours(caught)
    rollback = next(e for e in ctl.events if e.kind == "rollback")
    assert rollback.details["target_steps"] == N
    # The lost steps ran again: the yielded steps go back once, by steps_back - 1 (the
    # rollback is read one step late), and end at N - 1.
    back = [b for a, b in zip(seen, seen[1:], strict=False) if b != a + 1]
    assert len(back) == 1 and seen[-1] == N - 1
    # Same final state as run() on the same data (run is the reference driver).
    with toy_controller(tmp_path / "run", async_save=False) as ref:
        ref_state, _ = ref.run(
            step_fn, state0, IndexedBatches(batch_fn_factory(BAD)), N, progress=False
        )
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(ref_state.params["w"]))
    assert ref.skipped_ranges == ctl.skipped_ranges


def test_steps_names_a_loop_that_never_calls_step(tmp_path):
    state0, _ = toy_problem()
    with toy_controller(tmp_path, async_save=False) as ctl:
        with pytest.raises(RuntimeError, match="before steps"):
            next(ctl.steps(N))
        ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory()))
        with pytest.raises(RuntimeError, match=r"did not call ctl.step"):
            for _ in ctl.steps(N):
                pass
        for bad in (-1, 2.5, True, "60"):
            with pytest.raises(ValueError, match="target number of steps"):
                next(ctl.steps(bad))
        with pytest.raises(ValueError, match="target number of steps"):
            ctl.restore_or_init(state0, ctl.data, total_steps=-5)


def _take(ctl, state, data, step_fn, n):
    for _ in range(n):
        state, metrics = step_fn(state, next(data))
        state, data = ctl.step(state, metrics, data)
    return state, data


@pytest.mark.parametrize("how", ["close", "exit", "gc"])
def test_a_missing_finish_warns_that_the_final_state_was_not_saved(tmp_path, how):
    state0, step_fn = toy_problem()
    ctl = toy_controller(tmp_path, async_save=False)
    state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory()))
    state, data = _take(ctl, state, data, step_fn, 14)
    match = r"at step 14 without finish\(\): the final state was not saved \(the newest "
    match += r"checkpoint is step 10\) and its last loss was not checked"
    with pytest.warns(RuntimeWarning, match=match):
        if how == "close":
            ctl.close()
        elif how == "exit":
            with ctl:
                pass
        else:
            del ctl, state, data
            gc.collect()


def test_finish_or_an_exception_gives_no_missing_finish_warning(tmp_path):
    state0, step_fn = toy_problem()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*without finish")
        with toy_controller(tmp_path / "a", async_save=False) as ctl:
            state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory()))
            state, data = _take(ctl, state, data, step_fn, 14)
            ctl.finish(state, data)
        assert ctl.checkpoint_steps()[-1] == 14
        with pytest.raises(KeyError):  # the loop's own error is the news, not a warning
            with toy_controller(tmp_path / "b", async_save=False) as ctl:
                state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory()))
                _take(ctl, state, data, step_fn, 3)
                raise KeyError("the loop died")


def test_screen_ahead_on_data_that_cannot_move_back_warns_naming_the_iterator(tmp_path):
    state0, step_fn = toy_problem()
    batches = (batch_fn_factory()(i) for i in range(100))  # a generator: no rewind
    with toy_controller(tmp_path, screen_ahead=64, screen_step=step_fn) as ctl:
        with pytest.warns(RuntimeWarning) as caught:
            ctl.restore_or_init(state0, batches)
        messages = [str(w.message) for w in caught]
        screen = [m for m in messages if "screen_ahead" in m]
        assert len(screen) == 1 and "screen_ahead=64: PlainIterator" in screen[0]
        assert "builtins.generator" in screen[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*screen_ahead")
        with toy_controller(tmp_path / "ok", screen_ahead=64, screen_step=step_fn) as ctl:
            ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory()))  # can screen


def _docs(n=400):
    rng = np.random.default_rng(0)
    return [{"t": rng.integers(1, 255, int(rng.integers(3, 9)), dtype=np.int32)} for _ in range(n)]


def _loader(docs, ops):
    sampler = grain.samplers.IndexSampler(len(docs), num_epochs=1, shuffle=False)
    return grain.DataLoader(data_source=docs, sampler=sampler, operations=ops, worker_count=0)


def _packing():
    return [grain.experimental.PackAndBatchOperation({"t": 16}, batch_size=2)]


def test_a_packing_grain_loader_warns_that_resume_is_not_exact_and_it_is_not():
    from stabljax.control.data.grain_iterators import GrainLoaderIterator

    docs = _docs()
    with pytest.warns(RuntimeWarning, match=r"PackAndBatchOperation.*will not be bit-exact"):
        it = GrainLoaderIterator(iter(_loader(docs, _packing())))
    # The warning is true: Grain's own resume of this loader gives other batches.
    full = [next(it) for _ in range(12)]
    first = iter(_loader(docs, _packing()))
    for _ in range(5):
        next(first)
    resumed = iter(_loader(docs, _packing()))
    resumed.set_state(first.get_state())
    again = [next(resumed) for _ in range(7)]
    leaves = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)]) for b in full[5:] + again]
    same = all(np.array_equal(a, b) for a, b in zip(leaves[:7], leaves[7:], strict=True))
    assert not same


def test_a_map_and_batch_grain_loader_resumes_exactly_without_that_warning():
    from stabljax.control.data.grain_iterators import GrainLoaderIterator

    docs = [{"t": np.full(4, i, np.int32)} for i in range(64)]
    ops = [grain.transforms.Batch(4)]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*bit-exact")
        it = GrainLoaderIterator(iter(_loader(docs, ops)))
    full = [next(it)["t"] for _ in range(8)]
    first = iter(_loader(docs, ops))
    for _ in range(3):
        next(first)
    resumed = iter(_loader(docs, ops))
    resumed.set_state(first.get_state())
    assert all(np.array_equal(a, next(resumed)["t"]) for a in full[3:])


def test_rollback_event_says_how_far_back_and_the_target(tmp_path):
    state0, step_fn = toy_problem()
    with toy_controller(tmp_path, async_save=False) as ctl:
        ctl.run(step_fn, state0, IndexedBatches(batch_fn_factory(BAD)), N, progress=False)
    rollback = next(e for e in read_events(tmp_path / "events.jsonl") if e.kind == "rollback")
    assert rollback.details["target_steps"] == N
    # Read one step late: steps 0..detected+1 had run (the counter is at detected + 2).
    assert rollback.details["steps_back"] == rollback.step + 2 - rollback.details["restored_step"]
