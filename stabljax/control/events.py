"""Typed event records and a crash-safe ``events.jsonl`` log.

Every detection, rollback, data skip, save and restore of the
:class:`~stabljax.control.controller.RollbackController` becomes an :class:`Event`: a
``kind`` string, the training ``step`` it concerns, a wall-clock ``time`` and a
JSON-able ``details`` dict. :class:`EventLog` keeps them in memory and appends each one
to ``events.jsonl`` as a single ``write`` of one whole line, flushed and fsynced, so a
crash (even SIGKILL) leaves at most a torn last line, which :func:`read_events` skips and
the next append starts on a fresh line.

Every line carries ``"schema": SCHEMA_VERSION`` ("major.minor"); docs/events.md
documents each kind and its fields. A reader accepts its own major version (a newer
minor may add kinds and fields, which it skips or ignores) and raises
:class:`EventSchemaError` on another major version; a line without the field predates
versioning and reads as 1.0.

Metrics writers (:class:`JsonlMetricsWriter`, :class:`TensorBoardMetricsWriter`) for
:meth:`RollbackController.run`: any ``callable(step, metrics)``. The controller hands a
writer each step's metrics one step late (after the next step is dispatched, so the
device never waits on a fetch), as host scalars: every scalar metric as a
``float``/``int``/``bool``, nested dicts flattened with ``/`` (``layers/grad_norm/w``),
non-scalar arrays left out. After a rollback the replayed steps are written again: a
writer sees a step number a second time, newer values last.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import os
import pathlib
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal, get_args

import numpy as np

from stabljax.control.checkpoint import fsutil, jsonio
from stabljax.control.decide.remedies import remedy_event

# ------------------------------------------------------------------------------------------ events
# Typed event records and a crash-safe ``events.jsonl`` log.


EventKind = Literal[
    "save",
    "save_deferred",
    "save_failed",
    "restore",
    "spike",
    "divergence",
    "slow_divergence",
    "rollback",
    "skip",
    "corrupt_checkpoint",
    "diverged",
    "preempted",
    "data_exhausted",
    "triage",
    "rebaseline",
    "remedy",
    "warning",
    "warning_response",
]
"""The kinds of :class:`Event`.

