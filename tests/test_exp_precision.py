"""``python -m experiments.precision --quick``: what it writes and what it must show."""

import pytest
from experiment_runs import run_quick

FIGURES = ("precision.png",)


@pytest.mark.slow
def test_precision(tmp_path):
    res, cfg, _ = run_quick("precision", tmp_path, figures=FIGURES)
    for r in res["rows"]:
        if r["arm"] == "fp16":
            assert r["final_loss_scale"] > 0
        if r["arm"] == "fp16-noscale":
            assert r["overflows"] == 0 and r["final_loss_scale"] == 1.0
