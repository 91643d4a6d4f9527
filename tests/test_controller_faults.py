"""RollbackController against an operator's world: double launch, preemption, disk full,
bad directories, changed state or data on resume, the end of the data, save health.

Uses the toy problem of tests/toy.py and conftest.py's ``reference`` run.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings

import chex
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest
from toy import (
    BAD,
    CTL_WORKER,
    assert_resumed_exactly,
    batch_fn_factory,
    make_toy,
    toy_detectors,
    toy_problem,
)
from toy import event_kinds as _kinds
from toy import run_toy as _run
from toy import start_ctl_worker as _worker
from toy import toy_controller as _controller

from stabljax.control import (
    CheckpointMismatch,
    CheckpointSaveError,
    Detection,
    IndexedBatches,
    PlainIterator,
    RollbackController,
    TrainingDiverged,
    read_events,
)
from stabljax.optim.guards.skips import skip_nonfinite, skip_spikes

STATE0, STEP = toy_problem()


def _saved_steps(directory):
    return [
        e.step for e in read_events(pathlib.Path(directory) / "events.jsonl") if e.kind == "save"
    ]


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kw, names",
    [
        (
            dict(save_every=10, keep=3, rollback_margin=100),
            ("rollback_margin", "save_every", "keep"),
        ),
        (dict(save_every=100, keep=1, rollback_margin=100), ("rollback_margin", "keep")),
        (
            dict(save_every=10, keep=3, rollback_margin=0, preemption_signals=[signal.SIGKILL]),
            ("preemption_signals", "SIGKILL"),
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused_at_construction(tmp_path, kw, names):
    with pytest.raises(ValueError) as info:
        RollbackController(tmp_path, **kw)
    for name in names:
        assert name in str(info.value)
    # Refused before the directory is touched: nothing written, nothing locked, so a
    # corrected controller opens it (a held lock would raise here).
    assert list(tmp_path.iterdir()) == []
    RollbackController(tmp_path).close()


def test_an_unknown_detection_action_is_an_error_where_it_appears(tmp_path):
    class Odd:
        name, keys, active_onset = "odd", ("loss",), None

        def update(self, step, metrics):
            return Detection("spike", step, step, "explode", "odd", 1.0) if step == 15 else None

        def get_state(self):
            return {}

        def set_state(self, state):
            pass

    with pytest.raises(ValueError, match="'odd'.*'explode'"):
        _run(tmp_path, 30, batch_fn_factory(), detectors=[Odd()])


def test_a_detection_with_action_raise_raises_training_diverged(tmp_path):
    class Floor:
        name, keys, active_onset = "loss_scale", ("loss",), None

        def update(self, step, metrics):
            if step == 25:
                return Detection("divergence", step, 20, "raise", "loss scale stuck at 1", 1.0)
            return None

        def get_state(self):
            return {}

        def set_state(self, state):
            pass

    with pytest.raises(TrainingDiverged, match="loss scale stuck at 1") as info:
        _run(tmp_path, 60, batch_fn_factory(), detectors=[Floor(), *toy_detectors()])
    assert "step 25" in str(info.value)
    assert _kinds(tmp_path)[-1] == "diverged"
    # The directory was released on the way out: a restart can take it.
    RollbackController(tmp_path, save_every=10, rollback_margin=10).close()


# ---------------------------------------------------------------------------- history


def test_events_never_mix_losses_of_an_abandoned_branch(tmp_path):
    # The second spike comes 9 steps after the first rollback: without trimming, its
    # "losses before" would interleave steps 20..29 of both branches.
    ctl, _, _ = _run(tmp_path, 60, batch_fn_factory(bad=[35, 45]))
    rollbacks = [e for e in ctl.events if e.kind == "rollback"]
    assert len(rollbacks) == 2
    for e in rollbacks:
        steps = [s for s, _, _ in e.details["losses"]]
        assert steps == sorted(set(steps)), steps
        assert steps[-1] <= e.step
    second = rollbacks[1].details["losses"]
    assert all(isinstance(v, float) and v < 1e3 for _, v, _ in second[:-2])


# --------------------------------------------------------------------- double launch


def test_a_second_controller_on_a_directory_is_refused_in_the_same_process(tmp_path):
    first = _controller(tmp_path)
    with pytest.raises(RuntimeError, match="already in use") as info:
        _controller(tmp_path)
    assert str(tmp_path) in str(info.value) and str(os.getpid()) in str(info.value)
    first.close()
    _controller(tmp_path).close()  # released by close()


def test_run_and_the_context_manager_release_the_directory(tmp_path):
    ctl = _controller(tmp_path / "a")
    ctl.run(STEP, STATE0, IndexedBatches(batch_fn_factory()), 20, progress=False)
    _controller(tmp_path / "a").close()  # run() closed it on its way out
    with _controller(tmp_path / "b") as ctl:
        ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    _controller(tmp_path / "b").close()
    # A closed controller's run() reopens and resumes from its directory.
    state, data = ctl.run(STEP, STATE0, IndexedBatches(batch_fn_factory()), 30, progress=False)
    assert int(state.step) == 30 and ctl.last_run.reached


_HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from stabljax.control import RollbackController
ctl = RollbackController({d!r})
print("held", flush=True)
time.sleep(600)
"""


