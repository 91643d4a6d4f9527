"""Regenerates the table at the top of experiments/README.md from every results.json.

    python -m experiments.summary_table [--check]

One row per remedy of every experiment's ``summary``; ``--check`` exits 1 when the README
table differs from the one the results give (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from experiments.common import RESULTS

README = pathlib.Path(__file__).resolve().parent / "README.md"
START, END = "<!-- summary-table:start -->", "<!-- summary-table:end -->"
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


def table(results: pathlib.Path = RESULTS) -> str:
    """The Markdown table of every ``<results>/<name>/results.json`` summary."""
    lines = [
        "| experiment | instability reproduced | failure metric | seeds | sizes | remedy "
        "| metric (remedy − base) | mean [95% CI] | mechanism moved | claim met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = [n for n in ORDER if (results / n / "results.json").exists()]
    names += sorted(
        p.parent.name
        for p in results.glob("*/results.json")
        if p.parent.name not in ORDER and p.parent.name != "bench"
    )
    for name in names:
        payload = json.loads((results / name / "results.json").read_text())
        s = payload.get("summary")
        if s is None:
            lines.append(f"| {name} | (no summary) | | | | | | | | |")
            continue
        head = (
            f"| {name} | {'yes' if s['instability_reproduced'] else 'no'} "
            f"| {s['failure_metric']} | {s['seeds']} | {', '.join(map(str, s['sizes']))} "
        )
        if not s["remedies"]:
            lines.append(head + "| (none) | | | | |")
        for rname, r in s["remedies"].items():
            lo, hi = r["ci95"]
            lines.append(
                head
                + f"| {rname} | {r['metric']} | {_num(r['effect_mean'])} [{_num(lo)}, {_num(hi)}] "
                f"| {'yes' if r['mechanism_moved'] else 'no'} "
                f"| {'**yes**' if r.get('claim_met') else 'no'} |"
            )
    return "\n".join(lines) + "\n"


def render(readme: str, body: str) -> str:
    """``readme`` with the text between the markers replaced by ``body``."""
    if START not in readme or END not in readme:
        raise ValueError(f"README has no {START} ... {END} block")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{body}{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.summary_table", description=__doc__.splitlines()[0]
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the README table is stale")
    args = p.parse_args(argv)
    text = README.read_text()
    new = render(text, table())
    if args.check:
        if new != text:
            print("experiments/README.md's table is stale: run python -m experiments.summary_table")
            return 1
        return 0
    README.write_text(new)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
