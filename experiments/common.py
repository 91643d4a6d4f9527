"""Shared plumbing for experiments and benchmarks: CLI, environment record, result writing.

Each experiment file holds only what makes it different; everything it shares with the
others (the config-to-CLI mapping, the results folder layout, the Markdown table, the
environment record) lives here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    """Versions, devices and machine facts recorded with every result."""
    import jax

    versions = {}
    for mod in ("jax", "jaxlib", "optax", "flax", "orbax.checkpoint", "grain", "numpy"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            versions[mod] = getattr(m, "__version__", "?")
        except ImportError:
            versions[mod] = None
    devs = jax.devices()
    return {
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_kind": devs[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy / jax arrays and scalars
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no NaN/Inf; keep them readable
    return x


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Renders dict rows as a GitHub Markdown table (floats to 4 significant digits)."""
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(
    out: pathlib.Path | str,
    *,
    config: Any,
    results: dict[str, Any],
    table: str,
    title: str,
    stem: str = "results",
) -> pathlib.Path:
    """Writes ``<stem>.json`` (config, environment, every number) and ``<stem>.md``.

    Files are written to a temporary name and renamed, so a reader never sees half a file.
    """
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": _jsonable(config),
        "environment": environment(),
        "results": _jsonable(results),
    }
    for name, text in (
        (f"{stem}.json", json.dumps(payload, indent=1, sort_keys=True) + "\n"),
        (f"{stem}.md", f"# {title}\n\n{table}"),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return out


def _field_type(f: dataclasses.Field, hints: dict[str, Any]) -> Any:
    t = hints.get(f.name, str)
    origin = typing.get_origin(t)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0] if args else str
    return t


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def parse_config(cls: type, argv: Sequence[str] | None, description: str, *, name: str):
    """Builds an argparse CLI from a frozen dataclass; returns (config, args).

    Every field becomes ``--field-name`` with its default shown in ``--help``. ``--quick``
    starts from ``cls.quick()`` instead of the defaults; ``--out`` picks the results folder
    (default ``experiments/results/<name>``).
    """
    hints = typing.get_type_hints(cls)
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke-run configuration")
    p.add_argument("--out", default=str(RESULTS / name), help="results folder")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    for f in dataclasses.fields(cls):
        t = _field_type(f, hints)
        kwargs: dict[str, Any] = {"type": t}
        if t is bool:
            kwargs["type"] = _parse_bool
        elif typing.get_origin(t) is tuple:
            kwargs = {"type": (typing.get_args(t) or (str,))[0], "nargs": "+"}
        helptext = f.metadata.get("help", f.name.replace("_", " "))
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, default=None, help=f"{helptext} (default {f.default})", **kwargs)
    args = p.parse_args(argv)
    base = cls.quick() if args.quick and hasattr(cls, "quick") else cls()
    changes = {}
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name)
        if v is not None:
            changes[f.name] = tuple(v) if isinstance(v, list) else v
    return dataclasses.replace(base, **changes), args
