"""``python -m experiments.qk_clip --quick``: what it writes and what it must show."""

import math

import numpy as np
from experiment_runs import run_quick

FIGURES = ("max_logit.png", "loss_vs_lr.png")


def test_qk_clip(tmp_path):
    res, cfg, s = run_quick("qk_clip", tmp_path, figures=FIGURES)
    n = len(cfg["arms"]) * len(cfg["seeds"]) * sum(len(cfg[f"{o}_lrs"]) for o in cfg["optimizers"])
    extra = sum(len(set(cfg["scan_lrs"]) - set(cfg[f"{o}_lrs"])) for o in cfg["optimizers"])
    assert (
        len(res["rows"]) == n + extra * len(cfg["seeds"]) and res["primary_metric"] == "final_loss"
    )
    assert s["primary_metric"] and set(s["lr_grid"]) == set(cfg["optimizers"])
    # The family compares remedies on each optimizer's own grid; the scan LRs (none arm
    # only) widen the grid record, whose best LR is the lowest seed-mean final loss.
    assert s["family_size"] == 2 * sum(len(cfg[f"{o}_lrs"]) for o in cfg["optimizers"])
    for o in cfg["optimizers"]:
        g = s["lr_grid"][o]
        assert g["lrs"] == sorted(set(cfg[f"{o}_lrs"]) | set(cfg["scan_lrs"]))
        assert g["best_lr"] == g["lrs"][int(np.argmin(g["score"]))]
        assert all(r["mechanism_moved"] is None for r in s["remedies"].values())
    for r in s["remedies"].values():
        assert 0 < r["p_sign_flip"] <= r["p_holm"] <= 1
    for r in res["rows"]:
        if r["arm"] != "qk_clip":
            assert r["clipped_head_steps"] == 0
        assert r["skipped_steps"] == 0 and math.isfinite(r["init_loss"])

    # QK-Clip holds the logits where the unclipped AdamW run at the top LR passes tau.
    def late(arm):
        return np.mean(
            [
                r["late_max_attn_logit"]
                for r in res["rows"]
                if (r["optimizer"], r["arm"], r["lr"]) == ("adamw", arm, max(cfg["adamw_lrs"]))
            ]
        )

    assert late("none") > cfg["tau"] and late("qk_clip") < late("none")
    assert any(r["clipped_head_steps"] > 0 for r in res["rows"] if r["arm"] == "qk_clip")