def test_a_second_job_on_a_directory_is_refused_and_a_crashed_one_leaves_no_lock(tmp_path):
    root = str(pathlib.Path(__file__).resolve().parents[1])
    code = _HOLD.format(root=root, d=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="already in use") as info:
            RollbackController(tmp_path)
        assert f"pid {proc.pid}" in str(info.value)
    finally:
        proc.kill()
        proc.wait()
    RollbackController(tmp_path).close()  # SIGKILL released it


# -------------------------------------------------------------------------- saves


def _resume_here(directory, reference, extra=2_000_000):
    """Finishes the job in this process (quicker than a new interpreter)."""
    state0, step = make_toy(extra=extra)
    with _controller(directory) as ctl:
        state, data = ctl.run(
            step, state0, IndexedBatches(batch_fn_factory(BAD)), 120, progress=False
        )
    chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(reference[1].params))
    assert ctl.skipped_ranges == reference[0].skipped_ranges
    return ctl


def test_a_crash_right_after_an_async_save_never_claims_it(tmp_path, reference):
    d = tmp_path / "ckpt"
    # Step 40 (after the first rollback) is a save; 8 MB of ballast keeps it in flight.
    proc = _worker(d, tmp_path / "o.npz", "--kill-at-step", "40", "--extra", "2000000")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    on_disk = {int(p.name) for p in d.iterdir() if p.name.isdigit()}
    claimed = _saved_steps(d)
    # Every save the log claims was complete (the newest three are still there).
    assert set(claimed[-3:]) <= on_disk, (claimed, on_disk)
    ctl = _resume_here(d, reference)
    restore = next(e for e in ctl.events if e.kind == "restore")
    assert restore.step in (30, 40)


def test_a_loop_that_dies_without_close_finishes_its_save_and_resumes_there(tmp_path, reference):
    d = tmp_path / "ckpt"
    # Step 20 is a save, 8 MB of ballast keeps it in flight when the loop raises; nobody
    # calls close(), so only the exit hook can finish it.
    proc = _worker(d, tmp_path / "o.npz", "--raise-at-step", "20", "--extra", "2000000")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "the loop dies" in err, err[-2000:]
    assert "Exception ignored" not in err and "cannot schedule new futures" not in err, err
    assert 20 in {int(p.name) for p in d.iterdir() if p.name.isdigit()}
    ctl = _resume_here(d, reference)
    assert next(e for e in ctl.events if e.kind == "restore").step == 20


def test_stale_probe_files_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now
    stale = tmp_path / f".stabljax-probe-{dead.pid}-0"
    live = tmp_path / f".stabljax-probe-{os.getppid()}-1"  # a live process: left alone
    stale.write_text("ok")
    live.write_text("ok")
    _controller(tmp_path).close()
    assert not stale.exists() and live.exists()


