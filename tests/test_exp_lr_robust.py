"""``python -m experiments.lr_robust --quick``: what it writes and what it must show; the
primary metric (:func:`experiments.lr_robust.gaps`), the family and the moonshot verdict on
hand-built numbers."""

import math

import numpy as np
import pytest
from experiment_runs import run_quick

from experiments import lr_robust, stats

FIGURES = ("heldout_vs_lr.png", "loss.png", "effects.png")
LN256 = math.log(256)


def test_gaps_hand_computed():
    # 2.2 / 2.0 - 1 = 0.1; a NaN loss counts as ln 256: 5.5452 / 2 - 1 = 1.7726; 1.9 / 2 - 1
    got = lr_robust.gaps([2.2, float("nan"), 1.9], [2.0, 2.0, 2.0])
    assert got == pytest.approx([0.1, LN256 / 2 - 1, -0.05])
    assert got[1] == pytest.approx(1.7726, abs=1e-4)
    assert lr_robust.gaps([2.0], [float("inf")]) == pytest.approx([2.0 / LN256 - 1])
    with pytest.raises(ValueError):
        lr_robust.gaps([1.0, 2.0], [1.0])


def _ec(values: dict[tuple[str, float], list[float]], diverged=()) -> dict:
    return {
        lr_robust.key(a, m): {
            "final_heldout": v,
            "diverged": [(a, m, k) in diverged for k in range(len(v))],
        }
        for (a, m), v in values.items()
    }


def test_family_and_moonshot_on_hand_built_losses():
    import dataclasses

    cfg = dataclasses.replace(
        lr_robust.Config.quick(), seeds=(0, 1, 2), multiples=(1.0, 10.0), d_model=32, n_layers=2
    )
    ref = [2.0, 2.1, 2.2]
    ec = _ec({
        ("unguarded", 1.0): ref,
        ("reactive", 1.0): ref,  # the reference run itself: gap exactly 0
        ("predictive", 1.0): [2.0, 2.1, 2.2],
        ("unguarded", 10.0): [2.4, 2.52, 2.64],  # +20 % on every seed
        ("reactive", 10.0): [2.4, 2.52, float("nan")],  # a diverged run: ln 256
        ("predictive", 10.0): [2.002, 2.1021, 2.2044],  # +0.1 %, +0.1 %, +0.2 %
    }, diverged={("reactive", 10.0, 2)})  # fmt: skip
    lrs = [0.003, 0.03]
    comp = lr_robust.comparisons(cfg, ec, lrs)
    # 1x: the 3 pairs only (no arm against the margin: the reference run is the 1x
    # unguarded one, and a controller that never acts there is that run); 10x: 3 + 3.
    assert len(comp) == 9
    assert not [k for k in comp if "margin @ lr 0.003" in k]
    c = comp["predictive − 1 % margin @ lr 0.03 (10x best), d32x2"]
    assert c["remedy"] == pytest.approx([0.001, 0.001, 0.002]) and c["base"] == [0.01] * 3
    c = comp["reactive − unguarded @ lr 0.03 (10x best), d32x2"]
    assert c["remedy"] == pytest.approx([0.2, 0.2, LN256 / 2.2 - 1])
    assert c["base"] == pytest.approx([0.2, 0.2, 0.2])
    fam = stats.family(lr_robust.PRIMARY, comp, test="paired_t")
    # predictive @ 10x: gap - 1 % = [-0.009, -0.009, -0.008]: mean -0.008667, sd 0.000577,
    # t = 26.0 on 2 df, p = 0.001476; Holm over 9 ranks it among the smallest.
    d = fam["predictive − 1 % margin @ lr 0.03 (10x best), d32x2"]
    assert d["effect_mean"] == pytest.approx(-0.026 / 3)
    assert d["p_test"] == pytest.approx(0.001476, abs=2e-6) and d["claim_met"]
    goal = lr_robust.moonshot(cfg, ec, fam, lrs)
    assert goal["predictive"]["met"] and not goal["unguarded"]["met"]
    assert not goal["reactive"]["met"]  # one diverged run at 10x
    per = goal["reactive"]["per_multiple"]
    assert per["10x"]["diverged"] == 1 and per["1x"]["within_1pct_shown"]
    assert goal["unguarded"]["per_multiple"]["1x"]["within_1pct_shown"]  # by definition
    assert goal["unguarded"]["per_multiple"]["10x"]["mean_gap"] == pytest.approx(0.2)