``save`` / ``restore``: a checkpoint committed / read (a ``save`` event is written only
once the checkpoint is complete on disk). ``save_deferred``: a due save postponed because
an episode was open or the last loss was not finite (``details["reason"]``).
``save_failed``: a save that did not commit (``details["error"]``). ``spike``, ``divergence``,
``slow_divergence``: a detector fired (``details["action"]`` says whether it was only
recorded or caused a rollback). ``rollback``: the state went back to an earlier
checkpoint. ``skip``: a data range was added to the skip ledger.
``corrupt_checkpoint``: a checkpoint failed to restore or verify and was set aside.
``diverged``: the controller gave up (:class:`~stabljax.control.controller.TrainingDiverged`).
``preempted``: a preemption signal stopped the run at a step boundary (``details["saved"]``).
``data_exhausted``: the data ran out before the target step.
``triage``: after a rollback, a replay of the suspect window classified the spike
(:mod:`stabljax.control.diagnose.triage`; ``details["verdict"]``, evidence, culprits, attribution).
``rebaseline``: a ``skip_spikes`` guard took a new loss level as its baseline after
consecutive agreeing skips (``metrics["spike_rebaselines"]`` rose; ``details["total"]``).
``warning``: a :class:`~stabljax.control.detect.warning.WarningDetector` found a leading
indicator rising (no rollback). ``warning_response``: a
:class:`~stabljax.control.decide.remedies.WarningResponse` lowered or restored a
hyperparameter (``details["change"]``).
"""

SCHEMA_VERSION = "1.2"
"""The version of the ``events.jsonl`` line format (docs/events.md)."""


class EventSchemaError(ValueError):
    """An ``events.jsonl`` line of a schema version this reader does not know."""


def check_schema(version: Any, what: str = "") -> None:
    """Raises :class:`EventSchemaError` unless ``version`` has :data:`SCHEMA_VERSION`'s major.

    ``what`` (a file and line) starts the message when given.

    Example:
      >>> from stabljax.control.events import check_schema
      >>> check_schema("1.3")
      >>> check_schema("2.0")
      Traceback (most recent call last):
      ...
      stabljax.control.events.EventSchemaError: events schema '2.0' is not readable here ...
    """
    major = SCHEMA_VERSION.split(".")[0]
    parts = version.split(".") if isinstance(version, str) else []
    if len(parts) != 2 or parts[0] != major or not all(p.isdigit() for p in parts):
        raise EventSchemaError(
            f"{what + ': ' if what else ''}events schema {version!r} is not readable here "
            f"(this reader knows {major}.x, see docs/events.md)"
        )


EVENT_KINDS: tuple[str, ...] = get_args(EventKind)


def _jsonable(value: Any) -> Any:
    """Plain JSON types only; non-finite floats become strings (JSON has no NaN)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return int(value)
    try:
        f = float(value)
    except (TypeError, ValueError):
        return str(value)
    if hasattr(value, "dtype") and "int" in str(value.dtype):
        return int(value)
    if hasattr(value, "dtype") and "bool" in str(value.dtype):
        return bool(value)
    return f if math.isfinite(f) else str(f)


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing the controller saw or did.

    Attributes:
      kind: one of :data:`EVENT_KINDS`.
      step: the training step (``state.step``) it concerns.
      time: seconds since the epoch when it was recorded.
      details: JSON-able details (losses, ranges, checkpoint steps, reasons).

    Example:
      >>> from stabljax.control.events import Event
      >>> e = Event("save", 100, time=0.0, details={"data_index": 100})
      >>> print(e.to_json())
      {"schema": "1.2", "kind": "save", "step": 100, "time": 0.0, "details": {"data_index": 100}}
      >>> Event.from_json(e.to_json()) == e
      True
    """

    kind: EventKind
    step: int
    time: float = dataclasses.field(default_factory=time.time)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind must be one of {EVENT_KINDS}, got {self.kind!r}")
        # operator.index takes Python, NumPy and JAX integers but no float (12.7 is not
        # silently step 12); a bool is an int to Python but never a step.
        try:
            step = None if isinstance(self.step, bool | np.bool_) else operator.index(self.step)
        except TypeError:
            step = None
        if step is None:
            raise ValueError(f"step must be an integer, got {self.step!r}")
        stamp = float(self.time)
        if not math.isfinite(stamp):
            raise ValueError(f"time must be a finite number, got {self.time!r}")
        object.__setattr__(self, "step", int(step))
        object.__setattr__(self, "time", stamp)
        object.__setattr__(self, "details", _jsonable(dict(self.details)))

    def to_dict(self) -> dict[str, Any]:
        """Returns the record as a JSON-able dict."""
        return {
            "schema": SCHEMA_VERSION,
            "kind": self.kind,
            "step": self.step,
            "time": self.time,
            "details": self.details,
        }

    def to_json(self) -> str:
        """Returns the record as one line of JSON (no newline)."""
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, d: Any, *, what: str = "event") -> Event:
        """Builds an event from :meth:`to_dict`'s output.

        Raises:
          EventSchemaError: an unknown schema version (none means 1.0).
          MalformedJSONError: (a ``ValueError``) ``d`` is not an object with an integer
            ``step``, a finite ``time``, a string ``kind`` and an object ``details``
            (:data:`~stabljax.control.checkpoint.jsonio.EVENT_SCHEMA`), named by ``what``.
          ValueError: an unknown kind.
        """
        if isinstance(d, Mapping):
            d = dict(d)
            check_schema(d.get("schema", SCHEMA_VERSION), what)
        jsonio.check_record(d, jsonio.EVENT_SCHEMA, what=what)
        return cls(d["kind"], d["step"], time=d["time"], details=dict(d.get("details", {})))

    @classmethod
    def from_json(cls, line: str) -> Event:
        """Builds an event from :meth:`to_json`'s output (read strictly:
        :func:`~stabljax.control.checkpoint.jsonio.loads_strict`)."""
        return cls.from_dict(jsonio.loads_strict(line, what="event"))


def rollback_events(
    plan: Any,
    *,
    losses: Any,
    steps_back: int,
    target_steps: int | None,
    fed_end: int,
    screened: tuple[str, ...] = (),
    triage: Mapping[str, Any] | None = None,
) -> list[Event]:
    """The events of one rollback, in order: ``rollback``, ``skip``, then ``triage`` and
    ``remedy`` (:func:`~stabljax.control.decide.remedies.remedy_event`) when they ran.

    Args:
      plan: the :class:`~stabljax.control.decide.policy.RollbackPlan` carried out.
      losses: the ``[step, loss, skipped]`` rows before the detection.
      steps_back: the steps taken back (from the step rolled back from to the target).
      target_steps: the run's target (``None``: none declared).
      fed_end: one past the last data index fed before the rollback.
      screened: the plan entry's keys that say what screening ahead found, for the skip event.
      triage: the triage report, if triage ran.
    """
    entry, skip, at = plan.entry, plan.skip, plan.detected
    rollback = dict(onset=plan.onset, restored_step=plan.target, margin_met=plan.margin_met)
    rollback |= dict(reason=entry["reason"], losses=losses, rollbacks=plan.ledger.rollbacks)
    rollback |= dict(steps_back=steps_back, target_steps=target_steps)
    skipped = dict(range=entry["range"], length=skip.length, doubled=skip.doubled)
    skipped |= {k: entry[k] for k in screened if k in entry} | {"fed_end": fed_end}
    events = [Event("rollback", at, details=rollback), Event("skip", at, details=skipped)]
    if triage is not None:
        events.append(Event("triage", at, details=dict(narrowed=plan.narrowed, **triage)))
    if "remedy" in entry:
        events.append(Event("remedy", at, details=remedy_event(entry, reapplied=False)))
    return events


def append_line(path: str | os.PathLike, line: str) -> None:
    """Appends ``line`` and a newline to ``path`` as one write, then flushes and fsyncs.

    If the file does not end with a newline (a torn line from a crash), a newline is
    written first so the new record starts on its own line. The file is opened with
    ``O_NOFOLLOW`` (:func:`~stabljax.control.checkpoint.fsutil.open_nofollow`): a symlink planted at
    ``path`` is an :class:`~stabljax.control.checkpoint.fsutil.UnsafePathError`, and nothing outside
    the run directory is appended to.

    Args:
      path: the file (created if missing).
      line: one line of text without a newline.
    """
    if "\n" in line:
        raise ValueError("line must not contain a newline")
    data = (line + "\n").encode("utf-8", "backslashreplace")
    fd = fsutil.open_nofollow(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def load_events(path: str | os.PathLike) -> tuple[list[Event], list[str]]:
    """Reads ``events.jsonl`` strictly: the events, and a warning per line skipped.

    Each line goes through :func:`~stabljax.control.checkpoint.jsonio.loads_strict` and
    :data:`~stabljax.control.checkpoint.jsonio.EVENT_SCHEMA`: a torn line (a crash in a write), a
    line that is not a JSON object, a ``step`` that is not an integer (``12.7``,
    ``true``), a non-finite number (``Infinity``) or nesting deeper than
    :data:`~stabljax.control.checkpoint.jsonio.MAX_DEPTH` is skipped with a warning
    ``"PATH:LINE: ..."``. A kind this version does not know (a newer minor version's) is
    skipped without one. A line of another schema major version raises
    :class:`EventSchemaError` naming the file and line (its records cannot be trusted to
    mean what this reader thinks).

    Args:
      path: the file; a missing file gives no events.

    Returns:
      ``(events, warnings)``, events in file order.

    Raises:
      EventSchemaError: a line of another major version.
      UnsafePathError: ``path`` is a symlink, a FIFO or a device.
    """

    def convert(record: dict[str, Any], where: str) -> Event | None:
        if isinstance(record.get("kind"), str) and record["kind"] not in EVENT_KINDS:
            check_schema(record.get("schema", SCHEMA_VERSION), where)
            return None  # a newer minor version's kind
        return Event.from_dict(record, what=where)

    return jsonio.read_jsonl(path, {}, convert=convert)


def read_events(path: str | os.PathLike) -> list[Event]:
    """Reads ``events.jsonl``, skipping (with a warning) the lines it cannot trust.

    :func:`load_events`, with each skipped line reported as a
    :class:`~stabljax.control.checkpoint.jsonio.MalformedLineWarning` naming the file and line.

    Args:
      path: the file; a missing file gives an empty list.

    Returns:
      The events in file order.

    Example:
      >>> import os, tempfile, warnings
      >>> from stabljax.control.events import Event, EventLog, read_events
      >>> path = os.path.join(tempfile.mkdtemp(), "events.jsonl")
      >>> log = EventLog(path)
      >>> log.append(Event("spike", 7, details={"loss": 9.5}))
      >>> with open(path, "a") as f:
      ...     _ = f.write('{"kind": "sa')  # a torn line, as a crash leaves it
      >>> log.append(Event("rollback", 8))
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     events = read_events(path)
      >>> [(e.kind, e.step) for e in events]
      [('spike', 7), ('rollback', 8)]
      >>> print(str(caught[0].message).split("/")[-1][:22])
      events.jsonl:2: not va
    """
    events, warned = load_events(path)
    for message in warned:
        warnings.warn(message, jsonio.MalformedLineWarning, stacklevel=2)
    return events


FLUSHED_BY = frozenset(
    {"save", "save_failed", "restore", "preempted", "diverged", "data_exhausted"}
)
"""On an object store, the kinds after which :class:`EventLog` writes its buffer out."""


class EventLog:
    """Events in memory, each also appended to a JSON-lines file.

    On an object store (``gs://...``), which has no append, events are buffered and
    written as a new object (:class:`~stabljax.control.checkpoint.fsutil.PartLog`) after
    each event of a kind in :data:`FLUSHED_BY` (a save, a restore or rollback, the end of
    a run), at :meth:`flush` (the controller's ``close``) and when an event arrives 60 s
    after the oldest unwritten one. A flushed event survives a crash, SIGKILL included; a
    crash loses at most the events since the last flush. Between flushes no request is made.

    Args:
      path: the ``events.jsonl`` file (or ``gs://.../events.jsonl``), or ``None`` to keep
        events in memory only.
      write: whether this process writes the file (on several hosts only the primary
        host does; every host keeps the same events in memory).

    Example:
      >>> from stabljax.control.events import Event, EventLog
      >>> log = EventLog(None)
      >>> log.append(Event("save", 10))
      >>> log.append(Event("spike", 12))
      >>> len(log), log.count("spike"), log[-1].step
      (2, 1, 12)
    """

    def __init__(self, path: str | os.PathLike | None, *, write: bool = True):
        self.path = None if path is None else os.fspath(path)
        self.write = write
        self._events: list[Event] = []
        self._lock = threading.Lock()  # a background save logs from its own thread
        remote = self.path is not None and write and fsutil.is_remote(self.path)
        self._parts = fsutil.PartLog(self.path) if remote else None

    def append(self, event: Event) -> None:
        """Records ``event`` (and writes it out); safe from several threads."""
        with self._lock:
            self._events.append(event)
            if self._parts is not None:
                self._parts.write(event.to_json())
            elif self.path is not None and self.write:
                append_line(self.path, event.to_json())
        if self._parts is not None and event.kind in FLUSHED_BY:
            self._parts.flush()

    def flush(self) -> None:
        """Writes the buffered events of an object-store log (nothing on a local disk,
        where each event is on disk when :meth:`append` returns)."""
        if self._parts is not None:
            self._parts.flush()

    def count(self, kind: str) -> int:
        """The number of events of ``kind`` recorded so far."""
        return sum(e.kind == kind for e in self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    def __getitem__(self, i):
        return self._events[i]

    def __repr__(self) -> str:
        return f"EventLog(path={self.path!r}, events={len(self._events)})"


# ----------------------------------------------------------------------------------------- writers
# Metrics writers for :meth:`RollbackController.run`: any ``callable(step, metrics)``.


def host_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | bool]:
    """The scalar entries of ``metrics`` as Python numbers; nested mappings flattened.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.control.events import host_metrics
      >>> host_metrics({"loss": jnp.float32(2.5), "skipped": jnp.bool_(False),
      ...               "layers": {"w": jnp.float32(1.0)}, "hist": jnp.ones(3)})
      {'loss': 2.5, 'skipped': False, 'layers/w': 1.0}
    """
    out: dict[str, float | int | bool] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(host_metrics(value, prefix=f"{name}/"))
            continue
        arr = np.asarray(value)
        if arr.size != 1:
            continue
        item = arr.reshape(()).item()
        if isinstance(item, bool | int | float):
            out[name] = item
    return out


def _json_number(x: Any) -> Any:
    # events.jsonl's convention: non-finite floats as strings, so every line is strict JSON.
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


class JsonlMetricsWriter:
    """Appends one JSON object a line, ``{"step": s, "loss": ..., ...}``, to ``path``.

    Each line is written whole and flushed, so a crash leaves at most the line in
    progress unwritten, never a half line that a later append would glue onto; a file
    that ends without a newline (a crash in a write) gets one first. Non-finite values
    are written as strings (``"nan"``), as in ``events.jsonl``. The file is opened with
    ``O_NOFOLLOW``: a symlink at ``path`` is an
    :class:`~stabljax.control.checkpoint.fsutil.UnsafePathError`. Use as a context manager or call
    :meth:`close`. On an object store (``gs://.../metrics.jsonl``) rows are buffered and
    written as new objects at :meth:`flush`, :meth:`close` and when a row arrives
    ``flush_every`` seconds after the oldest unwritten one
    (:class:`~stabljax.control.checkpoint.fsutil.PartLog`): a crash loses the unwritten rows.

    Args:
      path: the file; its parent folders are created.
      flush_every: on an object store, the most seconds a row waits while more arrive.

    Example:
      >>> import json, pathlib, tempfile
      >>> from stabljax.control.events import JsonlMetricsWriter
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> with JsonlMetricsWriter(path) as w:
      ...     w(0, {"loss": 2.0}); w(1, {"loss": float("nan")})
      >>> [json.loads(line) for line in path.read_text().splitlines()]
      [{'step': 0, 'loss': 2.0}, {'step': 1, 'loss': 'nan'}]
    """

    def __init__(self, path: str | os.PathLike, *, flush_every: float = 60.0):
        if fsutil.is_remote(path):
            self.path, self._parts = os.fspath(path), fsutil.PartLog(path, flush_every=flush_every)
            return
        self._parts = None
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Not through a symlink planted at the file's name (fsutil.open_nofollow).
        fd = fsutil.open_nofollow(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        self._file = open(fd, "a", encoding="utf-8", errors="backslashreplace")  # noqa: SIM115
        if torn:
            self._file.write("\n")

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._closed:
            raise ValueError(f"JsonlMetricsWriter({self.path}) is closed")
        row = {"step": int(step), **{k: _json_number(v) for k, v in host_metrics(metrics).items()}}
        if self._parts is not None:
            self._parts.write(json.dumps(row, allow_nan=False))
            return
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    @property
    def _closed(self) -> bool:
        return self._parts is None and self._file.closed

    def flush(self) -> None:
        if self._parts is not None:
            self._parts.flush()
        elif not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if self._parts is not None:
            self._parts.flush()
        else:
            self._file.close()

    def __enter__(self) -> JsonlMetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorBoardMetricsWriter:
    """Writes each scalar metric as a TensorBoard scalar, with ``tensorboardX``.

    Needs the optional extra: ``pip install -e ".[tensorboard]"`` (``tensorboardX``, no
    TensorFlow or PyTorch). View with ``tensorboard --logdir LOGDIR``.

    Args:
      logdir: the event-file folder.
      **kwargs: passed to ``tensorboardX.SummaryWriter`` (e.g. ``flush_secs``).
    """

    def __init__(self, logdir: str | os.PathLike, **kwargs: Any):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "TensorBoardMetricsWriter needs tensorboardX: pip install -e '.[tensorboard]' "
                "(or pip install tensorboardX)"
            ) from e
        self.logdir = str(logdir)
        self._writer = SummaryWriter(self.logdir, **kwargs)

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in host_metrics(metrics).items():
            self._writer.add_scalar(key, float(value), global_step=int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardMetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = (
    "EVENT_KINDS",
    "Event",
    "EventKind",
    "EventLog",
    "EventSchemaError",
    "FLUSHED_BY",
    "JsonlMetricsWriter",
    "SCHEMA_VERSION",
    "TensorBoardMetricsWriter",
    "append_line",
    "check_schema",
    "host_metrics",
    "load_events",
    "read_events",
)
