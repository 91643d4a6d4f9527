"""The one command line of every experiment and benchmark: ``python -m experiments.<name>``.

Every field of a frozen config becomes ``--field-name`` (listed in ``--help`` with its
default); ``--quick`` starts from ``Config.quick()``; ``--out`` picks the results folder.
:func:`start` does all of that and returns an :class:`Invocation`, which runs a sweep under
a progress bar and writes the results with the command line and wall time: an
experiment's ``results.json``/``.md`` (:meth:`Invocation.write`) or a benchmark's
``<name>.json``/``.md`` with its ratios against their targets (:meth:`Invocation.report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from experiments import common
from experiments.common import RESULTS


def _field_type(f: dataclasses.Field, hints: dict[str, Any]) -> Any:
    t = hints.get(f.name, str)
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        t = args[0] if args else str
    return t


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except ``None``: config fields default to ``None`` on the command
    line (unset, so ``--quick`` can fill them) and state their real default in their help."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def parse_config(
    cls: type, argv: Sequence[str] | None, description: str, *, name: str, out: pathlib.Path
):
    """Builds an argparse CLI from a frozen dataclass; returns ``(config, args)``.

    ``args.command`` is the command line as run (recorded in the results).
    """
    hints = typing.get_type_hints(cls)
    p = argparse.ArgumentParser(
        prog=f"python -m experiments.{name}",
        description=description,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke-run configuration")
    p.add_argument("--out", default=str(out), help="results folder")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g = p.add_argument_group(
        "multi-process runs",
        "Start one process per host (or several on one host) with the same command and "
        "these three flags; each process uses its local devices and process 0 writes the "
        "results. On a TPU pod slice, SLURM or Open MPI, --distributed finds them by itself.",
    )
    g.add_argument(
        "--coordinator-address",
        default=None,
        help="HOST:PORT of process 0, where the processes meet (jax.distributed.initialize)",
    )
    g.add_argument("--num-processes", type=int, default=None, help="number of processes")
    g.add_argument("--process-id", type=int, default=None, help="this process's index")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with the cluster's own detection "
        "(also when JAX_COORDINATOR_ADDRESS or STABLJAX_DISTRIBUTED is set)",
    )
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
    shown = list(sys.argv[1:] if argv is None else argv)
    args.command = " ".join(["python", "-m", f"experiments.{name}", *shown])
    return dataclasses.replace(base, **changes), args


def init_distributed(args: argparse.Namespace | None = None) -> None:
    """Joins a multi-process run when launched as one; a single process needs nothing.

    With ``--coordinator-address``, ``--num-processes`` and ``--process-id`` (all three)
    it calls ``jax.distributed.initialize`` with them. With ``--distributed``, or
    ``JAX_COORDINATOR_ADDRESS`` / ``STABLJAX_DISTRIBUTED`` in the environment, it calls it
    without arguments, and JAX finds its peers itself. On CPU the collectives between
    processes go through gloo. Must run before anything touches a JAX device.
    """
    import jax

    explicit = {
        k: getattr(args, k, None) for k in ("coordinator_address", "num_processes", "process_id")
    }
    given = [k for k, v in explicit.items() if v is not None]
    if given and len(given) < 3:
        missing = sorted(set(explicit) - set(given))
        raise ValueError(
            "--coordinator-address, --num-processes and --process-id go together; "
            f"missing {', '.join('--' + m.replace('_', '-') for m in missing)}"
        )
    auto = getattr(args, "distributed", False) or any(
        os.environ.get(v) for v in ("JAX_COORDINATOR_ADDRESS", "STABLJAX_DISTRIBUTED")
    )
    if not given and not auto:
        return
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**(explicit if given else {}))


@dataclasses.dataclass
class Invocation:
    """One run of an experiment's or benchmark's ``main``: config, arguments, folder, clock."""

    name: str
    cfg: Any
    args: argparse.Namespace
    out: pathlib.Path
    t0: float

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def sweep(self, total: int, run: Callable[[Any], Any]) -> Any:
        """``run(bar)`` under a progress bar of ``total`` steps, closed on error too."""
        bar = common.progress_bar(total, self.name, disable=self.args.no_progress)
        try:
            return run(bar)
        finally:
            bar.close()

    def write(
        self,
        results: dict[str, Any],
        *,
        table: str,
        title: str,
        summary: dict[str, Any] | None = None,
        stem: str = "results",
        top: dict[str, Any] | None = None,
    ) -> pathlib.Path:
        """``<stem>.json`` and ``<stem>.md`` in ``out``, with the command line and wall time
        (and ``top``: :func:`experiments.common.write_results`); prints ``table``."""
        print(table)
        return common.write_results(
            self.out,
            config=self.cfg,
            results=results,
            table=table,
            title=title,
            stem=stem,
            summary=summary,
            command=self.args.command,
            wall_s=self.elapsed(),
            top=top,
        )

    def report(
        self,
        rows: Sequence[dict[str, Any]],
        results: dict[str, Any],
        *,
        targets: dict[str, float],
        title: str,
        stem: str | None = None,
    ) -> dict[str, Any]:
        """A benchmark's results: ``<stem>.json`` and ``<stem>.md`` (``rows``, then each of
        ``results["ratios"]`` beside its target), the table printed; returns ``results``.

        ``stem`` defaults to the benchmark's name (``bench.train_step`` -> ``train_step``).
        """
        ratios = [
            {"ratio": k, "value": v, "target": targets.get(k, "")}
            for k, v in results["ratios"].items()
        ]
        table = common.markdown_table(rows) + "\n" + common.markdown_table(ratios)
        self.write(results, table=table, title=title, stem=stem or self.name.rpartition(".")[2])
        return results


def start(
    cls: type, argv: Sequence[str] | None, doc: str, *, name: str, folder: str | None = None
) -> Invocation:
    """Parses the command line of ``python -m experiments.<name>`` (:func:`parse_config`;
    the description is ``doc``'s first line), joins a multi-process run if launched as one,
    and starts the clock.

    Results go to ``experiments/results/<folder>``: by default the experiment's name, or
    ``bench`` for a benchmark (``name`` ``bench.<x>``), where every benchmark writes its
    own ``<x>.json``.
    """
    if folder is None:
        folder = "bench" if name.startswith("bench.") else name
    cfg, args = parse_config(cls, argv, doc.splitlines()[0], name=name, out=RESULTS / folder)
    init_distributed(args)
    return Invocation(name, cfg, args, pathlib.Path(args.out), time.perf_counter())


def fresh_workdir(workdir: str | None, out: pathlib.Path, *, name: str) -> pathlib.Path:
    """A run's checkpoint folder: ``workdir`` (``--workdir``; it must not exist, since the
    run would resume from it, and every process must see it), else ``<out>/ckpt``, emptied
    (one process only)."""
    import jax

    if workdir is None:
        if jax.process_count() > 1:
            raise ValueError("a multi-process run needs --workdir, a folder every process sees")
        path = out / "ckpt"
        shutil.rmtree(path, ignore_errors=True)  # this run's own folder: start afresh
        return path
    from jax.experimental import multihost_utils

    path = pathlib.Path(workdir)
    if path.exists():
        raise ValueError(f"--workdir {path} exists; the run would resume from it")
    multihost_utils.sync_global_devices(f"{name}: workdir checked")
    return path
