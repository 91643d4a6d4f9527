"""``python -m stabljax.report DIR [--out OUT]``: writes OUT/report.html for a run."""

from __future__ import annotations

import argparse
import sys

from stabljax.report import write_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m stabljax.report",
        description="Write a self-contained HTML stability report (report.html) for a "
        "RollbackController checkpoint directory: loss curve with spikes, rollbacks and "
        "skipped data, grad norm, counters, loss scale, triage verdicts and a summary.",
    )
    p.add_argument("directory", help="the run's checkpoint directory (holds events.jsonl)")
    p.add_argument("--out", default=None, help="output folder (default: the directory)")
    p.add_argument("--metrics", default=None, help="metrics JSONL (default DIR/metrics.jsonl)")
    p.add_argument("--title", default=None, help="page title")
    args = p.parse_args(argv)
    try:
        path = write_report(args.directory, args.out, metrics=args.metrics, title=args.title)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
