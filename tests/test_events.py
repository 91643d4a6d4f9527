"""stabljax.control.events: the event record, its schema version, the append-only
``events.jsonl`` (one whole line per write, torn lines healed and skipped) and the log.

The metrics writers of the same module are tested in test_writers.py; that a real run
writes the schema version on every line, in test_triage.py.
"""

from __future__ import annotations

import json
import pathlib
import re
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from stabljax.control.checkpoint.fsutil import UnsafePathError
from stabljax.control.checkpoint.jsonio import MalformedJSONError, MalformedLineWarning
from stabljax.control.events import (
    EVENT_KINDS,
    SCHEMA_VERSION,
    Event,
    EventLog,
    EventSchemaError,
    append_line,
    check_schema,
    load_events,
    read_events,
)

ROOT = pathlib.Path(__file__).parent.parent


# ------------------------------------------------------------------------------ record


def test_an_event_keeps_only_json_types_and_round_trips():
    details = {
        "count": np.int64(3),
        "loss": jnp.float32(2.5),
        "nan": jnp.float32(float("nan")),
        "inf": float("-inf"),
        "flag": np.bool_(True),
        "range": (10, np.int32(37)),
        7: {"nested": [np.float64(0.5), None, "s"]},
    }
    e = Event("rollback", np.int32(40), time=1.5, details=details)
    assert e.step == 40 and type(e.step) is int
    assert e.details == {
        "count": 3,
        "loss": 2.5,
        "nan": "nan",
        "inf": "-inf",
        "flag": True,
        "range": [10, 37],
        "7": {"nested": [0.5, None, "s"]},
    }
    assert type(e.details["count"]) is int and type(e.details["flag"]) is bool
    line = e.to_json()
    assert json.loads(line) == {
        "schema": SCHEMA_VERSION,
        "kind": "rollback",
        "step": 40,
        "time": 1.5,
        "details": e.details,
    }
    assert Event.from_json(line) == e


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of .*'explosion'"):
        Event("explosion", 1)


@pytest.mark.parametrize("step", [12.7, 12.0, True, np.bool_(True), "12", None, float("inf")])
def test_a_step_that_is_not_an_integer_is_refused(step):
    with pytest.raises(ValueError, match="step must be an integer"):
        Event("save", step)


@pytest.mark.parametrize("step", [12, np.int64(12), np.int32(12), jnp.int32(12)])
def test_python_numpy_and_jax_integers_are_steps(step):
    e = Event("save", step, time=0.0)
    assert e.step == 12 and type(e.step) is int


def test_a_non_finite_time_is_refused():
    with pytest.raises(ValueError, match="time must be a finite number"):
        Event("save", 1, time=float("nan"))


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"kind": "save", "step": 12.0, "time": 0.0}, "'step' must be an integer, got 12.0"),
        ({"kind": "save", "step": False, "time": 0.0}, "'step' must be an integer, got false"),
        ({"kind": "save", "step": 1, "time": "0"}, "'time' must be a finite number"),
        ({"kind": 7, "step": 1, "time": 0.0}, "'kind' must be a string"),
        ({"kind": "save", "step": 1, "time": 0.0, "details": [1]}, "'details' must be an object"),
        ([1, 2], "expected a JSON object, got an array"),
    ],
)
def test_from_dict_reads_only_what_to_dict_writes(record, problem):
    with pytest.raises(MalformedJSONError, match=re.escape(f"line 3: {problem}")):
        Event.from_dict(record, what="line 3")


def test_from_json_refuses_nan_and_infinity_tokens():
    line = Event("save", 1, time=0.0).to_json()
    with pytest.raises(MalformedJSONError, match="NaN is not a JSON number"):
        Event.from_json(line.replace("0.0", "NaN"))
    with pytest.raises(MalformedJSONError, match="Infinity is not a JSON number"):
        Event.from_json(line.replace('"step": 1', '"step": Infinity'))


# ------------------------------------------------------------------------------ schema


@pytest.mark.parametrize("version", ["1.0", "1.7", "1.12"])
def test_every_minor_version_of_the_major_is_readable(version):
    check_schema(version)


@pytest.mark.parametrize("version", ["2.0", "0.9", "1", "1.0.1", "x.y", "1.x", "", None, 1.0])
def test_another_major_or_a_malformed_version_is_a_schema_error(version):
    with pytest.raises(EventSchemaError, match="is not readable here"):
        check_schema(version)


def test_an_unknown_major_schema_version_is_an_error_and_none_reads_as_1_0(tmp_path):
    path = tmp_path / "events.jsonl"
    old = {"kind": "save", "step": 10, "time": 0.0, "details": {}}
    path.write_text(json.dumps(old) + "\n" + json.dumps({**old, "schema": "1.7"}) + "\n")
    assert [e.step for e in read_events(path)] == [10, 10]
    with path.open("a") as f:
        f.write(json.dumps({**old, "schema": "2.0"}) + "\n")
    with pytest.raises(EventSchemaError, match="2.0"):
        read_events(path)
    # A ValueError, as documented, whose message names the version and what is readable.
    with pytest.raises(ValueError, match=r"events schema '3\.1' is not readable here.*1\.x"):
        Event.from_dict({**old, "schema": "3.1"})


