"""Two real JAX processes on localhost: the same decisions everywhere, identical states.

Each process runs tests/ctl_worker.py with ``jax.distributed.initialize`` and gloo CPU
collectives, 2 devices each (4 in all), training the toy regression data parallel under
one RollbackController directory. Only process 1's half of batch 35 is poisoned; the
global loss spikes, and both processes must roll back at the same step to the same
checkpoint and end with bit-identical parameters.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from stabljax.control import read_events

WORKER = pathlib.Path(__file__).with_name("ctl_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(directory, out, *args):
    """Runs both processes of tests/ctl_worker.py to their end: ``[(returncode, stderr)]``.

    Process ``i`` writes ``{out}{i}.npz`` (and its ``.json``/``.preempted.json``).
    """
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    procs = []
    for i in range(2):
        cmd = [sys.executable, str(WORKER), "--dir", str(directory), "--out", f"{out}{i}.npz"]
        cmd += [*args, "--process-id", str(i), "--port", str(port)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    codes = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        codes.append((p.returncode, err))
    return codes


@pytest.mark.slow
def test_two_processes_roll_back_together_and_end_identical(tmp_path):
    codes = _launch(tmp_path / "ckpt", tmp_path / "p", "--steps", "80", "--bad", "35")
    for code, err in codes:
        assert code == 0, err[-3000:]

    p0, p1 = (np.load(tmp_path / f"p{i}.npz") for i in range(2))
    for k in ("w", "b", "step"):
        np.testing.assert_array_equal(p0[k], p1[k])
    assert int(p0["step"]) == 80
    i0, i1 = (json.loads((tmp_path / f"p{i}.npz.json").read_text()) for i in range(2))
    assert i0 == i1
    assert len(i0["rollbacks"]) == 1 and i0["rollbacks"][0]["restored"] == 20
    assert i0["ranges"] == [[20, 37]]
    # The primary host alone wrote the event log: one line per event, not two.
    kinds = [e.kind for e in read_events(tmp_path / "ckpt" / "events.jsonl")]
    assert kinds.count("rollback") == 1 and kinds.count("spike") == 1
    assert np.isfinite(p0["w"]).all()


def _launch_fsdp(tmp_path, name, steps, *, bad="35", **flags):
    args = ["--fsdp", "--steps", str(steps), "--bad", bad]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return _launch(tmp_path / "ckpt", tmp_path / name, *args)


def _preempted(tmp_path, name):
    return [json.loads((tmp_path / f"{name}{i}.npz.preempted.json").read_text()) for i in (0, 1)]


@pytest.mark.slow
def test_fsdp_across_processes_sigkill_and_sigterm_after_a_restart_and_a_rollback(tmp_path):
    """Params and Adam moments split over 2 processes x 2 devices; every interruption
    stops both processes at the same step, and the end is the uninterrupted run's, bit
    for bit."""
    codes = _launch_fsdp(tmp_path / "ref", "r", 60)
    assert all(c == 0 for c, _ in codes), codes[0][1][-3000:] + codes[1][1][-3000:]

    # SIGKILL both processes at step 25 (the save of step 20 is on disk).
    codes = _launch_fsdp(tmp_path, "k", 60, kill_at_step=25)
    assert [c for c, _ in codes] == [-signal.SIGKILL] * 2, codes[0][1][-3000:]
    # After the restart (resumed at 20): SIGTERM right after the save of step 30.
    codes = _launch_fsdp(tmp_path, "a", 60, term_at=30)
    assert all(c == 0 for c, _ in codes), codes[0][1][-3000:] + codes[1][1][-3000:]
    after_restart = _preempted(tmp_path, "a")
    assert after_restart[0] == after_restart[1]
    assert after_restart[0]["saved"] and 30 < after_restart[0]["step"] <= 32, after_restart
    # The next launch trains past batch 35, rolls back to 20, and is preempted right after
    # saving step 30 again.
    codes = _launch_fsdp(tmp_path, "b", 60, term_at=30, term_rollbacks=1)
    assert all(c == 0 for c, _ in codes), codes[0][1][-3000:] + codes[1][1][-3000:]
    after_rollback = _preempted(tmp_path, "b")
    assert after_rollback[0] == after_rollback[1]
    assert after_rollback[0]["rollbacks"] == 1
    assert after_rollback[0]["saved"] and 30 < after_rollback[0]["step"] <= 32, after_rollback
    codes = _launch_fsdp(tmp_path, "e", 60)
    assert all(c == 0 for c, _ in codes), codes[0][1][-3000:] + codes[1][1][-3000:]

    ref, end = np.load(tmp_path / "ref" / "r0.npz"), np.load(tmp_path / "e0.npz")
    for k in ("w", "b", "step"):
        np.testing.assert_array_equal(end[k], ref[k])
        np.testing.assert_array_equal(np.load(tmp_path / "e1.npz")[k], ref[k])
    assert int(end["step"]) == 60
    ledger = json.loads((tmp_path / "e0.npz.json").read_text())
    assert ledger == json.loads((tmp_path / "ref" / "r0.npz.json").read_text())
    assert ledger["rollbacks"] == 1
    events = list(read_events(tmp_path / "ckpt" / "events.jsonl"))
    preempted = [e.step for e in events if e.kind == "preempted"]
    assert preempted == [after_restart[0]["step"], after_rollback[0]["step"]]
