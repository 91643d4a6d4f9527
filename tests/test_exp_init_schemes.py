"""``python -m experiments.init_schemes --quick``: what it writes and what it must show."""

import math

from experiment_runs import run_quick

FIGURES = ("init.png",)


def test_init_schemes(tmp_path):
    res, cfg, _ = run_quick("init_schemes", tmp_path, figures=FIGURES)
    assert len(res["rows"]) == len(cfg["schemes"]) * len(cfg["lrs"]) * len(cfg["seeds"])
    for r in res["rows"]:
        assert isinstance(r["check_ok"], bool) and math.isfinite(r["growth_init"])
    assert set(res["losses"]) == {f"{sc}@{lr:g}" for sc in cfg["schemes"] for lr in cfg["lrs"]}
