"""One strict reader for everything stabljax writes as JSON.

``events.jsonl``, ``metrics.jsonl``, the rollback record (``stabljax-rollback.json``) and
a checkpoint's meta item are data, and a run directory may come from elsewhere: what is
read back is checked as strictly as the library writes it.

* Numbers are finite: the tokens ``NaN``, ``Infinity`` and ``-Infinity`` and a float that
  overflows (``1e999``) are errors (the writers store non-finite values as the strings
  ``"nan"``, ``"inf"``, ``"-inf"``). Integers fit in 64 bits.
* Nesting is at most :data:`MAX_DEPTH` deep (checked before parsing, so a line of
  100,000 brackets is an error, not a ``RecursionError``); an object has no repeated key.
* A record's top-level type is an object, and its fields have the types of a
  :data:`Schema`: an integer field takes an ``int`` only (not ``true``, not ``12.0``, not
  ``12.7``).

Lines of a JSON-lines file are independent: :func:`read_jsonl` skips a bad line and
returns a warning naming the file and line. A whole-file record is all or nothing:
:func:`read_json` raises :class:`MalformedJSONError` naming the file. Both messages are
one line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from stabljax.control.checkpoint import fsutil

__all__ = [
    "EVENT_SCHEMA",
    "MAX_DEPTH",
    "META_SCHEMA",
    "METRICS_SCHEMA",
    "RECORD_SCHEMA",
    "Field",
    "MalformedJSONError",
    "MalformedLineWarning",
    "check_record",
    "check_tree",
    "loads_strict",
    "read_json",
    "read_jsonl",
    "read_meta",
    "read_rollback_record",
]

MAX_DEPTH = 64
"""The deepest nesting accepted (the library writes at most 6 levels)."""

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
NONFINITE = ("nan", "inf", "-inf")


class MalformedJSONError(ValueError):
    """A JSON file or line that is not what stabljax writes; the message names the file."""


class MalformedLineWarning(UserWarning):
    """A line of a JSON-lines file was skipped; the message names the file and line."""


Kind = Literal["int", "count", "number", "bool", "str", "dict", "list", "ranges", "scalar"]


@dataclasses.dataclass(frozen=True)
class Field:
    """The type of one field of a record.

    Attributes:
      kind: ``"int"`` (an ``int``, never a bool or a float), ``"count"`` (an int ≥ 0),
        ``"number"`` (an int or a finite float, not a bool), ``"bool"``, ``"str"``,
        ``"dict"``, ``"list"``, ``"ranges"`` (a list of ``[a, b]`` int pairs with
        ``0 ≤ a ≤ b``) or ``"scalar"`` (a number, a bool or one of ``"nan"``, ``"inf"``,
        ``"-inf"``, as the metrics writers store values).
      required: whether a record must have it.
      nullable: whether ``null`` is allowed.
    """

    kind: Kind
    required: bool = True
    nullable: bool = False


Schema = Mapping[str, Field]
"""Field name → :class:`Field`; fields a schema does not name are not checked."""

EVENT_SCHEMA: Schema = {
    "schema": Field("str", required=False),
    "kind": Field("str"),
    "step": Field("int"),
    "time": Field("number"),
    "details": Field("dict", required=False),
}
"""A line of ``events.jsonl`` (docs/events.md)."""

METRICS_SCHEMA: Schema = {"step": Field("int")}
"""A row of ``metrics.jsonl``; its other fields are checked as ``"scalar"``."""

RECORD_SCHEMA: Schema = {
    "rollbacks": Field("count"),
    "target_step": Field("count"),
    "data_index": Field("count"),
    "skipped_ranges": Field("ranges"),
    "last_rollback": Field("dict", required=False, nullable=True),
    "history": Field("list", required=False),
    "time": Field("number", required=False),
}
"""The rollback record, ``stabljax-rollback.json``."""

META_SCHEMA: Schema = {
    "version": Field("int"),
    "step": Field("count"),
    "data_index": Field("count"),
    "skipped_ranges": Field("ranges"),
    "rollbacks": Field("count"),
    "last_rollback": Field("dict", required=False, nullable=True),
    "history": Field("list", required=False),
    "detectors": Field("dict", required=False, nullable=True),
    "ckpt_losses": Field("dict", required=False, nullable=True),
    "fingerprint": Field("list", required=False, nullable=True),
    "digest": Field("str", required=False),
}
"""A checkpoint's meta item (``<step>/meta/metadata``), the fields readers rely on."""

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number (non-finite values are written as strings)")


