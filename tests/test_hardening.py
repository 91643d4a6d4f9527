"""A run directory from elsewhere is data, not code (issue 41): hostile input against the
real library, no mocks.

A real controller run (the triage toy, one rollback at step 35) is copied per test and
tampered with as someone sharing it could: every field the report renders carries markup,
lines of ``events.jsonl`` are malformed, the meta item and the rollback record are edited,
and symlinks are planted at the fixed names. Each test checks what was read, what the page
shows, and that nothing outside the run directory changed.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import warnings

import numpy as np
import pytest
import toy

from stabljax.control import (
    Event,
    EventLog,
    IndexedBatches,
    JsonlMetricsWriter,
    RollbackController,
    read_events,
)
from stabljax.control.checkpoint.fsutil import (
    DirectoryLock,
    UnsafePathError,
    atomic_write_text,
    refuse_symlinks,
)
from stabljax.control.checkpoint.integrity import meta_digest
from stabljax.control.checkpoint.jsonio import (
    MalformedJSONError,
    MalformedLineWarning,
    loads_strict,
    read_meta,
    read_rollback_record,
)
from stabljax.report import load_run, write_report

ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A real run: 60 steps of the triage toy, a spike at 35, a rollback, triage, metrics."""
    d = tmp_path_factory.mktemp("hardening") / "ckpt"
    state, step = toy.triage_toy()
    writer = JsonlMetricsWriter(d / "metrics.jsonl")
    with RollbackController(d, **toy.triage_controller_kwargs()) as ctl:
        ctl.run(
            step,
            state,
            IndexedBatches(toy.triage_batches(bad=[35])),
            60,
            progress=False,
            metrics_writer=writer,
        )
    writer.close()
    assert ctl.rollbacks == 1
    return d


