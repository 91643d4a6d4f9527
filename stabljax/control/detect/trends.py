"""Trend tests for slow divergence: Mann–Kendall, Sen's slope and the Hamed–Rao correction.

Pure NumPy functions of a series, used by
:class:`~stabljax.control.detect.drift.SlowDivergenceDetector`.

References:
  Hamed and Rao, `A modified Mann-Kendall trend test for autocorrelated data
  <https://doi.org/10.1016/S0022-1694(97)00125-X>`_, 1998.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stabljax.base import validate


def mann_kendall(x: Any) -> tuple[float, float, float]:
    r"""The Mann–Kendall trend statistic of a series, with the tie-corrected variance.

    .. math::
        S = \sum_{i<j} \operatorname{sgn}(x_j - x_i), \qquad
        \operatorname{Var} S = \frac{n(n-1)(2n+5) - \sum_t t(t-1)(2t+5)}{18},

    the sum over groups of :math:`t` tied values, and the continuity-corrected
    :math:`z = (S - \operatorname{sgn} S) / \sqrt{\operatorname{Var} S}` (0 when
    :math:`S = 0`), approximately standard normal without a trend.

    Args:
      x: a 1-D sequence of at least 3 finite numbers.

    Returns:
      ``(S, Var S, z)`` as floats.

    Example:
      >>> from stabljax.control.detect.trends import mann_kendall
      >>> s, var, z = mann_kendall([1.0, 2.0, 3.0, 4.0])
      >>> print(s, round(var, 4), round(z, 4))
      6.0 8.6667 1.6984

    References:
      Mann, `Nonparametric tests against trend <https://doi.org/10.2307/1907187>`_, 1945;
      Kendall, Rank Correlation Methods, 1975.
    """
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    if x.ndim != 1 or n < 3:
        raise ValueError(f"need a 1-D series of >= 3 values, got shape {x.shape}")
    diff = x[None, :] - x[:, None]
    s = float(np.sign(diff[np.triu_indices(n, 1)]).sum())
    _, counts = np.unique(x, return_counts=True)
    ties = float(np.sum(counts * (counts - 1.0) * (2.0 * counts + 5.0)))
    var = (n * (n - 1.0) * (2.0 * n + 5.0) - ties) / 18.0
    if s == 0 or var <= 0:
        return s, var, 0.0
    return s, var, (s - math.copysign(1.0, s)) / math.sqrt(var)


def sen_slope(x: Any) -> float:
    r"""Sen's slope: the median of :math:`(x_j - x_i)/(j - i)` over all :math:`i < j`.

    Args:
      x: a 1-D sequence of at least 2 numbers.

    Returns:
      The slope per element, as a float.

    Example:
      >>> from stabljax.control.detect.trends import sen_slope
      >>> print(sen_slope([0.0, 1.0, 2.0, 3.0, 30.0]))
      1.0
    """
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    if x.ndim != 1 or n < 2:
        raise ValueError(f"need a 1-D series of >= 2 values, got shape {x.shape}")
    i, j = np.triu_indices(n, 1)
    return float(np.median((x[j] - x[i]) / (j - i)))


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their mean rank (as ``scipy.stats.rankdata``)."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    # first and last position of each run of equal values, in sorted order
    edges = np.flatnonzero(np.diff(xs)) + 1
    starts = np.concatenate([[0], edges])
    ends = np.concatenate([edges, [x.size]])
    ranks = np.empty(x.size, np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def rank_acf(x: np.ndarray) -> np.ndarray:
    """Autocorrelations (lags 0..n-1) of the ranks of ``x`` minus its Sen's-slope trend."""
    n = x.shape[0]
    i, j = np.triu_indices(n, 1)
    slope = float(np.median((x[j] - x[i]) / (j - i)))
    # Times 1..n as pymannkendall has them: which detrended values tie is a matter of
    # rounding, and the same arithmetic gives the same ties.
    r = _ranks(x - slope * np.arange(1, n + 1))
    y = r - r.mean()
    acov = np.correlate(y, y, "full")[n - 1 :] / n
    if acov[0] == 0:
        return np.zeros(n)
    return acov / acov[0]


