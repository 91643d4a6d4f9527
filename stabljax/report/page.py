"""Reads a run's checkpoint directory and renders the stability report as one HTML page.

The inputs, all plain JSON (no Orbax, no JAX needed to read them):

* ``events.jsonl`` (docs/events.md): spikes, rollbacks, skips, triage verdicts, saves;
* the ledger: the ``meta`` item of the newest checkpoint (``<step>/meta/metadata``) or
  the rollback record ``stabljax-rollback.json``, whichever has seen more rollbacks;
* ``metrics.jsonl`` if the run wrote one (:class:`stabljax.control.JsonlMetricsWriter`): one row
  per step, rows of an abandoned branch followed by the replayed steps after a rollback.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import html
import json
import math
import pathlib
from typing import Any

from stabljax import metrics as keys
from stabljax.control.events import SCHEMA_VERSION, Event, read_events
from stabljax.report import svg
from stabljax.telemetry import spike_score

VERDICT_COLORS = {
    "data": "#e8710a",
    "state": "#1f5fbf",
    "nondeterministic": "#a142f4",
    "inconclusive": "#777",
}
DETECTIONS = ("spike", "divergence", "slow_divergence")


@dataclasses.dataclass
class Run:
    """What the report shows, read from a checkpoint directory."""

    directory: pathlib.Path
    events: list[Event]
    ledger: dict[str, Any]
    rows: list[dict[str, Any]]  # metrics.jsonl, in file order

    @property
    def kept(self) -> dict[int, dict[str, Any]]:
        """The last row of each step: the trajectory the final state was trained on."""
        out: dict[int, dict[str, Any]] = {}
        for r in self.rows:
            out[int(r["step"])] = r
        return dict(sorted(out.items()))

    @property
    def abandoned(self) -> list[list[dict[str, Any]]]:
        """Rows that a later row of the same step replaced (rolled-back branches)."""
        last = {int(r["step"]): i for i, r in enumerate(self.rows)}
        segments, cur, prev = [], [], None
        for i, r in enumerate(self.rows):
            s = int(r["step"])
            if prev is not None and s <= prev and cur:
                segments.append(cur)
                cur = []
            prev = s
            if last[s] != i:
                cur.append(r)
            elif cur:
                segments.append(cur)
                cur = []
        if cur:
            segments.append(cur)
        return [seg for seg in segments if seg]

    def of(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.kind in kinds]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return float(v) if isinstance(v, bool) else None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # "nan", "inf" as written by the writers
        except ValueError:
            return None
    return None


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn line
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def _read_ledger(directory: pathlib.Path) -> dict[str, Any]:
    metas = []
    for d in directory.iterdir() if directory.exists() else ():
        if d.name.isdigit() and (d / "commit_success.txt").exists():
            try:
                metas.append(json.loads((d / "meta" / "metadata").read_text()))
            except (OSError, ValueError):
                continue
    best = max(metas, key=lambda m: int(m.get("step", -1)), default=None)
    try:
        record = json.loads((directory / "stabljax-rollback.json").read_text())
    except (OSError, ValueError):
        record = None
    if record is not None and (best is None or record["rollbacks"] > best.get("rollbacks", 0)):
        best = {**record, "step": record.get("target_step")}
    return best or {}


def load_run(directory: str | pathlib.Path, metrics: str | pathlib.Path | None = None) -> Run:
    """Reads ``directory`` (and ``metrics``, default ``directory/metrics.jsonl``)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory {str(directory)!r} is not a directory")
    if not (directory / "events.jsonl").exists():
        raise ValueError(f"directory {str(directory)!r} has no events.jsonl (not a run?)")
    path = pathlib.Path(metrics) if metrics is not None else directory / "metrics.jsonl"
    return Run(
        directory,
        read_events(directory / "events.jsonl"),
        _read_ledger(directory),
        _read_jsonl(path),
    )


# ------------------------------------------------------------------------ figures


