"""Several hosts, one decision: host copies that are the same on every process, and agreement.

On one process each of these is the plain operation; on several (a TPU pod, the gloo
processes of the tests) every process calls it at the same point and gets the same answer,
so every controller of a run takes the same decisions from the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
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
