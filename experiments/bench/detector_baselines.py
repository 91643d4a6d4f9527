"""The previous detectors, kept as the detector benchmark's baseline.

:class:`OldSlow`: a Mann-Kendall test on block means taken as independent (window 50,
block 20, z 3.5, rise 3 %); :class:`OldSpike`: an EMA mean/std spike test (6 sigma, 10 %
floor, decay 0.99). Both take ``update(step, {"loss": x})`` and return ``True`` on an alarm,
else ``None``. Used by :mod:`experiments.bench.detectors`.
"""

from __future__ import annotations

import math

import numpy as np

from stabljax.control.detect.trends import mann_kendall, sen_slope


class OldSlow:
    """The previous slow-divergence test: Mann-Kendall on block means taken as iid."""

    def __init__(self, window=50, block=20, z_threshold=3.5, min_rise=0.03):
        self.window, self.block, self.z, self.min_rise = window, block, z_threshold, min_rise
        self._means, self._sum, self._count = [], 0.0, 0

    def update(self, step, metrics):
        self._sum += metrics["loss"]
        self._count += 1
        if self._count < self.block:
            return None
        self._means.append(self._sum / self._count)
        self._sum, self._count = 0.0, 0
        self._means = self._means[-self.window :]
        if len(self._means) < self.window:
            return None
        _, _, z = mann_kendall(self._means)
        rise = sen_slope(self._means) * (self.window - 1) / abs(np.median(self._means))
        if z <= self.z or rise < self.min_rise:
            return None
        self._means = []
        return True


class OldSpike:
    """The previous spike test: x - mean > max(6 std, 0.1 |mean|), bias-corrected EMA."""

    def __init__(self, threshold=6.0, rel_floor=0.1, decay=0.99, warmup=20):
        self.t, self.f, self.d, self.warmup = threshold, rel_floor, decay, warmup
        self.n, self.mean, self.var = 0, 0.0, 0.0

    def update(self, step, metrics):
        x = metrics["loss"]
        if self.n >= self.warmup:
            if x - self.mean > max(self.t * math.sqrt(self.var), self.f * abs(self.mean)):
                return True
        self.n += 1
        a = (1 - self.d) / (1 - self.d**self.n)
        delta = x - self.mean
        self.mean += a * delta
        self.var = (1 - a) * (self.var + a * delta * delta)
        return None
