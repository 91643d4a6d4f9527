"""Metrics writers for :meth:`RollbackController.run`: any ``callable(step, metrics)``.

The controller hands a writer each step's metrics one step late (after the next step is
dispatched, so the device never waits on a fetch), as host scalars: every scalar metric
as a ``float``/``int``/``bool``, nested dicts flattened with ``/`` (``layers/grad_norm/w``),
non-scalar arrays left out. After a rollback the replayed steps are written again: a
writer sees a step number a second time, newer values last.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["JsonlMetricsWriter", "TensorBoardMetricsWriter", "host_metrics"]


def host_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | bool]:
    """The scalar entries of ``metrics`` as Python numbers; nested mappings flattened.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.control.writers import host_metrics
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
    are written as strings (``"nan"``), as in ``events.jsonl``. Use as a context manager
    or call :meth:`close`.

    Args:
      path: the file; its parent folders are created.

    Example:
      >>> import json, pathlib, tempfile
      >>> from stabljax.control.writers import JsonlMetricsWriter
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
      >>> with JsonlMetricsWriter(path) as w:
      ...     w(0, {"loss": 2.0}); w(1, {"loss": float("nan")})
      >>> [json.loads(line) for line in path.read_text().splitlines()]
      [{'step': 0, 'loss': 2.0}, {'step': 1, 'loss': 'nan'}]
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_in_newline()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if torn:
            self._file.write("\n")

    def _ends_in_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._file.closed:
            raise ValueError(f"JsonlMetricsWriter({self.path}) is closed")
        row = {"step": int(step), **{k: _json_number(v) for k, v in host_metrics(metrics).items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
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
