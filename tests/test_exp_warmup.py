"""``python -m experiments.warmup --quick``: what it writes and what it must show."""

import math

from experiment_runs import run_quick

FIGURES = ("loss.png", "bursts_vs_lr.png")


def test_warmup(tmp_path):
    res, cfg, s = run_quick("warmup", tmp_path, figures=FIGURES)
    assert len(res["rows"]) == len(cfg["warmups"]) * len(cfg["lrs"]) * len(cfg["seeds"])
    assert set(s["remedies"]) == {f"warmup {w:g}" for w in cfg["warmups"][1:]}
    for r in res["rows"]:
        assert r["bursts"] >= 0 and math.isfinite(r["init_loss"])
    # Warmup bounds the first updates: the mechanism moves even in 6 steps.
    assert all(r["mechanism_moved"] for r in s["remedies"].values())
