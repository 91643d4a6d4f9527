"""Benchmark plumbing: interleaved wall-time medians, XLA cost analysis, copy bandwidth.

Candidates are timed round-robin in one process (A, B, C, A, B, C, ...) so that machine
noise, clock changes and cache state hit every candidate alike; the reported figure is the
median of each candidate's samples, and ratios are taken between medians.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def compiled_cost(compiled: Any) -> dict[str, float]:
    """``flops`` and ``bytes accessed`` from XLA's cost analysis of a compiled function."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list | tuple):  # older jax returned one dict per computation
        ca = ca[0] if ca else {}
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}


def interleaved_medians(
    runners: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 2
) -> dict[str, float]:
    """Median seconds per call of each runner, timed round-robin.

    Each runner performs one call and returns something to block on; the timer includes
    ``jax.block_until_ready`` of it, so asynchronous dispatch does not hide work.
    """
    for _ in range(warmup):
        for fn in runners.values():
            jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def copy_runner(n_floats: int) -> Callable[[], Any]:
    """One call of ``y = x + 1`` on ``n_floats`` float32, ``x`` donated (see below)."""
    f = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    box = [jnp.zeros((n_floats,), jnp.float32)]

    def run():
        box[0] = f(box[0])
        return box[0]

    return run


def copy_bytes(n_floats: int) -> int:
    """Bytes one :func:`copy_runner` call moves: every float read once and written once."""
    return 2 * 4 * n_floats


def copy_bandwidth(n_floats: int, *, repeats: int = 20) -> float:
    """Measured bytes/s of an elementwise read-modify-write of ``n_floats`` float32.

    ``y = x + 1`` with ``x`` donated reads and writes every byte once: the floor that any
    memory-bound update of that many values can reach on this machine. To compare with
    other candidates under the same machine noise, time :func:`copy_runner` together with
    them in :func:`interleaved_medians` instead.
    """
    t = interleaved_medians({"copy": copy_runner(n_floats)}, repeats=repeats)["copy"]
    return copy_bytes(n_floats) / t
