"""Inline SVG line charts for the stability report: no dependencies, no script, no network.

:func:`chart` draws one panel: line series over a shared step axis, optional log scale,
shaded step spans (rollback windows), vertical marks (rollbacks) and point marks
(spikes), with tick labels and a legend. :func:`strip` draws the data-index strip with
the skipped ranges.

Every text and attribute value is escaped (``html.escape``, quoted); numbers are
formatted as numbers, so a caller passes only numbers for positions.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence

WIDTH, LEFT, RIGHT, TOP, BOTTOM = 900, 70, 20, 28, 30


@dataclasses.dataclass
class Series:
    """One line: ``xs``/``ys`` (non-finite ys break the line and are drawn as ✕ marks)."""

    name: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str = "#1f5fbf"
    width: float = 1.5
    dash: str = ""
    dots: bool = False


@dataclasses.dataclass
class Span:
    """A shaded x range with a label (e.g. an abandoned rollback window)."""

    start: float
    end: float
    label: str = ""
    color: str = "#f4b400"


@dataclasses.dataclass
class Mark:
    """A vertical line (``y is None``) or a point marker at ``(x, y)``."""

    x: float
    y: float | None = None
    label: str = ""
    color: str = "#c5221f"


def _esc(s: str) -> str:
    return html.escape(str(s), quote=True)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``.

    Example:
      >>> from stabljax.report.svg import nice_ticks
      >>> nice_ticks(0, 97)
      [0.0, 20.0, 40.0, 60.0, 80.0]
    """
    if not hi > lo:
        return [float(lo)]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out, t = [], first
    while t <= hi + 1e-9 * step:
        out.append(float(round(t, 12)))
        t += step
    return out


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.0e}"
    return f"{v:.4g}"


@dataclasses.dataclass(frozen=True)
class _Frame:
    """A panel's plot area: the data ranges (y in the transformed space) and the pixel box."""

    x0: float
    x1: float
    y0: float
    y1: float
    log_y: bool
    w: float
    h: float

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * self.w

    def py(self, v: float) -> float:  # v already transformed
        return TOP + (1 - (v - self.y0) / (self.y1 - self.y0)) * self.h

    def tf(self, y: float) -> float:
        return math.log10(y) if self.log_y else y

    def drawable(self, y: float | None) -> bool:
        return y is not None and math.isfinite(y) and (y > 0 or not self.log_y)


def _frame(
    series: Sequence[Series],
    spans: Sequence[Span],
    marks: Sequence[Mark],
    x_range: tuple[float, float] | None,
    log_y: bool | None,
    height: int,
) -> _Frame:
    """The ranges a panel shows: every series, span and mark, y padded by 5%."""
    finite = [y for s in series for y in s.ys if y is not None and math.isfinite(y)]
    xs = [x for s in series for x in s.xs] + [m.x for m in marks]
    xs += [v for sp in spans for v in (sp.start, sp.end)]
    if x_range is None:
        x_range = (min(xs), max(xs)) if xs else (0.0, 1.0)
    x0, x1 = x_range
    x1 = x1 if x1 > x0 else x0 + 1
    if log_y is None:
        pos = [y for y in finite if y > 0]
        log_y = bool(pos) and len(pos) == len(finite) and max(pos) / min(pos) > 100
    tf = (lambda y: math.log10(y)) if log_y else (lambda y: y)
    ty = [tf(y) for y in finite if (y > 0 or not log_y)] + [
        tf(m.y) for m in marks if m.y is not None and math.isfinite(m.y) and (m.y > 0 or not log_y)
    ]
    y0, y1 = (min(ty), max(ty)) if ty else (0.0, 1.0)
    if y1 <= y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = 0.05 * (y1 - y0)
    w, h = WIDTH - LEFT - RIGHT, height - TOP - BOTTOM
    return _Frame(x0, x1, y0 - pad, y1 + pad, log_y, w, h)


def _axes(f: _Frame, height: int, y_label: str) -> list[str]:
    """The y grid and tick labels (decades on a log scale), the x ticks, the axis labels."""
    out = []
    if f.log_y:
        ticks = [float(t) for t in range(math.ceil(f.y0), math.floor(f.y1) + 1)]
        labels = [_fmt(10**t) for t in ticks]
    else:
        ticks = nice_ticks(f.y0, f.y1)
        labels = [_fmt(t) for t in ticks]
    for t, lab in zip(ticks, labels, strict=True):
        y = f.py(t)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + f.w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{lab}</text>'
        )
    for t in nice_ticks(f.x0, f.x1, 8):
        x = f.px(t)
        out.append(
            f'<text x="{x:.1f}" y="{TOP + f.h + 16}" font-size="11" text-anchor="middle">'
            f"{_fmt(t)}</text>"
        )
    out.append(
        f'<text x="{LEFT + f.w}" y="{height - 2}" font-size="11" text-anchor="end">step</text>'
    )
    if y_label:
        out.append(f'<text x="4" y="{TOP - 6}" font-size="11">{_esc(y_label)}</text>')
    return out