def _finite_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"the number {token[:40]} overflows a float")
    return value


def _int(token: str) -> int:
    value = int(token)
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"the integer {token[:40]}... does not fit in 64 bits")
    return value


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {key!r} appears twice in one object")
    return out


def loads_strict(text: str, *, what: str = "JSON", max_depth: int = MAX_DEPTH) -> Any:
    """Parses ``text`` as JSON under the rules of this module.

    Args:
      text: one JSON document.
      what: names the document in the error (e.g. ``"/run/events.jsonl:12"``).
      max_depth: the deepest nesting of arrays and objects accepted.

    Raises:
      stabljax.control.checkpoint.jsonio.MalformedJSONError: ``text`` is not JSON, holds ``NaN``/``Infinity`` or a number out
        of range, repeats a key, or nests deeper than ``max_depth``.

    Example:
      >>> from stabljax.control.checkpoint.jsonio import loads_strict
      >>> loads_strict('{"step": 12, "loss": 0.5}')
      {'step': 12, 'loss': 0.5}
      >>> loads_strict('{"step": Infinity}', what="events.jsonl:3")
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.jsonio.MalformedJSONError: events.jsonl:3: Infinity is not a JSON number ...
      >>> loads_strict("[" * 100_000, what="x")
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.jsonio.MalformedJSONError: x: nested deeper than 64 levels
    """
    if _depth(text) > max_depth:
        raise MalformedJSONError(f"{what}: nested deeper than {max_depth} levels")
    try:
        return json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite_float,
            parse_int=_int,
            object_pairs_hook=_pairs,
        )
    except RecursionError:  # unreachable below the depth bound; kept as a last guard
        raise MalformedJSONError(f"{what}: nested too deep") from None
    except json.JSONDecodeError as e:
        raise MalformedJSONError(f"{what}: not valid JSON ({_one_line(e)})") from None
    except ValueError as e:
        raise MalformedJSONError(f"{what}: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _problem(value: Any, depth: int, max_depth: int) -> str | None:
    """What makes an already-parsed value break the rules, or None."""
    if depth > max_depth:
        return f"nested deeper than {max_depth} levels"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int):
        return None if INT_MIN <= value <= INT_MAX else "an integer does not fit in 64 bits"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"a non-finite number ({value})"
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"a key of type {type(k).__name__}"
            if (p := _problem(v, depth + 1, max_depth)) is not None:
                return p
        return None
    if isinstance(value, list | tuple):
        for v in value:
            if (p := _problem(v, depth + 1, max_depth)) is not None:
                return p
        return None
    return f"a value of type {type(value).__name__}"


def check_tree(value: Any, *, what: str = "JSON", max_depth: int = MAX_DEPTH) -> Any:
    """Checks an already-parsed value (e.g. the meta item Orbax read) under the same rules
    as :func:`loads_strict`, and returns it.

    Example:
      >>> from stabljax.control.checkpoint.jsonio import check_tree
      >>> check_tree({"step": float("nan")}, what="meta")
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.jsonio.MalformedJSONError: meta: a non-finite number (nan)
    """
    if (p := _problem(value, 1, max_depth)) is not None:
        raise MalformedJSONError(f"{what}: {p}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_KIND_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", _is_int),
    "count": ("an integer ≥ 0", lambda v: _is_int(v) and v >= 0),
    "number": (
        "a finite number",
        lambda v: _is_int(v) or (isinstance(v, float) and math.isfinite(v)),
    ),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "list": ("an array", lambda v: isinstance(v, list)),
    "ranges": (
        "an array of [start, end] integer pairs with 0 ≤ start ≤ end",
        lambda v: (
            isinstance(v, list)
            and all(
                isinstance(r, list) and len(r) == 2 and all(map(_is_int, r)) and 0 <= r[0] <= r[1]
                for r in v
            )
        ),
    ),
    "scalar": (
        'a number, true/false or "nan"/"inf"/"-inf"',
        lambda v: (
            isinstance(v, bool | int) or isinstance(v, float) and math.isfinite(v) or v in NONFINITE
        ),
    ),
}