def summary(run: Run) -> dict[str, Any]:
    """The summary table's numbers."""
    rollbacks = run.of("rollback")
    ranges = [tuple(r) for r in run.ledger.get("skipped_ranges", [])]
    if not ranges:
        ranges = [tuple(e.details["range"]) for e in run.of("skip")]
    verdicts = collections.Counter(e.details.get("verdict") for e in run.of("triage"))
    steps = [e.step for e in run.events] + list(run.kept)
    final = max([int(run.ledger.get("step", 0) or 0), *steps], default=0)
    return {
        "final step": final,
        "steps lost (computed, then rolled back)": steps_lost(run),
        "batches skipped": sum(b - a for a, b in ranges),
        "skipped ranges": ", ".join(f"[{a}, {b})" for a, b in ranges) or "none",
        "rollbacks": int(run.ledger.get("rollbacks", len(rollbacks))),
        "detections": ", ".join(
            f"{k} {v}" for k, v in collections.Counter(e.kind for e in run.of(*DETECTIONS)).items()
        )
        or "none",
        "level shifts the guards accepted (rebaseline)": ", ".join(
            f"step {e.step}" for e in run.of("rebaseline")
        )
        or "none",
        "triage verdicts": ", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())) or "none",
        "checkpoints saved": len(run.of("save")),
        "data index at the end": run.ledger.get("data_index", "?"),
        "restarts (resumes)": sum(
            str(e.details.get("reason", "")).startswith("resume") for e in run.of("restore")
        ),
        "diverged": "yes" if run.of("diverged") else "no",
        **spike_scores(run),
    }


def spike_scores(run: Run) -> dict[str, str]:
    """OLMo 2's spike score (:func:`stabljax.telemetry.spike_score`) of the loss and the
    grad norm over the final trajectory (metrics.jsonl's kept rows), as table cells."""
    out = {}
    for key, label in ((keys.LOSS, "loss"), (keys.GRAD_NORM, "grad norm")):
        values = [_number(r.get(key)) for r in run.kept.values() if key in r]
        score = spike_score([math.nan if v is None else v for v in values]) if values else None
        if score is None:
            cell = "n/a (no metrics.jsonl)"
        elif math.isnan(score):
            cell = f"n/a ({len(values)} steps; a value is scored after 100)"
        else:
            cell = f"{score:.3f} %"
        out[f"spike score, {label} (% ≥ 7σ from the mean of the last 1000)"] = cell
    return out


def steps_lost(run: Run) -> int:
    """Steps computed and then discarded by rollbacks: the rolled-back rows of
    metrics.jsonl, else ``detected + 2 - restored`` per rollback (the controller reads a
    step's metrics one step late, so the step after the detection was already computed)."""
    if run.rows:
        return sum(len(seg) for seg in run.abandoned)
    return sum(e.step + 2 - int(e.details["restored_step"]) for e in run.of("rollback"))


