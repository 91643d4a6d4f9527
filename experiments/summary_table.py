"""Regenerates the table at the top of experiments/README.md and the experiment claims in
the top-level README.md from every results.json.

    python -m experiments.summary_table [--check]

One row per remedy of every experiment's ``summary``, and one claims line per experiment;
``--check`` exits 1 when either README block differs from what the results give (a test
runs it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from experiments.common import RESULTS

README = pathlib.Path(__file__).resolve().parent / "README.md"
TOP_README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- summary-table:start -->", "<!-- summary-table:end -->"
CLAIMS = ("<!-- experiment-claims:start -->", "<!-- experiment-claims:end -->")
ORDER = (
    "spike_recovery",
    "adam_eps",
    "lr_sensitivity",
    "warmup",
    "clipping",
    "precision",
    "init_schemes",
)


def _num(x) -> str:
    return f"{float(x):+.3g}" if isinstance(x, int | float) else str(x)


def _p(x) -> str:
    if x is None:
        return "—"
    x = float(x)
    return "nan" if x != x else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def _summaries(results: pathlib.Path) -> list[tuple[str, dict | None]]:
    names = [n for n in ORDER if (results / n / "results.json").exists()]
    names += sorted(
        p.parent.name
        for p in results.glob("*/results.json")
        if p.parent.name not in ORDER and p.parent.name != "bench"
    )
    return [
        (n, json.loads((results / n / "results.json").read_text()).get("summary")) for n in names
    ]


def _yes(x) -> str:
    return "n/a" if x is None else ("yes" if x else "no")


def table(results: pathlib.Path = RESULTS) -> str:
    """The Markdown table of every ``<results>/<name>/results.json`` summary."""
    lines = [
        "| experiment | failure made by the model | failure metric | seeds | sizes "
        "| comparison (regime) | primary metric (remedy − base) | mean [95% CI] | CI "
        "| p (Holm) | mechanism moved | claim met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in _summaries(results):
        if s is None:
            lines.append(f"| {name} | (no summary) | | | | | | | | | | |")
            continue
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
            lines.append(
                head
                + f"| {rname} | {r['metric']} | {_num(r['effect_mean'])} [{_num(lo)}, {_num(hi)}] "
                f"| {ci} | {_p(r.get('p_holm'))} | {_yes(r['mechanism_moved'])} "
                f"| {'**yes**' if r.get('claim_met') else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def claims(results: pathlib.Path = RESULTS) -> str:
    """The top-level README's claims, one line per experiment, from the summaries: the
    comparisons whose claim is met (effect, interval, Holm p, regime in the name) or the
    experiment's ``not_shown`` line."""
    out = []
    for name, s in _summaries(results):
        if s is None:
            continue
        met = {k: r for k, r in s["remedies"].items() if r.get("claim_met")}
        where = f"{', '.join(map(str, s['sizes']))}, {s['seeds']} seeds"
        made = s.get("failure_made_by_model")
        kind = {True: "failure made by the model", False: "injected failure (stress test)"}.get(
            made, "failure source not recorded"
        )
        if met:
            parts = [
                f"{k}: {_num(r['effect_mean'])} [{_num(r['ci95'][0])}, {_num(r['ci95'][1])}]"
                + (f", Holm p {_p(r['p_holm'])}" if r.get("p_holm") is not None else "")
                for k, r in met.items()
            ]
            metric = next(iter(met.values()))["metric"]
            out.append(f"- **{name}** ({where}; {kind}), {metric}: " + "; ".join(parts) + ".")
        else:
            why = s.get("not_shown") or s.get("note") or "no comparison met its claim"
            out.append(f"- **{name}** ({where}; {kind}): not shown. {why}")
    return "\n".join(out) + "\n"


def render(readme: str, body: str, markers: tuple[str, str] = (START, END)) -> str:
    """``readme`` with the text between the markers replaced by ``body``."""
    start, end = markers
    if start not in readme or end not in readme:
        raise ValueError(f"README has no {start} ... {end} block")
    head, rest = readme.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}{end}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.summary_table", description=__doc__.splitlines()[0]
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the README table is stale")
    args = p.parse_args(argv)
    targets = [(README, table(), (START, END)), (TOP_README, claims(), CLAIMS)]
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
