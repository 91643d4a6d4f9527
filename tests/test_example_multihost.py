"""examples/multihost.py as a user runs it: 2 processes, no shared working directory."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "multihost.py"


@pytest.mark.slow
def test_the_multihost_example_rolls_back_together_and_ends_identical(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["process"] for r in results] == [0, 1]
    for r in results:
        assert r["step"] == 80  # trained to the target despite the rollback
        assert r["rollbacks"] >= 1
        (a, b), *_ = r["skipped_ranges"]
        assert a < 60 < b  # the skip starts at the poisoned window (60-67) or before it
    assert results[0] | {"process": 1} == results[1]
    assert "processes agree" in out.stdout


def test_the_multihost_example_parses_its_windows():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import multihost
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    assert multihost._indices("60-63") == [60, 61, 62, 63]
    assert multihost._indices("3,5") == [3, 5]
    assert multihost._indices("") == []
