"""The stability report: one self-contained HTML page from a run's checkpoint directory.

``python -m stabljax.report DIR [--out OUT]`` or, from the training job,
:func:`write_report`. The page reads ``events.jsonl``, the ledger and ``metrics.jsonl``
(if the run wrote one) and shows the loss curve with spikes, rollbacks and skipped
ranges marked, the grad norm, the skip/overflow counters and the loss scale, one panel
per rollback (window, triage verdict, attribution, remedy) and a summary table. Inline
SVG and CSS only: no script, no network, readable offline.

A run directory may be someone else's: it is read as data (:mod:`stabljax.report.read`,
strict JSON, no symlinked fixed names), every value is escaped on the page
(:mod:`stabljax.report.page`), and ``report.html`` is written through a fresh temporary
file and an atomic rename, never through a symlink.
"""

from __future__ import annotations

import os
import pathlib

from stabljax.control.checkpoint import fsutil
from stabljax.report.page import render, summary
from stabljax.report.read import Run, load_run

__all__ = ("Run", "load_run", "render", "summary", "write_page", "write_report")


def write_report(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    *,
    metrics: str | os.PathLike | None = None,
    title: str | None = None,
) -> pathlib.Path:
    """Writes ``out_dir/report.html`` (default ``ckpt_dir``) and returns its path.

    The page is UTF-8; a lone surrogate (``os.fsdecode`` makes one from a non-UTF-8 file
    name, and it may reach a detector's reason) is written as its ``\\udcXX`` escape. It
    goes to a new temporary file (``O_EXCL | O_NOFOLLOW``) renamed over ``report.html``:
    a symlink planted at either name is never written through.

    Args:
      ckpt_dir: the RollbackController's directory (``ValueError`` if it has no
        ``events.jsonl``).
      out_dir: where ``report.html`` goes (created).
      metrics: the per-step metrics log; default ``ckpt_dir/metrics.jsonl`` if present.
      title: the page title (default from the directory name).

    Raises:
      ValueError: the directory is not a run, or a file in it is malformed or a symlink
        (:func:`stabljax.report.read.load_run`); the message names the file.
    """
    run = load_run(ckpt_dir, metrics)
    return write_page(run, out_dir if out_dir is not None else ckpt_dir, title=title)


def write_page(run: Run, out_dir: str | os.PathLike, *, title: str | None = None) -> pathlib.Path:
    """Renders ``run`` (from :func:`load_run`) to ``out_dir/report.html``, as
    :func:`write_report` does, and returns its path."""
    page = render(run, title=title)
    if fsutil.is_remote(out_dir):  # gs://...: one upload, never a local "gs:" folder
        out = fsutil.RunFiles(out_dir)
        out.write("report.html", page.encode("utf-8", "backslashreplace"))
        return out.path / "report.html"
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.html"
    fsutil.atomic_write_text(path, page, errors="backslashreplace")
    return path
