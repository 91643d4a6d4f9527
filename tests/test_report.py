"""The stability report: rendered from a real small controller run, checked against it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import toy

from stabljax.control import IndexedBatches, JsonlMetricsWriter, RollbackController
from stabljax.report import load_run, summary, write_report
from stabljax.report.read import Run

ROOT = pathlib.Path(__file__).parent.parent
CHROMIUM = "/usr/bin/chromium"


def _job(directory, *, triage=True, metrics=True, **data):
    state, step = toy.triage_toy()
    kw = dict(toy.triage_controller_kwargs(), triage=triage)
    writer = JsonlMetricsWriter(directory / "metrics.jsonl") if metrics else None
    with RollbackController(directory, **kw) as ctl:
        ctl.run(
            step,
            state,
            IndexedBatches(toy.triage_batches(**data)),
            60,
            progress=False,
            metrics_writer=writer,
        )
    if writer is not None:
        writer.close()
    return ctl


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("report") / "ckpt"
    ctl = _job(d, bad=[35])
    return d, ctl


def _cell(page: str, name: str) -> str:
    m = re.search(rf"<tr><th>{re.escape(name)}</th><td>(.*?)</td></tr>", page)
    assert m, name
    return m.group(1)


def test_the_report_is_one_self_contained_file(run_dir, tmp_path):
    d, _ = run_dir
    path = write_report(d, tmp_path / "out")
    assert path == tmp_path / "out" / "report.html"
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") >= 4
    assert "<script" not in page and "src=" not in page and "<link" not in page
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}  # the SVG namespace only: no network
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_the_summary_numbers_are_the_ledgers_and_the_events(run_dir, tmp_path):
    d, ctl = run_dir
    page = write_report(d, tmp_path).read_text()
    rollbacks = [e for e in ctl.events if e.kind == "rollback"]
    assert _cell(page, "rollbacks") == str(ctl.rollbacks) == "1"
    assert _cell(page, "batches skipped") == str(sum(b - a for a, b in ctl.skipped_ranges))
    assert (
        _cell(page, "skipped ranges")
        == ", ".join(f"[{a}, {b})" for a, b in ctl.skipped_ranges)
        == "[30, 37)"
    )
    # Steps 30..36 ran, then were rolled back (36 was in flight when 35 was read).
    lost = sum(e.step + 2 - e.details["restored_step"] for e in rollbacks)
    assert _cell(page, "steps lost (computed, then rolled back)") == str(lost) == "7"
    assert _cell(page, "final step") == "60"
    assert _cell(page, "triage verdicts") == "data 1"
    assert _cell(page, "detections") == f"spike {sum(e.kind == 'spike' for e in ctl.events)}"
    assert _cell(page, "checkpoints saved") == str(sum(e.kind == "save" for e in ctl.events))
    assert _cell(page, "data index at the end") == str(ctl.data.index)


def test_the_event_panel_shows_window_verdict_evidence_attribution_and_remedy(run_dir, tmp_path):
    d, ctl = run_dir
    page = write_report(d, tmp_path).read_text()
    tri = next(e for e in ctl.events if e.kind == "triage").details
    assert "Rollback 1 at step 35" in page
    assert _cell(page, "restored checkpoint") == "30"
    assert _cell(page, "data skipped") == "[30, 37) — 7 batches"
    assert 'class="badge"' in page and ">data</span>" in page
    assert _cell(page, "culprit batches (data indices)") == "35"
    assert tri["reason"] in page and tri["remedy"] in page
    assert f"{tri['steps']} in" in _cell(page, "replayed steps")
    assert "Replayed losses (triage evidence)" in page
    assert "replay from checkpoint 20" in page and "replay from checkpoint 30" in page
    hint = tri["attribution"]["hints"][0]
    assert hint["evidence"] in page and "First layer whose gradient norm jumped" in page
    assert f"<code>{tri['attribution']['first_jump']['layer']}</code>" in page


def test_the_loss_curve_draws_every_step_of_the_final_trajectory(run_dir, tmp_path):
    d, _ = run_dir
    page = write_report(d, tmp_path).read_text()
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"] for r in rows}
    loss_svg = page[page.index('aria-label="Loss"') :].split("</svg>")[0]
    lines = re.findall(r'points="([^"]*)"><title>loss \(the final trajectory\)', loss_svg)
    assert sum(len(p.split()) for p in lines) == len(steps) == 60
    # The abandoned branch (steps replayed after the rollback) is drawn apart.
    assert len(rows) > len(steps) and "loss on a rolled-back branch" in loss_svg
    for title in ("Gradient norm", "Data: fed (blue) and skipped (orange)"):
        assert title in page
    assert "rolled back: steps 30..35 were discarded" in loss_svg


def test_kept_and_abandoned_rows_on_a_constructed_log():
    rows = [{"step": s, "loss": float(s)} for s in range(6)]
    rows += [{"step": s, "loss": 10.0 + s} for s in range(3, 8)]
    run = Run(pathlib.Path("."), [], {}, rows)
    assert list(run.kept) == list(range(8))
    assert [run.kept[s]["loss"] for s in (2, 3, 7)] == [2.0, 13.0, 17.0]
    assert [[r["step"] for r in seg] for seg in run.abandoned] == [[3, 4, 5]]


def test_without_metrics_or_triage_the_report_still_reads(tmp_path):
    d = tmp_path / "plain"
    ctl = _job(d, triage=False, metrics=False, bad=[35])
    page = write_report(d).read_text()
    assert "No metrics.jsonl" in page and "off for this run" in page
    assert (
        _cell(page, "rollbacks") == str(ctl.rollbacks) and _cell(page, "triage verdicts") == "none"
    )
    assert summary(load_run(d))["batches skipped"] == 7
    assert _cell(page, "steps lost (computed, then rolled back)") == "7"  # from the events


def test_the_command_line_writes_the_report_and_refuses_a_non_run(run_dir, tmp_path):
    d, _ = run_dir
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "stabljax.report", str(d), "--out", str(tmp_path / "o")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "o" / "report.html")
    assert (tmp_path / "o" / "report.html").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "stabljax.report", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "events.jsonl" in bad.stderr and str(tmp_path) in bad.stderr
    with pytest.raises(ValueError, match="not a directory"):
        write_report(tmp_path / "missing")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium")
def test_a_headless_chromium_screenshot_of_the_report(run_dir, tmp_path):
    """Renders the page in Chromium; STABLJAX_REPORT_PNG=docs/report.png keeps the picture."""
    d, _ = run_dir
    path = write_report(d, tmp_path)
    png = tmp_path / "report.png"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--screenshot={png}",
        "--window-size=980,2500",
        path.as_uri(),
    ]
    subprocess.run(cmd, capture_output=True, timeout=180, check=False)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (980, 2500) and len(data) > 50_000  # not a blank page
    if os.environ.get("STABLJAX_REPORT_PNG"):
        shutil.copy(png, ROOT / os.environ["STABLJAX_REPORT_PNG"])


def test_the_summary_shows_the_spike_score_of_the_final_trajectory(run_dir, tmp_path):
    from stabljax.telemetry import spike_score

    d, _ = run_dir
    page = write_report(d, tmp_path).read_text()
    run = load_run(d)
    losses = [float(r["loss"]) for r in run.kept.values()]
    label = "spike score, loss (% ≥ 7σ from the mean of the last 1000)"
    assert len(losses) == 60 and _cell(page, label).startswith("n/a (60 steps")
    long = Run(
        d, run.events, run.ledger, [{"step": i, "loss": 2.0, "grad_norm": 1.0} for i in range(300)]
    )
    long.rows[250]["loss"] = 50.0
    s = summary(long)
    assert s[label] == f"{spike_score([r['loss'] for r in long.rows]):.3f} %" == "0.500 %"
    assert s["spike score, grad norm (% ≥ 7σ from the mean of the last 1000)"] == "0.000 %"
    empty = Run(d, run.events, run.ledger, [])
    assert summary(empty)[label] == "n/a (no metrics.jsonl)"
