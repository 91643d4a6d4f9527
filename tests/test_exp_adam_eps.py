"""``python -m experiments.adam_eps --quick``: what it writes and what it must show."""

from experiment_runs import run_quick

FIGURES = ("loss_vs_scale.png", "grad_rms_vs_width.png")


def test_adam_eps(tmp_path):
    res, cfg, s = run_quick("adam_eps", tmp_path, figures=FIGURES)
    eff = res["effects"][str(cfg["widths"][0])]
    # eps = 1e-8 against gradients shrunk 1e8: the update is eps-bound and the loss lags.
    assert eff["x1e-08"]["stall_vs_x1"]["ci95"][0] > 0.05
    # eps = 0 is invariant to the gradient scale, uniform or shallow-only (float32 rounding).
    for c in ("x1e-08", "shallow x1e-08"):
        assert abs(eff[c]["safe_adamw_eps0"]["shift_vs_x1"]["effect_mean"]) < 1e-3
    assert s["instability_reproduced"] and all(r["claim_met"] for r in s["remedies"].values())
