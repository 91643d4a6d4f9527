"""examples/multihost.py: its ``__main__`` starts 2 local JAX processes that train under
one run directory, roll back together and agree (docs/guides/tpu.md)."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def test_the_multihost_example_runs_two_processes_that_roll_back_together(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "examples" / "multihost.py"), "--dir", str(tmp_path / "run")]
    proc = subprocess.run(
        [*cmd, "--steps", "40"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = re.findall(r"process (\d) \(exit 0\): (.*)", proc.stdout)
    assert [i for i, _ in lines] == ["0", "1"] and lines[0][1] == lines[1][1], proc.stdout
    found = re.fullmatch(r"step=40 w=(\S+) skipped=(.*) rollbacks=1", lines[0][1])
    assert found, lines
    ranges = ast.literal_eval(found[2])
    assert len(ranges) == 1 and ranges[0][0] <= 25 < ranges[0][1]  # the poisoned batch
    assert abs(float(found[1]) - 2.0) < 1e-2  # trained to the true slope after the skip
    assert "the processes agree: True" in proc.stdout
