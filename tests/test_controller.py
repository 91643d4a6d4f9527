"""RollbackController: ledger honesty, crash safety, corruption, guards, lag, bad input.

The toy problem (tests/toy.py) is a linear regression trained with SGD whose batches are
a pure function of their index; "bad" indices get targets +50 (a loss spike whose update
wrecks the parameters), "nan" indices NaN targets. ``reference`` is conftest.py's.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import signal
import threading
import time
import warnings

import chex
import flax.struct
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CountedReads as _Probe
from helpers import host as _host
from helpers import mesh8, shard_leading
from toy import (
    BAD,
    assert_resumed_exactly,
    batch_fn_factory,
    make_toy,
    start_ctl_worker,
    toy_problem,
)
from toy import run_toy as _run
from toy import toy_controller as _controller

from stabljax.control import (
    DivergenceDetector,
    IndexedBatches,
    RollbackController,
    SlowDivergenceDetector,
    SpikeDetector,
    TrainingDiverged,
    read_events,
)
from stabljax.control.decide.policy import first_allowed
from stabljax.optim.guards.skips import skip_nonfinite, skip_spikes

STATE0, STEP = toy_problem()


def _used_indices(data_index, ranges):
    return [i for i in range(data_index) if first_allowed(i, ranges) == i]


def test_ledger_honesty_bit_identical_retrain(reference):
    ctl, state, data = reference
    assert ctl.rollbacks >= 2
    assert int(state.step) == 120 and ctl.current_step == 120
    used = _used_indices(data.index, ctl.skipped_ranges)
    assert len(used) == 120
    assert not set(used) & set(BAD)
    fn = batch_fn_factory(BAD)
    s = STATE0
    for i in used:
        s, _ = STEP(s, fn(i))
    chex.assert_trees_all_equal(_host(s.params), _host(state.params))
    # The run recovered: the final loss is at the noise floor.
    _, m = STEP(state, batch_fn_factory()(10_000))
    assert float(m["loss"]) < 0.05


def test_rollback_events_and_targets(reference):
    ctl, _, _ = reference
    kinds = [e.kind for e in ctl.events]
    assert kinds[0] == "save" and kinds.count("rollback") == ctl.rollbacks
    for e in ctl.events:
        if e.kind == "rollback":
            # The newest checkpoint at least rollback_margin before the onset.
            assert e.details["restored_step"] <= e.details["onset"] - 10
            assert e.details["margin_met"]
            assert e.details["restored_step"] % 10 == 0
    spikes = [e for e in ctl.events if e.kind == "spike"]
    assert spikes and all(e.details["action"] == "rollback" for e in spikes)
    # The events file holds the same records, every line whole.
    lines = (ctl.directory / "events.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    assert [e.kind for e in read_events(ctl.directory / "events.jsonl")] == kinds
    # Only the newest `keep` checkpoints are kept.
    assert ctl.checkpoint_steps() == [100, 110, 120]


def test_consecutive_rollbacks_double_the_skip(tmp_path):
    bad = range(40, 140)
    ctl, state, data = _run(tmp_path, 100, batch_fn_factory(bad))
    skips = [e.details for e in ctl.events if e.kind == "skip"]
    assert len(skips) >= 3
    doubled = [(a, b) for a, b in zip(skips, skips[1:], strict=False) if b["doubled"]]
    assert doubled
    for a, b in doubled:
        assert b["length"] >= 2 * a["length"]
    assert all(first_allowed(i, ctl.skipped_ranges) != i for i in bad)
    used = _used_indices(data.index, ctl.skipped_ranges)
    assert len(used) == 100 and not set(used) & set(bad)
    assert np.isfinite(np.asarray(_host(state.params)["w"])).all()


def test_max_rollbacks_raises_training_diverged_with_a_useful_message(tmp_path):
    with pytest.raises(TrainingDiverged) as info:
        _run(tmp_path, 200, batch_fn_factory(range(40, 10**6)), max_rollbacks=2)
    msg = str(info.value)
    assert "2 rollback(s) (max_rollbacks=2)" in msg
    assert "Losses before it" in msg and "Rollbacks so far:" in msg
    assert "Skipped data ranges" in msg
    for advice in ("learning rate", "warmup", "z-loss", "eps", "initialization"):
        assert advice in msg
    assert len(info.value.history) == 2
    kinds = [e.kind for e in read_events(tmp_path / "events.jsonl")]
    assert kinds.count("rollback") == 2 and kinds[-1] == "diverged"


_GUARDED_SPIKES = make_toy(skip_spikes(optax.sgd(0.05), warmup_steps=10, watch=("loss",)))
_GUARDED_NAN = make_toy(skip_nonfinite(optax.sgd(0.05)))


@pytest.mark.parametrize(
    "toy, fn, kind",
    [
        (_GUARDED_SPIKES, batch_fn_factory(bad=[50]), "spike"),
        (_GUARDED_NAN, batch_fn_factory(nan=[50]), "divergence"),
    ],
    ids=["skip_spikes", "skip_nonfinite"],
)
def test_a_spike_a_guard_skipped_is_recorded_only(tmp_path, toy, fn, kind):
    state0, step = toy
    ctl, state, _ = _run(tmp_path, 80, fn, state=state0, step=step)
    assert ctl.rollbacks == 0 and ctl.skipped_ranges == []
    found = [e for e in ctl.events if e.kind == kind]
    assert len(found) == 1
    assert found[0].step == 50 and found[0].details["action"] == "record"
    assert found[0].details["skipped"] is True


@pytest.mark.parametrize(
    "toy, fn",
    [
        (_GUARDED_SPIKES, batch_fn_factory(bad=range(50, 60))),
        (_GUARDED_NAN, batch_fn_factory(nan=range(50, 60))),
    ],
    ids=["skip_spikes", "skip_nonfinite"],
)
def test_a_guarded_anomaly_that_persists_rolls_back(tmp_path, toy, fn):
    state0, step = toy
    ctl, state, data = _run(tmp_path, 100, fn, state=state0, step=step)
    assert ctl.rollbacks >= 1
    first = next(e for e in ctl.events if e.kind == "rollback")
    assert first.details["onset"] == 50
    assert first.step == 54  # patience 5 / skip streak > 4: the fifth skipped step
    skip = next(e for e in ctl.events if e.kind == "skip").details["range"]
    assert skip[0] <= 50 and skip[1] == 56  # everything fed up to the detection
    # The rest of the bad stretch (56..59, shorter than the limit) is skipped in-graph
    # and only recorded; the ledger still accounts for every step.
    assert ctl.rollbacks == 1
    assert len(_used_indices(data.index, ctl.skipped_ranges)) == 100
    assert np.isfinite(np.asarray(_host(state.params)["w"])).all()


def test_step_does_not_read_the_current_metrics(tmp_path):
    ctl = _controller(tmp_path, save_every=1000)
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    probes = []
    for k in range(5):
        p = {"loss": _Probe(1.0 + k), "skipped": _Probe(False), "skip_streak": _Probe(0)}
        probes.append(p)
        state = state.replace(step=state.step + 1)  # a step advances state.step
        state, data = ctl.step(state, p, data)
        assert all(v.reads == 0 for v in p.values()), f"step {k} read its own metrics"
        if k:
            assert all(v.reads > 0 for v in probes[k - 1].values())
    # On a save step the current metrics are read too: the save waits for the step anyway.
    ctl2 = _controller(tmp_path / "b", save_every=2, rollback_margin=2)  # 10 > 2 x keep 3
    s, d = ctl2.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    s, m = STEP(s, next(d))
    s, d = ctl2.step(s, {"loss": (p1 := _Probe(1.0))}, d)
    assert p1.reads == 0
    s, m = STEP(s, next(d))
    s, d = ctl2.step(s, {"loss": (p2 := _Probe(1.0))}, d)
    assert p1.reads and p2.reads
    ctl.close(), ctl2.close()


class _Crash(Exception):
    pass


def test_crash_between_rollback_record_and_delete_is_finished_on_restart(tmp_path, reference):
    ref_ctl, ref_state, ref_data = reference
    ctl = _controller(tmp_path)

    def crash(step, **kw):
        raise _Crash

    ctl._store.delete_newer_than = crash  # dies right after the rollback record is written
    with pytest.raises(_Crash):
        ctl.run(STEP, STATE0, IndexedBatches(batch_fn_factory(BAD)), 120, progress=False)
    ctl.close()
    record = json.loads((tmp_path / "stabljax-rollback.json").read_text())
    assert record["rollbacks"] == 1
    assert max(ctl.checkpoint_steps()) > record["target_step"]  # newer ones not deleted

    ctl2, state, data = _run(tmp_path, 120, batch_fn_factory(BAD))
    chex.assert_trees_all_equal(_host(state.params), _host(ref_state.params))
    assert ctl2.skipped_ranges == ref_ctl.skipped_ranges and data.index == ref_data.index
    restore = next(e for e in ctl2.events if e.kind == "restore")
    assert "interrupted rollback" in restore.details["reason"]


def _worker(directory, out, *extra, wait=True):
    proc = start_ctl_worker(directory, out, *extra)
    if wait:
        _, err = proc.communicate(timeout=300)
        return proc.returncode, err
    return proc


@pytest.mark.parametrize("mode", [[], ["--background"]], ids=["async", "background"])
def test_sigkill_right_after_an_async_save_resumes_exactly(tmp_path, reference, mode):
    d, out = tmp_path / "ckpt", tmp_path / "final.npz"
    # The 6th save is step 40 after the first rollback; 8 MB of ballast keeps it in flight.
    rc, err = _worker(d, out, "--kill-at-save", "6", "--extra", "2000000", *mode)
    assert rc == -signal.SIGKILL, err[-2000:]
    assert not out.exists()
    # Restart here (the same job in this process: a second interpreter start is slow).
    state0, step = make_toy(extra=2_000_000)
    ctl = _controller(d)
    state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory(BAD)))
    assert ctl.current_step in (30, 40) and ctl.rollbacks == 1
    state, data = ctl.run(step, state, data, 120, progress=False)
    ctl.close()
    host = _host(state.params)
    np.savez(out, w=host["w"], b=host["b"], step=int(state.step))
    info = {"ranges": ctl.skipped_ranges, "index": data.index}
    pathlib.Path(str(out) + ".json").write_text(json.dumps(info))
    assert_resumed_exactly(d, out, reference)
    kinds = [e.kind for e in read_events(d / "events.jsonl")]
    assert kinds.count("rollback") == 2  # one before the kill, one after


@pytest.mark.slow
def test_sigkill_at_random_points_resumes_exactly(tmp_path, reference):
    d, out = tmp_path / "ckpt", tmp_path / "final.npz"
    # Kill points are fractions of an uninterrupted run's duration on this machine, so
    # they land inside the run whether the machine is idle or loaded.
    t0 = time.perf_counter()
    rc, err = _worker(tmp_path / "timing", tmp_path / "timing.npz", "--extra", "2000000")
    assert rc == 0, err[-2000:]
    duration = time.perf_counter() - t0
    rng = random.Random(0)
    kills = 0
    for attempt in range(3):
        # On a shared machine the timing run can be slower than the runs it times: when a
        # run ends before its first kill, start over in a fresh directory, timed by it.
        d = tmp_path / f"ckpt{attempt}"
        for _ in range(8):
            t0 = time.perf_counter()
            proc = _worker(d, out, "--extra", "2000000", wait=False)
            time.sleep(rng.uniform(0.3, 0.9) * duration)
            if proc.poll() is not None:
                proc.communicate()
                duration = 0.5 * (time.perf_counter() - t0)  # an upper bound, halved
                break
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate()
            kills += 1
        if kills:
            break
    assert kills >= 1  # at least one random-point kill happened (usually several)
    rc, err = _worker(d, out, "--extra", "2000000")
    assert rc == 0, err[-2000:]
    assert_resumed_exactly(d, out, reference)


def _largest_state_file(step_dir):
    # The merged OCDBT data file that a restore reads (not the per-process leftovers).
    files = [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def _truncate(step_dir):
    f = _largest_state_file(step_dir)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_bit(step_dir):
    f = _largest_state_file(step_dir)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 1
    f.write_bytes(bytes(b))


def _garble_meta(step_dir):
    (step_dir / "meta" / "metadata").write_text('{"version": 1, "st')


def _drop_state(step_dir):
    shutil.rmtree(step_dir / "state")


# A failed tensorstore read leaves an Orbax coroutine that is finalised after its event
# loop closed ("Event loop is closed"): Orbax-internal noise, not a controller error.
_ORBAX_NOISE = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_ORBAX_NOISE
@pytest.mark.parametrize("corrupt", [_truncate, _flip_bit, _garble_meta, _drop_state])
def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_previous_used(tmp_path, corrupt):
    fn = batch_fn_factory()
    d = tmp_path / "ckpt"
    _run(d, 30, fn)
    corrupt(d / "30")
    ctl = _controller(d)
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(fn))
    assert ctl.current_step == 20 and int(state.step) == 20 and data.index == 20
    bad = [e for e in ctl.events if e.kind == "corrupt_checkpoint"]
    assert [e.step for e in bad] == [30]
    assert [p.name.split("-")[0] for p in (d / "stabljax-corrupt").iterdir()] == ["30"]
    state, data = ctl.run(STEP, state, data, 40, progress=False)
    ctl.close()
    _, ref_state, _ = _run(tmp_path / "ref", 40, fn)
    chex.assert_trees_all_equal(_host(state.params), _host(ref_state.params))


@_ORBAX_NOISE
def test_a_corrupt_rollback_target_is_set_aside_and_an_older_one_used(tmp_path):
    fn = batch_fn_factory(bad=[35])
    _run(tmp_path, 30, fn)  # checkpoints 10, 20, 30; the bad batch is still ahead
    _truncate(tmp_path / "20")
    ctl, state, data = _run(tmp_path, 60, fn)
    rollback = next(e for e in ctl.events if e.kind == "rollback")
    assert rollback.details["restored_step"] == 10  # 20 (<= 35 - 10) is unreadable
    assert [e.step for e in ctl.events if e.kind == "corrupt_checkpoint"] == [20]
    assert [p.name.split("-")[0] for p in (tmp_path / "stabljax-corrupt").iterdir()] == ["20"]
    assert ctl.skipped_ranges == [(10, 37)] and int(state.step) == 60


def test_silent_corruption_is_caught_by_the_fingerprint(tmp_path):
    # A well-formed checkpoint with the right step but other values (another run's).
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, 30, batch_fn_factory(seed=0))
    _run(b, 30, batch_fn_factory(seed=1))
    shutil.rmtree(a / "30" / "state")
    shutil.copytree(b / "30" / "state", a / "30" / "state")
    ctl = _controller(a)
    ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    bad = [e for e in ctl.events if e.kind == "corrupt_checkpoint"]
    assert [e.step for e in bad] == [30] and "fingerprint" in bad[0].details["reason"]
    assert ctl.current_step == 20
    ctl.close()


def test_no_restorable_checkpoint_is_an_error_and_nothing_is_moved(tmp_path):
    d = tmp_path / "ckpt"
    _run(d, 20, batch_fn_factory())
    other, _ = make_toy(optax.adam(1e-3))  # a different state structure
    ctl = _controller(d)
    with pytest.raises(RuntimeError, match="structure changed"):
        ctl.restore_or_init(other, IndexedBatches(batch_fn_factory()))
    assert not (d / "stabljax-corrupt").exists()
    assert ctl.checkpoint_steps() == [0, 10, 20]


def test_restore_keeps_shardings(tmp_path):
    @flax.struct.dataclass
    class S:
        step: jax.Array
        params: dict

    mesh = mesh8()
    params = shard_leading({"w": jnp.arange(32.0).reshape(8, 4), "b": jnp.ones(3)}, mesh)
    state = S(step=shard_leading(jnp.zeros([], jnp.int32), mesh), params=params)
    RollbackController(tmp_path).restore_or_init(state, IndexedBatches(lambda i: i))
    ctl = RollbackController(tmp_path)
    target = jax.tree.map(jnp.zeros_like, state)
    restored, _ = ctl.restore_or_init(target, IndexedBatches(lambda i: i))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        np.testing.assert_array_equal(got, want)
    ctl.close()


class _Records:
    """A random-access source whose record i is batch i."""

    def __init__(self, fn):
        self.fn = fn

    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        return self.fn(int(i))

    def __repr__(self):
        return "Records"


def _grain_map(fn):
    return iter(grain.MapDataset.source(_Records(fn)))


def _grain_loader(fn):
    return grain.DataLoader(
        data_source=_Records(fn),
        sampler=grain.samplers.IndexSampler(10**6, shuffle=False, num_epochs=1),
        worker_count=0,
    )


@pytest.mark.parametrize("make", [_grain_map, _grain_loader], ids=["MapDataset", "DataLoader"])
def test_grain_data_rolls_back_and_resumes_like_indexed_batches(tmp_path, make):
    fn = batch_fn_factory(bad=[35])
    d = tmp_path / "grain"
    ctl = _controller(d)
    state, data = ctl.run(STEP, STATE0, make(fn), 50, progress=False)
    ctl.close()
    assert ctl.rollbacks == 1
    # Restart with a fresh Grain iterator: the position comes from Grain's checkpoint.
    ctl2 = _controller(d)
    state, data = ctl2.run(STEP, STATE0, make(fn), 80, progress=False)
    ctl2.close()
    assert (d / "80" / "data").is_dir()
    _, ref_state, ref_data = _run(tmp_path / "ref", 80, fn)
    chex.assert_trees_all_equal(_host(state.params), _host(ref_state.params))
    assert data.index == ref_data.index and ctl2.skipped_ranges == [(20, 37)]


def _drift_run(tmp_path, detector, **kw):
    fn = batch_fn_factory(drift_from=150)
    ctl = _controller(tmp_path, save_every=20, detectors=[detector, DivergenceDetector()], **kw)
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(fn))
    while ctl.current_step < 600:
        state, m = STEP(state, next(data))
        state, data = ctl.step(state, m, data)
        if ctl.events.count("slow_divergence"):
            break
    ctl.close()
    return ctl


def test_slow_divergence_warns_by_default(tmp_path):
    with pytest.warns(RuntimeWarning, match="Mann-Kendall"):
        ctl = _drift_run(tmp_path, SlowDivergenceDetector(window=20, block=10))
    found = [e for e in ctl.events if e.kind == "slow_divergence"]
    assert found and all(e.details["action"] == "warn" for e in found)
    assert found[0].step > 150 and ctl.rollbacks == 0


@pytest.mark.parametrize("background_save", [False, True], ids=["foreground", "background"])
def test_slow_divergence_can_roll_back_to_the_best_checkpoint(tmp_path, background_save):
    det = SlowDivergenceDetector(window=20, block=10, action="rollback_best")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*Mann-Kendall")  # no drift warning in this mode
        ctl = _drift_run(tmp_path, det, background_save=background_save)
    assert ctl.rollbacks == 1
    saves = [(e.details["smoothed_loss"], e.step) for e in ctl.events if e.kind == "save"]
    best = min(s for s in saves if s[0] is not None)[1]
    rollback = next(e for e in ctl.events if e.kind == "rollback")
    assert rollback.details["restored_step"] == best
    newest_three = [20 * (rollback.step // 20) - 20 * k for k in range(3)]
    assert best < min(newest_three)  # kept because it is the best, not because it is new


def test_missing_directory_is_created(tmp_path):
    d = tmp_path / "a" / "b" / "c"
    RollbackController(d).close()
    assert d.is_dir()


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_directory_is_a_clear_error(tmp_path, where):
    if where == "under_a_file":
        (tmp_path / "file").write_text("x")
        d = tmp_path / "file" / "ckpt"
    else:
        d = pathlib.Path("/proc/stabljax-ckpt")
    with pytest.raises(OSError, match="cannot be created or written"):
        RollbackController(d)


def test_metrics_without_loss_are_a_clear_error(tmp_path):
    ctl = RollbackController(tmp_path)
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    with pytest.raises(ValueError, match="'loss'.*grad_norm"):
        ctl.step(state, {"grad_norm": jnp.float32(1.0)}, data)
    with pytest.raises(ValueError, match="'loss'"):
        ctl.step(state, jnp.float32(1.0), data)
    ctl.close()


def test_misuse_is_a_clear_error(tmp_path):
    ctl = RollbackController(tmp_path / "a")
    with pytest.raises(RuntimeError, match="restore_or_init"):
        ctl.step(STATE0, {"loss": 1.0}, IndexedBatches(lambda i: i))
    with pytest.raises(TypeError, match="'step'"):
        ctl.restore_or_init({"params": 1.0}, IndexedBatches(lambda i: i))
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    with pytest.raises(ValueError, match="restore_or_init returned"):
        ctl.step(state, {"loss": 1.0}, IndexedBatches(lambda i: i))
    ctl.close()

    def no_increment(state, batch):
        _, m = STEP(state, batch)
        return state, m

    ctl = _controller(tmp_path / "b")
    with pytest.raises(ValueError, match="increment state.step"):
        ctl.run(no_increment, STATE0, IndexedBatches(batch_fn_factory()), 30, progress=False)
    ctl.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"save_every": 0},
        {"keep": 0},
        {"rollback_margin": -1},
        {"extra_skip": 1.5},
        {"max_rollbacks": -1},
        {"save_every": float("nan")},
        {"keep": float("inf")},
        {"rollback_margin": True},
        {"extra_skip": None},
        {"max_rollbacks": float("inf")},
    ],
)
def test_invalid_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RollbackController(tmp_path, **kwargs)


def test_max_rollbacks_none_is_unlimited(tmp_path):
    ctl, _, _ = _run(tmp_path, 60, batch_fn_factory(BAD), max_rollbacks=None)
    assert ctl.max_rollbacks is None and ctl.rollbacks == 1


def test_duplicate_detector_names(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        RollbackController(tmp_path, detectors=[SpikeDetector(), SpikeDetector()])


def test_extra_skip_and_a_completed_run_restarts_as_a_no_op(tmp_path):
    fn = batch_fn_factory(bad=[35])
    ctl, state, data = _run(tmp_path, 60, fn, extra_skip=5)
    assert ctl.skipped_ranges == [(20, 42)]  # fed up to 36, plus 5
    ctl2 = _controller(tmp_path, extra_skip=5)
    state2, data2 = ctl2.run(STEP, STATE0, IndexedBatches(fn), 60, progress=False)
    ctl2.close()
    assert [e.kind for e in ctl2.events] == ["restore"]
    chex.assert_trees_all_equal(_host(state2.params), _host(state.params))
    assert data2.index == data.index


def test_progress_bar_runs(tmp_path, capsys):
    _run_ctl = _controller(tmp_path)
    _run_ctl.run(STEP, STATE0, IndexedBatches(batch_fn_factory(BAD)), 40, progress=True)
    _run_ctl.close()
    err = capsys.readouterr().err
    assert "rollbacks=1" in err and "40/40" in err


def test_deleted_checkpoints_are_removed_in_the_background_and_crash_leftovers_on_restart(
    tmp_path,
):
    ctl, _, _ = _run(tmp_path, 60, batch_fn_factory(()))  # close() waits for the sweeps
    assert ctl.checkpoint_steps() == [40, 50, 60]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.startswith("stabljax-trash")], names
    # A sweep that a crash cut short leaves a renamed trash folder behind.
    leftover = tmp_path / "stabljax-trash.0123abcd" / "10" / "state"
    leftover.mkdir(parents=True)
    (leftover / "data").write_bytes(b"x" * 100)
    ctl = _controller(tmp_path)
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory(())))
    assert ctl.current_step == 60
    ctl.close()
    assert not (tmp_path / "stabljax-trash.0123abcd").exists()


# ------------------------------------------------------------------- background saves


def test_background_save_runs_like_the_foreground_with_a_donating_step(tmp_path, reference):
    ref_ctl, ref_state, ref_data = reference
    state0, step = make_toy(donate=True)
    ctl, state, data = _run(
        tmp_path, 120, batch_fn_factory(BAD), state=state0, step=step, background_save=True
    )
    chex.assert_trees_all_equal(_host(state.params), _host(ref_state.params))
    assert ctl.skipped_ranges == ref_ctl.skipped_ranges and data.index == ref_data.index
    assert ctl.rollbacks == ref_ctl.rollbacks

    # The same events (a background save's event may come after a later step's).
    def key(e):
        return (e.step, e.kind)

    assert sorted(map(key, ctl.events)) == sorted(map(key, ref_ctl.events))
    assert sorted(map(key, read_events(tmp_path / "events.jsonl"))) == sorted(map(key, ctl.events))
    assert ctl.checkpoint_steps() == [100, 110, 120]
    # Each checkpoint holds its own step's state (the step donated it meanwhile), data
    # position and ledger: the same as the foreground run's checkpoint of that step.
    for step_no in (100, 120):
        got = _restore_copy(tmp_path, step_no, tmp_path / f"bg{step_no}")
        want = _restore_copy(ref_ctl.directory, step_no, tmp_path / f"fg{step_no}")
        chex.assert_trees_all_equal(got[0], want[0])
        assert got[1:] == want[1:] and got[1] == step_no


def _restore_copy(directory, step_no, scratch, data=None):
    """(host state, step, data index, skipped ranges) restored from checkpoint ``step_no``."""
    shutil.copytree(directory, scratch)
    for p in scratch.iterdir():
        if p.name.isdigit() and int(p.name) > step_no:
            shutil.rmtree(p)
    (scratch / "stabljax-rollback.json").unlink(missing_ok=True)
    ctl = _controller(scratch)
    data = IndexedBatches(batch_fn_factory(BAD)) if data is None else data
    state, data = ctl.restore_or_init(make_toy()[0], data)
    ctl.close()
    return _host(state), ctl.current_step, data.index, ctl.skipped_ranges


def test_a_failed_background_save_raises_at_the_next_wait_and_writes_nothing(tmp_path):
    ctl = _controller(tmp_path, background_save=True)
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    write = ctl._store.write

    def failing(step, *args, **kwargs):  # the worker's write of step 10 fails
        if step == 10:
            raise ValueError("the write of step 10 failed")
        return write(step, *args, **kwargs)

    ctl._store.write = failing
    with pytest.raises(ValueError, match="the write of step 10 failed"):
        while ctl.current_step < 30:
            state, metrics = STEP(state, next(data))
            state, data = ctl.step(state, metrics, data)
    assert ctl.current_step == 20  # raised by the next save's wait
    assert ctl.checkpoint_steps() == [0]
    assert [e.kind for e in ctl.events] == ["save"]
    ctl.close()


def test_a_background_save_keeps_the_position_and_ledger_of_its_step(tmp_path):
    """The worker writes what the loop had at the save step, though it ran on since."""
    fn = batch_fn_factory()
    ctl = _controller(tmp_path, background_save=True)
    state, data = ctl.restore_or_init(STATE0, _grain_map(fn))
    gate, entered = threading.Event(), threading.Event()
    write = ctl._store.write

    def held(*args, **kwargs):
        entered.set()
        assert gate.wait(60)
        return write(*args, **kwargs)

    ctl._store.write = held
    while ctl.current_step < 15:  # the step-10 save waits in the worker meanwhile
        state, metrics = STEP(state, next(data))
        state, data = ctl.step(state, metrics, data)
    assert entered.wait(60)
    gate.set()
    ctl._store.write = write
    assert ctl.checkpoint_steps() == [0, 10]
    ctl.close()
    got = _restore_copy(tmp_path, 10, tmp_path / "copy", _grain_map(fn))
    assert got[1:] == (10, 10, [])
    grain_file = tmp_path / "10" / "data" / "process_0-of-1.json"
    assert json.loads(grain_file.read_text()) == {"next_index": 10}


def test_background_save_needs_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="background_save=True needs a single process, got 2"):
        RollbackController(tmp_path, background_save=True)


def test_a_users_numbered_folder_is_left_in_place_through_retention_and_rollback(tmp_path):
    _run(tmp_path, 30, batch_fn_factory(BAD))  # checkpoints 10, 20, 30
    user = tmp_path / "5"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.warns(RuntimeWarning, match="named like a checkpoint step"):
        ctl, state, data = _run(tmp_path, 120, batch_fn_factory(BAD))
    assert ctl.rollbacks >= 1 and int(state.step) == 120
    assert (user / "notes.txt").read_text() == "mine"
    assert 5 not in ctl.checkpoint_steps()
    assert not (tmp_path / "stabljax-corrupt").exists()


def test_a_folder_of_someone_elses_files_is_refused_and_nothing_moves(tmp_path):
    (tmp_path / "2024").mkdir()
    (tmp_path / "2024" / "photo.jpg").write_bytes(b"\xff\xd8")
    # Refused at restore_or_init, before anything is written (no checkpoint 0 either).
    with pytest.raises(RuntimeError, match=r"holds no stabljax run.*\(2024\).*nothing was moved"):
        _run(tmp_path, 10, batch_fn_factory())
    assert (tmp_path / "2024" / "photo.jpg").read_bytes() == b"\xff\xd8"
    assert not (tmp_path / "stabljax-corrupt").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["2024"]