def test_docs_events_md_documents_every_kind():
    text = (ROOT / "docs" / "events.md").read_text()
    for kind in EVENT_KINDS:
        assert f"`{kind}`" in text, kind
    assert f"`{SCHEMA_VERSION}`" in text


# ------------------------------------------------------------------------------- file


def test_append_line_writes_one_line_and_starts_after_a_torn_one(tmp_path):
    path = tmp_path / "events.jsonl"
    append_line(path, '{"a": 1}')
    assert path.read_bytes() == b'{"a": 1}\n'
    with path.open("a") as f:
        f.write('{"kind": "sa')  # what a crash in the middle of a write leaves
    append_line(path, '{"b": 2}')
    assert path.read_bytes() == b'{"a": 1}\n{"kind": "sa\n{"b": 2}\n'
    with pytest.raises(ValueError, match="newline"):
        append_line(path, '{"c": 3}\n{"d": 4}')
    assert path.read_bytes().count(b"\n") == 3


def test_read_events_skips_what_it_cannot_read_and_keeps_the_rest(tmp_path):
    path = tmp_path / "events.jsonl"
    assert read_events(path) == []  # no file yet
    save = Event("save", 10, time=0.0, details={"data_index": 10})
    spike = Event("spike", 12, time=1.0)
    newer_kind = {**save.to_dict(), "kind": "kind_of_a_later_minor_version"}
    lines = [
        save.to_json(),
        "",
        '{"kind": "sa',  # torn
        "[1, 2]",  # not a record
        json.dumps(newer_kind),  # skipped without a warning: a later minor version's kind
        json.dumps({"schema": "1.0", "kind": "save"}),  # fields missing
        spike.to_json().replace('"step": 12', '"step": 12.7'),  # not an integer step
        spike.to_json(),
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(MalformedLineWarning) as caught:
        assert read_events(path) == [save, spike]
    assert [str(w.message).split(": ", 2)[:2] for w in caught] == [
        [f"{path}:3", "not valid JSON (Unterminated string starting at"],
        [f"{path}:4", "expected a JSON object, got an array"],
        [f"{path}:6", "the field 'step' is missing"],
        [f"{path}:7", "'step' must be an integer, got 12.7"],
    ]
    events, warned = load_events(path)
    assert events == [save, spike] and warned == [str(w.message) for w in caught]


def test_a_line_of_another_major_version_names_the_file_and_line(tmp_path):
    path = tmp_path / "events.jsonl"
    EventLog(path).append(Event("save", 1))
    with path.open("a") as f:
        f.write(json.dumps({"schema": "2.0", "kind": "save", "step": 2, "time": 0.0}) + "\n")
    with pytest.raises(EventSchemaError, match=re.escape(f"{path}:2: events schema '2.0'")):
        read_events(path)


def test_append_line_and_the_log_refuse_a_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="refusing to follow the symlink"):
        append_line(run / "events.jsonl", '{"a": 1}')
    with pytest.raises(UnsafePathError):
        EventLog(run / "events.jsonl").append(Event("save", 1))
    assert victim.read_text() == "precious\n"


def test_threads_appending_at_once_leave_every_line_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    threads, per_thread = 8, 40
    payload = "x" * 2000  # long lines: a split write would interleave them

    def work(t):
        for k in range(per_thread):
            log.append(Event("save", t * 1000 + k, time=0.0, details={"p": payload}))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    lines = path.read_text().splitlines()
    assert len(lines) == len(log) == threads * per_thread
    on_disk = [Event.from_json(line) for line in lines]  # every line parses
    assert sorted(e.step for e in on_disk) == sorted(e.step for e in log)
    for t in range(threads):  # each thread's events in its own order
        mine = [e.step for e in on_disk if e.step // 1000 == t]
        assert mine == [t * 1000 + k for k in range(per_thread)]


def test_an_event_log_keeps_events_in_memory_and_writes_only_when_asked(tmp_path):
    quiet = EventLog(tmp_path / "quiet.jsonl", write=False)  # a non-primary host
    for kind, step in [("save", 10), ("spike", 12), ("rollback", 14), ("spike", 20)]:
        quiet.append(Event(kind, step))
    assert not (tmp_path / "quiet.jsonl").exists()
    assert len(quiet) == 4 and quiet.count("spike") == 2 and quiet.count("skip") == 0
    assert [e.step for e in quiet] == [10, 12, 14, 20] and quiet[-1].kind == "spike"
    memory = EventLog(None)
    memory.append(Event("save", 1))
    assert len(memory) == 1 and memory.path is None
    written = EventLog(tmp_path / "events.jsonl")
    for e in quiet:
        written.append(e)
    assert read_events(tmp_path / "events.jsonl") == list(quiet)
