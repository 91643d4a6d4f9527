"""Reads a run's checkpoint directory for the report, strictly: it is data, not code.

The inputs, all plain JSON (no Orbax, no JAX needed to read them):

* ``events.jsonl`` (docs/events.md): spikes, rollbacks, skips, triage verdicts, saves;
* the ledger: the ``meta`` item of the newest checkpoint (``<step>/meta/metadata``) or
  the rollback record ``stabljax-rollback.json``, whichever has seen more rollbacks;
* ``metrics.jsonl`` if the run wrote one (:class:`stabljax.control.JsonlMetricsWriter`): one row
  per step, rows of an abandoned branch followed by the replayed steps after a rollback.

The directory may be someone else's (a bucket, a bug report), so everything goes through
:mod:`~stabljax.control.checkpoint.jsonio`: a line of ``events.jsonl`` or ``metrics.jsonl``
that is not what stabljax writes is skipped and listed in :attr:`Run.warnings` (file and line); a
malformed meta item or rollback record is a
:class:`~stabljax.control.checkpoint.jsonio.MalformedJSONError`
naming the file. Fixed names are read without following symlinks, and never from a FIFO or
a device (:func:`stabljax.control.checkpoint.fsutil.read_text`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from stabljax.control.checkpoint import fsutil, jsonio
from stabljax.control.events import Event, load_events

RECORD = "stabljax-rollback.json"


@dataclasses.dataclass
class Run:
    """What the report shows, read from a checkpoint directory.

    Attributes:
      directory: the run's checkpoint directory.
      events: ``events.jsonl``'s events, in file order.
      ledger: the newest meta item or rollback record (``{}`` if none).
      rows: ``metrics.jsonl``'s rows, in file order.
      warnings: one line per input line skipped (``"PATH:LINE: what was wrong"``).
    """

    directory: Any  # a pathlib.Path, or an etils.epath.Path on an object store
    events: list[Event]
    ledger: dict[str, Any]
    rows: list[dict[str, Any]]
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def kept(self) -> dict[int, dict[str, Any]]:
        """The last row of each step: the trajectory the final state was trained on."""
        out: dict[int, dict[str, Any]] = {}
        for r in self.rows:
            out[int(r["step"])] = r
        return dict(sorted(out.items()))

    @property
    def abandoned(self) -> list[list[dict[str, Any]]]:
        """Rows that a later row of the same step replaced (rolled-back branches)."""
        last = {int(r["step"]): i for i, r in enumerate(self.rows)}
        segments, cur, prev = [], [], None
        for i, r in enumerate(self.rows):
            s = int(r["step"])
            if prev is not None and s <= prev and cur:
                segments.append(cur)
                cur = []
            prev = s
            if last[s] != i:
                cur.append(r)
            elif cur:
                segments.append(cur)
                cur = []
        if cur:
            segments.append(cur)
        return [seg for seg in segments if seg]

    def of(self, *kinds: str) -> list[Event]:
        """The events of the given kinds, in file order."""
        return [e for e in self.events if e.kind in kinds]


def _committed(step_dir: Any) -> bool:
    """Whether Orbax committed this step folder (its marker file: ``commit_success.txt``
    on an object store, and on a local disk where Orbax writes one)."""
    return (step_dir / "commit_success.txt").is_file()


def read_ledger(directory: Any) -> dict[str, Any]:
    """The newest ledger of ``directory``: the meta item of its newest committed
    checkpoint, or the rollback record if that has seen more rollbacks.

    Only step folders with Orbax's commit marker are read; a meta item or record that is
    present but malformed raises :class:`~stabljax.control.checkpoint.jsonio.MalformedJSONError`
    naming its file.
    """
    metas, local = [], not fsutil.is_remote(directory)
    for d in sorted(directory.iterdir()) if directory.is_dir() else ():
        if d.name.isdigit() and not (local and d.is_symlink()) and _committed(d):
            try:
                metas.append(jsonio.read_meta(d / "meta" / "metadata"))
            except FileNotFoundError:
                continue
    best = max(metas, key=lambda m: m["step"], default=None)
    record = jsonio.read_rollback_record(directory / RECORD)
    if record is not None and (best is None or record["rollbacks"] > best["rollbacks"]):
        best = {**record, "step": record["target_step"]}
    return best or {}


def load_run(directory: str | pathlib.Path, metrics: str | pathlib.Path | None = None) -> Run:
    """Reads ``directory`` (and ``metrics``, default ``directory/metrics.jsonl``).

    ``directory`` may be an object store's (``gs://bucket/run``): its logs are read as
    the controller wrote them there (:class:`~stabljax.control.checkpoint.fsutil.PartLog`).

    Raises:
      ValueError: ``directory`` is not a directory or has no ``events.jsonl``; or (its
        subclasses) a malformed meta item or rollback record
        (:class:`~stabljax.control.checkpoint.jsonio.MalformedJSONError`), an ``events.jsonl`` of
        another schema major version, a fixed-name file that is a symlink
        (:class:`~stabljax.control.checkpoint.fsutil.UnsafePathError`). Each message names the file.
    """
    remote = fsutil.is_remote(directory)
    directory = fsutil.run_path(directory) if remote else pathlib.Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory {str(directory)!r} is not a directory")
    events_path = directory / "events.jsonl"
    if not fsutil.RunFiles(directory).exists("events.jsonl", log=True):
        raise ValueError(f"directory {str(directory)!r} has no events.jsonl (not a run?)")
    events, warnings = load_events(events_path)
    # A path the user named may be a symlink; the run directory's own file may not.
    path = metrics if metrics is not None else directory / "metrics.jsonl"
    rows, row_warnings = jsonio.read_jsonl(
        path, jsonio.METRICS_SCHEMA, extra=jsonio.Field("scalar"), follow=metrics is not None
    )
    return Run(directory, events, read_ledger(directory), rows, warnings + row_warnings)
