"""Regenerates the table at the top of experiments/README.md and the experiment claims on
the documentation's experiments page (docs/experiments.md) from every results.json.

    python -m experiments.summary_table [--check] [--rederive] [--replot]

One row per remedy of every experiment's ``summary``, and one claims line per experiment
(:mod:`experiments.claims`: LR multiples, stress tests, best loss per arm); ``--check``
exits 1 when a generated block differs from what the results give (a test runs it);
``--rederive`` first writes each summary's ``best_per_arm`` into its results.json from
the rows stored there (no training run).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys

from experiments.claims import (
    best_block,
    claims,
    num,
    p_text,
    payloads,
    rederive,
    regime,
    summaries,
    verdicts,
    where_text,
)
from experiments.common import RESULTS
from experiments.holm_family import one_family

README = pathlib.Path(__file__).resolve().parent / "README.md"
#: The page that carries the experiment claims (the generated ``CLAIMS`` block).
CLAIMS_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "experiments.md"
START, END = "<!-- summary-table:start -->", "<!-- summary-table:end -->"
CLAIMS = ("<!-- experiment-claims:start -->", "<!-- experiment-claims:end -->")
BEST = ("<!-- best-loss:start -->", "<!-- best-loss:end -->")
#: The experiments whose module has ``replot(out)`` (figures from a stored results.json).
REPLOT = (
    "adam_eps",
    "precision",
    "warmup",
    "clipping",
    "init_schemes",
    "qk_clip",
    "lr_sensitivity",
)


def _yes(x) -> str:
    return "n/a" if x is None else ("yes" if x else "no")


def table(results: pathlib.Path = RESULTS) -> str:
    """The Markdown table of every ``<results>/<name>/results.json`` summary: a met claim
    above 10x the base's best LR, or from a failure set by hand, reads "stress test (not
    counted)", and a comparison that does not name its LR multiple gets it appended."""
    lines = [
        "| experiment | failure made by the model | failure metric | seeds | sizes "
        "| comparison (regime) | primary metric (remedy − base) | mean [95% CI] | CI "
        "| p (Holm) | mechanism moved | claim met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stored = dict(payloads(results))
    for name, s in summaries(results):
        if s is None:
            lines.append(f"| {name} | (no summary) | | | | | | | | | | |")
            continue
        best = best_block(name, stored[name]) or s.get("best_per_arm")
        one_family(s, best)
        made = s.get("failure_made_by_model")
        head = (
            f"| {name} | {_yes(made)} "
            f"| {s['failure_metric']} | {s['seeds']} | {', '.join(map(str, s['sizes']))} "
        )
        ci = "t" if s.get("interval", "").startswith("paired t") else "bootstrap"
        if not s["remedies"]:
            lines.append(head + "| (none) | | | | | | |")
        for rname, r in s["remedies"].items():
            lo, hi = r["ci95"]
            reg = regime(name, rname, s, best)
            verdict = "no"
            if r.get("claim_met"):
                verdict = "stress test (not counted)" if reg["stress"] else "**yes**"
            lines.append(
                head + f"| {where_text(rname, reg, [])} | {r['metric']} "
                f"| {num(r['effect_mean'])} [{num(lo)}, {num(hi)}] "
                f"| {ci} | {p_text(r.get('p_holm'))} | {_yes(r['mechanism_moved'])} | {verdict} |"
            )
    return "\n".join(lines) + "\n"


def best_table(results: pathlib.Path = RESULTS) -> str:
    """The Markdown table of each arm's best loss at its own best LR against the base's,
    re-derived from the stored rows (:func:`experiments.claims.best_block`), with the
    verdict: lowers the best loss, or only widens the stable LR range, or neither."""
    lines = [
        "| experiment | arm | best LR | best loss (mean [95% t-CI]) | remedy − base at each "
        "one's best LR [95% paired t-CI] | p (Holm, one family with the claims) | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, payload in payloads(results):
        best = best_block(name, payload)
        if not best:
            continue
        one_family(payload["summary"], best)
        verdict = verdicts(name, payload["summary"], best)
        for group, arms in best.items():
            for arm, e in arms.items():
                b = e["best_loss"]
                vs = e.get("vs_base")
                diff = (
                    "base"
                    if vs is None
                    else f"{num(vs['effect_mean'])} "
                    + (f"[{num(vs['ci95'][0])}, {num(vs['ci95'][1])}]")
                )
                key = f"{group} {arm}".strip()
                lines.append(
                    f"| {name} | {key} | {e['best_lr']:g} | {b['mean']:.3f} "
                    f"[{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}] | {diff} "
                    f"| {p_text(vs and vs.get('p_holm'))} | {verdict.get(key, '')} |"
                )
    return "\n".join(lines) + "\n"


def render(readme: str, body: str, markers: tuple[str, str] = (START, END)) -> str:
    """``readme`` with the text between the markers replaced by ``body``."""
    start, end = markers
    if start not in readme or end not in readme:
        raise ValueError(f"the page has no {start} ... {end} block")
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}{end}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.summary_table", description=__doc__.splitlines()[0]
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the README table is stale")
    p.add_argument(
        "--rederive",
        action="store_true",
        help="write each summary's best_per_arm into its results.json, derived from the stored "
        "per-LR, per-seed rows (no training run)",
    )
    p.add_argument(
        "--replot",
        action="store_true",
        help="redraw the LR figures of every experiment with a replot() from its stored "
        "results.json (no training run)",
    )
    args = p.parse_args(argv)
    if args.replot:
        for name in REPLOT:
            importlib.import_module(f"experiments.{name}").replot(RESULTS / name)
            print(f"{name}: figures redrawn from results.json")
    if args.rederive:
        for _, path in rederive():
            print(f"{path}: summary.best_per_arm re-derived from its rows")
    targets = [
        (README, table(), (START, END)),
        (README, best_table(), BEST),
        (CLAIMS_PAGE, claims(), CLAIMS),
    ]
    stale = []
    for path, body, markers in targets:
        text = path.read_text()
        new = render(text, body, markers)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check:
        for path in stale:
            print(
                f"{path.name}'s generated block is stale: run python -m experiments.summary_table"
            )
        return 1 if stale else 0
    print(table())
    print(claims())
    return 0


if __name__ == "__main__":
    sys.exit(main())
