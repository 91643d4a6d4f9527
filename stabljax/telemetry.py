"""Device-side training telemetry: norms, leading indicators, Adam-epsilon diagnostics.

The in-graph functions (:func:`global_norm`, :func:`layer_metrics`,
:func:`leading_signals`) return
``jax.Array`` scalars and never sync with the host, so the train step can return them
as metrics. The host helpers (:func:`layer_metrics_to_host`, :func:`adam_eps_report`)
fetch once and return plain ``{path: float}`` dicts for a logger.

Parameter paths are the pytree key paths of the parameters joined with ``/``
(``"blocks/0/kernel"``); the trailing ``.value`` of a Flax NNX ``Variable`` is dropped
so an ``nnx.State`` gives the module path (``"linear/kernel"``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stabljax import metrics
from stabljax.base import all_finite, path_str
from stabljax.base import global_norm_f32 as global_norm

__all__ = (
    "Signals",
    "adam_eps_report",
    "attn_logit_metrics",
    "global_norm",
    "layer_metrics",
    "layer_metrics_to_host",
    "leading_signals",
    "path_str",
    "spike_score",
)

_ADAM_FIELDS = ("mu", "nu", "count")


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    safe = jnp.where(den > 0, den, 1.0)
    return jnp.where(den > 0, num / safe, jnp.where(num > 0, jnp.inf, 0.0))


def layer_metrics(grads: Any, params: Any, updates: Any) -> dict[str, dict[str, jax.Array]]:
    r"""Per-parameter-path norms of one step, as device scalars.

    For each parameter leaf :math:`p` with gradient :math:`g` and applied update
    :math:`u`: ``grad_norm`` :math:`\|g\|`, ``param_norm`` :math:`\|p\|`,
    ``update_ratio`` :math:`\|u\| / \|p\|` (0 when both are 0, Inf when only
    :math:`\|p\|` is, e.g. a zero-initialised bias on its first update) and
    ``nonfinite_grad`` (true when :math:`g` holds a NaN or Inf). All float32 but the
    flag, which is a bool.

    Args:
      grads: gradients, with the structure of ``params``.
      params: the parameters the gradients were taken at.
      updates: the updates applied to them (zeros on a skipped step).

    Returns:
      ``{metric: {path: scalar}}`` with the metrics named above and the paths of
      :func:`path_str`.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.telemetry import layer_metrics
      >>> params = {"w": jnp.array([3.0, 4.0])}
      >>> m = layer_metrics({"w": jnp.array([0.0, jnp.nan])}, params, {"w": jnp.array([0.5, 0.0])})
      >>> print(m["param_norm"]["w"], m["update_ratio"]["w"], m["nonfinite_grad"]["w"])
      5.0 0.1 True
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    g_leaves = treedef.flatten_up_to(grads)
    u_leaves = treedef.flatten_up_to(updates)
    out: dict[str, dict[str, jax.Array]] = {k: {} for k in metrics.LAYER_KEYS}
    for (path, p), g, u in zip(flat, g_leaves, u_leaves, strict=True):
        key = path_str(path)
        p_norm = global_norm(p)
        g = jnp.asarray(g)
        out[metrics.LAYER_GRAD_NORM][key] = global_norm(g)
        out[metrics.LAYER_PARAM_NORM][key] = p_norm
        out[metrics.LAYER_UPDATE_RATIO][key] = _ratio(global_norm(u), p_norm)
        out[metrics.LAYER_NONFINITE_GRAD][key] = jnp.logical_not(all_finite(g))
    return out


def attn_logit_metrics(max_logits: Any) -> dict[str, Any]:
    """The max attention logit overall and per layer, from per-layer, per-head maxima.

    Args:
      max_logits: a ``[n_layers, n_heads]`` array (the reference Transformer's
        ``aux["max_attn_logits"]``) or a ``{layer: [n_heads]}`` mapping.

    Returns:
      ``{"max_attn_logit": scalar, "max_attn_logit_layers": {str(layer): scalar}}``,
      float32 device values.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.telemetry import attn_logit_metrics
      >>> m = attn_logit_metrics(jnp.array([[1.0, 7.0], [3.0, 2.0]]))
      >>> print(m["max_attn_logit"], {k: float(v) for k, v in m["max_attn_logit_layers"].items()})
      7.0 {'0': 7.0, '1': 3.0}
    """
    if isinstance(max_logits, Mapping):
        items = list(max_logits.items())
    else:
        arr = jnp.asarray(max_logits)
        items = [(i, arr[i]) for i in range(arr.shape[0])]
    layers = {str(k): jnp.max(jnp.asarray(v, jnp.float32)) for k, v in items}
    overall = functools.reduce(jnp.maximum, layers.values(), jnp.float32(-jnp.inf))
    return {metrics.MAX_ATTN_LOGIT: overall, metrics.MAX_ATTN_LOGIT_LAYERS: layers}


