"""stabljax.control.errors: what each exception carries and catches as, and warn()
pointing at the user's line whatever the depth of the call into stabljax."""

from __future__ import annotations

import errno
import inspect
import pathlib
import signal

import numpy as np
import pytest

from stabljax.control.data.iterators import as_data_iterator
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
