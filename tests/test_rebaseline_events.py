"""A level shift the ``skip_spikes`` guard absorbs is a ``rebaseline`` event under the controller.

The reference is the bare jitted step run without any controller: the steps at which its
``metrics["spike_rebaselines"]`` rose are the steps the events must name, once each, in an
uninterrupted run, across a restart, and across a rollback that replays the shift.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stabljax import make_train_step
from stabljax.control import (
    SCHEMA_VERSION,
    IndexedBatches,
    RollbackController,
    read_events,
)
from stabljax.control.detect.monitor import Monitor
from stabljax.optim.guards.skips import skip_nonfinite, skip_spikes
from stabljax.report import page, read
from stabljax.step import TrainState

SHIFT_AT = 55  # data index where the loss level triples for good
STEPS = 100


def _batch(i: int) -> dict:
    rng = np.random.default_rng(i)
    level = 3.0 if i >= SHIFT_AT else 1.0
    return {"level": np.float32(level), "noise": np.float32(0.01 * rng.standard_normal())}


def _loss(params, batch):
    # A loss whose level is set by the data (the shift), not by anything the guard can fix.
    loss = batch["level"] * (1.0 + batch["noise"] + 1e-3 * jnp.sum(params["w"] ** 2))
    return loss, {}


OPT = skip_nonfinite(
    skip_spikes(
        optax.sgd(1e-2), warmup_steps=8, watch=("loss",), rebaseline_after=3, rebaseline_ratio=4.0
    )
)
STEP = make_train_step(_loss, OPT)


def _state():
    return TrainState.create({"w": jnp.ones((3,), jnp.float32)}, OPT)


def _reference_rises() -> list[tuple[int, int]]:
    """(step, cumulative count) where the bare run's count rose.

    The step is ``state.step`` before the update, i.e. the data index, as the
    controller names every step's metrics.
    """
    state, last, rises = _state(), 0, []
    for i in range(STEPS):
        state, m = STEP(state, _batch(i))
        total = int(m["spike_rebaselines"])
        if total > last:
            rises.append((i, total))
        last = total
    return rises


@pytest.fixture(scope="module")
def rises():
    r = _reference_rises()
    # The shift is absorbed once, a few steps after it (3 agreeing skips, then accepted).
    assert len(r) == 1 and r[0][1] == 1 and SHIFT_AT <= r[0][0] <= SHIFT_AT + 5, r
    return r


def _events(directory):
    return [
        (e.step, e.details["total"])
        for e in read_events(directory / "events.jsonl")
        if e.kind == "rebaseline"
    ]


def _controller(directory, detectors=()):
    return RollbackController(
        directory,
        save_every=10,
        keep=3,
        rollback_margin=10,
        detectors=list(detectors),
        async_save=False,
    )


def _run(directory, until, detectors=()):
    with _controller(directory, detectors) as ctl:
        state, data = ctl.run(STEP, _state(), IndexedBatches(_batch), until, progress=False)
    return ctl, state


def test_rebaseline_event_names_the_step_the_guard_reports(tmp_path, rises):
    ctl, state = _run(tmp_path, STEPS)
    assert int(state.step) == STEPS
    assert _events(tmp_path) == rises
    (event,) = [e for e in ctl.events if e.kind == "rebaseline"]
    assert event.details["added"] == 1
    assert event.details["loss"] == pytest.approx(3.0, rel=0.05)  # the new level
    assert event.details["recent"][-1][0] == event.step
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert all(json.loads(line)["schema"] == SCHEMA_VERSION == "1.2" for line in lines)
    # The run report lists it in its summary.
    summary = page.summary(read.load_run(tmp_path))
    assert summary["level shifts the guards accepted (rebaseline)"] == f"step {rises[0][0]}"


def test_restart_after_the_rebaseline_does_not_repeat_it(tmp_path, rises):
    _run(tmp_path, rises[0][0] + 7)  # stops past the re-baseline, after a save
    _run(tmp_path, STEPS)  # resumes from the last save, which holds the count
    assert _events(tmp_path) == rises


def test_restart_before_the_rebaseline_records_it_once(tmp_path, rises):
    _run(tmp_path, SHIFT_AT - 2)
    _run(tmp_path, STEPS)
    assert _events(tmp_path) == rises


def test_monitor_counts_from_the_loaded_checkpoint():
    """A rollback and a restart both load the checkpoint's meta (``Saver.load``).

    The event compares each step's count with the count the restored state carries, so
    a re-baseline replayed on a new branch is recorded again, and one the checkpoint
    already holds is not.
    """
    logged = []
    mon = Monitor([], lambda kind, step, **d: logged.append((kind, step, d["total"])))
    meta = {"detectors": {}, "ema": [0.0, 0]}
    metric = lambda total: {"loss": np.float32(1.0), "spike_rebaselines": np.int32(total)}
    mon.load({**meta, "spike_rebaselines": 0})  # a checkpoint before the re-baseline
    mon.observe(57, metric(1))
    mon.observe(58, metric(1))
    mon.load({**meta, "spike_rebaselines": 1})  # one after it
    mon.observe(61, metric(1))
    mon.observe(70, metric(3))  # two guards re-baselined at once
    mon.load(meta)  # a checkpoint written without guards: the first count is a baseline
    mon.observe(71, metric(5))
    mon.observe(72, metric(6))
    assert logged == [("rebaseline", 57, 1), ("rebaseline", 70, 3), ("rebaseline", 72, 6)]
    assert mon.to_meta()["spike_rebaselines"] == 6