def _shown(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=True) if not isinstance(v, float) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_record(
    record: Any, schema: Schema, *, what: str = "record", extra: Field | None = None
) -> dict[str, Any]:
    """Checks that ``record`` is an object whose fields have ``schema``'s types.

    Args:
      record: a parsed JSON value.
      schema: the fields to check.
      what: names the record in the error (a file, a file and line).
      extra: if given, the type of every field ``schema`` does not name.

    Returns:
      ``record``.

    Raises:
      stabljax.control.checkpoint.jsonio.MalformedJSONError: naming ``what``, the field and what it must be.

    Example:
      >>> from stabljax.control.checkpoint.jsonio import EVENT_SCHEMA, check_record
      >>> check_record({"kind": "save", "step": 12.7, "time": 0.0}, EVENT_SCHEMA, what="e:1")
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.jsonio.MalformedJSONError: e:1: 'step' must be an integer, got 12.7
      >>> check_record([1, 2], EVENT_SCHEMA, what="e:2")
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.jsonio.MalformedJSONError: e:2: expected a JSON object, got an array
    """
    if not isinstance(record, dict):
        got = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        raise MalformedJSONError(
            f"{what}: expected a JSON object, got {got.get(type(record), 'a number')}"
        )
    for name, field in schema.items():
        if name not in record:
            if field.required:
                raise MalformedJSONError(f"{what}: the field {name!r} is missing")
            continue
        _check_field(record[name], name, field, what)
    if extra is not None:
        for name, value in record.items():
            if name not in schema:
                _check_field(value, name, extra, what)
    return record


def _check_field(value: Any, name: str, field: Field, what: str) -> None:
    if value is None and field.nullable:
        return
    description, ok = _KIND_CHECKS[field.kind]
    if not ok(value):
        raise MalformedJSONError(f"{what}: {name!r} must be {description}, got {_shown(value)}")


def read_jsonl(
    path: str | os.PathLike,
    schema: Schema,
    *,
    extra: Field | None = None,
    convert: Callable[[dict[str, Any], str], Any] | None = None,
    follow: bool = False,
    max_depth: int = MAX_DEPTH,
) -> tuple[list[Any], list[str]]:
    """Reads a JSON-lines file: the records that pass, and a warning per line skipped.

    Blank lines are ignored; a torn line (a crash in a write), a line that breaks the
    rules of :func:`loads_strict` or a record that fails :func:`check_record` is skipped.

    Args:
      path: the file; a missing file gives no records and no warnings.
      schema: each record's fields (:data:`EVENT_SCHEMA`, :data:`METRICS_SCHEMA`, ...).
      extra: the type of the fields ``schema`` does not name (``None``: unchecked).
      convert: if given, ``convert(record, "PATH:LINE")`` is what is kept for a record
        that passed: ``None`` skips it silently, a :class:`MalformedJSONError` skips it
        with a warning, any other exception propagates.
      follow: whether a symlink at ``path`` is followed (:func:`fsutil.read_text`).
      max_depth: the deepest nesting accepted.

    Returns:
      ``(records, warnings)``: records in file order; each warning is one line,
      ``"PATH:LINE: what was wrong"``.

    Raises:
      stabljax.control.checkpoint.fsutil.UnsafePathError: ``path`` is a symlink (unless ``follow``), a FIFO or a device.

    Example:
      >>> import os, tempfile
      >>> from stabljax.control.checkpoint.jsonio import METRICS_SCHEMA, read_jsonl
      >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
      >>> _ = open(path, "w").write('{"step": 0, "loss": 2.5}\\n{"step": true}\\n[3]\\n')
      >>> rows, warnings = read_jsonl(path, METRICS_SCHEMA)
      >>> rows
      [{'step': 0, 'loss': 2.5}]
      >>> [w.split(": ", 1)[1] for w in warnings]
      ["'step' must be an integer, got true", 'expected a JSON object, got an array']
    """
    path = os.fspath(path)
    try:
        text = fsutil.read_text(path, follow=follow)
    except FileNotFoundError:
        return [], []
    records, warnings = [], []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            value = loads_strict(line, what=where, max_depth=max_depth)
            record = check_record(value, schema, what=where, extra=extra)
            if convert is not None:
                record = convert(record, where)
        except MalformedJSONError as e:
            warnings.append(str(e))
            continue
        if record is not None:
            records.append(record)
    return records, warnings