def test_at_1x_an_arm_that_acted_is_judged_against_the_reference_run():
    import dataclasses

    cfg = dataclasses.replace(
        lr_robust.Config.quick(), seeds=(0, 1, 2), multiples=(1.0, 10.0), d_model=32, n_layers=2
    )
    ref = [2.0, 2.1, 2.2]
    worse = [2.06, 2.163, 2.2671]  # +3.0 %, +3.0 %, +3.05 %: its rollbacks hurt a healthy run
    ec = _ec({
        ("unguarded", 1.0): ref, ("reactive", 1.0): worse, ("predictive", 1.0): ref,
        ("unguarded", 10.0): ref, ("reactive", 10.0): ref, ("predictive", 10.0): ref,
    })  # fmt: skip
    fam = stats.family(lr_robust.PRIMARY, lr_robust.comparisons(cfg, ec, [0.003, 0.03]))
    per = {
        a: g["per_multiple"]["1x"]
        for a, g in lr_robust.moonshot(cfg, ec, fam, [0.003, 0.03]).items()
    }
    assert per["reactive"]["mean_gap"] == pytest.approx((0.03 + 0.03 + 0.0305) / 3)
    assert not per["reactive"]["within_1pct_shown"]  # mean gap 3 % > 1 %
    assert per["predictive"]["within_1pct_shown"] and per["unguarded"]["within_1pct_shown"]


def test_results_go_to_their_own_run_folder():
    assert lr_robust.main.__module__ == "experiments.lr_robust"
    from experiments import spike_recovery

    argv = spike_recovery.output_argv(["--quick"], lr_robust.RUN_FOLDER)
    assert argv == ["--quick", "--out", "runs/lr_robust"]
    with pytest.raises(ValueError, match="include 1"):
        lr_robust.main(["--quick", "--multiples", "2", "10", "--out", "/nonexistent/x"])


def test_lr_robust(tmp_path):
    res, cfg, s = run_quick("lr_robust", tmp_path, figures=FIGURES)
    ec, n, steps = s["equal_compute"], len(cfg["seeds"]), cfg["steps"]
    keys = [lr_robust.key(a, m) for m in cfg["multiples"] for a in lr_robust.ARMS]
    assert sorted(ec) == sorted(keys) and res["equal_compute"] == ec
    assert s["failure_made_by_model"] is True and "Transformer" in s["task"]
    best = s["lr_grid"]["best_lr"]
    assert s["grid_lrs"] == pytest.approx([m * best for m in cfg["multiples"]])
    assert s["lr_grid"]["seeds"] == len(cfg["scan_seeds"]) >= 3
    for k, a in ec.items():
        # equal compute: every run the same number of train-step calls (none gave up here)
        assert a["steps_executed"] == [steps] * n or any(a["gave_up"]), k
        if k.startswith("unguarded"):
            assert a["rollbacks"] == [0] * n and a["warnings"] == [0] * n
        if not k.startswith("predictive"):
            assert a["warning_responses"] == [0] * n
    # One compiled step for every arm: a controlled run that never acted is the unguarded one.
    runs = {(r["arm"], r["multiple"], r["seed"]): r for r in res["runs"]}
    for (_, m, sd), r in runs.items():
        if r["rollbacks"] == 0 and r["warning_responses"] == 0:
            u = runs[("unguarded", m, sd)]
            assert r["final_heldout"] == u["final_heldout"] and r["losses"] == u["losses"]
    # The family, recomputed: gaps to the unguarded best-LR run, paired t, Holm over all.
    ref = ec[lr_robust.key("unguarded", 1.0)]["final_heldout"]
    fam = s["remedies"]
    # Per LR the 3 pairs, and above 1x each arm against the margin.
    assert len(fam) == s["family_size"] == 6 * len(cfg["multiples"]) - 3
    for name, r in fam.items():
        arm, _, rest = name.partition(" − ")
        m = float(rest.split("(")[1].split("x best")[0])
        gap = np.array(lr_robust.gaps(ec[lr_robust.key(arm, m)]["final_heldout"], ref))
        base = rest.split(" @ ")[0]
        other = (
            np.full(n, lr_robust.MARGIN)
            if base == "1 % margin"
            else np.array(lr_robust.gaps(ec[lr_robust.key(base, m)]["final_heldout"], ref))
        )
        assert r["per_seed"] == pytest.approx((gap - other).tolist()), name
    raw = [stats.paired_t_p(r["per_seed"]) for r in fam.values()]
    for r, p, adj in zip(fam.values(), raw, stats.holm(raw), strict=True):
        assert r["test"] == "paired_t" and r["p_test"] == pytest.approx(p, nan_ok=True)
        assert r["p_holm"] == pytest.approx(adj, nan_ok=True)
    for arm, g in s["moonshot"].items():
        per = g["per_multiple"].values()
        assert g["met"] == all(p["diverged"] == 0 and p["within_1pct_shown"] for p in per), arm
    assert s["instability_reproduced"] == (not s["moonshot"]["unguarded"]["met"])
