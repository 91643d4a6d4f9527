"""``python -m experiments.qk_clip --quick``: what it writes and what it must show."""

import json
import math

import numpy as np
import pytest
from experiment_runs import run_quick

FIGURES = ("max_logit.png", "loss_vs_lr.png", "paired_vs_lr.png")


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
        assert r["test"] == "paired_t" and 0 <= r["p_test"] <= r["p_holm"] <= 1
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

    # reuse=: the qk_clip arm alone re-run at another tau; none and qk_norm (which tau does
    # not touch) come from the stored file, row for row, and the family is recomputed.
    stored = tmp_path / "qk_clip" / "results.json"
    res2, cfg2, s2 = run_quick(
        "qk_clip", tmp_path / "b", "--tau", "3", "--reuse", str(stored), figures=FIGURES
    )
    assert cfg2["tau"] == 3 and s2["tau"] == 3 and len(res2["rows"]) == len(res["rows"])
    for arm in ("none", "qk_norm"):
        assert [r for r in res2["rows"] if r["arm"] == arm] == [
            r for r in res["rows"] if r["arm"] == arm
        ]
    assert res2["max_logit_curves"]["adamw none"] == res["max_logit_curves"]["adamw none"]
    clip = [r["clipped_head_steps"] for r in res["rows"] if r["arm"] == "qk_clip"]
    clip2 = [r["clipped_head_steps"] for r in res2["rows"] if r["arm"] == "qk_clip"]
    assert sum(clip2) < sum(clip)  # a higher tau clips fewer heads
    payload = json.loads(stored.read_text())
    payload["config"]["steps"] += 1
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.json").write_text(json.dumps(payload))
    from experiments import qk_clip

    with pytest.raises(ValueError, match=r"`reuse` was run with other settings: \['steps'\]"):
        qk_clip.main(
            [
                "--quick",
                "--no-progress",
                "--out",
                str(tmp_path / "c"),
                "--reuse",
                str(tmp_path / "other" / "results.json"),
            ]
        )