def layer_metrics_to_host(step_metrics: Mapping[str, Any]) -> dict[str, float]:
    """Fetches per-layer metrics to the host as a flat ``{"metric/path": float}`` dict.

    Host-side: one ``jax.device_get`` for the whole dict. Call it on the metrics of a
    step that has already finished (e.g. one step late) so the device is not idle.

    Args:
      step_metrics: the metrics of a step made with ``layer_metrics=True`` (its
        ``layers`` entry is used), or the output of :func:`layer_metrics` itself.

    Returns:
      ``{f"{metric}/{path}": float}``, e.g. ``"grad_norm/dense/w"``; flags become
      1.0 (non-finite gradient) or 0.0.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.telemetry import layer_metrics, layer_metrics_to_host
      >>> p = {"w": jnp.array([3.0, 4.0])}
      >>> layer_metrics_to_host(layer_metrics(p, p, p))
      {'grad_norm/w': 5.0, 'nonfinite_grad/w': 0.0, 'param_norm/w': 5.0, 'update_ratio/w': 1.0}
    """
    m = step_metrics
    layers = m[metrics.LAYERS] if metrics.LAYERS in m else m
    host = jax.device_get(dict(layers))
    out = {}
    for metric, per_path in host.items():
        for path, value in per_path.items():
            out[f"{metric}/{path}" if path else metric] = float(np.asarray(value))
    return out


def spike_score(
    values: Any, *, window: int = 1000, n_sigma: float = 7.0, min_history: int = 100
) -> float:
    r"""OLMo 2's spike score: the % of values at least ``n_sigma`` σ from their rolling mean.

    Host-side (numpy, float64). Value :math:`x_t` is a spike when
    :math:`|x_t - \mu_t| \ge n_\sigma \sigma_t`, with :math:`\mu_t` and :math:`\sigma_t`
    (population) the mean and standard deviation of the finite values among the
    ``window`` values before it. A value is scored once ``min_history`` finite values
    precede it in its window (the first, fast-falling steps of a loss are not spikes);
    a non-finite value is scored as a spike and never enters a window. Two-sided, as
    OLMo 2 states it ("at least seven standard deviations away").

    Args:
      values: a 1-D series, e.g. the loss or the grad norm of every step.
      window: the rolling window (OLMo 2: 1000).
      n_sigma: the threshold in standard deviations (OLMo 2: 7).
      min_history: finite values a window needs before the value after it is scored.

    Returns:
      The percentage (0-100) of scored values that are spikes; NaN when none is scored.

    Example:
      >>> import numpy as np
      >>> from stabljax.telemetry import spike_score
      >>> x = 3.0 + 0.01 * np.sin(np.arange(400))
      >>> x[300] = 10.0
      >>> print(f"{spike_score(x):.3f}")  # 1 of the 300 scored values
      0.333

    References:
      Team OLMo, `2 OLMo 2 Furious <https://arxiv.org/abs/2501.00656>`_, 2025
    """
    x = np.asarray(values, np.float64).reshape(-1)
    if window < 1 or min_history < 1 or min_history > window or not n_sigma > 0:
        raise ValueError(
            "spike_score: need window >= min_history >= 1 and n_sigma > 0; got "
            f"window={window}, min_history={min_history}, n_sigma={n_sigma}"
        )
    finite = np.isfinite(x)
    xf = np.where(finite, x, 0.0)
    c = np.concatenate([[0.0], np.cumsum(finite)])
    s1 = np.concatenate([[0.0], np.cumsum(xf)])
    s2 = np.concatenate([[0.0], np.cumsum(xf * xf)])
    t = np.arange(x.size)
    lo = np.maximum(t - window, 0)
    n = c[t] - c[lo]
    scored = n >= min_history
    if not scored.any():
        return float("nan")
    safe_n = np.where(scored, n, 1.0)
    mean = (s1[t] - s1[lo]) / safe_n
    var = np.maximum((s2[t] - s2[lo]) / safe_n - mean * mean, 0.0)
    dev = np.abs(x - mean)
    # The float64 rounding of a constant window is not a deviation.
    tiny = 1e-9 * np.maximum(1.0, np.abs(mean))
    with np.errstate(invalid="ignore"):
        spike = np.logical_or(~finite, (dev >= n_sigma * np.sqrt(var)) & (dev > tiny))
    return float(100.0 * np.sum(spike & scored) / np.sum(scored))