def variance_ratio(rho: np.ndarray, n: int, keep: np.ndarray) -> float:
    r"""Hamed and Rao's :math:`n/n^*` from the autocorrelations ``rho[1:]`` marked ``keep``."""
    k = np.arange(1, keep.size + 1, dtype=np.float64)
    w = (n - k) * (n - k - 1) * (n - k - 2)
    return float(
        1.0 + 2.0 / (n * (n - 1.0) * (n - 2.0)) * np.sum((w * rho[1 : keep.size + 1])[keep])
    )


def normal_quantile(p: float) -> float:
    """The standard normal quantile, by bisection on ``math.erf`` (no scipy needed)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mann_kendall_hamed_rao(
    x: Any, *, alpha: float = 0.05, max_lag: int | None = None
) -> tuple[float, float, float, float]:
    r"""Mann–Kendall with Hamed and Rao's variance correction for autocorrelated data.

    Serial correlation inflates the variance of Mann–Kendall's :math:`S`; Hamed and Rao
    correct it with an effective sample size:

    .. math::
        \operatorname{Var}^* S = \operatorname{Var} S \cdot \frac{n}{n^*}, \qquad
        \frac{n}{n^*} = 1 + \frac{2}{n(n-1)(n-2)}
        \sum_{k=1}^{n-1} (n-k)(n-k-1)(n-k-2)\,\rho_k,

    with :math:`\rho_k` the lag-:math:`k` autocorrelation of the ranks of the series
    after its Sen's-slope trend is removed, summed over the significant lags only
    (:math:`|\rho_k| > \Phi^{-1}(1-\alpha/2)/\sqrt{n}`), and
    :math:`z = (S - \operatorname{sgn} S)/\sqrt{\operatorname{Var}^* S}`. This is
    ``pymannkendall.hamed_rao_modification_test``'s statistic (``lag`` there is
    ``max_lag`` here); :math:`n/n^*` is returned as computed, which can be below 1.

    Args:
      x: a 1-D sequence of at least 3 finite numbers.
      alpha: significance level of the lags kept; in (0, 1).
      max_lag: the largest lag summed, in [1, n-1]; ``None`` for n-1.

    Returns:
      ``(S, Var* S, n/n*, z)`` as floats.

    Example:
      >>> from stabljax.control.detect.trends import mann_kendall_hamed_rao
      >>> import math
      >>> x = [0.1 * t + math.sin(t / 2) for t in range(20)]  # a trend and a slow wave
      >>> s, var, ratio, z = mann_kendall_hamed_rao(x)
      >>> print(s, round(var, 1), round(ratio, 3), round(z, 3))
      80.0 1877.7 1.977 1.823
      >>> print(round(mann_kendall(x)[2], 3))  # without the correction
      2.563

    References:
      Hamed and Rao, `A modified Mann-Kendall trend test for autocorrelated data
      <https://doi.org/10.1016/S0022-1694(97)00125-X>`_, Journal of Hydrology 204,
      1998.
    """
    s, var, _ = mann_kendall(x)
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    who = "mann_kendall_hamed_rao"
    validate(who, "alpha", alpha, lambda a: (a > 0) & (a < 1), "in (0, 1)")
    lag = n - 1 if max_lag is None else max_lag

    def ok(a):  # an integer scalar >= 1
        return a.ndim == 0 and a.dtype.kind in "iu" and a >= 1

    validate(who, "max_lag", lag, lambda a: ok(a) and a <= n - 1, f"an int in [1, {n - 1}]")
    rho = rank_acf(x)[: lag + 1]
    keep = np.abs(rho[1:]) > normal_quantile(1 - alpha / 2) / math.sqrt(n)
    ratio = variance_ratio(rho, n, keep)
    var_star = var * ratio
    if s == 0 or var_star <= 0:
        return s, var_star, ratio, 0.0
    return s, var_star, ratio, (s - math.copysign(1.0, s)) / math.sqrt(var_star)
