"""``python -m experiments.clipping --quick``: what it writes and what it must show."""

import math

import numpy as np
from experiment_runs import run_quick

from experiments import clipping, stats

FIGURES = ("final_loss_vs_lr.png", "effects.png", "loss.png")


def _per_seed(rows, arm, lr, seeds):
    """Final loss per seed of one arm at one LR, a diverged run counted as its init loss."""
    out = []
    for sd in seeds:
        (r,) = [r for r in rows if (r["arm"], r["lr"], r["seed"]) == (arm, lr, sd)]
        out.append(r["final_loss"] if math.isfinite(r["final_loss"]) else r["init_loss"])
    return out


def test_clipping(tmp_path):
    res, cfg, s = run_quick("clipping", tmp_path, figures=FIGURES)
    rows, lrs, seeds = res["rows"], cfg["lrs"], cfg["seeds"]
    assert len(rows) == len(cfg["arms"]) * len(lrs) * len(seeds)
    assert res["primary_metric"] == clipping.PRIMARY
    assert s["primary_metric"] == clipping.PRIMARY_TEXT and s["failure_made_by_model"] is True
    for r in rows:
        assert 0 <= r["clip_rate"] <= 1
        if r["arm"] == "none":
            assert r["clip_rate"] == 0
    # The unclipped arm's best LR, recomputed from the rows.
    best = min(lrs, key=lambda lr: np.mean(_per_seed(rows, "none", lr, seeds)))
    assert s["lr_grid"]["none"]["best_lr"] == best == res["effects"]["best_lr_none"]
    assert s["lr_grid"]["none"]["spans_1e-4_to_1"]
    at = [lr for lr in lrs if best <= lr <= 10 * best]
    assert res["effects"]["compared_lrs"] == at
    # Each clipper against none, and ZClip against the fixed clip, at every compared LR.
    pairs = [(a, "none") for a in cfg["arms"] if a != "none"] + [("zclip", "clip_1.0")]
    assert len(s["remedies"]) == len(pairs) * len(at)
    for a, b in pairs:
        for lr in at:
            (name,) = [k for k in s["remedies"] if k.startswith(f"{a} vs {b} @ lr {lr:g} (")]
            r = s["remedies"][name]
            d = np.subtract(_per_seed(rows, a, lr, seeds), _per_seed(rows, b, lr, seeds))
            assert abs(r["effect_mean"] - d.mean()) < 1e-12
            assert r["p_sign_flip"] == stats.sign_flip_p(d)
            assert r["mechanism_moved"] is None  # the clip rate moves by construction
