"""The fast tier (``fast_every``): host-RAM copies of recent states beside the persistent
checkpoints. A rollback to one equals a rollback to a persistent checkpoint at that step, reads
nothing from the bucket, and a restart (the fast tier gone) resumes from the run directory."""

from __future__ import annotations

import re

import chex
import numpy as np
import pytest
import toy
from gcs import BUCKET
from helpers import host

from stabljax.control import IndexedBatches, RollbackController

FAST = dict(save_every=30, fast_every=10)  # persistent at 0, 30, 60...; host copies every 10
# The same rollback targets from persistent checkpoints only: one every 10 steps, and as
# many kept as the fast run's window (save_every * keep = 90) so the doubling rule agrees.
PERSISTENT = dict(save_every=10, keep=9)


@pytest.fixture(scope="module")
def persistent_run(tmp_path_factory):
    """The toy with its bad batches, rolled back from persistent checkpoints only."""
    directory = tmp_path_factory.mktemp("persistent")
    return toy.run_toy(directory, 120, toy.batch_fn_factory(toy.BAD), **PERSISTENT)


def _restored(ctl) -> list[int]:
    return [e.details["restored_step"] for e in ctl.events if e.kind == "rollback"]


def _assert_same_run(state, ctl_ranges, index, persistent_run) -> None:
    ref_ctl, ref_state, ref_data = persistent_run
    chex.assert_trees_all_equal(host(state), host(ref_state))  # bit for bit
    assert ctl_ranges == ref_ctl.skipped_ranges and index == ref_data.index


def test_a_fast_tier_rollback_is_a_rollback_to_a_checkpoint_at_that_step(tmp_path, persistent_run):
    ctl, state, data = toy.run_toy(tmp_path, 120, toy.batch_fn_factory(toy.BAD), **FAST)
    ref_ctl = persistent_run[0]
    # Both rollbacks went to states that only the fast tier held (not on the 30-step grid).
    assert _restored(ctl) == _restored(ref_ctl) and all(s % 30 for s in _restored(ctl))
    _assert_same_run(state, ctl.skipped_ranges, data.index, persistent_run)
    assert ctl.rollbacks == ref_ctl.rollbacks == 2
    assert all(s % 30 == 0 for s in ctl.checkpoint_steps())  # nothing fast on disk


def test_without_the_fast_tier_the_targets_are_the_persistent_checkpoints(tmp_path):
    """The test above can fail: with save_every=30 alone the rollbacks go elsewhere."""
    ctl, _, _ = toy.run_toy(tmp_path, 120, toy.batch_fn_factory(toy.BAD), save_every=30)
    assert all(s % 30 == 0 for s in _restored(ctl)) and ctl.rollbacks >= 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "10"])
def test_fast_every_is_checked(tmp_path, bad):
    with pytest.raises(ValueError, match="fast_every must be an int >= 1 or None"):
        RollbackController(tmp_path, fast_every=bad)


def test_fast_every_is_refused_on_several_processes():
    from stabljax.control.decide.policy import check_config

    with pytest.raises(ValueError, match=r"fast_every=10 needs a single process, got 2"):
        check_config(save_every=10, keep=3, rollback_margin=10, fast_every=10, processes=2)


@pytest.mark.parametrize(
    "kill",
    [
        # SIGKILL right after the first rollback (to fast copy 20; the record written, the
        # persistent checkpoint 30 of the abandoned branch not deleted yet, as a fast-tier
        # rollback leaves it to the next save): the restart deletes it, restores 0 and takes
        # the record.
        ["--kill-at-rollback", "1"],
        # SIGKILL at step 55, the fast tier holding 40 and 50: the restart resumes from 30.
        ["--kill-at-step", "55"],
    ],
)
def test_a_sigkill_loses_the_fast_tier_and_the_restart_resumes_from_the_directory(
    tmp_path, persistent_run, kill
):
    out = tmp_path / "final.npz"
    fast = ["--save-every", "30", "--fast-every", "10", "--sync"]
    proc = toy.start_ctl_worker(tmp_path / "run", out, *fast, *kill)
    proc.communicate(timeout=300)
    assert proc.returncode == -9 and not out.exists()
    before = toy.event_kinds(tmp_path / "run")
    # Either way checkpoint 30 is on disk: after the rollback, the abandoned branch's.
    assert (tmp_path / "run" / "30" / "_CHECKPOINT_METADATA").is_file()
    proc = toy.start_ctl_worker(tmp_path / "run", out, *fast)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    from stabljax.control import read_events

    restores = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e.kind == "restore"]
    resumed = [e for e in restores if e.details.get("reason", "").startswith("resume")]
    assert len(resumed) == 1 and resumed[0].step % 30 == 0  # a persistent checkpoint
    if kill[0] == "--kill-at-rollback":
        assert before.count("rollback") == 1
        assert resumed[0].step == 0 and "interrupted rollback" in resumed[0].details["reason"]
    else:
        assert resumed[0].step == 30
    got = np.load(out)
    _, ref_state, _ = persistent_run
    np.testing.assert_array_equal(got["w"], host(ref_state.params)["w"])
    np.testing.assert_array_equal(got["b"], host(ref_state.params)["b"])
    assert int(got["step"]) == 120


