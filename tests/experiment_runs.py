"""The quick run every experiment test starts from (imported as ``from experiment_runs import
run_quick``, like tests/toy.py)."""

import importlib
import json
import math
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

SUMMARY_KEYS = {"instability_reproduced", "failure_metric", "remedies", "seeds", "sizes", "note"}
REMEDY_KEYS = {"metric", "effect_mean", "ci95", "mechanism_moved", "claim_met"}
#: Issue 29's summary: seeds, primary metric, interval method, Holm p, LR grid.
ISSUE29_KEYS = {
    "seed_ids",
    "primary_metric",
    "interval",
    "p_values",
    "family_size",
    "lr_grid",
    "failure_made_by_model",
    "not_shown",
}


def run_quick(name, tmp_path, *extra, figures=(), script=False):
    """Runs ``experiments.<name> --quick`` into ``tmp_path`` and checks what every experiment
    writes: results.json (environment, command, wall time, config, summary), results.md and
    ``figures``; returns ``(results, config, summary)``."""
    out = tmp_path / name
    args = ["--quick", "--no-progress", "--out", str(out), *extra]
    if script:  # as README's command runs it: a fresh interpreter, from the repository root
        cmd = [sys.executable, "-m", f"experiments.{name}", *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        importlib.import_module(f"experiments.{name}").main(args)
    payload = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text().startswith("# ")
    for fig in figures:
        assert (out / fig).stat().st_size > 1000, fig
    env = payload["environment"]
    assert env["device_count"] >= 1 and env["versions"]["jax"] and env["versions"]["optax"]
    assert env["python"] and env["platform"]
    assert (
        payload["command"].startswith("python -m experiments.") and "--quick" in payload["command"]
    )
    assert payload["wall_s"] > 0 and payload["config"]
    s = payload["summary"]
    # Issue 29's statistics add keys (primary metric, Holm-adjusted p) to the issue-17 schema.
    assert SUMMARY_KEYS <= set(s) and s["seeds"] == len(payload["config"]["seeds"])
    for r in s["remedies"].values():
        assert REMEDY_KEYS <= set(r)
        lo, hi = r["ci95"]
        assert lo <= r["effect_mean"] <= hi or not math.isfinite(lo)
        holm_ok = r.get("p_holm", 0.0) < 0.05
        assert r["claim_met"] == (hi < 0 and r["mechanism_moved"] is not False and holm_ok)
    if "primary_metric" in s:
        assert ISSUE29_KEYS <= set(s) and s["seed_ids"] == payload["config"]["seeds"]
        assert s["family_size"] == len(s["remedies"])
        for r in s["remedies"].values():
            p = r.get("p_test", r["p_sign_flip"])  # the p the experiment's test gave
            assert 0 <= p <= r["p_holm"] <= 1 or math.isnan(r["p_holm"])
    return payload["results"], payload["config"], s