def _is_adam_state(x: Any) -> bool:
    # optax's ScaleByAdamState and stabljax's safe-Adam and Adam-atan2 states share the
    # field names, so one test finds all three (and any other state that follows optax).
    fields = getattr(type(x), "_fields", None)
    return isinstance(x, tuple) and fields is not None and all(n in fields for n in _ADAM_FIELDS)


def adam_eps_report(opt_state: Any, eps: float, *, b2: float = 0.999) -> dict[str, float]:
    r"""Per parameter path, the fraction of coordinates whose :math:`\sqrt{\hat v}` is below eps.

    Molybog et al.'s diagnostic: where :math:`\sqrt{\hat v} < \epsilon` the epsilon,
    not the gradient statistics, sets the size of Adam's update
    :math:`\hat m / (\sqrt{\hat v} + \epsilon)`. They find that at scale the gradients
    of shallow layers shrink toward eps, and that this precedes loss spikes. With
    :math:`t` the Adam step count, :math:`\hat v = \nu / (1 - \beta_2^t)` (and
    :math:`\hat v = \nu = 0` before the first update).

    Every Adam state anywhere in ``opt_state`` is found (inside ``optax.chain``,
    ``inject_hyperparams``, ``multi_transform``, stabljax guards): any state with
    optax's ``ScaleByAdamState`` fields ``mu``, ``nu`` and ``count``, which stabljax's
    ``ScaleBySafeAdamState`` and ``ScaleByAdamAtan2State`` share. Host-side: it fetches
    the result.

    Args:
      opt_state: an optimizer state.
      eps: the threshold, usually the optimizer's own eps.
      b2: the :math:`\beta_2` of the optimizer, for the bias correction (the state
        does not record it; pass the one you built the optimizer with).

    Returns:
      ``{path: fraction}`` with the parameter paths of
      :func:`~stabljax.telemetry.path_str`. When several Adam states cover the same
      path, each key is prefixed with the state's own path and ``":"``. Empty when
      there is no Adam state.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.telemetry import adam_eps_report
      >>> params = {"w": jnp.zeros(4)}
      >>> opt = optax.adam(1e-3, b2=0.5)
      >>> state = opt.init(params)
      >>> _, state = opt.update({"w": jnp.array([0.0, 0.0, 1.0, 1.0])}, state)
      >>> adam_eps_report(state, 1e-8, b2=0.5)
      {'w': 0.5}

    References:
      Molybog et al., `A Theory on Adam Instability in Large-Scale Machine Learning
      <https://arxiv.org/abs/2304.09871>`_, 2023
    """
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"b2 must be in [0, 1), got {b2}")
    found = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_adam_state)[0]
    entries: list[tuple[str, str, jax.Array]] = []
    for state_path, state in found:
        if not _is_adam_state(state):
            continue
        count = jnp.asarray(state.count).astype(jnp.float32)
        correction = jnp.where(count > 0, 1.0 - jnp.power(jnp.float32(b2), count), 1.0)
        for path, nu in jax.tree_util.tree_flatten_with_path(state.nu)[0]:
            v_hat = jnp.asarray(nu).astype(jnp.float32) / correction
            frac = jnp.mean(jnp.sqrt(v_hat) < eps)
            entries.append((path_str(state_path), path_str(path), frac))
    params_seen = [p for _, p, _ in entries]
    clash = len(set(params_seen)) != len(params_seen)
    values = jax.device_get([f for _, _, f in entries])
    return {
        (f"{s}:{p}" if clash else p): float(v) for (s, p, _), v in zip(entries, values, strict=True)
    }


@dataclasses.dataclass(frozen=True)
class Signals:
    r"""Turns on the step's leading-indicator metrics (``make_train_step(signals=...)``).

    Attributes:
      b2: the :math:`\beta_2` of the Adam inside the optimizer, for the bias correction of
        its second moment (the state does not record it; optax's default is 0.999).
    """

    b2: float = 0.999

    def __post_init__(self):
        ok = isinstance(self.b2, int | float) and not isinstance(self.b2, bool)
        if not ok or not 0.0 <= self.b2 < 1.0:
            raise ValueError(f"Signals: b2 must be a number in [0, 1), got {self.b2!r}")


def _first_adam_state(opt_state: Any) -> Any:
    found = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_adam_state)[0]
    return next((s for _, s in found if _is_adam_state(s)), None)