# ------------------------------------------------------------------ the bucket's request log


def _reads(requests: list[str]) -> list[str]:
    """The requests that read a checkpoint: an object's content (``alt=media``), or an
    object of a step's items (state, meta, data). Listings and the commit-marker probes of
    :meth:`~stabljax.control.checkpoint.store.CheckpointStore.steps` are not reads."""
    item = re.compile(r"%2F\d+%2F(state|meta|data)")
    return [r for r in requests if r.startswith("GET") and ("alt=media" in r or item.search(r))]


def _rollback_requests(emulator, run: str, **kw) -> tuple[RollbackController, list[str]]:
    """Trains the toy on ``gs://BUCKET/run`` by hand; the requests of the call that rolled
    back (the first one)."""
    state, train_step = toy.toy_problem()
    ctl = toy.toy_controller(f"gs://{BUCKET}/{run}", async_save=False, **kw)
    state, data = ctl.restore_or_init(state, IndexedBatches(toy.batch_fn_factory(toy.BAD)))
    while ctl.rollbacks == 0:
        state, metrics = train_step(state, next(data))
        mark = emulator.mark()
        state, data = ctl.step(state, metrics, data)
    requests = emulator.requests(mark)
    ctl.finish(state, data)  # a fast-tier target is not in the bucket: this saves it there
    assert ctl.checkpoint_steps()[-1] == 20
    ctl.close()
    return ctl, requests


@pytest.mark.filterwarnings("ignore:rollback at step:RuntimeWarning")  # no target declared
def test_a_fast_tier_rollback_reads_nothing_from_the_bucket(gcs_emulator):
    ctl, requests = _rollback_requests(gcs_emulator, "fast-rollback", **FAST)
    assert _restored(ctl) == [20]
    # No read, no listing, no delete: two uploads, the rollback record and the rollback's
    # events. The persistent checkpoint 30 of the abandoned branch is deleted by the next
    # save (finish saved 20, and 30 is gone: _rollback_requests checks it).
    assert [r.split(" ")[0] for r in requests] == ["POST", "POST"], requests
    assert all(r.startswith("POST /upload/storage/v1/b/bkt/o?") for r in requests)
    # The same rollback from the bucket (a checkpoint at 20 there) reads it.
    ctl, requests = _rollback_requests(gcs_emulator, "bucket-rollback", **PERSISTENT)
    assert _restored(ctl) == [20]
    assert any("bucket-rollback%2F20%2Fstate" in r for r in _reads(requests)), requests


def test_on_the_bucket_a_sigkill_after_a_fast_rollback_resumes_from_the_bucket(
    gcs_emulator, tmp_path, persistent_run
):
    """Item 4 on its users' ground: the run directory is ``gs://``, each process has its own
    empty cwd. SIGKILL right after the rollback to fast copy 20 (persistent 30 of the
    abandoned branch still in the bucket): the restart finishes the rollback from the
    record in the bucket, resumes from the bucket's checkpoint 0 and ends bit-identical."""
    import gcsfs

    from stabljax.control import read_events

    run, out = f"gs://{BUCKET}/fast-kill", tmp_path / "final.npz"
    fast = ["--save-every", "30", "--fast-every", "10", "--sync"]
    proc = toy.start_ctl_worker(run, out, *fast, "--kill-at-rollback", "1")
    proc.communicate(timeout=300)
    assert proc.returncode == -9 and not out.exists()
    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    assert fs.exists(f"{BUCKET}/fast-kill/30/commit_success.txt")  # abandoned, not deleted
    fs.rm(f"{BUCKET}/fast-kill/stabljax.lock")  # the operator takes over the dead job's lock
    proc = toy.start_ctl_worker(run, out, *fast)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    restores = [e for e in read_events(f"{run}/events.jsonl") if e.kind == "restore"]
    resumed = [e for e in restores if e.details.get("reason", "").startswith("resume")]
    assert len(resumed) == 1 and resumed[0].step == 0
    assert "interrupted rollback" in resumed[0].details["reason"]
    got, (_, ref_state, _) = np.load(out), persistent_run
    np.testing.assert_array_equal(got["w"], host(ref_state.params)["w"])
    np.testing.assert_array_equal(got["b"], host(ref_state.params)["b"])
    assert not any(p.name != "final.npz" and "json" not in p.name for p in tmp_path.iterdir())
