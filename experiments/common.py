"""What every experiment and benchmark shares: the results folder, the environment record,
result files, the progress bar.

The proxy (model, data, optimizer) lives in :mod:`experiments.proxy`, the command line in
:mod:`experiments.cli`, the training loop in :mod:`experiments.trainer`, statistics in
:mod:`experiments.stats` and figures in :mod:`experiments.plots`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import platform
import sys
import time
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


#: The library code a result depends on: results are stale when these change after the
#: commit they ran on (``tests/test_experiments.py`` checks every committed results.json).
LIBRARY_PATHS = ("stabljax/control", "stabljax/optim")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def git(*args: str) -> str | None:
    """``git args`` in the repository root: its stdout stripped, or None (no git, no repo,
    or git failed)."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def library_commit() -> dict[str, Any]:
    """The commit the library code ran at: ``{"commit": sha or None, "dirty": [...]}``, the
    files under :data:`LIBRARY_PATHS` that differed from that commit when the run started
    (uncommitted edits: the commit alone does not say what ran)."""
    sha = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--", *LIBRARY_PATHS) if sha else None
    return {
        "commit": sha,
        "paths": list(LIBRARY_PATHS),
        "dirty": [line[3:] for line in (dirty or "").splitlines()],
    }


def jsonable(x: Any) -> Any:
    """``x`` as JSON-ready builtins; non-finite floats as the strings ``nan``/``inf``."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy / jax arrays and scalars
        return jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no NaN/Inf; keep them readable
    return x


def captioned_tables(*tables: tuple[str, Sequence[dict[str, Any]]]) -> str:
    """``(caption, rows)`` pairs as Markdown: each caption, a blank line, its table."""
    return "\n".join(f"{caption}\n\n{markdown_table(rows)}" for caption, rows in tables)


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
    summary: dict[str, Any] | None = None,
    command: str | None = None,
    wall_s: float | None = None,
    top: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Writes ``<stem>.json`` (command, wall time, config, environment, the library commit
    (:func:`library_commit`), summary, every number) and ``<stem>.md``.

    Files are written to a temporary name and renamed, so a reader never sees half a file.
    In a multi-process run only process 0 writes (every process holds the same numbers).
    ``top``: fields a reader looks for at the top level of the file (copies of summary
    fields), beside the fixed ones.
    """
    out = pathlib.Path(out)
    if not is_primary():
        return out
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": jsonable(config),
        "environment": environment(),
        "library": library_commit(),
        "results": jsonable(results),
    }
    if summary is not None:
        payload["summary"] = jsonable(summary)
    if command is not None:
        payload["command"] = command
    if wall_s is not None:
        payload["wall_s"] = round(float(wall_s), 1)
    payload |= {k: jsonable(v) for k, v in (top or {}).items() if k not in payload}
    for name, text in (
        (f"{stem}.json", json.dumps(payload, indent=1, sort_keys=True) + "\n"),
        (f"{stem}.md", f"# {title}\n\n{table}"),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out / name)
    return out


def is_primary() -> bool:
    """True on process 0 (the one that writes results and draws the progress bar)."""
    import jax

    return jax.process_index() == 0


class _NullBar:
    def __init__(self, total):
        self.total = total

    def update(self, n=1):
        pass

    def refresh(self):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def progress_bar(total: int, desc: str, *, disable: bool = False):
    """A tqdm bar (a no-op object when tqdm is missing, ``disable``, or not process 0)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # experiments extra not installed
        tqdm = None
    if tqdm is None or disable or not is_primary():
        return _NullBar(total)
    return tqdm(total=total, desc=desc, dynamic_ncols=True)


def grow_bar(bar: Any, steps: int) -> None:
    """Adds ``steps`` to a :func:`progress_bar`'s total: a rollback's replay is work too,
    so a bar that counts compute steps ends full, never past its total."""
    if steps > 0:
        bar.total += steps
        bar.refresh()


def finite_or_nan(x: float) -> float:
    """``x`` if finite else NaN (so tables show one marker for a diverged run)."""
    return float(x) if math.isfinite(float(x)) else float("nan")


def fmt_ci(effect: dict[str, Any], digits: int = 3) -> str:
    """``mean [lo, hi]`` of a :func:`experiments.stats.paired_effect` result."""
    lo, hi = effect["ci95"]
    return f"{effect['effect_mean']:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def fmt_interval(x: dict[str, Any] | None, digits: int = 3) -> str:
    """``mean [lo, hi]`` of a :func:`experiments.stats.interval` result (``—`` for None)."""
    if x is None:
        return "—"
    lo, hi = x["ci95"]
    return f"{x['mean']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def family_rows(remedies: dict[str, dict[str, Any]], label: str) -> list[dict[str, str]]:
    """One table row per comparison of a :func:`experiments.stats.family`: the effect with its
    95 % t-interval under ``label``, the sign-flip and Holm p, whether the claim is met."""
    return [
        {
            "comparison": k,
            label: fmt_ci(v),
            "p (sign-flip)": f"{v['p_sign_flip']:.4f}",
            "p (Holm)": f"{v['p_holm']:.4f}",
            "claim met": "yes" if v["claim_met"] else "no",
        }
        for k, v in remedies.items()
    ]


def equal_compute_tables(
    cfg: Any, s: dict[str, Any], rows: Sequence[dict[str, Any]], label: str, primary: str
) -> str:
    """The three tables of an equal-compute LM experiment's results.md (spike_recovery,
    lr_robust; ``cfg`` has ``seeds`` and ``steps``): the per-arm ``rows``, the one Holm
    family with its paired-t p-values, and the LR scan the best fixed LR came from."""
    eff = family_rows(s["remedies"], label)
    for e, r in zip(eff, s["remedies"].values(), strict=True):
        e["p (paired t)"] = f"{r['p_test']:.2g}"
    g = s["lr_grid"]
    scan = [
        {"lr": f"{lr:g}", "final held-out": f"{v:.4f}"}
        for lr, v in zip(g["lrs"], g["score"], strict=True)
    ]
    return captioned_tables(
        (f"Means over {len(cfg.seeds)} seeds, {cfg.steps} train-step calls per run", rows),
        (f"{primary}, paired per seed; paired t p-values, Holm over all {len(eff)}", eff),
        (f"LR scan ({g['arm']}): best {g['best_lr']:g}", scan),
    )
