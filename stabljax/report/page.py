"""Renders the stability report of a run (:class:`~stabljax.report.read.Run`) as one HTML page.

The run directory may come from elsewhere, so every value read from it is data: each
string is escaped (``html.escape``, attributes quoted), a number is formatted only after a
type check (anything else is shown as escaped JSON), and a detail of the wrong type or
shape leaves its cell, mark or chart out instead of failing the page. The page has no
script, no link and no network reference.
"""

from __future__ import annotations

import collections
import datetime
import html
import json
import math
from typing import Any

from stabljax.control.events import SCHEMA_VERSION, Event
from stabljax.metrics import GRAD_NORM, LOSS, LOSS_SCALE, OVERFLOW, SKIP_STREAK, SKIPPED
from stabljax.report import svg
from stabljax.report.read import Run
from stabljax.telemetry import spike_score

VERDICT_COLORS = {
    "data": "#e8710a",
    "state": "#1f5fbf",
    "nondeterministic": "#a142f4",
    "inconclusive": "#777",
}
DETECTIONS = ("spike", "divergence", "slow_divergence")
MAX_WINDOW = 10_000  # the most steps a triage evidence chart draws
MAX_WARNINGS = 50  # read warnings listed on the page (the rest are counted)
NONFINITE = ("nan", "inf", "-inf")

# ------------------------------------------------------------------ typed access
# Event details come from a file: each accessor returns the value only if it has the type
# the page needs, else None (or an empty container).


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _pair(v: Any) -> tuple[int, int] | None:
    """``[a, b]`` with integers ``a <= b``, else None."""
    if isinstance(v, list | tuple) and len(v) == 2:
        a, b = _int(v[0]), _int(v[1])
        if a is not None and b is not None and a <= b:
            return a, b
    return None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _text(v: Any) -> str:
    """A string as itself, anything else as JSON (for display; escape before output)."""
    if isinstance(v, str):
        return v
    try:
        return json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(v)


def _number(v: Any) -> float | None:
    """A metric value as a float: numbers, bools (0/1) and the writers' non-finite strings."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        try:
            return float(v)
        except OverflowError:
            return None
    if isinstance(v, str) and v in NONFINITE:
        return float(v)
    return None


# ------------------------------------------------------------------------ figures


def skipped_ranges(run: Run) -> list[tuple[int, int]]:
    """The ledger's skipped ranges, else the skip events' (well-formed ones only)."""
    ranges = [r for r in map(_pair, _list(run.ledger.get("skipped_ranges"))) if r is not None]
    if not ranges:
        ranges = [r for e in run.of("skip") if (r := _pair(e.details.get("range"))) is not None]
    return ranges


def summary(run: Run) -> dict[str, Any]:
    """The summary table's numbers."""
    rollbacks = run.of("rollback")
    ranges = skipped_ranges(run)
    verdicts = collections.Counter(_text(e.details.get("verdict")) for e in run.of("triage"))
    steps = [e.step for e in run.events] + list(run.kept)
    final = max([_int(run.ledger.get("step")) or 0, *steps], default=0)
    counted = _int(run.ledger.get("rollbacks"))
    return {
        "final step": final,
        "steps lost (computed, then rolled back)": steps_lost(run),
        "batches skipped": sum(b - a for a, b in ranges),
        "skipped ranges": ", ".join(f"[{a}, {b})" for a, b in ranges) or "none",
        "rollbacks": len(rollbacks) if counted is None else counted,
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
            _text(e.details.get("reason", "")).startswith("resume") for e in run.of("restore")
        ),
        "diverged": "yes" if run.of("diverged") else "no",
        **spike_scores(run),
    }


def spike_scores(run: Run) -> dict[str, str]:
    """OLMo 2's spike score (:func:`stabljax.telemetry.spike_score`) of the loss and the
    grad norm over the final trajectory (metrics.jsonl's kept rows), as table cells."""
    out = {}
    for key, label in ((LOSS, "loss"), (GRAD_NORM, "grad norm")):
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
    restored = [(e.step, _int(e.details.get("restored_step"))) for e in run.of("rollback")]
    return sum(step + 2 - r for step, r in restored if r is not None)


