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
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` pointing at the first frame outside stabljax: the user's line.

    Call chains into stabljax have different depths (``ctl.step`` or ``ctl.run``,
    ``restore_or_init`` or ``as_data_iterator``), so no fixed ``stacklevel`` fits;
    Python 3.12's ``skip_file_prefixes`` would, and this counts the frames instead.
    """
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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


PROBE = ".stabljax-probe-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's process
        return True
    return True


def clean_probes(directory: pathlib.Path) -> None:
    """Removes probe files left by processes that died between writing and removing them.

    A pid that is dead here may be alive on another host sharing the directory; removing
    its probe is harmless, since the probe's writer removes it with ``missing_ok``.
    """
    for path in directory.glob(f"{PROBE}*-*"):
        try:
            pid = int(path.name[len(PROBE) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            path.unlink(missing_ok=True)


def check_directory(directory: pathlib.Path) -> None:
    """Creates ``directory`` (and its parents), checks that it can be written, and
    removes stale probe files."""
    probe = directory / f"{PROBE}{os.getpid()}-{jax.process_index()}"
    try:
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file is in the way", str(directory))
        directory.mkdir(parents=True, exist_ok=True)
        mode = directory.stat().st_mode
        if not mode & 0o222:  # root writes anywhere; respect the operator's intent anyway
            raise PermissionError(errno.EACCES, f"read-only (mode {oct(mode & 0o777)})")
        probe.write_text("ok")
        probe.unlink(missing_ok=True)
        clean_probes(directory)
    except OSError as e:
        raise OSError(
            e.errno,
            f"checkpoint directory {str(directory)!r} cannot be created or written "
            f"({type(e).__name__}: {e}); pass a writable directory",
        ) from e