def _adam_rms(grads: Any, opt_state: Any, b2: float) -> dict[str, jax.Array]:
    state = _first_adam_state(opt_state)
    if state is None:
        return {}
    count = jnp.asarray(state.count).astype(jnp.float32)
    correction = jnp.where(count > 0, 1.0 - jnp.power(jnp.float32(b2), count), 1.0)
    tiny = jnp.finfo(jnp.float32).tiny
    nu_flat, treedef = jax.tree_util.tree_flatten_with_path(state.nu)
    out = {}
    for (path, nu), g in zip(nu_flat, treedef.flatten_up_to(grads), strict=True):
        v_hat = jnp.maximum(jnp.asarray(nu, jnp.float32) / correction, tiny)
        g = jnp.asarray(g, jnp.float32)
        out[path_str(path)] = jnp.sqrt(jnp.mean(g * g / v_hat))
    return out


def _max_of(values: Mapping[str, jax.Array]) -> jax.Array:
    return functools.reduce(jnp.maximum, values.values(), jnp.zeros([], jnp.float32))


def leading_signals(
    grads: Any, params: Any, updates: Any, opt_state: Any, *, b2: float = 0.999
) -> dict[str, Any]:
    r"""Per-layer signals that move before a loss spike, and their max over layers.

    For each parameter leaf :math:`p` with gradient :math:`g` and applied update
    :math:`u`:

    * ``update_rms_ratio``: :math:`\mathrm{RMS}(u)/\mathrm{RMS}(p) = \|u\|/\|p\|`
      (same number of coordinates; 0 when both are 0, Inf when only :math:`p` is), the
      update/weight ratio WeSaR and Wortsman et al. watch;
    * ``adam_rms``: :math:`\sqrt{\mathrm{mean}(g^2/\hat v)}` with
      :math:`\hat v = \nu/(1-\beta_2^t)` the bias-corrected second moment of the first
      Adam state in ``opt_state`` (any state with optax's ``mu``, ``nu``, ``count``
      fields) *after* this step's update, as Wortsman et al.'s StableAdamW computes it:
      it rises above 1 when :math:`g^2` outruns the second moment, which they find
      precedes loss spikes by 1-8 steps. :math:`\hat v` is floored at the smallest
      normal float32 (an all-zero coordinate contributes 0). ``g`` is the gradient the
      step took, before any clipping inside the optimizer. Absent without an Adam state.

    The scalars ``update_rms_ratio`` and ``adam_rms`` are the max over layers; the
    per-layer values are under ``update_rms_ratio_layers`` and ``adam_rms_layers``. All
    float32 device values: nothing is fetched. Rates of change (the growth of the max
    attention logit, the drift of log Z, the grad-norm trend) need the previous steps, so
    :class:`~stabljax.control.detect.warning.WarningDetector` forms them on the host from
    the per-step ``max_attn_logit``, ``log_z`` and ``grad_norm``.

    Args:
      grads: the step's gradients (unscaled), with the structure of ``params``.
      params: the parameters the gradients were taken at.
      updates: the updates applied (zeros on a skipped step).
      opt_state: the optimizer state after the update.
      b2: the Adam's :math:`\beta_2`.

    Returns:
      ``{"update_rms_ratio": scalar, "update_rms_ratio_layers": {path: scalar}}`` and,
      with an Adam state, the same two for ``adam_rms``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from stabljax.telemetry import leading_signals
      >>> params = {"w": jnp.array([3.0, 4.0])}
      >>> opt = optax.adam(0.5, b2=0.5)
      >>> g = {"w": jnp.array([1.0, 0.0])}
      >>> u, state = opt.update(g, opt.init(params))
      >>> m = leading_signals(g, params, u, state, b2=0.5)
      >>> print(f"{float(m['update_rms_ratio']):.4f}", f"{float(m['adam_rms']):.4f}")
      0.1000 0.7071

    References:
      Wortsman et al., `Stable and low-precision training for large-scale
      vision-language models <https://arxiv.org/abs/2304.13013>`_, 2023;
      Nishida et al., `Initialization of Large Language Models via Reparameterization
      to Mitigate Loss Spikes <https://arxiv.org/abs/2410.10718>`_, 2024 (WeSaR)
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    ratios = {
        path_str(path): _ratio(global_norm(u), global_norm(p))
        for (path, p), u in zip(flat, treedef.flatten_up_to(updates), strict=True)
    }
    out: dict[str, Any] = {
        metrics.UPDATE_RMS_RATIO: _max_of(ratios),
        metrics.UPDATE_RMS_RATIO_LAYERS: ratios,
    }
    adam = _adam_rms(grads, opt_state, b2)
    if adam:
        out |= {metrics.ADAM_RMS: _max_of(adam), metrics.ADAM_RMS_LAYERS: adam}
    return out
