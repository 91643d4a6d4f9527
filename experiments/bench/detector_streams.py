"""The loss streams the detector benchmark feeds: synthetic noise and recorded losses.

AR(1) noise (iid at phi = 0), healthy recorded losses over their own trend (pooled and
resampled by a stationary block bootstrap), and a healthy falling loss, all at
:data:`LEVEL` nats with noise scale :data:`STD`. Used by :mod:`experiments.bench.detectors`.
"""

from __future__ import annotations

import json
import math

import numpy as np

from experiments.common import RESULTS

LEVEL, STD = 2.0, 0.05
# Healthy recorded curves: (results folder, path in results.json). The clipping and
# lr-sensitivity experiments train at unstable learning rates on purpose; left out.
# init_schemes' embed-LN arm at its lowest LR, seeds 0-2 (200 steps each).
REAL_CURVES = tuple(("init_schemes", ("losses", f"embed LN@0.00316@{k}")) for k in range(3))


def ar1(n: int, phi: float, std: float, rng: np.random.Generator) -> np.ndarray:
    """AR(1) noise with marginal std ``std`` (iid for phi = 0), started stationary."""
    e = rng.standard_normal(n)
    if phi == 0:
        return std * e
    out = np.empty(n)
    innov = std * math.sqrt(1 - phi * phi)
    prev = std * e[0]
    out[0] = prev
    for t in range(1, n):
        prev = phi * prev + innov * e[t]
        out[t] = prev
    return out


def _running(x: np.ndarray, width: int, fn) -> np.ndarray:
    half = width // 2
    return np.array([fn(x[max(0, i - half) : i + half + 1]) for i in range(len(x))])


def real_ratios(trend_width: int, skip_frac: float) -> tuple[np.ndarray, list[str]]:
    """Recorded healthy losses over their own smoothed trend, pooled (mean about 1).

    The trend is a running median then a running mean, ``trend_width`` steps each; the
    first ``skip_frac`` of each curve is dropped. Returns the ratios and the curves used.
    """
    pooled, used = [], []
    for folder, path in REAL_CURVES:
        f = RESULTS / folder / "results.json"
        if not f.exists():
            continue
        node = json.loads(f.read_text())["results"]
        try:
            for k in path:
                node = node[k]
        except (KeyError, TypeError):
            continue
        x = np.asarray(node, np.float64)
        x = x[np.isfinite(x)]
        trend = _running(_running(x, trend_width, np.median), trend_width, np.mean)
        r = x / trend
        pooled.append(r[int(skip_frac * len(r)) :])
        used.append(f"{folder}:{'/'.join(map(str, path))}")
    if not pooled:
        raise FileNotFoundError(f"no recorded loss curves under {RESULTS}")
    return np.concatenate(pooled), used


def block_bootstrap(r: np.ndarray, n: int, mean_block: int, rng) -> np.ndarray:
    """Politis and Romano's stationary bootstrap of ``r`` to ``n`` values (circular)."""
    out = np.empty(n)
    i = 0
    while i < n:
        start = int(rng.integers(len(r)))
        length = min(int(rng.geometric(1.0 / mean_block)), n - i)
        idx = (start + np.arange(length)) % len(r)
        out[i : i + length] = r[idx]
        i += length
    return out


def falling_loss(n: int, noise: str, rng: np.random.Generator) -> np.ndarray:
    """A healthy falling loss: 2 + exp(-t / 300) nats (3 at the start), with Student-t noise
    (3 degrees of freedom, scale 5 % of the level) or AR(1) noise (phi 0.99, std 0.05)."""
    level = LEVEL + np.exp(-np.arange(n) / 300.0)
    if noise == "student_t3":
        return level * (1 + STD * rng.standard_t(3, size=n))
    return level + ar1(n, 0.99, STD, rng)
