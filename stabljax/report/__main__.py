"""``python -m stabljax.report DIR [--out OUT]``: writes OUT/report.html for a run.

The directory is read as data, never run. Exit status 0: the report was written (lines
skipped while reading are listed on stderr and on the page); 2: bad arguments, or the
directory is not a run, or a file in it is malformed or a symlink: one line on stderr
names the file (and line), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from stabljax.report import write_page
from stabljax.report.read import load_run

SHOWN = 5  # read warnings echoed to stderr (all of them are on the page)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


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
        run = load_run(args.directory, args.metrics)
        path = write_page(run, args.out or args.directory, title=args.title)
    except (ValueError, OSError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a foreign directory must never give a traceback
        print(
            f"error: cannot report on {args.directory}: {type(e).__name__}: {_one_line(e)}",
            file=sys.stderr,
        )
        return 2
    warnings = run.warnings
    for message in warnings[:SHOWN]:
        print(f"warning: skipped {_one_line(message)}", file=sys.stderr)
    if len(warnings) > SHOWN:
        print(f"warning: ... {len(warnings) - SHOWN} more lines skipped", file=sys.stderr)
    print(os.fsencode(path).decode("utf-8", "backslashreplace"))  # a non-UTF-8 name too
    return 0


if __name__ == "__main__":
    sys.exit(main())
