"""Each example trainer runs on its own (``python -m examples.<name>``): a short run of its
``__main__`` with ``--steps 4``, in-process so the test pays for one JAX start."""

from __future__ import annotations

import re
import runpy
import sys

import pytest

EXAMPLES = ("trainer_before", "trainer_after", "trainer_handover")


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs_as_a_script(name, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", [name, "--steps", "4", "--workdir", str(workdir)])
    runpy.run_module(f"examples.{name}", run_name="__main__")
    out = capsys.readouterr().out
    m = re.search(r"^4 steps, held-out loss ([0-9.]+)$", out, re.M)
    assert m, out
    assert 0.0 < float(m.group(1)) < 6.0  # a byte-level model near ln 256 = 5.5 or below
    assert any(workdir.iterdir())  # it checkpointed where it was told


def test_example_help_lists_its_options(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["trainer_after", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("examples.trainer_after", run_name="__main__")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--steps" in out and "--workdir" in out
