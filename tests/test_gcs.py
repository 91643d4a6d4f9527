"""A gs:// run directory on fake-gcs-server (``tests/gcs.py``): Orbax, the controller, the
report, and the bucket requests a step makes."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import chex
import gcs
import gcsfs
import numpy as np
import orbax.checkpoint as ocp
import pytest
import toy
from etils import epath
from gcs import BUCKET
from helpers import host

from stabljax.control import IndexedBatches, JsonlMetricsWriter, read_events
from stabljax.control.checkpoint import fsutil
from stabljax.report import load_run, render, write_report


def test_orbax_saves_and_restores_on_the_emulator(gcs_emulator):
    mark = gcs_emulator.mark()
    directory = epath.Path("gs://bkt/orbax-check")
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(directory, options=options) as mgr:
        for s in range(3):
            mgr.save(s, args=ocp.args.StandardSave({"w": np.arange(4.0) + s}))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
        got = mgr.restore(2, args=ocp.args.StandardRestore({"w": np.zeros(4)}))
    np.testing.assert_array_equal(got["w"], np.arange(4.0) + 2)
    requests = gcs_emulator.requests(mark)
    assert any(r.startswith("POST /upload/storage/v1/b/bkt/o") for r in requests), requests[:20]


# --------------------------------------------------------------- the controller on gs://


def _empty_cwd(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty working directory: whatever lands on the local disk shows up in it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def _objects(prefix: str) -> list[str]:
    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    return sorted(fs.find(prefix))


def test_a_gs_run_trains_rolls_back_resumes_bit_exact_and_reads_back(
    gcs_emulator, reference, tmp_path, monkeypatch
):
    cwd = _empty_cwd(tmp_path, monkeypatch)
    run = f"gs://{BUCKET}/ctl-run"
    batch_fn = toy.batch_fn_factory(toy.BAD)
    first, state, _ = toy.run_toy(run, 60, batch_fn)  # the rollback for 35, 36 in here
    assert first.rollbacks == 1 and str(first.directory) == run
    ctl, state, data = toy.run_toy(run, 120, batch_fn, state=state)  # resumes, 80 ahead
    ref_ctl, ref_state, ref_data = reference
    chex.assert_trees_all_equal(host(state), host(ref_state))
    assert ctl.skipped_ranges == ref_ctl.skipped_ranges and data.index == ref_data.index
    assert ctl.rollbacks == ref_ctl.rollbacks == 2
    events = read_events(f"{run}/events.jsonl")
    kinds = [e.kind for e in events]
    assert kinds.count("rollback") == 2 and kinds.count("skip") == 2
    assert [e.details["range"] for e in events if e.kind == "skip"] == [
        list(r) for r in ref_ctl.skipped_ranges
    ]
    # Every event the controllers held in memory is in the bucket, in order (both runs).
    assert toy.comparable(events) == toy.comparable([*first.events, *ctl.events])
    report = load_run(run)
    assert report.ledger["skipped_ranges"] == [list(r) for r in ref_ctl.skipped_ranges]
    assert "rollback" in render(report)
    assert str(write_report(run)) == f"{run}/report.html"  # python -m stabljax.report gs://...
    names = _objects(f"{BUCKET}/ctl-run")
    assert any(n.endswith("/stabljax-rollback.json") for n in names)
    assert f"{BUCKET}/ctl-run/report.html" in names
    assert not any(n.endswith("stabljax.lock") for n in names)  # released by close()
    assert list(cwd.iterdir()) == []  # nothing on the local disk, no "gs:" folder


def test_a_missing_bucket_is_refused_before_training_naming_it(gcs_emulator, tmp_path, monkeypatch):
    cwd = _empty_cwd(tmp_path, monkeypatch)
    with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket'"):
        toy.toy_controller("gs://no-such-bucket/run1")
    assert list(cwd.iterdir()) == []


def test_a_second_job_is_refused_naming_the_holder_and_a_stale_lock_can_be_taken_over(
    gcs_emulator,
):
    run = f"gs://{BUCKET}/locked-run"
    first = toy.toy_controller(run)
    with pytest.raises(RuntimeError, match=r"in use .*held by pid \d+ on .*gcloud storage rm"):
        toy.toy_controller(run)
    # A killed job leaves its lock behind (nothing releases it); the operator deletes it.
    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    first._lock._token = None  # what a SIGKILL does: the holder is gone, the object stays
    assert fs.exists(f"{BUCKET}/locked-run/stabljax.lock")
    with pytest.raises(RuntimeError, match="held by"):
        toy.toy_controller(run)
    fs.rm_file(f"{BUCKET}/locked-run/stabljax.lock")
    second = toy.toy_controller(run)
    second.close()
    first.close()
    assert not fs.exists(f"{BUCKET}/locked-run/stabljax.lock")


def test_steps_that_neither_save_nor_flush_make_no_bucket_request(gcs_emulator):
    state, train_step = toy.toy_problem()
    batch_fn = toy.batch_fn_factory(())
    run = f"gs://{BUCKET}/quiet-run"
    ctl = toy.toy_controller(run, save_every=50, async_save=False)
    metrics_log = JsonlMetricsWriter(f"{run}/metrics.jsonl")
    state, data = ctl.restore_or_init(state, IndexedBatches(batch_fn))
    counts = []
    for _ in range(20):  # steps 1..20: no save is due, no event is written
        mark = gcs_emulator.mark()
        state, metrics = train_step(state, next(data))
        state, data = ctl.step(state, metrics, data)
        metrics_log(ctl.current_step, {"loss": metrics["loss"]})
        counts.append(len(gcs_emulator.requests(mark)))
    assert counts == [0] * 20
    mark = gcs_emulator.mark()
    metrics_log.close()  # a flush: one new object
    assert [r.split("?")[0] for r in gcs_emulator.requests(mark)].count(
        "POST /upload/storage/v1/b/bkt/o"
    ) >= 1
    mark = gcs_emulator.mark()
    state, data = ctl.finish(state, data)  # a save: requests
    assert len(gcs_emulator.requests(mark)) > 0
    ctl.close()
    rows = load_run(run).rows
    assert [r["step"] for r in rows] == list(range(1, 21))


def test_an_object_store_log_keeps_what_was_flushed_through_a_sigkill(gcs_emulator, tmp_path):
    path = f"gs://{BUCKET}/killed/events.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal
        from stabljax.control import Event, EventLog
        log = EventLog({path!r})
        log.append(Event("spike", 3))
        log.append(Event("save", 10))  # a save flushes the buffer
        log.append(Event("spike", 12))  # the unflushed tail
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    root = str(pathlib.Path(__file__).parent.parent)  # this checkout's stabljax
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert [(e.kind, e.step) for e in read_events(path)] == [("spike", 3), ("save", 10)]
    assert list(tmp_path.iterdir()) == []


def test_a_gs_path_is_never_taken_for_a_local_one():
    assert fsutil.is_remote("gs://b/r") and not fsutil.is_remote("gs:/b/r")
    assert str(fsutil.run_path("gs://b/r")) == "gs://b/r"
    assert fsutil.run_path("run") == pathlib.Path.cwd() / "run"


# ------------------------------------------------------------ a pod with no shared disk

WORKER = pathlib.Path(__file__).with_name("ctl_worker.py")


def _launch_pod(tmp_path, run: str, name: str, *args: str) -> list[tuple[int, str]]:
    """Both processes of ``ctl_worker.py --fsdp`` on the run directory ``run``, each with
    its own local temp directory as cwd (no disk shared): ``[(returncode, stderr)]``."""
    port = gcs._free_port()
    root = str(pathlib.Path(__file__).parent.parent)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    procs, logs = [], tmp_path / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        host = tmp_path / f"host{i}"
        host.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(WORKER), "--fsdp", "--dir", run, "--out", f"{name}.npz"]
        cmd += ["--steps", "60", "--bad", "35", "--process-id", str(i), "--port", str(port)]
        procs.append(
            subprocess.Popen(
                [*cmd, *args],
                cwd=host,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(logs / f"{name}{i}.err", "w"),  # noqa: SIM115 - the child's
            )
        )
    codes = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=500)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        codes.append((p.returncode, (logs / f"{name}{i}.err").read_text()))
    return codes


def _ok(codes) -> None:
    assert all(c == 0 for c, _ in codes), codes[0][1][-3000:] + codes[1][1][-3000:]


@pytest.mark.slow
def test_two_processes_share_a_gs_run_directory_and_no_disk(gcs_emulator, tmp_path):
    """Params and Adam moments split over 2 processes x 2 devices, each process with its
    own local directory; one gs:// run: the same decisions, a SIGKILL of both and a
    SIGTERM of one, and the end is the uninterrupted run's, bit for bit."""
    _ok(_launch_pod(tmp_path / "ref", f"gs://{BUCKET}/pod-ref", "r"))
    run = f"gs://{BUCKET}/pod"
    codes = _launch_pod(tmp_path, run, "k", "--kill-at-step", "25")
    assert [c for c, _ in codes] == [-signal.SIGKILL] * 2, codes[0][1][-3000:]
    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    # The killed job's lock stays behind on the bucket; the operator takes it over.
    assert "pid" in fs.cat_file(f"{BUCKET}/pod/stabljax.lock").decode()
    fs.rm_file(f"{BUCKET}/pod/stabljax.lock")
    codes = _launch_pod(tmp_path, run, "a", "--term-at", "30")  # SIGTERM to process 0
    _ok(codes)
    host = [tmp_path / f"host{i}" for i in (0, 1)]
    stopped = [json.loads((h / "a.npz.preempted.json").read_text()) for h in host]
    assert stopped[0] == stopped[1] and stopped[0]["saved"] and 30 < stopped[0]["step"] <= 32
    _ok(_launch_pod(tmp_path, run, "e"))
    for i in (0, 1):
        ref = np.load(tmp_path / "ref" / f"host{i}" / "r.npz")
        end = np.load(tmp_path / f"host{i}" / "e.npz")
        for k in ("w", "b", "step"):
            np.testing.assert_array_equal(end[k], ref[k])
    ledger = json.loads((tmp_path / "host0" / "e.npz.json").read_text())
    assert ledger == json.loads((tmp_path / "ref" / "host0" / "r.npz.json").read_text())
    assert ledger["rollbacks"] == 1
    # Process 0 alone wrote the controller's objects: each event once, and no lock of 1's.
    kinds = [e.kind for e in read_events(f"{run}/events.jsonl")]
    assert kinds.count("rollback") == 1 and kinds.count("preempted") == 1, kinds
    assert not fs.exists(f"{BUCKET}/pod/stabljax.lock.1")
    for i in (0, 1):  # each host's own directory holds only its outputs
        assert sorted(p.name for p in (tmp_path / f"host{i}").iterdir()) == sorted(
            ["a.npz.preempted.json", "e.npz", "e.npz.json"]
        )