def test_nothing_is_printed_at_exit_for_a_controller_never_closed(tmp_path):
    script = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from toy import batch_fn_factory, make_toy\n"
        "from stabljax.control import IndexedBatches, RollbackController\n"
        "state, step = make_toy()\n"
        "ctl = RollbackController(sys.argv[1], save_every=5, rollback_margin=1)\n"
        "state, data = ctl.restore_or_init(state, IndexedBatches(batch_fn_factory()))\n"
        "for _ in range(7):\n"
        "    state, m = step(state, next(data))\n"
        "    state, data = ctl.step(state, m, data)\n"
    )
    args = [sys.executable, "-c", script, str(tmp_path), str(CTL_WORKER.parent)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert _saved_steps(tmp_path) == [0, 5]


def test_warnings_point_at_the_callers_line(tmp_path):
    with _controller(tmp_path) as ctl:
        with pytest.warns(RuntimeWarning, match="plain iterator") as got:
            ctl.restore_or_init(STATE0, iter([batch_fn_factory()(i) for i in range(3)]))
    assert [w.filename for w in got] == [__file__]
    short = IndexedBatches(lambda i: batch_fn_factory()(i) if i < 12 else [][0])
    with _controller(tmp_path / "short") as ctl:
        with pytest.warns(RuntimeWarning, match="ran out") as got:
            ctl.run(STEP, STATE0, short, 30, progress=False)  # the caller's line
    assert {w.filename for w in got} == {__file__}


def test_a_failed_async_save_is_reported_naming_its_step_and_nothing_claims_it(
    tmp_path, monkeypatch
):
    d = tmp_path / "ckpt"
    real = ocp.CheckpointManager.wait_until_finished
    calls = {"n": 0}

    def failing(self):
        real(self)
        if self._checkpoints and self._checkpoints[-1].step == 30 and not calls["n"]:
            calls["n"] += 1
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", failing)
    with pytest.raises(CheckpointSaveError, match="checkpoint 30") as info:
        _run(d, 60, batch_fn_factory())
    assert info.value.step == 30 and info.value.errno == errno.EIO
    assert str(d) in str(info.value)
    kinds = _kinds(d)
    assert "save_failed" in kinds and 30 not in _saved_steps(d)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError], ids=["ctrl_c", "error"])
def test_an_interrupt_right_after_an_async_save_finishes_it_first(tmp_path, reference, exc):
    state0, step = make_toy(extra=2_000_000)  # 8 MB: the step-40 save is still in flight

    def interrupted(state, batch):
        if int(state.step) == 41 and ctl.rollbacks == 1:
            raise exc("stop")
        return step(state, batch)

    ctl = _controller(tmp_path)
    with pytest.raises(exc):
        ctl.run(interrupted, state0, IndexedBatches(batch_fn_factory(BAD)), 120, progress=False)
    assert _saved_steps(tmp_path)[-1] == 40 and (tmp_path / "40").is_dir()
    _controller(tmp_path).close()  # run() released the directory on its way out
    ctl2 = _resume_here(tmp_path, reference)
    assert next(e for e in ctl2.events if e.kind == "restore").step == 40


# ---------------------------------------------------------------------------- disk full


def _mount_tmpfs(path, size):
    path.mkdir()
    try:
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        )
    except OSError:
        return False
    return res.returncode == 0


def _fill_run(d, extra):
    state0, step = make_toy(extra=extra)
    return _run(d, 80, batch_fn_factory(), state=state0, step=step)


def test_disk_full_is_a_clear_error_and_a_restart_with_space_resumes(tmp_path):
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "1200k"):
        pytest.skip("cannot mount a tmpfs here (see the simulated ENOSPC test)")
    try:
        d = mnt / "ckpt"
        extra = 150_000  # ~470 kB a checkpoint (compressed): keep=3 needs room for 4
        with pytest.raises(CheckpointSaveError) as info:
            _fill_run(d, extra)
        err = info.value
        assert err.errno == errno.ENOSPC and "disk full" in str(err) and str(d) in str(err)
        assert f"checkpoint {err.step}" in str(err) and "bytes" in str(err)
        assert err.step not in _saved_steps(d)
        # The checkpoints that did commit are intact: resume on a disk with room.
        big = tmp_path / "big"
        shutil.copytree(d, big, ignore=shutil.ignore_patterns("*tmp*"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
    state0, step = make_toy(extra=extra)
    ctl = _controller(big)
    state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory()))
    assert ctl.current_step == max(_saved_steps(big)) and ctl.current_step < err.step
    state, data = ctl.run(step, state, data, 80, progress=False)
    _, ref_state, _ = _fill_run(tmp_path / "ref", extra)
    chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(ref_state.params))


def test_disk_full_simulated_names_directory_step_and_bytes(tmp_path, monkeypatch):
    real = ocp.CheckpointManager.save

    def save(self, step, *a, **k):
        if step == 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, *a, **k)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save)
    with pytest.raises(CheckpointSaveError, match="no space left") as info:
        _run(tmp_path, 40, batch_fn_factory())
    assert info.value.step == 20 and info.value.errno == errno.ENOSPC
    assert str(tmp_path) in str(info.value) and "keep + 1" in str(info.value)
    assert _saved_steps(tmp_path) == [0, 10]
    monkeypatch.undo()
    ctl, state, _ = _run(tmp_path, 40, batch_fn_factory())
    assert int(state.step) == 40 and next(e for e in ctl.events).step == 10


