"""``python -m experiments.spike_recovery --quick``: what it writes and what it must show."""

import json

from experiment_runs import run_quick

FIGURES = ("loss.png",)


def test_spike_recovery(tmp_path):
    res, cfg, s = run_quick("spike_recovery", tmp_path, figures=FIGURES, script=True)
    arms = res["arms"]
    assert set(arms) == {"clean", "unguarded", "guards", "rollback", "both"}
    # The late trap fires once the model has learnt and kills the unguarded run; the early
    # one (loss still above the threshold) is harmless everywhere.
    for r in res["runs"]:
        assert 2 not in r["traps_fired"]
        if r["arm"] == "unguarded":
            assert r["diverged"] and cfg["traps"][-1] in r["traps_fired"]
        if r["arm"] in ("guards", "rollback", "both"):
            assert not r["diverged"]
    assert arms["rollback"]["rollbacks"] >= 1 and arms["clean"]["bad_updates_applied"] == 0
    assert set(s["remedies"]) == {"guards", "rollback", "both"}
    # The "both" arm keeps its checkpoints and per-step metrics under <out>/ckpt and writes
    # a stability report per seed; a triage verdict, where a rollback happened, is a known one.
    out = tmp_path / "spike_recovery"
    for r in res["runs"]:
        if r["arm"] != "both":
            assert "report" not in r
            continue
        ckpt = out / "ckpt" / f"both-{r['seed']}"
        lines = (ckpt / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == r["compute_steps"] and json.loads(lines[0])["step"] == 0
        html = out / "reports" / f"seed{r['seed']}" / "report.html"
        assert r["report"] == f"reports/seed{r['seed']}/report.html"  # relative to --out
        assert "<html" in html.read_text()[:500].lower()
        assert len(r["triage"]) == r["rollbacks"]
        assert all(
            t["verdict"] in ("data", "state", "nondeterministic", "inconclusive")
            for t in r["triage"]
        )
