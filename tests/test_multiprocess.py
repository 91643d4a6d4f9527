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


@pytest.mark.slow
def test_two_processes_roll_back_together_and_end_identical(tmp_path):
    port = _free_port()
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    procs = []
    for i in range(2):
        cmd = [sys.executable, str(WORKER), "--dir", str(tmp_path / "ckpt")]
        cmd += ["--out", str(tmp_path / f"p{i}.npz"), "--steps", "80", "--bad", "35"]
        cmd += ["--process-id", str(i), "--port", str(port)]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        errs.append(err)
    for p, err in zip(procs, errs, strict=True):
        assert p.returncode == 0, err[-3000:]

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
