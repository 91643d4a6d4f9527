"""``python -m experiments.warmup --quick``: what it writes and what it must show."""

import math

import numpy as np
from experiment_runs import run_quick

from experiments import stats, warmup

FIGURES = ("final_loss_vs_lr.png", "effects.png", "loss.png")


def _score(rows, w, lr):
    """Seed-mean final loss of one arm at one LR, a diverged run counted as its init loss."""
    v = [
        r["final_loss"] if math.isfinite(r["final_loss"]) else r["init_loss"]
        for r in rows
        if r["warmup"] == w and r["lr"] == lr
    ]
    return float(np.mean(v)), v


def test_warmup(tmp_path):
    res, cfg, s = run_quick("warmup", tmp_path, figures=FIGURES)
    rows, lrs, seeds = res["rows"], cfg["lrs"], cfg["seeds"]
    assert len(rows) == len(cfg["warmups"]) * len(lrs) * len(seeds)
    assert res["primary_metric"] == warmup.PRIMARY and s["primary_metric"] == warmup.PRIMARY_TEXT
    assert s["failure_made_by_model"] is True and s["seed_ids"] == seeds
    for r in rows:
        assert r["bursts"] >= 0 and math.isfinite(r["init_loss"])
    # The best LR of the no-warmup arm, recomputed from the rows, and the grid record.
    base = cfg["warmups"][0]
    best = min(lrs, key=lambda lr: _score(rows, base, lr)[0])
    g = s["lr_grid"]["no warmup"]
    assert g["best_lr"] == best == res["effects"]["best_lr_no_warmup"]
    assert g["spans_1e-4_to_1"] and g["best_strictly_inside"] == (min(lrs) < best < max(lrs))
    # Compared exactly at the LRs from the best to 10x it, each warmup against none.
    at = [lr for lr in lrs if best <= lr <= 10 * best]
    assert res["effects"]["compared_lrs"] == at
    assert len(s["remedies"]) == (len(cfg["warmups"]) - 1) * len(at)
    for w in cfg["warmups"][1:]:
        for lr in at:
            name = next(
                k
                for k in s["remedies"]
                if k.startswith(f"warmup {w:g} (") and f"@ lr {lr:g} (" in k
            )
            r = s["remedies"][name]
            d = np.subtract(_score(rows, w, lr)[1], _score(rows, base, lr)[1])
            assert (
                r["effect_mean"] == np.float64(d.mean()).item()
                or abs(r["effect_mean"] - d.mean()) < 1e-12
            )
            assert r["p_sign_flip"] == stats.sign_flip_p(d)
            assert (
                r["mechanism_moved"] is None
            )  # none claimed: warmup's early cut is by construction
    # Wortsman's LR sensitivity per seed, no warmup, by hand: E[min(loss, init)] - min.
    by_hand = []
    for sd in seeds:
        rr = [r for r in rows if r["seed"] == sd and r["warmup"] == base]
        x = [
            min(r["final_loss"], r["init_loss"])
            if math.isfinite(r["final_loss"])
            else r["init_loss"]
            for r in rr
        ]
        by_hand.append(np.mean(x) - min(x))
    sens = res["effects"]["lr_sensitivity"]["no warmup"]["arm"]
    assert abs(sens["mean"] - np.mean(by_hand)) < 1e-9