# --------------------------------------------------------------------- directories


def test_bad_directories_are_clear_errors_at_construction(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="cannot be created or written"):
        RollbackController(tmp_path / "file")  # a file where the directory should be
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OSError, match="cannot be created or written.*read-only"):
            RollbackController(ro)
    finally:
        ro.chmod(0o755)
    RollbackController(tmp_path / "missing" / "parent" / "ckpt").close()  # created


# ---------------------------------------------------------------------- resume checks


def _toy_with(ballast):
    state, step = make_toy()
    return state.replace(ballast=ballast), step


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda s: s.replace(ballast=jnp.zeros(3)), ["ballast", "None in the checkpoint"]),
        (lambda s: s.replace(params={**s.params, "c": jnp.zeros(2)}), ["new leaf", "'c'"]),
        (lambda s: s.replace(params={"w": s.params["w"]}), ["'b'", "gone"]),
        (
            lambda s: s.replace(params={**s.params, "w": s.params["w"].astype(jnp.bfloat16)}),
            ["'w'", "dtype float32 in the checkpoint, bfloat16 now"],
        ),
        (
            lambda s: s.replace(params={**s.params, "w": jnp.zeros((5, 1))}),
            ["'w'", "shape [4, 1] in the checkpoint, [5, 1] now"],
        ),
    ],
    ids=["none_to_array", "new_leaf", "removed_leaf", "dtype", "shape"],
)
def test_resume_with_a_changed_state_lists_the_mismatched_leaves(tmp_path, change, words):
    _run(tmp_path, 20, batch_fn_factory())
    changed = change(STATE0)
    with _controller(tmp_path) as ctl:
        with pytest.raises(CheckpointMismatch) as info:
            ctl.restore_or_init(changed, IndexedBatches(batch_fn_factory()))
    msg = str(info.value)
    for w in words:
        assert w in msg, msg
    assert "corrupt" not in msg.replace("not corruption", "")
    assert "corrupt_checkpoint" not in _kinds(tmp_path)
    assert not (tmp_path / "stabljax-corrupt").exists()


def test_a_changed_optimizer_with_the_same_leaves_is_a_mismatch_and_moves_nothing(tmp_path):
    _run(tmp_path, 20, batch_fn_factory())
    on_disk = lambda: sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())  # noqa: E731
    before = on_disk()
    chained, _ = make_toy(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05)))
    assert jax.tree.leaves(chained) and len(jax.tree.leaves(chained)) == len(
        jax.tree.leaves(STATE0)
    )
    with _controller(tmp_path) as ctl:
        with pytest.raises(CheckpointMismatch) as info:
            ctl.restore_or_init(chained, IndexedBatches(batch_fn_factory()))
    msg = str(info.value)
    assert "structure: .opt_state[1] is EmptyState in the checkpoint, tuple now" in msg, msg
    assert "corrupt_checkpoint" not in _kinds(tmp_path)
    assert not (tmp_path / "stabljax-corrupt").exists()
    assert on_disk() == before == ["0", "10", "20"]
    # The original optimizer resumes from the newest checkpoint, as if nothing happened.
    with _controller(tmp_path) as ctl:
        state, _ = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    assert int(state.step) == 20


def test_a_changed_data_config_is_refused_on_resume(tmp_path):
    fn = batch_fn_factory()
    with _controller(tmp_path) as ctl:
        ctl.run(STEP, STATE0, IndexedBatches(fn, config={"batch_size": 16}), 20, progress=False)
    with _controller(tmp_path) as ctl:
        with pytest.raises(CheckpointMismatch, match="batch_size.*16.*32"):
            ctl.restore_or_init(STATE0, IndexedBatches(fn, config={"batch_size": 32}))
    with _controller(tmp_path, data_config={"batch_size": 16}) as ctl:  # the user's own
        ctl.restore_or_init(STATE0, IndexedBatches(fn))
        assert ctl.current_step == 20


def test_a_changed_ledger_in_the_meta_item_is_caught_by_the_digest(tmp_path):
    _run(tmp_path, 30, batch_fn_factory())
    meta = tmp_path / "30" / "meta" / "metadata"
    m = json.loads(meta.read_text())
    m["rollbacks"] = 7
    meta.write_text(json.dumps(m))
    with _controller(tmp_path) as ctl:
        ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
        assert ctl.current_step == 20 and ctl.rollbacks == 0
    bad = [e for e in read_events(tmp_path / "events.jsonl") if e.kind == "corrupt_checkpoint"]
    assert [e.step for e in bad] == [30] and "digest" in bad[0].details["reason"]