def read_json(
    path: str | os.PathLike,
    schema: Schema,
    *,
    follow: bool = False,
    max_depth: int = MAX_DEPTH,
) -> dict[str, Any]:
    """Reads one whole-file JSON record; any fault is an error naming the file.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      stabljax.control.checkpoint.jsonio.MalformedJSONError: the file breaks the rules of :func:`loads_strict` or
        :func:`check_record` (the message starts with ``path``).
      stabljax.control.checkpoint.fsutil.UnsafePathError: ``path`` is a symlink (unless ``follow``), a FIFO or a device.
    """
    path = os.fspath(path)
    text = fsutil.read_text(path, follow=follow)
    value = loads_strict(text, what=path, max_depth=max_depth)
    return check_record(value, schema, what=path)


def read_rollback_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The rollback record at ``path`` (``stabljax-rollback.json``), or ``None`` if missing.

    Raises:
      stabljax.control.checkpoint.jsonio.MalformedJSONError: the record is not valid (``"PATH: 'rollbacks' must be ..."``):
        a half-written record cannot exist (it is renamed into place), so a bad one was
        edited and must not be adopted.
      stabljax.control.checkpoint.fsutil.UnsafePathError: ``path`` is a symlink, a FIFO or a device.

    Example:
      >>> import json, os, tempfile
      >>> from stabljax.control.checkpoint.jsonio import read_rollback_record
      >>> path = os.path.join(tempfile.mkdtemp(), "stabljax-rollback.json")
      >>> read_rollback_record(path) is None
      True
      >>> record = {"rollbacks": 1, "target_step": 30, "data_index": 37.0,
      ...           "skipped_ranges": [[30, 37]]}
      >>> _ = open(path, "w").write(json.dumps(record))
      >>> read_rollback_record(path)
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.jsonio.MalformedJSONError: ...: 'data_index' must be an integer ≥ 0, got 37.0
    """
    try:
        return read_json(path, RECORD_SCHEMA)
    except FileNotFoundError:
        return None


def read_meta(
    source: str | os.PathLike | Mapping[str, Any], *, what: str = "meta"
) -> dict[str, Any]:
    """A checkpoint's meta item, checked: from its file (``<step>/meta/metadata``) or as
    Orbax's ``JsonRestore`` returned it (already parsed, so checked by :func:`check_tree`).

    Args:
      source: the file, or the parsed meta.
      what: names a parsed meta in errors (e.g. ``"checkpoint 40's meta"``); a file is
        named by its path.

    Returns:
      The meta as a dict.

    Raises:
      stabljax.control.checkpoint.jsonio.MalformedJSONError: naming the file (or ``what``) and the field.
      FileNotFoundError: the file does not exist.

    Example:
      >>> from stabljax.control.checkpoint.jsonio import read_meta
      >>> meta = {"version": 1, "step": 40, "data_index": 1e9, "skipped_ranges": [],
      ...         "rollbacks": 0}
      >>> read_meta(meta, what="checkpoint 40's meta")
      Traceback (most recent call last):
      ...
      stabljax.control.checkpoint.jsonio.MalformedJSONError: checkpoint 40's meta: 'data_index' must be ...
    """
    if isinstance(source, Mapping):
        return check_record(check_tree(dict(source), what=what), META_SCHEMA, what=what)
    return read_json(source, META_SCHEMA)
