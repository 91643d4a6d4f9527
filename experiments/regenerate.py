"""One command that regenerates every committed experiment result whose library code changed.

A results.json records the commit it ran on (:func:`experiments.common.library_commit`).
It is **stale** when a file under ``stabljax/control/`` or ``stabljax/optim/``
(:data:`experiments.common.LIBRARY_PATHS`) differs between that commit and the working
tree, when it records no commit, or when the library had uncommitted edits as it ran
(:func:`stale`; ``tests/test_experiments.py`` fails on any stale file).

    python -m experiments.regenerate            # the stale ones, then the READMEs' blocks
    python -m experiments.regenerate --all      # every experiment
    python -m experiments.regenerate --list     # what it would run, and how long each took

Each experiment runs in its own process with its committed command (:data:`PLAN`), then
``python -m experiments.summary_table --rederive`` re-derives the best-loss blocks and the
one Holm family per experiment (:mod:`experiments.holm_family`) and rewrites the READMEs'
generated blocks. Commit the library first: a run on uncommitted library edits is stale.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from experiments.common import LIBRARY_PATHS, RESULTS, git

#: name -> (arguments after ``python -m``, wall seconds of the committed run on the shared
#: 2-core machine, one run at a time; a rough guide, the load varies).
PLAN: dict[str, tuple[tuple[str, ...], float]] = {
    "spike_recovery": (("experiments.spike_recovery", "--commit-results", "--no-progress"), 517.0),
    "adam_eps": (("experiments.adam_eps", "--no-progress"), 508.7),
    "lr_sensitivity": (("experiments.lr_sensitivity", "--no-progress"), 1108.0),
    "warmup": (("experiments.warmup", "--no-progress"), 320.3),
    "clipping": (("experiments.clipping", "--no-progress"), 453.0),
    "precision": (("experiments.precision", "--no-progress"), 512.0),
    # The best LR from a 5-seed scan of the base arm, all in the run.
    "init_schemes": (
        ("experiments.init_schemes", "--no-progress", "--scan-seeds", "0", "1", "2", "3", "4"),
        591.5,
    ),
    # Every arm trained afresh at tau 100 (no --reuse of the tau-20 rows).
    "qk_clip": (("experiments.qk_clip", "--no-progress"), 505.2),
    "lr_robust": (("experiments.lr_robust", "--commit-results", "--no-progress"), 578.0),
}


def stale_reason(name: str) -> str | None:
    """Why ``experiments/results/<name>/results.json`` is stale, or None when it is not."""
    path = RESULTS / name / "results.json"
    if not path.exists():
        return "no results.json"
    lib = json.loads(path.read_text()).get("library") or {}
    commit = lib.get("commit")
    if not commit:
        return "it records no library commit (written before commits were recorded)"
    if lib.get("dirty"):
        return f"it ran on uncommitted library edits: {', '.join(lib['dirty'])}"
    if git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return f"its commit {commit[:12]} is not in this clone (fetch the history)"
    changed = git("diff", "--name-only", commit, "--", *LIBRARY_PATHS)
    if changed is None:
        return f"git diff against {commit[:12]} failed"
    if changed:
        files = changed.splitlines()
        more = f" and {len(files) - 5} more" if len(files) > 5 else ""
        return f"{', '.join(files[:5])}{more} changed since {commit[:12]}"
    return None


def stale() -> dict[str, str]:
    """``{name: reason}`` of every experiment in :data:`PLAN` whose results are stale."""
    return {n: r for n in PLAN if (r := stale_reason(n)) is not None}


def command(name: str) -> str:
    """The command that regenerates one experiment (named in the stale test's message)."""
    return "python -m " + " ".join(PLAN[name][0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.regenerate", description=__doc__)
    p.add_argument("--all", action="store_true", help="every experiment, stale or not")
    p.add_argument("--only", nargs="+", choices=sorted(PLAN), help="just these experiments")
    p.add_argument("--list", action="store_true", help="print the plan and exit")
    a = p.parse_args(argv)
    todo = list(a.only or (PLAN if a.all else stale()))
    reasons = stale()
    total = sum(PLAN[n][1] for n in todo)
    for n in todo:
        why = reasons.get(n, "requested")
        print(f"{command(n)}  (last run {PLAN[n][1] / 60:.0f} min; {why})")
    print(
        f"then: python -m experiments.summary_table --rederive  (runs above: ~{total / 3600:.1f} h)"
    )
    if a.list:
        return 0
    for n in todo:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", *PLAN[n][0]], check=True)
        print(f"{n}: {time.perf_counter() - t0:.0f} s")
    subprocess.run([sys.executable, "-m", "experiments.summary_table", "--rederive"], check=True)
    left = stale()
    for n, why in left.items():
        print(f"still stale: {n}: {why}")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