def _series(rows, key: str) -> tuple[list[float], list[float | None]]:
    pairs = [(int(r["step"]), _number(r.get(key))) for r in rows if key in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _loss_points(run: Run) -> list[tuple[int, float | None]]:
    """Without metrics.jsonl: the losses the rollback events list."""
    pts = {}
    for e in run.of("rollback"):
        for item in _list(e.details.get("losses")):
            if isinstance(item, list) and len(item) == 3 and _int(item[0]) is not None:
                pts[item[0]] = _number(item[1])
    return sorted(pts.items())


def _rollback_spans(run: Run) -> list[svg.Span]:
    out = []
    for e in run.of("rollback"):
        restored = _int(e.details.get("restored_step"))
        if restored is not None:
            label = f"rolled back: steps {restored}..{e.step} were discarded"
            out.append(svg.Span(restored, e.step, label))
    return out


def _marks(run: Run, loss_at: dict[int, float | None]) -> list[svg.Mark]:
    out = []
    for e in run.of(*DETECTIONS):
        # A spike's own value is the loss the run saw (the kept row may be a replay).
        y = _number(e.details.get("value")) if e.kind == "spike" else None
        y = loss_at.get(e.step) if e.kind == "spike" and y is None else y
        reason = _text(e.details.get("reason", ""))
        out.append(svg.Mark(e.step, y, f"{e.kind} at step {e.step}: {reason}"))
    for e in run.of("rollback"):
        restored = _text(e.details.get("restored_step"))
        out.append(svg.Mark(e.step, None, f"rollback at step {e.step} to {restored}", "#444"))
    return out


def loss_chart(run: Run) -> str:
    kept, series = run.kept, []
    if kept:
        xs, ys = _series(kept.values(), LOSS)
        series.append(svg.Series("loss (the final trajectory)", xs, ys))
        for k, seg in enumerate(run.abandoned):
            xs, ys = _series(seg, LOSS)
            name = "loss on a rolled-back branch"
            series.append(svg.Series(name if k == 0 else name + " ", xs, ys, "#c5221f", 1.2, "5 3"))
        loss_at = {s: _number(r.get(LOSS)) for r in run.rows for s in [int(r["step"])]}
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
    if any(GRAD_NORM in r for r in kept):
        xs, ys = _series(kept, GRAD_NORM)
        out.append(
            svg.chart(
                "Gradient norm",
                [svg.Series("grad norm", xs, ys, "#188038")],
                spans=_rollback_spans(run),
            )
        )
    counters = []
    for key, name, color in (
        (SKIPPED, "guard skips (cumulative)", "#e8710a"),
        (OVERFLOW, "fp16 overflows (cumulative)", "#a142f4"),
    ):
        if any(key in r for r in kept):
            xs, total, acc = [], [], 0
            for r in kept:
                if key in r:
                    acc += bool(_number(r[key]))
                    xs.append(int(r["step"]))
                    total.append(float(acc))
            counters.append(svg.Series(name, xs, total, color))
    if any(SKIP_STREAK in r for r in kept):
        xs, ys = _series(kept, SKIP_STREAK)
        counters.append(svg.Series("skip streak", xs, ys, "#777", 1.0, "3 2"))
    if counters:
        out.append(svg.chart("Skip and overflow counters", counters, log_y=False))
    if any(LOSS_SCALE in r for r in kept):
        xs, ys = _series(kept, LOSS_SCALE)
        out.append(svg.chart("Loss scale", [svg.Series("loss scale", xs, ys, "#a142f4")]))
    return out


# ---------------------------------------------------------------------- the page


def _e(v: Any) -> str:
    """Escaped text of ``v`` (a string as itself, anything else as JSON), quotes included."""
    return html.escape(_text(v), quote=True)


def _num(v: Any) -> str:
    """A number formatted; anything else (a string, a list, a bool) shown escaped."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return _e(v)
    if isinstance(v, int):
        return str(v)
    return f"{v:.6g}" if math.isfinite(v) else _e(str(v))


def _table(rows: list[tuple[str, str]]) -> str:
    """Rows of (label, cell HTML): each cell is built escaped by its caller."""
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _evidence_chart(t: dict[str, Any]) -> str:
    ev, window = _dict(t.get("evidence")), _pair(t.get("window"))
    if window is None or window[1] - window[0] > MAX_WINDOW:
        return ""
    c, onset = window
    steps = list(range(c, onset + 1))
    restored, earlier = _text(t.get("restored_step")), _text(t.get("earlier_step"))
    styles = {
        "run": ("the run (before the rollback)", "#777", 3.0, ""),
        "restored": (f"replay from checkpoint {restored}", "#1f5fbf", 1.5, ""),
        "earlier": (f"replay from checkpoint {earlier}", "#e8710a", 1.5, "5 3"),
        "culprit": (f"each batch alone from {earlier}", "#c5221f", 1.0, "1 3"),
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


def _attribution(a: Any) -> str:
    a = _dict(a)
    if not a:
        return "<p>No attribution (the onset step was not replayed).</p>"
    parts = []
    j = _dict(a.get("first_jump"))
    if j:
        parts.append(
            f"<p><b>First layer whose gradient norm jumped:</b> <code>{_e(j.get('layer'))}</code>"
            f" ({_num(j.get('grad_norm'))}, {_num(j.get('ratio'))}× its baseline "
            f"{_num(j.get('baseline'))}); largest jump: <code>{_e(j.get('largest'))}</code>.</p>"
        )
    else:
        parts.append(
            "<p>No layer's gradient norm jumped 10× over its baseline "
            "(or the step reports no per-layer norms).</p>"
        )
    hints = [_dict(h) for h in _list(a.get("hints"))]
    if hints:
        items = "".join(
            f"<li><b>{_e(_text(h.get('cause')).replace('_', ' '))}</b>: "
            f"{_e(h.get('evidence'))}. <i>Remedy:</i> {_e(h.get('remedy'))}</li>"
            for h in hints
        )
        parts.append(f"<p><b>Hints</b> (signals, never certainties):</p><ul>{items}</ul>")
    else:
        parts.append("<p>No attribution rule fired.</p>")
    if _dict(a.get("signals")):
        sig = ", ".join(f"{_e(k)} = {_num(v)}" for k, v in a["signals"].items())
        parts.append(f"<p>Counters at the onset: {sig}.</p>")
    return "".join(parts)


def _skip_cell(skip: Event) -> str:
    d = skip.details
    r = _pair(d.get("range"))
    where = f"[{r[0]}, {r[1]})" if r is not None else _e(d.get("range"))
    doubled = " (doubled: consecutive rollback)" if d.get("doubled") is True else ""
    return f"{where} — {_num(d.get('length'))} batches{doubled}"


def _window_chart(run: Run, rb: Event, restored: int) -> str:
    lo, hi = restored - 10, rb.step + 10
    window = [r for r in run.rows if lo <= int(r["step"]) <= hi]
    if not window:
        return ""
    sub = Run(run.directory, [rb], {}, window)
    name = "loss on the rolled-back branch"
    abandoned = [
        svg.Series(name, *_series(seg, LOSS), "#c5221f", 1.2, "5 3", True) for seg in sub.abandoned
    ]
    return svg.chart(
        f"The window around the onset (steps {max(lo, 0)}..{hi})",
        [svg.Series("loss (final trajectory)", *_series(sub.kept.values(), LOSS))] + abandoned,
        height=200,
        spans=_rollback_spans(sub),
    )


def _triage_panel(t: dict[str, Any]) -> list[str]:
    verdict = t.get("verdict")
    color = VERDICT_COLORS.get(verdict, "#777") if isinstance(verdict, str) else "#777"
    culprits = ", ".join(_text(c) for c in _list(t.get("culprits"))) or "none"
    host = _dict(t.get("host"))
    on = (
        f"process {_text(host.get('process_index'))}, {_text(host.get('platform'))} "
        f"devices {_text(host.get('device_ids'))}"
    )
    return [
        f'<p><b>Triage verdict:</b> <span class="badge" style="background:{_e(color)}">'
        f"{_e(verdict)}</span> {_e(t.get('reason'))}</p>"
        f"<p><b>Suggested remedy:</b> {_e(t.get('remedy'))}</p>"
        + _table(
            [
                ("culprit batches (data indices)", _e(culprits)),
                ("skip narrowed to the culprits", "yes" if t.get("narrowed") is True else "no"),
                ("replayed steps", f"{_num(t.get('steps'))} in {_num(t.get('seconds'))} s"),
                ("replayed on", _e(on)),
            ]
        ),
        _evidence_chart(t),
        "<h4>Attribution at the onset</h4>" + _attribution(t.get("attribution")),
    ]


def event_panels(run: Run) -> str:
    """One panel per rollback: window, detection, skip, triage verdict, attribution."""
    out = []
    for k, rb in enumerate(run.of("rollback"), 1):
        after = run.events[run.events.index(rb) + 1 :]
        skip = next((e for e in after if e.kind == "skip" and e.step == rb.step), None)
        tri = next((e for e in after[:3] if e.kind == "triage" and e.step == rb.step), None)
        d = rb.details
        margin = "" if d.get("margin_met", True) is not False else " (closer than rollback_margin)"
        rows = [
            ("detected at step", _num(rb.step)),
            ("onset (first anomalous step)", _num(d.get("onset"))),
            ("restored checkpoint", _num(d.get("restored_step")) + margin),
            ("why", _e(d.get("reason", ""))),
        ]
        if skip is not None:
            rows.append(("data skipped", _skip_cell(skip)))
        body = [_table(rows)]
        restored = _int(d.get("restored_step"))
        if restored is not None:
            body.append(_window_chart(run, rb, restored))
        if tri is None:
            body.append(
                "<p><b>Triage:</b> off for this run (<code>triage=False</code>); "
                "the whole window was skipped, as PaLM did.</p>"
            )
        else:
            body.extend(_triage_panel(tri.details))
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


def read_warnings(run: Run) -> str:
    """The lines skipped while reading the run, listed (escaped) on the page."""
    if not run.warnings:
        return ""
    items = "".join(f"<li><code>{_e(w)}</code></li>" for w in run.warnings[:MAX_WARNINGS])
    more = len(run.warnings) - MAX_WARNINGS
    tail = f"<p>... and {more} more.</p>" if more > 0 else ""
    return (
        f"<h2>Lines skipped while reading</h2><p>{len(run.warnings)} input lines were not "
        f"what stabljax writes and were left out of this page:</p><ul>{items}</ul>{tail}"
    )


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
    title = title if title is not None else f"Stability report: {run.directory.name}"
    s = summary(run)
    ranges = skipped_ranges(run)
    end = _int(run.ledger.get("data_index")) or max([b for _, b in ranges] + [1])
    culprits = [
        c for e in run.of("triage") for c in _list(e.details.get("culprits")) if _int(c) is not None
    ]
    charts = [
        loss_chart(run),
        *extra_charts(run),
        svg.strip(
            "Data: fed (blue) and skipped (orange) batch indices", end, ranges, culprits=culprits
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
        f'<p class="muted">{_e(str(run.directory))} · events schema {SCHEMA_VERSION} · '
        f"written {made}</p>{GUIDE}<h2>Summary</h2>"
        + _table([(k, _e(v)) for k, v in s.items()])
        + "<h2>Training curves</h2>"
        + note
        + "".join(charts)
        + "<h2>Events</h2>"
        + event_panels(run)
        + read_warnings(run)
        + "</body></html>"
    )