# ------------------------------------------------------------------------ end of data


def test_a_finite_batch_fn_ends_the_run_as_data_exhausted(tmp_path):
    fn = batch_fn_factory()

    def finite(i):
        if i >= 45:
            raise IndexError(f"batch {i} of 45")
        return fn(i)

    with pytest.warns(RuntimeWarning, match="data ran out at step 45"):
        with _controller(tmp_path) as ctl:
            state, data = ctl.run(STEP, STATE0, IndexedBatches(finite), 100, progress=False)
    assert int(state.step) == 45 and data.index == 45
    r = ctl.last_run
    assert r.data_exhausted and not r.reached and not r.preempted and r.target == 100
    assert _kinds(tmp_path)[-2:] == ["save", "data_exhausted"]
    assert _saved_steps(tmp_path)[-1] == 45  # the final state is saved


def test_a_rollback_skip_past_the_end_of_the_data_is_data_exhausted(tmp_path):
    fn = batch_fn_factory(bad=[35])
    batches = [fn(i) for i in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "a plain iterator: skipping drains it"
        data = PlainIterator(iter(batches))
        with _controller(tmp_path, extra_skip=10) as ctl:
            state, data = ctl.run(STEP, STATE0, data, 100, progress=False)
    assert ctl.last_run.data_exhausted and not ctl.last_run.reached
    assert ctl.rollbacks == 1 and int(state.step) == 20  # the restored checkpoint
    assert "data_exhausted" in _kinds(tmp_path)


# ------------------------------------------------------------------- health gating


_GUARDED_SPIKES = make_toy(skip_spikes(optax.sgd(0.05), warmup_steps=10, watch=("loss",)))
_GUARDED_NAN = make_toy(skip_nonfinite(optax.sgd(0.05)))


@pytest.mark.parametrize(
    "toy, fn, reason",
    [
        (_GUARDED_SPIKES, batch_fn_factory(bad=range(57, 61)), "episode is open"),
        (_GUARDED_NAN, batch_fn_factory(nan=[59]), "onset 59"),
    ],
    ids=["open_episode", "nonfinite"],
)
def test_no_checkpoint_while_an_episode_is_open_or_after_a_nonfinite_loss(
    tmp_path, toy, fn, reason
):
    state0, step = toy
    ctl, state, _ = _run(tmp_path, 80, fn, state=state0, step=step)
    assert ctl.rollbacks == 0
    deferred = [e for e in ctl.events if e.kind == "save_deferred"]
    assert [e.step for e in deferred] == [60] and reason in deferred[0].details["reason"]
    saves = [e.step for e in ctl.events if e.kind == "save"]
    assert 60 not in saves and any(60 < s < 70 for s in saves), saves
    assert saves[-1] == 80 and int(state.step) == 80


# ---------------------------------------------------------------------- preemption


def test_sigterm_in_process_saves_at_the_next_boundary_and_resumes_exactly(tmp_path, reference):
    before = signal.getsignal(signal.SIGTERM)

    def step_and_signal(state, batch):
        out = STEP(state, batch)
        if int(state.step) == 47:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    with _controller(tmp_path) as ctl:
        state, data = ctl.run(
            step_and_signal, STATE0, IndexedBatches(batch_fn_factory(BAD)), 120, progress=False
        )
    assert signal.getsignal(signal.SIGTERM) is before  # restored on close
    r = ctl.last_run
    assert r.preempted and not r.reached and r.step == int(state.step) == 48
    kinds = _kinds(tmp_path)
    assert kinds[-2:] == ["save", "preempted"] and _saved_steps(tmp_path)[-1] == 48
    ctl2 = _resume_here(tmp_path, reference, extra=0)
    assert ctl2.rollbacks == reference[0].rollbacks


def _signal_at_call(k):
    """STEP, sending this process SIGTERM right after its ``k``-th call (1-based)."""
    calls = {"n": 0}

    def step(state, batch):
        calls["n"] += 1
        out = STEP(state, batch)
        if calls["n"] == k:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    return step


def _preempt_at_call_and_resume(directory, reference, k):
    with _controller(directory) as ctl:
        ctl.run(
            _signal_at_call(k), STATE0, IndexedBatches(batch_fn_factory(BAD)), 120, progress=False
        )
    assert ctl.last_run.preempted or ctl.last_run.reached
    ctl2 = _resume_here(directory, reference, extra=0)
    assert ctl2.rollbacks == reference[0].rollbacks
    return ctl


@pytest.mark.parametrize("k", [36, 81], ids=["after_batch_35", "after_batch_80"])
def test_a_signal_right_after_a_bad_batch_skips_what_the_uninterrupted_run_skips(
    tmp_path, reference, k
):
    # The k-th step trains on a bad batch. Stopping off a save boundary reads its loss
    # one step early, and the rollback it triggers must count the next batch as fed, as
    # the uninterrupted run does (batch 36 is bad too): before, the resumed run skipped
    # [20, 36), met batch 36 and rolled back once more.
    ctl = _preempt_at_call_and_resume(tmp_path, reference, k)
    kinds = _kinds(tmp_path)
    cut = kinds.index("preempted")
    assert "rollback" in kinds[cut - 3 : cut], kinds[: cut + 1]
    assert ctl.skipped_ranges == reference[0].skipped_ranges[: len(ctl.skipped_ranges)]


@pytest.mark.slow
def test_a_signal_after_any_step_resumes_exactly(tmp_path, reference):
    # Every step of the run, the rolled-back branches' included (152 calls in all).
    for k in range(1, 153):
        _preempt_at_call_and_resume(tmp_path / str(k), reference, k)
        shutil.rmtree(tmp_path / str(k))


def _sweep(tmp_path, reference, signum, n, seed):
    d, out = tmp_path / "ckpt", tmp_path / "final.npz"
    extra = ["--run", "--extra", "2000000", "--signals", "term,int"]
    proc = _worker(tmp_path / "timing", tmp_path / "t.npz", *extra)
    assert proc.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    duration = time.perf_counter() - t0
    rng = random.Random(seed)
    preempted = 0
    for _ in range(n + 3):  # a signal after the end misses: start again from scratch
        if preempted >= n:
            break
        proc = _worker(d, out, *extra)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.5) * duration)  # each resume has less left
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=300)
        marker = pathlib.Path(str(out) + ".preempted.json")
        if proc.returncode == 0 and marker.exists():
            preempted += 1
            info = json.loads(marker.read_text())
            marker.unlink()
            assert _kinds(d)[-1] == "preempted"
            if info["reached"]:  # the signal landed in the last step: saved at the target
                assert info["step"] == 120
                break
            continue
        # It had finished: rc 0 (signal during the last save) or the default handler's
        # death once close() restored it, after the final checkpoint.
        assert proc.returncode in (0, -signum), err[-2000:]
        assert max(int(p.name) for p in d.iterdir() if p.name.isdigit()) == 120, err[-2000:]
        if preempted:
            break
        shutil.rmtree(d)
    assert preempted >= 1
    proc = _worker(d, out, *extra)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert_resumed_exactly(d, out, reference)
    kinds = _kinds(d)
    assert kinds.count("preempted") == preempted
    return preempted


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_at_a_random_point_preempts_cleanly_and_resumes_exactly(
    tmp_path, reference, signum
):
    _sweep(tmp_path, reference, signum, 2, seed=int(signum))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_at_many_random_points_preempt_cleanly_and_resume_exactly(
    tmp_path, reference, signum
):
    _sweep(tmp_path, reference, signum, 8, seed=100 + int(signum))


def test_in_a_hand_written_loop_step_raises_preempted_after_saving(tmp_path):
    from stabljax.control import Preempted

    before = signal.getsignal(signal.SIGINT)
    ctl = _controller(tmp_path, preemption_signals=(signal.SIGTERM, signal.SIGINT))
    state, data = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
    with pytest.raises(Preempted) as info:
        while ctl.current_step < 100:
            state, metrics = STEP(state, next(data))
            if ctl.current_step == 13:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, asked to mean "preempt"
            state, data = ctl.step(state, metrics, data)
    err = info.value
    assert isinstance(err, SystemExit) and err.code == 0
    assert err.step == 14 and err.saved and err.signum == signal.SIGINT
    ctl.close()
    assert signal.getsignal(signal.SIGINT) is before
    assert _kinds(tmp_path)[-2:] == ["save", "preempted"] and _saved_steps(tmp_path)[-1] == 14
    with _controller(tmp_path) as ctl:
        state, data = ctl.restore_or_init(STATE0, IndexedBatches(batch_fn_factory()))
        assert ctl.current_step == 14 and data.index == 14
