"""Host-side helpers of the controller: reading device values, and agreeing across hosts.

On one host every function here is trivial; on several (``jax.process_count() > 1``)
each gives the same answer on every process, which is what lets the controller decide
the same thing everywhere without a coordinator.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def to_host(x: Any) -> np.ndarray:
    """A numpy copy of ``x``; on several hosts the same value on every process."""
    if isinstance(x, jax.Array):
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def host_scalars(metrics: Mapping[str, Any], keys: frozenset[str] | None) -> dict[str, Any]:
    """Host Python scalars for the 0-d entries of ``metrics`` (all, or those in ``keys``)."""
    wanted = {
        k: v
        for k, v in metrics.items()
        if (keys is None or k in keys)
        and not (isinstance(v, Mapping) or v is None)
        and np.shape(v) == ()
    }
    for v in wanted.values():  # start every copy before waiting on the first
        if isinstance(v, jax.Array) and v.is_fully_addressable:
            v.copy_to_host_async()
    return {k: to_host(v).item() for k, v in wanted.items()}


def try_everywhere(fn: Callable[[], Any], log: Callable[..., None], step: int | None) -> Any:
    """``fn()``, or None (with a ``corrupt_checkpoint`` event) if it fails on any process."""
    try:
        result, ok, err = fn(), True, None
    except Exception as e:  # noqa: BLE001 - any failure to read means "not usable"
        result, ok, err = None, False, e
    if not all_agree(ok):
        if step is not None:
            reason = f"{type(err).__name__}: {err}"[:500] if err else "failed on another host"
            log("corrupt_checkpoint", step, reason=reason)
        return None
    return result


def is_primary() -> bool:
    return jax.process_index() == 0


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"stabljax:{name}")


def all_agree(ok: bool) -> bool:
    """True when ``ok`` holds on every process (the same answer everywhere)."""
    if jax.process_count() == 1:
        return ok
    flags = multihost_utils.process_allgather(np.asarray(ok, np.int32))
    return bool(np.all(flags))


def atomic_write_json(path: pathlib.Path, obj: Any) -> None:
    """Writes ``obj`` to a temporary file, fsyncs it, and renames it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_state(state: Any) -> None:
    """Raises ``TypeError`` unless ``state`` has the ``step`` field checkpoints count by."""
    if not hasattr(state, "step"):
        raise TypeError(
            f"state must have a 'step' field (int32 scalar), got {type(state).__name__}"
        )


def check_directory(directory: pathlib.Path) -> None:
    """Creates ``directory`` (and its parents) and checks that it can be written."""
    probe = directory / f".stabljax-probe-{os.getpid()}-{jax.process_index()}"
    try:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(directory))
        directory.mkdir(parents=True, exist_ok=True)
        mode = directory.stat().st_mode
        if not mode & 0o222:  # root writes anywhere; respect the operator's intent anyway
            raise PermissionError(errno.EACCES, f"read-only (mode {oct(mode & 0o777)})")
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise OSError(
            e.errno,
            f"checkpoint directory {str(directory)!r} cannot be created or written "
            f"({type(e).__name__}: {e}); pass a writable directory",
        ) from e
