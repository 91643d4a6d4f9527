"""stabljax.control.errors: what each exception carries and catches as, and warn()
pointing at the user's line whatever the depth of the call into stabljax."""

from __future__ import annotations

import errno
import inspect
import pathlib
import signal

import numpy as np
import pytest
from toy import batch_fn_factory, toy_problem

from stabljax.control import IndexedBatches, RollbackController
from stabljax.control.data.grain_iterators import as_data_iterator
from stabljax.control.detect.detectors import Detection
from stabljax.control.errors import (
    CheckpointMismatch,
    CheckpointSaveError,
    DataExhausted,
    Preempted,
    TrainingDiverged,
    warn,
)


def test_checkpoint_save_error_carries_step_directory_and_errno(tmp_path):
    e = CheckpointSaveError("disk full at 30", step=30, directory=str(tmp_path), code=errno.ENOSPC)
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert e.step == 30 and e.directory == pathlib.Path(tmp_path)
    assert str(e) == "disk full at 30"
    plain = CheckpointSaveError("failed", step=np.int64(10), directory=tmp_path, code=None)
    assert plain.errno is None and type(plain.step) is int


def test_a_checkpoint_mismatch_is_caught_as_a_runtime_or_a_value_error():
    for base in (RuntimeError, ValueError):
        with pytest.raises(base):
            raise CheckpointMismatch("state changed")


def test_training_diverged_keeps_a_copy_of_the_history():
    history = [{"restored": 10}]
    e = TrainingDiverged("gave up", history)
    history[0]["restored"] = 99
    assert e.history == [{"restored": 10}] and str(e) == "gave up"
    assert TrainingDiverged("x").history == []
    assert isinstance(DataExhausted("out"), RuntimeError)


def test_preempted_exits_cleanly_and_says_what_stopped_it():
    e = Preempted(40, signal.SIGTERM, True, state="s")
    assert isinstance(e, SystemExit) and e.code == 0  # unhandled, the process exits 0
    assert (e.step, e.signum, e.saved, e.state) == (40, signal.SIGTERM, True, "s")
    assert str(e) == "preempted by SIGTERM at step 40 (saved: True)"
    notice = Preempted(7, None, False)  # no signal: a notice by other means
    assert str(notice) == "preempted by preemption notice at step 7 (saved: False)"


def test_warn_points_at_the_callers_line_directly_and_through_stabljax():
    with pytest.warns(RuntimeWarning, match="look here") as got:
        line = inspect.currentframe().f_lineno + 1
        warn("look here")
    assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]
    with pytest.warns(RuntimeWarning, match="plain iterator") as got:
        line = inspect.currentframe().f_lineno + 1
        as_data_iterator(iter(range(3)))  # warns two calls deep inside stabljax
    assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]


class _WarnAt:
    """A detector whose only finding is a ``"warn"`` at one step."""

    name = "warn_at"
    keys = ("loss",)

    def __init__(self, at: int):
        self.at = at

    def update(self, step, metrics):
        if step != self.at:
            return None
        return Detection("spike", step, step, "warn", "look at step 3", 0.0)

    def active_onset(self):
        return None

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def test_the_controllers_warnings_point_at_the_callers_line(tmp_path):
    # Each call site in stabljax passes its depth below the public entry point: a foreign
    # step folder (restore_or_init) and a detector's "warn" (ctl.step) land on these lines.
    state, step = toy_problem()
    with RollbackController(tmp_path, save_every=100, async_save=False) as ctl:
        ctl.restore_or_init(state, IndexedBatches(batch_fn_factory()))  # a run: checkpoint 0
    (tmp_path / "123").mkdir()  # named like a step, not a checkpoint
    (tmp_path / "123" / "notes.txt").write_text("mine")
    ctl = RollbackController(tmp_path, save_every=100, detectors=[_WarnAt(3)], async_save=False)
    with ctl:
        with pytest.warns(RuntimeWarning, match="named like a checkpoint step") as got:
            line = inspect.currentframe().f_lineno + 1
            state, data = ctl.restore_or_init(state, IndexedBatches(batch_fn_factory()))
        assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]
        with pytest.warns(RuntimeWarning, match="look at step 3") as got:
            for _ in range(6):
                state, metrics = step(state, next(data))
                line = inspect.currentframe().f_lineno + 1
                state, data = ctl.step(state, metrics, data)
        assert [(w.filename, w.lineno) for w in got] == [(__file__, line)]
