"""Smoke runs of every experiment in --quick mode: each writes its JSON, table and figures.

The numbers asserted are the ones each experiment's page is built from; the assertions
check they are present, finite where they must be, and consistent with each other.
"""

import importlib
import json
import math
import pathlib
import subprocess
import sys

import pytest

from experiments import common

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIGURES = {
    "lr_sensitivity": ("loss_vs_lr.png", "logits.png"),
    "warmup": ("loss_vs_lr.png",),
    "adam_eps": ("loss_vs_scale.png",),
    "clipping": ("loss.png",),
    "init_schemes": ("init.png",),
    "precision": ("precision.png",),
    "spike_recovery": ("loss.png",),
}


def _run(name, tmp_path, *extra, script=False):
    out = tmp_path / name
    args = ["--quick", "--no-progress", "--out", str(out), *extra]
    if script:  # as README's command runs it: a fresh interpreter, the file as a script
        path = ROOT / "experiments" / f"{name}.py"
        proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        importlib.import_module(f"experiments.{name}").main(args)
    payload = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text().startswith("# ")
    for fig in FIGURES[name]:
        assert (out / fig).stat().st_size > 1000, fig
    assert payload["environment"]["device_count"] >= 1
    assert payload["config"]
    return payload["results"], payload["config"]


def _finite(x):
    return isinstance(x, int | float) and math.isfinite(x)


def test_lr_sensitivity(tmp_path):
    res, cfg = _run("lr_sensitivity", tmp_path)
    assert len(res["rows"]) == len(cfg["arms"]) * len(cfg["lrs"]) * len(cfg["seeds"])
    for arm in cfg["arms"]:
        s = res["sensitivity"][arm]
        assert _finite(s["mean"]) and s["mean"] >= 0
        assert len(s["per_seed"]) == len(cfg["seeds"])
    for r in res["rows"]:
        assert _finite(r["init_loss"]) and _finite(r["max_attn_logit"]) and _finite(r["mean_log_z"])


def test_warmup(tmp_path):
    res, cfg = _run("warmup", tmp_path)
    assert {str(w) for w in cfg["warmups"]} == {str(float(k)) for k in res["sensitivity"]}
    assert len(res["rows"]) == len(cfg["warmups"]) * len(cfg["lrs"]) * len(cfg["seeds"])


def test_adam_eps(tmp_path):
    res, cfg = _run("adam_eps", tmp_path)
    arms = res["arms"]
    assert len(cfg["seeds"]) >= 2  # the criterion needs a seed spread
    # Scale invariance of the eps-free arms is exact up to float32 rounding, even in 6 steps.
    for arm in ("safe_adamw_eps0", "adamw_atan2"):
        assert arms[arm]["max_gap_vs_scale1"] < 1e-3, arm
        assert res["pow2_check"][arm]["bit_identical_to_x1"], arm
        inv = arms[arm]["invariance"]
        assert inv["invariant"] is True and inv["scale_effect"] <= inv["seed_sd"], arm
    # eps = 1e-8 against gradients shrunk 1e8: the update is eps-bound and the loss lags.
    assert arms["adamw_eps1e-8"]["degradation_at_smallest_scale"] > 0.05
    assert arms["adamw_eps1e-8"]["invariance"]["invariant"] is False
    tiny = [r for r in res["rows"] if r["arm"] == "adamw_eps1e-8" and r["scale"] == 1e-8]
    assert all(r["eps_fraction"] > 0.9 for r in tiny)


def test_clipping(tmp_path):
    res, cfg = _run("clipping", tmp_path)
    assert set(res["summary"]) == set(cfg["arms"])
    for r in res["rows"]:
        assert r["spikes"] == len(r["spike_steps"]) and r["steps_lost"] >= 0


def test_init_schemes(tmp_path):
    res, cfg = _run("init_schemes", tmp_path)
    assert len(res["rows"]) == len(cfg["schemes"]) * len(cfg["seeds"])
    for r in res["rows"]:
        assert isinstance(r["check_ok"], bool) and _finite(r["growth_init"])
        assert len(r["residual_rms_end"]) == cfg["n_layers"] + 1


def test_precision(tmp_path):
    res, cfg = _run("precision", tmp_path)
    by_arm = {r["arm"]: r for r in res["rows"]}
    assert by_arm["fp32"]["overflows"] == 0 and by_arm["fp32"]["final_loss_scale"] == 1.0
    assert by_arm["fp16"]["final_loss_scale"] > 1.0
    assert _finite(by_arm["bf16"]["final_loss"])


def test_spike_recovery(tmp_path):
    res, _ = _run("spike_recovery", tmp_path, script=True)
    assert set(res["arms"]) == {"clean", "unguarded", "guarded"}
    assert _finite(res["arms"]["clean"]["final_loss"])
    assert res["arms"]["guarded"]["rollbacks"] >= 1


def test_lr_sensitivity_formula():
    # mean(min(loss, init)) - best: [2, 3, nan->5, 7->5] with init 5 -> mean 3.75 - 2.
    assert common.lr_sensitivity([2.0, 3.0, float("nan"), 7.0], 5.0) == pytest.approx(1.75)


def test_steps_lost():
    losses = [3.0, 2.9, 2.8, 6.0, 4.0, 2.9, 2.7, 2.6]
    assert common.steps_lost(losses, [3]) == 3  # back to <= 2.8 at step 6
    assert common.steps_lost(losses, []) == 0
    assert common.steps_lost([2.0, 5.0, 4.0], [1]) == 2  # never recovers: to the end


def test_adam_eps_invariance_criterion():
    from experiments.adam_eps import invariance

    # Seed SD pooled over scales: variances 0.02 and 0.08 (ddof 1) -> sqrt(0.05).
    by_scale = {1.0: [1.0, 1.2], 1e-8: [1.1, 1.5]}
    inv = invariance(by_scale, 1.0)
    assert inv["scale_effect"] == pytest.approx(0.2)  # mean 1.3 vs 1.1
    assert inv["seed_sd"] == pytest.approx(math.sqrt(0.05))
    assert inv["seed_sd_dof"] == 2 and inv["invariant"] is True
    assert invariance({1.0: [1.0, 1.2], 1e-8: [1.5, 1.7]}, 1.0)["invariant"] is False
    assert invariance({1.0: [1.0], 1e-8: [1.0]}, 1.0)["invariant"] is None
