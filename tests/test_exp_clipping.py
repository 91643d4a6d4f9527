"""``python -m experiments.clipping --quick``: what it writes and what it must show."""

from experiment_runs import run_quick

FIGURES = ("loss.png", "bursts_vs_lr.png")


def test_clipping(tmp_path):
    res, cfg, s = run_quick("clipping", tmp_path, figures=FIGURES)
    assert len(res["rows"]) == len(cfg["arms"]) * len(cfg["lrs"]) * len(cfg["seeds"])
    for r in res["rows"]:
        assert 0 <= r["clip_rate"] <= 1
        if r["arm"] == "none":
            assert r["clip_rate"] == 0
