"""The stability report: one self-contained HTML page from a run's checkpoint directory.

``python -m stabljax.report DIR [--out OUT]`` or, from the training job,
:func:`write_report`. The page reads ``events.jsonl``, the ledger and ``metrics.jsonl``
(if the run wrote one) and shows the loss curve with spikes, rollbacks and skipped
ranges marked, the grad norm, the skip/overflow counters and the loss scale, one panel
per rollback (window, triage verdict, attribution, remedy) and a summary table. Inline
SVG and CSS only: no script, no network, readable offline.
"""

from __future__ import annotations

import os
import pathlib

from stabljax.report.page import Run, load_run, render, summary

__all__ = ("Run", "load_run", "render", "summary", "write_report")


def write_report(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    *,
    metrics: str | os.PathLike | None = None,
    title: str | None = None,
) -> pathlib.Path:
    """Writes ``out_dir/report.html`` (default ``ckpt_dir``) and returns its path.

    Args:
      ckpt_dir: the RollbackController's directory (``ValueError`` if it has no
        ``events.jsonl``).
      out_dir: where ``report.html`` goes (created).
      metrics: the per-step metrics log; default ``ckpt_dir/metrics.jsonl`` if present.
      title: the page title (default from the directory name).
    """
    run = load_run(ckpt_dir, metrics)
    out = pathlib.Path(out_dir if out_dir is not None else ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render(run, title=title), encoding="utf-8")
    os.replace(tmp, path)
    return path