def _series(rows, key: str) -> tuple[list[float], list[float | None]]:
    pairs = [(int(r["step"]), _number(r.get(key))) for r in rows if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _loss_points(run: Run) -> list[tuple[int, float]]:
    """Without metrics.jsonl: the losses the rollback events list and the saves' EMA."""
    pts = {}
    for e in run.of("rollback"):
        for s, loss, _ in e.details.get("losses", []):
            pts[int(s)] = _number(loss)
    return sorted(pts.items())


def _rollback_spans(run: Run) -> list[svg.Span]:
    return [
        svg.Span(
            int(e.details["restored_step"]),
            e.step,
            f"rolled back: steps {e.details['restored_step']}..{e.step} were discarded",
        )
        for e in run.of("rollback")
    ]


def _marks(run: Run, loss_at: dict[int, float | None]) -> list[svg.Mark]:
    out = []
    for e in run.of(*DETECTIONS):
        # A spike's own value is the loss the run saw (the kept row may be a replay).
        y = _number(e.details.get("value")) if e.kind == "spike" else None
        y = loss_at.get(e.step) if e.kind == "spike" and y is None else y
        out.append(svg.Mark(e.step, y, f"{e.kind} at step {e.step}: {e.details.get('reason', '')}"))
    for e in run.of("rollback"):
        label = f"rollback at step {e.step} to {e.details['restored_step']}"
        out.append(svg.Mark(e.step, None, label, "#444"))
    return out


def loss_chart(run: Run) -> str:
    kept, series = run.kept, []
    if kept:
        xs, ys = _series(kept.values(), keys.LOSS)
        series.append(svg.Series("loss (the final trajectory)", xs, ys))
        for k, seg in enumerate(run.abandoned):
            xs, ys = _series(seg, keys.LOSS)
            name = "loss on a rolled-back branch"
            series.append(svg.Series(name if k == 0 else name + " ", xs, ys, "#c5221f", 1.2, "5 3"))
        loss_at = {s: _number(r.get(keys.LOSS)) for r in run.rows for s in [int(r["step"])]}
    else:
        pts = _loss_points(run)
        series.append(
            svg.Series(
                "loss (from the rollback events)",
                [p[0] for p in pts],
                [p[1] for p in pts],
                dots=True,
            )
        )
        loss_at = dict(pts)
    return svg.chart(
        "Loss", series, height=280, spans=_rollback_spans(run), marks=_marks(run, loss_at)
    )


def extra_charts(run: Run) -> list[str]:
    kept = list(run.kept.values())
    out = []
    if any(keys.GRAD_NORM in r for r in kept):
        xs, ys = _series(kept, keys.GRAD_NORM)
        out.append(
            svg.chart(
                "Gradient norm",
                [svg.Series("grad norm", xs, ys, "#188038")],
                spans=_rollback_spans(run),
            )
        )
    counters = []
    for key, name, color in (
        (keys.SKIPPED, "guard skips (cumulative)", "#e8710a"),
        (keys.OVERFLOW, "fp16 overflows (cumulative)", "#a142f4"),
    ):
        if any(key in r for r in kept):
            xs, total, acc = [], [], 0
            for r in kept:
                if key in r:
                    acc += bool(_number(r[key]))
                    xs.append(int(r["step"]))
                    total.append(float(acc))
            counters.append(svg.Series(name, xs, total, color))
    if any(keys.SKIP_STREAK in r for r in kept):
        xs, ys = _series(kept, keys.SKIP_STREAK)
        counters.append(svg.Series("skip streak", xs, ys, "#777", 1.0, "3 2"))
    if counters:
        out.append(svg.chart("Skip and overflow counters", counters, log_y=False))
    if any(keys.LOSS_SCALE in r for r in kept):
        xs, ys = _series(kept, keys.LOSS_SCALE)
        out.append(svg.chart("Loss scale", [svg.Series("loss scale", xs, ys, "#a142f4")]))
    return out


# ---------------------------------------------------------------------- the page


def _e(v: Any) -> str:
    return html.escape(str(v))


def _num(v: Any) -> str:
    f = _number(v)
    if f is None:
        return _e(v)
    if math.isfinite(f) and f == int(f) and abs(f) < 1e12 and not isinstance(v, float):
        return str(int(f))
    return f"{f:.6g}"


def _table(rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _evidence_chart(t: dict[str, Any]) -> str:
    ev, (c, onset) = t.get("evidence", {}), t.get("window", [0, 0])
    steps = list(range(c, onset + 1))
    styles = {
        "run": ("the run (before the rollback)", "#777", 3.0, ""),
        "restored": (f"replay from checkpoint {t.get('restored_step')}", "#1f5fbf", 1.5, ""),
        "earlier": (f"replay from checkpoint {t.get('earlier_step')}", "#e8710a", 1.5, "5 3"),
        "culprit": (f"each batch alone from {t.get('earlier_step')}", "#c5221f", 1.0, "1 3"),
    }
    series = []
    for name, (label, color, width, dash) in styles.items():
        ys = ev.get(name)
        if isinstance(ys, list) and len(ys) == len(steps):
            series.append(
                svg.Series(label, steps, [_number(y) for y in ys], color, width, dash, dots=True)
            )
    marks = []
    if _number(ev.get("rerun")) is not None:
        marks.append(svg.Mark(onset, _number(ev["rerun"]), "the onset step re-run", "#a142f4"))
    if not series:
        return ""
    return svg.chart(
        "Replayed losses (triage evidence) by step of the window", series, height=200, marks=marks
    )


def _attribution(a: dict[str, Any] | None) -> str:
    if not a:
        return "<p>No attribution (the onset step was not replayed).</p>"
    parts = []
    j = a.get("first_jump")
    if j:
        parts.append(
            f"<p><b>First layer whose gradient norm jumped:</b> <code>{_e(j['layer'])}</code> "
            f"({_num(j['grad_norm'])}, {_num(j['ratio'])}× its baseline {_num(j['baseline'])}); "
            f"largest jump: <code>{_e(j['largest'])}</code>.</p>"
        )
    else:
        parts.append(
            "<p>No layer's gradient norm jumped 10× over its baseline "
            "(or the step reports no per-layer norms).</p>"
        )
    hints = a.get("hints", [])
    if hints:
        items = "".join(
            f"<li><b>{_e(h['cause'].replace('_', ' '))}</b>: {_e(h['evidence'])}. "
            f"<i>Remedy:</i> {_e(h['remedy'])}</li>"
            for h in hints
        )
        parts.append(f"<p><b>Hints</b> (signals, never certainties):</p><ul>{items}</ul>")
    else:
        parts.append("<p>No attribution rule fired.</p>")
    if a.get("signals"):
        sig = ", ".join(f"{_e(k)} = {_num(v)}" for k, v in a["signals"].items())
        parts.append(f"<p>Counters at the onset: {sig}.</p>")
    return "".join(parts)


def event_panels(run: Run) -> str:
    """One panel per rollback: window, detection, skip, triage verdict, attribution."""
    out = []
    for k, rb in enumerate(run.of("rollback"), 1):
        after = run.events[run.events.index(rb) + 1 :]
        skip = next((e for e in after if e.kind == "skip" and e.step == rb.step), None)
        tri = next((e for e in after[:3] if e.kind == "triage" and e.step == rb.step), None)
        d = rb.details
        rows = [
            ("detected at step", _num(rb.step)),
            ("onset (first anomalous step)", _num(d["onset"])),
            (
                "restored checkpoint",
                f"{_num(d['restored_step'])}"
                + ("" if d.get("margin_met", True) else " (closer than rollback_margin)"),
            ),
            ("why", _e(d.get("reason", ""))),
        ]
        if skip is not None:
            a, b = skip.details["range"]
            rows.append(
                (
                    "data skipped",
                    f"[{a}, {b}) — {skip.details['length']} batches"
                    + (" (doubled: consecutive rollback)" if skip.details["doubled"] else ""),
                )
            )
        body = [_table(rows)]
        lo, hi = int(d["restored_step"]) - 10, rb.step + 10
        window = [r for r in run.rows if lo <= int(r["step"]) <= hi]
        if window:
            sub = Run(run.directory, [rb], {}, window)
            body.append(
                svg.chart(
                    f"The window around the onset (steps {max(lo, 0)}..{hi})",
                    [svg.Series("loss (final trajectory)", *_series(sub.kept.values(), keys.LOSS))]
                    + [
                        svg.Series(
                            "loss on the rolled-back branch",
                            *_series(seg, keys.LOSS),
                            "#c5221f",
                            1.2,
                            "5 3",
                            True,
                        )
                        for seg in sub.abandoned
                    ],
                    height=200,
                    spans=_rollback_spans(sub),
                )
            )
        if tri is None:
            body.append(
                "<p><b>Triage:</b> off for this run (<code>triage=False</code>); "
                "the whole window was skipped, as PaLM did.</p>"
            )
        else:
            t = tri.details
            color = VERDICT_COLORS.get(t["verdict"], "#777")
            culprits = ", ".join(map(str, t.get("culprits", []))) or "none"
            host = t.get("host", {})
            body.append(
                f'<p><b>Triage verdict:</b> <span class="badge" style="background:{color}">'
                f"{_e(t['verdict'])}</span> {_e(t['reason'])}</p>"
                f"<p><b>Suggested remedy:</b> {_e(t['remedy'])}</p>"
                + _table(
                    [
                        ("culprit batches (data indices)", _e(culprits)),
                        ("skip narrowed to the culprits", "yes" if t.get("narrowed") else "no"),
                        ("replayed steps", f"{_num(t.get('steps'))} in {_num(t.get('seconds'))} s"),
                        (
                            "replayed on",
                            _e(
                                f"process {host.get('process_index')}, "
                                f"{host.get('platform')} devices {host.get('device_ids')}"
                            ),
                        ),
                    ]
                )
            )
            body.append(_evidence_chart(t))
            body.append("<h4>Attribution at the onset</h4>" + _attribution(t.get("attribution")))
        out.append(
            f'<section class="event"><h3>Rollback {k} at step {rb.step}</h3>'
            + "".join(body)
            + "</section>"
        )
    for e in run.of("diverged"):
        out.append(
            f'<section class="event"><h3>Gave up at step {e.step}</h3>'
            f"<pre>{_e(e.details.get('message', ''))}</pre></section>"
        )
    return "".join(out) or "<p>No rollback happened in this run.</p>"


CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:940px;
color:#202124}
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}th,td{border:1px solid #ddd;padding:4px 8px;
text-align:left;font-size:13px;vertical-align:top}th{background:#f5f5f5;font-weight:600}
.event{border:1px solid #ccc;border-radius:6px;padding:8px 14px;margin:14px 0}
.badge{color:#fff;border-radius:4px;padding:1px 8px;font-weight:600}
p,li{font-size:14px;line-height:1.45}.muted{color:#666;font-size:12px}
"""

GUIDE = (
    "<p>This page shows one training run watched by stabljax's rollback controller. When "
    "the loss spiked or diverged, the controller went back to an earlier checkpoint "
    "(<i>rollback</i>) and never fed the batches around the spike again (<i>skipped "
    "data</i>). With triage on, before resuming it replayed the suspect window on a copy "
    "of the state to tell <b>data</b> (the batches spike from an earlier checkpoint too), "
    "<b>state</b> (only this batch with this state: PaLM's case) and "
    "<b>nondeterministic</b> (the same step gives different numbers: suspect hardware) "
    "apart. Shaded bands in the charts are discarded (rolled-back) steps; red triangles "
    "are detections; dashed vertical lines are rollbacks; ✕ marks a non-finite value.</p>"
)


def render(run: Run, *, title: str | None = None) -> str:
    """The report as one self-contained HTML string (inline SVG and CSS, no script)."""
    title = title or f"Stability report: {run.directory.name}"
    s = summary(run)
    ranges = [tuple(r) for r in run.ledger.get("skipped_ranges", [])] or [
        tuple(e.details["range"]) for e in run.of("skip")
    ]
    end = run.ledger.get("data_index") or max([b for _, b in ranges] + [1])
    culprits = [c for e in run.of("triage") for c in e.details.get("culprits", [])]
    charts = [
        loss_chart(run),
        *extra_charts(run),
        svg.strip(
            "Data: fed (blue) and skipped (orange) batch indices",
            int(end),
            ranges,
            culprits=culprits,
        ),
    ]
    note = (
        ""
        if run.rows
        else (
            '<p class="muted">No metrics.jsonl: the loss curve shows only the losses the rollback '
            "events recorded. Pass <code>metrics_writer=JsonlMetricsWriter(DIR/'metrics.jsonl')"
            "</code> to <code>run</code> for every step.</p>"
        )
    )
    made = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>"
        f'<p class="muted">{_e(run.directory)} · events schema {SCHEMA_VERSION} · '
        f"written {made}</p>{GUIDE}<h2>Summary</h2>"
        + _table([(k, _e(v)) for k, v in s.items()])
        + "<h2>Training curves</h2>"
        + note
        + "".join(charts)
        + "<h2>Events</h2>"
        + event_panels(run)
        + "</body></html>"
    )