def _line(f: _Frame, s: Series) -> list[str]:
    """One series: a polyline per finite run, dots if asked, a ✕ at each non-finite value."""
    out, runs, cur, bad = [], [], [], []
    for x, y in zip(s.xs, s.ys, strict=True):
        if y is None or not math.isfinite(y) or (f.log_y and y <= 0):
            bad.append(x)
            if cur:
                runs.append(cur)
            cur = []
        else:
            cur.append(f"{f.px(x):.1f},{f.py(f.tf(y)):.1f}")
    if cur:
        runs.append(cur)
    dash = f' stroke-dasharray="{_esc(s.dash)}"' if s.dash else ""
    color = _esc(s.color)
    for r in runs:
        out.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="{float(s.width):g}"{dash} '
            f'points="{" ".join(r)}"><title>{_esc(s.name)}</title></polyline>'
        )
        if s.dots or len(r) == 1:
            for p in r:
                cx, cy = p.split(",")
                out.append(f'<circle cx="{cx}" cy="{cy}" r="2" fill="{color}"/>')
    for x in bad:
        out.append(
            f'<text x="{f.px(x):.1f}" y="{TOP + 10}" font-size="10" fill="{color}" '
            f'text-anchor="middle">✕<title>{_esc(s.name)}: non-finite at step {x:g}'
            "</title></text>"
        )
    return out


def _mark(f: _Frame, m: Mark) -> str:
    """A vertical dashed line (no y), else a triangle above the point (at the top if off-scale)."""
    x = f.px(m.x)
    if m.y is None:
        return (
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + f.h}" '
            f'stroke="{_esc(m.color)}" stroke-dasharray="4 3">'
            f"<title>{_esc(m.label)}</title></line>"
        )
    y = f.py(f.tf(m.y)) if f.drawable(m.y) else TOP + 8
    return (
        f'<path d="M{x:.1f},{y - 7:.1f} l-5,-8 h10 z" fill="{_esc(m.color)}">'
        f"<title>{_esc(m.label)}</title></path>"
    )


def _legend(series: Sequence[Series], spans: Sequence[Span]) -> list[str]:
    """A swatch and name per series, then per distinct span label (up to its first colon)."""
    out, lx = [], LEFT + 8
    for item, color in [(s.name, s.color) for s in series] + [
        (lab, col) for lab, col in {(sp.label.split(":")[0], sp.color) for sp in spans if sp.label}
    ]:
        out.append(f'<rect x="{lx}" y="{TOP + 6}" width="10" height="10" fill="{_esc(color)}"/>')
        out.append(f'<text x="{lx + 14}" y="{TOP + 15}" font-size="11">{_esc(item)}</text>')
        lx += 24 + 7 * len(item)
    return out


def chart(
    title: str,
    series: Sequence[Series],
    *,
    height: int = 220,
    log_y: bool | None = None,
    spans: Sequence[Span] = (),
    marks: Sequence[Mark] = (),
    x_range: tuple[float, float] | None = None,
    y_label: str = "",
) -> str:
    """One SVG panel; ``log_y=None`` picks a log scale when positive values span > 100×."""
    f = _frame(series, spans, marks, x_range, log_y, height)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_esc(title)}">',
        f'<rect x="{LEFT}" y="{TOP}" width="{f.w}" height="{f.h}" fill="#fff" stroke="#999"/>',
        f'<text x="{LEFT}" y="18" font-size="14" font-weight="bold">{_esc(title)}</text>',
    ]
    for sp in spans:
        a, b = f.px(max(sp.start, f.x0)), f.px(min(sp.end, f.x1))
        out.append(
            f'<rect x="{a:.1f}" y="{TOP}" width="{max(b - a, 1):.1f}" height="{f.h}" '
            f'fill="{_esc(sp.color)}" fill-opacity="0.18"><title>{_esc(sp.label)}</title></rect>'
        )
    out += _axes(f, height, y_label)
    for s in series:
        out += _line(f, s)
    out += [_mark(f, m) for m in marks]
    out += _legend(series, spans)
    out.append("</svg>")
    return "\n".join(out)


def strip(title: str, end: int, ranges: Sequence[Sequence[int]], *, culprits=()) -> str:
    """The data indices ``[0, end)`` as a bar: fed in blue, skipped ranges in orange."""
    height, w = 70, WIDTH - LEFT - RIGHT
    end = max(end, 1)

    def px(i: float) -> float:
        return LEFT + i / end * w

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_esc(title)}">',
        f'<text x="{LEFT}" y="16" font-size="14" font-weight="bold">{_esc(title)}</text>',
        f'<rect x="{LEFT}" y="24" width="{w}" height="18" fill="#1f5fbf" fill-opacity="0.35"/>',
    ]
    for a, b in ranges:
        out.append(
            f'<rect x="{px(a):.1f}" y="24" width="{max(px(b) - px(a), 1.5):.1f}" height="18" '
            f'fill="#e8710a"><title>{_esc(f"skipped [{a}, {b})")}</title></rect>'
        )
    for i in culprits:
        out.append(
            f'<line x1="{px(i + 0.5):.1f}" x2="{px(i + 0.5):.1f}" y1="20" y2="46" '
            f'stroke="#c5221f" stroke-width="2"><title>{_esc(f"culprit batch {i}")}</title></line>'
        )
    for t in nice_ticks(0, end, 8):
        out.append(
            f'<text x="{px(t):.1f}" y="58" font-size="11" text-anchor="middle">{_fmt(t)}</text>'
        )
    out.append(
        f'<text x="{LEFT + w}" y="{height - 2}" font-size="11" text-anchor="end">data index</text>'
    )
    out.append("</svg>")
    return "\n".join(out)