@pytest.fixture
def run(pristine, tmp_path):
    """A copy of the real run, with an ``outside`` folder next to it to watch."""
    d = tmp_path / "run"
    shutil.copytree(pristine, d, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("precious\n")
    return d, outside


def snapshot(folder: pathlib.Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with its bytes' SHA-256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def append_raw(path: pathlib.Path, *lines: str) -> None:
    with open(path, "a", encoding="utf-8", errors="surrogatepass") as f:
        for line in lines:
            f.write(line + "\n")


class Page(html.parser.HTMLParser):
    """The page's elements, attributes and text, as a browser's parser sees them."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attrs: set[str] = set()
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self.attrs.update(name for name, _ in attrs)

    def handle_data(self, data):
        self.text.append(data)


SAFE_TAGS = {
    "html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "h4", "p", "table",
    "tr", "th", "td", "section", "span", "b", "i", "code", "ul", "li", "pre", "svg", "rect",
    "text", "line", "polyline", "circle", "path",
}  # fmt: skip


def assert_inert(page: str) -> Page:
    parsed = Page(page)
    assert parsed.tags <= SAFE_TAGS, parsed.tags - SAFE_TAGS
    assert not {a for a in parsed.attrs if a.startswith("on") or a in ("src", "href")}
    assert "<script" not in page.lower() and "<img" not in page.lower()
    return parsed


def payload(field: str) -> str:
    """Markup that would run script if it reached the page raw, tagged by its field."""
    return f"\"'><script>alert('{field}')</script><img src=x onerror=alert('{field}')>"


# -------------------------------------------------------------------------------- escaping


def hostile_events(step: int) -> list[Event]:
    p = payload
    return [
        Event("spike", step, details={"reason": p("spike.reason"), "value": p("spike.value")}),
        Event("restore", step, details={"reason": p("restore.reason")}),
        Event(
            "rollback",
            step,
            details={
                "onset": p("rollback.onset"),
                "restored_step": p("rollback.restored_step"),
                "reason": p("rollback.reason"),
                "margin_met": p("rollback.margin_met"),
                "losses": [[p("loss.step"), p("loss.value"), False], p("losses.item")],
            },
        ),
        Event(
            "skip",
            step,
            details={
                "range": [p("skip.range"), 5],
                "length": p("skip.length"),
                "doubled": p("skip.doubled"),
            },
        ),
        Event(
            "triage",
            step,
            details={
                "verdict": p("triage.verdict"),
                "reason": p("triage.reason"),
                "remedy": p("triage.remedy"),
                "culprits": [p("triage.culprit"), 3],
                "narrowed": p("triage.narrowed"),
                "steps": p("triage.steps"),
                "seconds": p("triage.seconds"),
                "restored_step": p("triage.restored_step"),
                "earlier_step": p("triage.earlier_step"),
                "window": [0, 3],
                "evidence": {"run": [1.0, p("evidence.y"), 2.0, 3.0], "rerun": p("rerun")},
                "host": {
                    "process_index": p("host.process_index"),
                    "platform": p("host.platform"),
                    "device_ids": [p("host.device_ids")],
                },
                "attribution": {
                    "first_jump": {
                        "layer": p("jump.layer"),
                        "largest": p("jump.largest"),
                        "grad_norm": p("jump.grad_norm"),
                        "ratio": p("jump.ratio"),
                        "baseline": p("jump.baseline"),
                    },
                    "hints": [
                        {
                            "cause": p("hint.cause"),
                            "evidence": p("hint.evidence"),
                            "remedy": p("hint.remedy"),
                        },
                        p("hint.item"),
                    ],
                    "signals": {p("signal.key"): p("signal.value")},
                },
            },
        ),
        Event("diverged", step, details={"message": p("diverged.message")}),
    ]


RENDERED = [
    "spike.reason", "rollback.onset", "rollback.restored_step",
    "rollback.reason", "skip.range", "skip.length", "triage.verdict", "triage.reason",
    "triage.remedy", "triage.culprit", "triage.steps", "triage.seconds", "host.process_index",
    "host.platform", "host.device_ids", "jump.layer", "jump.largest", "jump.grad_norm",
    "jump.ratio", "jump.baseline", "hint.cause", "hint.evidence", "hint.remedy",
    "signal.key", "signal.value", "diverged.message", "title",
]  # fmt: skip


def test_every_rendered_field_is_escaped_and_shown_as_text(run):
    d, outside = run
    log = EventLog(d / "events.jsonl")
    for e in hostile_events(58):
        log.append(e)
    append_raw(d / "metrics.jsonl", json.dumps({"step": 61, payload("metrics.key"): 1.0}))
    page = write_report(d, title=payload("title")).read_text(encoding="utf-8")
    parsed = assert_inert(page)
    text = "".join(parsed.text)
    for field in RENDERED:
        # Rendered (the browser shows the markup as text) and inert (no element came of it).
        assert f"<script>alert('{field}')</script>" in text, field
    # Numbers formatted only after a type check: the real panel's numbers are still numbers.
    assert "Rollback 1 at step 35" in page and "[30, 37) — 7 batches" in page
    assert "Rollback 2 at step 58" in page
    assert snapshot(outside) == {"victim.txt": hashlib.sha256(b"precious\n").hexdigest()}


def test_a_directory_name_with_markup_is_escaped(pristine, tmp_path):
    d = tmp_path / "<b onmouseover=alert(1)>run"
    shutil.copytree(pristine, d)
    page = write_report(d).read_text(encoding="utf-8")
    assert_inert(page)
    assert "&lt;b onmouseover=alert(1)&gt;run" in page


def test_a_lone_surrogate_in_a_reason_is_written_escaped(run):
    d, _ = run
    name = os.fsdecode(b"data/shard-\xff.bin")  # a non-UTF-8 file name: a lone surrogate
    assert "\udcff" in name
    EventLog(d / "events.jsonl").append(Event("spike", 59, details={"reason": f"bad {name}"}))
    page_bytes = write_report(d).read_bytes()
    page = page_bytes.decode("utf-8")  # valid UTF-8 throughout
    assert "bad data/shard-\\udcff.bin" in page


# --------------------------------------------------------------------- the strict reader


MALFORMED = {
    "infinity step": '{"kind": "save", "step": Infinity, "time": 0.0}',
    "nan time": '{"kind": "save", "step": 3, "time": NaN}',
    "overflowing float": '{"kind": "save", "step": 3, "time": 1e999}',
    "huge int": '{"kind": "save", "step": 100000000000000000000000, "time": 0.0}',
    "fractional step": '{"kind": "save", "step": 12.7, "time": 0.0}',
    "integral float step": '{"kind": "save", "step": 12.0, "time": 0.0}',
    "bool step": '{"kind": "save", "step": true, "time": 0.0}',
    "list": "[1, 2, 3]",
    "string": '"save"',
    "deeply nested": '{"kind": "save", "step": 3, "time": 0.0, "details": '
    + "[" * 100_000
    + "]" * 100_000
    + "}",
    "deeply nested object": '{"a": ' * 50_000 + "1" + "}" * 50_000,
    "duplicate key": '{"kind": "save", "step": 3, "step": 4, "time": 0.0}',
    "details a list": '{"kind": "save", "step": 3, "time": 0.0, "details": [1]}',
    "torn": '{"kind": "save", "st',
}
PROBLEM = {
    "infinity step": "Infinity is not a JSON number",
    "nan time": "NaN is not a JSON number",
    "overflowing float": "overflows a float",
    "huge int": "does not fit in 64 bits",
    "fractional step": "'step' must be an integer, got 12.7",
    "integral float step": "'step' must be an integer, got 12.0",
    "bool step": "'step' must be an integer, got true",
    "list": "expected a JSON object, got an array",
    "string": "expected a JSON object, got a string",
    "deeply nested": "nested deeper than 64 levels",
    "deeply nested object": "nested deeper than 64 levels",
    "duplicate key": "the key 'step' appears twice",
    "details a list": "'details' must be an object",
    "torn": "not valid JSON",
}


def test_malformed_event_lines_are_skipped_with_a_warning_naming_file_and_line(run):
    d, _ = run
    path = d / "events.jsonl"
    good = read_events(path)
    first = len(path.read_text().splitlines()) + 1
    append_raw(path, *MALFORMED.values())
    EventLog(path).append(Event("save", 70, time=1.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = read_events(path)
    assert events == [*good, Event("save", 70, time=1.0)]
    messages = [str(w.message) for w in caught if w.category is MalformedLineWarning]
    assert len(messages) == len(MALFORMED)
    for k, name in enumerate(MALFORMED):
        assert messages[k].startswith(f"{path}:{first + k}: "), (name, messages[k])
        assert PROBLEM[name] in messages[k], (name, messages[k])
        assert "\n" not in messages[k] and len(messages[k]) < 500


def test_the_report_lists_the_skipped_lines_and_the_cli_warns_and_succeeds(run):
    d, _ = run
    append_raw(d / "events.jsonl", MALFORMED["infinity step"], MALFORMED["deeply nested"])
    append_raw(d / "metrics.jsonl", '{"step": 12.7, "loss": 1.0}', '{"step": 5, "loss": {}}')
    loaded = load_run(d)
    assert [w.split(": ", 1)[0].rsplit("/", 1)[-1] for w in loaded.warnings] == [
        f"events.jsonl:{n}" for n in (len(loaded.events) + 1, len(loaded.events) + 2)
    ] + [f"metrics.jsonl:{n}" for n in (len(loaded.rows) + 1, len(loaded.rows) + 2)]
    page = write_report(d).read_text()
    assert "Lines skipped while reading" in page and "4 input lines" in page
    proc = cli(d)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.count("warning: skipped ") == 4


def cli(directory, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "stabljax.report", str(directory), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def newest_meta(d: pathlib.Path) -> pathlib.Path:
    return d / str(max(int(p.name) for p in d.iterdir() if p.name.isdigit())) / "meta/metadata"


def edit_json(path: pathlib.Path, **changes) -> None:
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


@pytest.mark.parametrize(
    "tamper, file, problem",
    [
        (lambda d: edit_json(newest_meta(d), data_index=12.7), "meta", "'data_index' must be"),
        (lambda d: edit_json(newest_meta(d), rollbacks=True), "meta", "'rollbacks' must be"),
        (
            lambda d: newest_meta(d).write_text('{"step": ' + "[" * 5000 + "]" * 5000 + "}"),
            "meta",
            "nested deeper",
        ),
        (
            lambda d: (d / "stabljax-rollback.json").write_text("[1, 2]"),
            "record",
            "expected a JSON object, got an array",
        ),
        (
            lambda d: edit_json(d / "stabljax-rollback.json", target_step=float("inf")),
            "record",
            "Infinity is not a JSON number",
        ),
        (
            lambda d: edit_json(d / "stabljax-rollback.json", skipped_ranges=[[37, 30]]),
            "record",
            "'skipped_ranges' must be",
        ),
        (
            lambda d: append_raw(d / "events.jsonl", json.dumps({"schema": "2.0", "kind": "x"})),
            "events",
            "events schema '2.0' is not readable here",
        ),
    ],
    ids=[
        "meta float index", "meta bool", "meta nested", "record list", "record inf",
        "record reversed range", "events major 2",
    ],
)  # fmt: skip
def test_a_malformed_meta_record_or_schema_exits_2_naming_the_file(run, tamper, file, problem):
    d, _ = run
    tamper(d)
    path = {
        "meta": newest_meta(d),
        "record": d / "stabljax-rollback.json",
        "events": d / "events.jsonl",
    }[file]
    with pytest.raises(ValueError) as info:
        load_run(d)
    assert str(info.value).startswith(str(path)) and problem in str(info.value)
    proc = cli(d, "--out", str(d.parent / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {path}") and problem in line
    if file == "events":
        assert line.startswith(f"error: {path}:{len(path.read_text().splitlines())}: ")
    assert not (d.parent / "out" / "report.html").exists()


def test_the_readers_accept_exactly_what_the_library_wrote(pristine):
    meta = read_meta(newest_meta(pristine))
    assert meta["step"] == 60 and meta["skipped_ranges"] == [[30, 37]]
    record = read_rollback_record(pristine / "stabljax-rollback.json")
    raw = json.loads((pristine / "stabljax-rollback.json").read_text())
    assert record == raw and record["target_step"] == 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the library's own files give no warning
        events = read_events(pristine / "events.jsonl")
    assert len(events) == len((pristine / "events.jsonl").read_text().splitlines())
    assert not load_run(pristine).warnings


def test_an_orbax_restored_meta_is_checked_like_a_file():
    ok = {"version": 1, "step": 40, "data_index": 40, "skipped_ranges": [], "rollbacks": 0}
    assert read_meta(ok) == ok
    for bad, problem in [
        ({**ok, "data_index": 1e9}, "'data_index' must be an integer ≥ 0, got 1000000000.0"),
        ({**ok, "step": np.nan}, "a non-finite number"),
        ({**ok, "rollbacks": -1}, "'rollbacks' must be an integer ≥ 0, got -1"),
        ({k: v for k, v in ok.items() if k != "skipped_ranges"}, "'skipped_ranges' is missing"),
    ]:
        with pytest.raises(MalformedJSONError) as info:
            read_meta(bad, what="checkpoint 40's meta")
        assert str(info.value).startswith("checkpoint 40's meta: ") and problem in str(info.value)


@pytest.mark.parametrize(
    "text, value",
    [
        ("12", 12),
        ("-0.5", -0.5),
        ('"nan"', "nan"),
        ('{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ],
)  # fmt: skip
def test_loads_strict_reads_what_json_dumps_writes(text, value):
    assert loads_strict(text) == value == json.loads(text)


# ------------------------------------------------------------------------------ symlinks


def test_a_symlinked_events_jsonl_is_neither_appended_to_nor_read(run):
    d, outside = run
    before = snapshot(outside)
    (d / "events.jsonl").unlink()
    (d / "events.jsonl").symlink_to(outside / "victim.txt")
    with pytest.raises(UnsafePathError, match="refusing to follow the symlink"):
        EventLog(d / "events.jsonl").append(Event("save", 1))
    with pytest.raises(UnsafePathError):
        read_events(d / "events.jsonl")
    proc = cli(d)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert str(d / "events.jsonl") in proc.stderr and "symlink" in proc.stderr
    assert snapshot(outside) == before


def test_a_controller_whose_events_jsonl_is_a_symlink_writes_nothing_outside(tmp_path):
    d, outside = tmp_path / "ckpt", tmp_path / "outside"
    d.mkdir()
    outside.mkdir()
    (outside / "victim.txt").write_text("precious\n")
    (d / "events.jsonl").symlink_to(outside / "victim.txt")
    before = snapshot(outside)
    state, step = toy.triage_toy()
    with pytest.raises(UnsafePathError):
        with RollbackController(d, **toy.triage_controller_kwargs()) as ctl:
            ctl.run(step, state, IndexedBatches(toy.triage_batches()), 20, progress=False)
    assert snapshot(outside) == before


@pytest.mark.parametrize("name", ["report.html", "report.html.tmp"])
def test_a_symlinked_report_or_temp_file_is_replaced_not_written_through(run, name):
    d, outside = run
    before = snapshot(outside)
    (d / name).symlink_to(outside / "victim.txt")
    path = write_report(d)
    assert path == d / "report.html" and not path.is_symlink()
    assert path.read_text().startswith("<!DOCTYPE html>")
    assert snapshot(outside) == before
    assert not [p for p in d.iterdir() if p.name.startswith(".report.html.tmp")]


def test_a_symlinked_metrics_file_is_refused_by_the_writer(run):
    d, outside = run
    before = snapshot(outside)
    (d / "metrics.jsonl").unlink()
    (d / "metrics.jsonl").symlink_to(outside / "victim.txt")
    with pytest.raises(UnsafePathError):
        JsonlMetricsWriter(d / "metrics.jsonl")
    # The report does not read it either, unless the user names the file.
    with pytest.raises(UnsafePathError, match="metrics.jsonl"):
        load_run(d)
    assert (
        load_run(d, metrics=outside / "victim.txt")
        .warnings[0]
        .endswith("not valid JSON (Expecting value: line 1 column 1 (char 0))")
    )
    assert snapshot(outside) == before


def test_a_fifo_at_a_fixed_name_is_refused_without_blocking(run):
    d, _ = run
    (d / "metrics.jsonl").unlink()
    os.mkfifo(d / "metrics.jsonl")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        load_run(d)


def test_atomic_write_keeps_the_old_file_on_failure_and_refuse_symlinks(tmp_path):
    path = tmp_path / "report.html"
    atomic_write_text(path, "old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(path, "new \udcff")  # strict by default
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["report.html"]
    atomic_write_text(path, "new \udcff", errors="backslashreplace")
    assert path.read_bytes() == b"new \\udcff"
    refuse_symlinks(tmp_path, ["report.html", "missing"])
    (tmp_path / "stabljax-trash").symlink_to(tmp_path.parent)
    with pytest.raises(UnsafePathError, match="stabljax-trash is a symlink"):
        refuse_symlinks(tmp_path, ["events.jsonl", "stabljax-trash"])


@pytest.mark.parametrize(
    "name",
    ["stabljax.lock", "stabljax.lock.1", "stabljax-rollback.json", "stabljax-trash",
     "stabljax-corrupt", "stabljax-trash.0f", ".stabljax-probe-PID-0"],
)  # fmt: skip
def test_a_controller_refuses_a_run_whose_special_entry_is_a_symlink(run, name):
    name = name.replace("PID", str(os.getpid()))  # (the same test ids on every xdist worker)
    d, outside = run
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to(outside if "trash" in name or "corrupt" in name else outside / "x")
    (outside / "x").write_text("precious\n")
    before, inside = snapshot(outside), snapshot(d)
    with pytest.raises(UnsafePathError, match=name.replace(".", r"\.")):
        RollbackController(d, **toy.triage_controller_kwargs())
    assert snapshot(outside) == before and snapshot(d) == inside  # nothing written anywhere


def test_the_lock_is_not_taken_through_a_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stabljax.lock").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="stabljax.lock"):
        DirectoryLock(tmp_path / "run").acquire()
    assert victim.read_text() == "precious\n"


def restart(d):
    state, step = toy.triage_toy()
    with RollbackController(d, **toy.triage_controller_kwargs()) as ctl:
        got, data = ctl.restore_or_init(state, IndexedBatches(toy.triage_batches(bad=[35])))
        return ctl, data.index, [e for e in ctl.events if e.kind == "corrupt_checkpoint"]


def test_a_malformed_rollback_record_stops_the_resume_naming_the_file(run):
    d, outside = run
    (d / "stabljax-rollback.json").write_text(
        json.dumps({"rollbacks": 1, "target_step": 30, "data_index": 37.5, "skipped_ranges": []})
    )
    steps = sorted(p.name for p in d.iterdir() if p.name.isdigit())
    with pytest.raises(MalformedJSONError, match="stabljax-rollback.json: 'data_index' must be"):
        restart(d)
    assert sorted(p.name for p in d.iterdir() if p.name.isdigit()) == steps
    assert not (d / "stabljax-corrupt").exists()


@pytest.mark.parametrize("recompute", [False, True], ids=["edited", "edited_digest_recomputed"])
def test_an_edited_meta_is_a_corrupt_checkpoint_named_and_set_aside(run, recompute):
    d, _ = run
    newest = max(int(p.name) for p in d.iterdir() if p.name.isdigit())
    path = d / str(newest) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["data_index"] = 1e9 if recompute else 10**9  # a float fails the strict reader
    if recompute:  # the plain digest is anyone's to recompute; the type check still holds
        meta["digest"] = meta_digest(meta)
    path.write_text(json.dumps(meta))
    ctl, index, corrupt = restart(d)
    problem = "'data_index' must be an integer" if recompute else "meta digest mismatch"
    assert [e.step for e in corrupt] == [newest] and problem in corrupt[0].details["reason"]
    assert ctl.current_step == newest - 10 and index < 10**9
    assert [p.name.split("-")[0] for p in (d / "stabljax-corrupt").iterdir()] == [str(newest)]


# ----------------------------------------------------------------------------- packaging


def test_the_license_is_an_spdx_expression_with_the_file_in_the_wheel():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
