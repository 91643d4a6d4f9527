"""The check at init: one forward and backward pass, one small function per check."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stabljax.base import validate
from stabljax.init.report import InitFlag, InitReport
from stabljax.metrics import MAX_ATTN_LOGIT, RESIDUAL_RMS


def _default_loss(logits: jax.Array, batch: Mapping[str, Any]) -> jax.Array:
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    mask = batch.get("mask")
    if mask is None:
        return jnp.mean(ce)
    mask = jnp.asarray(mask, jnp.bool_)
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _layer_of(path) -> int | None:
    for k in path:
        v = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, str) and v.isdigit():
            return int(v)
    return None


def _measure(apply_fn, loss_fn, params, batch):
    """Loss, logit/aux statistics and per-leaf gradient sum of squares, in one pass."""
    mask = batch.get("mask")

    def forward(p):
        out = apply_fn(p, batch["inputs"])
        logits, aux = out if isinstance(out, tuple) else (out, {})
        loss = loss_fn(logits, batch)
        var = jnp.var(logits.astype(jnp.float32), axis=-1)
        if mask is None:
            logit_var = jnp.mean(var)
        else:
            m = jnp.asarray(mask, jnp.bool_)
            logit_var = jnp.sum(jnp.where(m, var, 0.0)) / jnp.maximum(jnp.sum(m), 1)
        stats = {"logit_std": jnp.sqrt(logit_var)}
        for name in (RESIDUAL_RMS, MAX_ATTN_LOGIT):
            if name in aux:
                stats[name] = jnp.asarray(aux[name], jnp.float32)
        # A zero-size array carries the vocabulary size out as a static shape.
        return jnp.asarray(loss, jnp.float32), (stats, jnp.zeros((0, logits.shape[-1])))

    (loss, (stats, vocab)), grads = jax.value_and_grad(forward, has_aux=True)(params)
    sumsq = jax.tree.map(lambda g: jnp.sum(jnp.square(g.astype(jnp.float32))), grads)
    return loss, stats, sumsq, vocab


# Keyed on (apply_fn, loss_fn): checking several inits of one architecture compiles once.
_measure_cached = jax.jit(_measure, static_argnums=(0, 1))


def _measure_jit(apply_fn, loss_fn, params, batch):
    return jax.jit(lambda p, b: _measure(apply_fn, loss_fn, p, b))(params, batch)


def check_init(
    apply_fn: Callable[[Any, jax.Array], Any],
    params: Any,
    batch: Mapping[str, Any],
    *,
    loss_fn: Callable[[jax.Array, Mapping[str, Any]], jax.Array] | None = None,
    growth_bound: float = 2.0,
    logit_std_bound: float = math.sqrt(2.0),
    loss_excess_bound: float = 1.0,
    grad_spread_bound: float = 4.0,
) -> InitReport:
    r"""Measures a model at init and flags what is out of range, each with a fix.

    One jitted forward and backward pass on ``batch``. The checks, and where their default
    bounds come from (every bound is an argument):

    - **Residual growth** :math:`R = \|h_L\|/\|h_0\| = e^{\lambda L}` within
      [1/``growth_bound``, ``growth_bound``] (2). Each pre-norm block divides its input by
      the stream's RMS, so that RMS sets the size of every block's gradient (Xiong et al.
      2020); :math:`R > 2` means the sublayers together add more than 3× the input's variance
      and the first and last blocks see gradients of different size, the setting Takase et
      al. (2023) tie to loss spikes. OLMo 2 measures the same λ at init. The fix scales the
      output projections by :math:`\sqrt{(b^2-1)/(R^2-1)}`, which brings R to the bound b
      when the sublayer outputs add independently (in a pre-norm stack their size does not
      depend on the stream's scale), and names the depth-scaled schemes.
    - **Output-logit std** s ≤ ``logit_std_bound`` (√2) and **initial loss** within
      ``loss_excess_bound`` (1 nat = (√2)²/2) of log V. For logits independent of the labels
      the expected loss is log V + s²/2: fan-in-scaled (1/√d) output layers give s ≈ 1 by
      design, half a nat; the bound allows that with a factor √2 in std and flags a model
      that starts over a nat (a factor e in perplexity) worse than uniform. A non-finite
      loss is always flagged.
    - **Gradient spread**: max/min of the per-layer gradient RMS ≤ ``grad_spread_bound``
      (4). A pre-norm block's gradient scales like 1/RMS of the stream at its input, so the
      residual bound alone allows ×2; the second factor 2 leaves room for everything else
      (attention vs MLP mix, post-norm paths, where R says nothing). Non-finite and all-zero
      layer gradients are flagged too.
    - **Attention logits**, when ``aux`` reports them: max pre-softmax logit ≤ 2·log T (T =
      sequence length). A softmax over T logits of std s is dominated by its few largest
      terms once s > √(2 log T) (the freezing point of Derrida's random energy model), where
      a row's max is s·√(2 log T) = 2·log T. Unit-variance logits, what the 1/√d_head scale
      aims for, stay well below it; the max is over all rows, so the check errs early.

    ``apply_fn(params, inputs)`` returns the logits ``[..., T, V]``, or ``(logits, aux)``
    with ``aux["residual_rms"]`` (f32[L+1]: RMS of the residual stream at the input and
    after each block) and optionally ``aux["max_attn_logit"]`` —
    ``stabljax.reference.TransformerLM(..., return_aux=True)`` reports both. Without
    ``residual_rms`` the growth checks are skipped. Per-layer gradients group the parameter
    leaves by the first integer in their path (``blocks/3/...``).

    Args:
      apply_fn: ``apply_fn(params, inputs) -> logits`` or ``(logits, aux)``.
      params: the parameters at init (any pytree, e.g. an ``nnx.State``).
      batch: a dict with ``inputs`` (int tokens ``[B, T]``), ``targets`` (``[B, T]``) and
        optionally ``mask`` (``[B, T]`` bool), as the train step takes it.
      loss_fn: ``loss_fn(logits, batch) -> scalar``; default: mean cross-entropy over the
        mask.
      growth_bound: bound on the residual growth factor and its inverse, > 1.
      logit_std_bound: bound on the output-logit std.
      loss_excess_bound: bound on ``|loss - log V|`` in nats.
      grad_spread_bound: bound on the max/min ratio of per-layer gradient RMS.

    Returns:
      An :class:`InitReport`; ``report.ok`` is true when nothing was flagged, and
      ``print(report)`` shows a table.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from stabljax.reference import TransformerConfig, TransformerLM
      >>> from stabljax.init import check_init
      >>> from stabljax.step import nnx_apply
      >>> model = TransformerLM(TransformerConfig(d_model=32, n_layers=2), rngs=nnx.Rngs(0))
      >>> apply_fn, params = nnx_apply(model, return_aux=True)
      >>> tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
      >>> batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
      >>> report = check_init(apply_fn, params, batch)
      >>> print(report.ok, round(report.loss - report.log_vocab, 1))
      True 0.0

    References:
      Xiong et al., `On Layer Normalization in the Transformer Architecture
      <https://arxiv.org/abs/2002.04745>`_, 2020

      Takase et al., `Spike No More: Stabilizing the Pre-training of Large Language Models
      <https://arxiv.org/abs/2312.16903>`_, 2023

      Team OLMo et al., `2 OLMo 2 Furious <https://arxiv.org/abs/2501.00656>`_, 2024

      Wortsman et al., `Small-scale proxies for large-scale Transformer training
      instabilities <https://arxiv.org/abs/2309.14322>`_, 2023

      Derrida, `Random-energy model: An exactly solvable model of disordered systems
      <https://doi.org/10.1103/PhysRevB.24.2613>`_, 1981
    """
    validate("check_init", "growth_bound", growth_bound, lambda a: a > 1, "> 1")
    validate("check_init", "logit_std_bound", logit_std_bound, lambda a: a > 0, "> 0")
    validate("check_init", "loss_excess_bound", loss_excess_bound, lambda a: a > 0, "> 0")
    validate("check_init", "grad_spread_bound", grad_spread_bound, lambda a: a > 1, "> 1")
    for key in ("inputs", "targets"):
        if key not in batch:
            raise ValueError(f"check_init: batch needs an {key!r} entry, got keys {list(batch)}")
    loss_fn = _default_loss if loss_fn is None else loss_fn
    try:
        hash((apply_fn, loss_fn))
        measure = _measure_cached
    except TypeError:
        measure = _measure_jit
    loss, stats, sumsq, vocab = measure(apply_fn, loss_fn, params, dict(batch))
    loss, stats, sumsq = jax.device_get((loss, stats, sumsq))
    grad_rms, nonfinite_paths = _grad_rms_by_layer(params, sumsq)

    loss = float(loss)
    log_vocab = math.log(int(vocab.shape[-1]))
    logit_std = float(stats["logit_std"])
    residual = stats.get(RESIDUAL_RMS)
    residual = None if residual is None else np.asarray(residual, np.float64)
    max_attn = stats.get(MAX_ATTN_LOGIT)
    max_attn = None if max_attn is None else float(max_attn)
    seq_len = int(np.shape(batch["inputs"])[-1])

    growth, residual_flags = _check_residual(residual, growth_bound)
    grad_growth, spread_flags = _check_grad_spread(grad_rms, grad_spread_bound)
    flags = [
        *residual_flags,
        *spread_flags,
        *_check_grad_nonfinite(nonfinite_paths),
        *_check_grad_zero(grad_rms),
        *_check_logit_std(logit_std, logit_std_bound),
        *_check_initial_loss(loss, log_vocab, loss_excess_bound),
        *_check_attn_logit(max_attn, seq_len),
    ]
    return InitReport(
        loss=loss,
        log_vocab=log_vocab,
        logit_std=logit_std,
        residual_rms=residual,
        growth_exponent=growth,
        grad_rms=grad_rms,
        grad_growth_exponent=grad_growth,
        max_attn_logit=max_attn,
        seq_len=seq_len,
        flags=tuple(flags),
    )


def _grad_rms_by_layer(params: Any, sumsq: Any) -> tuple[np.ndarray, list[str]]:
    """Per-layer gradient RMS (leaves grouped by the layer index in their path), and the
    paths of the leaves whose gradient is not finite."""
    sizes = jax.tree.map(lambda x: int(np.size(x)), params)
    by_layer: dict[int, list[float]] = {}
    nonfinite_paths = []
    for (path, s), n in zip(
        jax.tree_util.tree_flatten_with_path(sumsq)[0], jax.tree.leaves(sizes), strict=True
    ):
        if not np.isfinite(s):
            nonfinite_paths.append(jax.tree_util.keystr(path))
        layer = _layer_of(path)
        if layer is not None:
            acc = by_layer.setdefault(layer, [0.0, 0])
            acc[0] += float(s)
            acc[1] += n
    grad_rms = np.array(
        [np.sqrt(by_layer[i][0] / max(by_layer[i][1], 1)) for i in sorted(by_layer)],
        np.float64,
    )
    return grad_rms, nonfinite_paths


def _check_residual(
    residual: np.ndarray | None, bound: float
) -> tuple[float | None, list[InitFlag]]:
    """The growth exponent λ, and a flag when the residual RMS grows or shrinks past ×bound."""
    if residual is None or len(residual) < 2:
        return None, []
    n_layers = len(residual) - 1
    ratio = float(residual[-1] / residual[0])
    growth = math.log(ratio) / n_layers if ratio > 0 and np.isfinite(ratio) else math.nan
    if not np.isfinite(ratio) or ratio > bound:
        if np.isfinite(ratio) and ratio > 1:
            factor = math.sqrt((bound**2 - 1) / (ratio**2 - 1))
            how = f"multiply the std of the residual output projections by ≤ {factor:.2g}"
        else:
            how = "lower the std of the residual output projections"
        return growth, [
            InitFlag(
                "residual_growth",
                ratio,
                bound,
                f"residual RMS grows ×{ratio:.3g} over {n_layers} layers "
                f"(λ = {growth:.3g}; bound ×{bound:g})",
                f"{how}, e.g. σ/√(2L) = σ/{math.sqrt(2 * n_layers):.3g} (scheme 'gpt2') "
                "or σ/√(2(l+1)) ('depth_scaled'), or raise the embedding std",
            )
        ]
    if ratio < 1 / bound:
        return growth, [
            InitFlag(
                "residual_growth",
                ratio,
                1 / bound,
                f"residual RMS shrinks ×{ratio:.3g} over {n_layers} layers "
                f"(λ = {growth:.3g}; bound ×{1 / bound:g})",
                "the blocks cancel the input stream: check the sign/scale of the residual "
                "path (residual α, output-projection std)",
            )
        ]
    return growth, []


def _check_grad_spread(grad_rms: np.ndarray, bound: float) -> tuple[float | None, list[InitFlag]]:
    """The gradient growth exponent, and a flag when max/min per-layer RMS exceeds bound."""
    if len(grad_rms) < 2 or not (np.all(grad_rms > 0) and np.all(np.isfinite(grad_rms))):
        return None, []
    grad_growth = math.log(grad_rms[0] / grad_rms[-1]) / len(grad_rms)
    spread = float(grad_rms.max() / grad_rms.min())
    if spread <= bound:
        return grad_growth, []
    lo, hi = int(np.argmin(grad_rms)), int(np.argmax(grad_rms))
    return grad_growth, [
        InitFlag(
            "grad_spread",
            spread,
            bound,
            f"per-layer gradient RMS spans ×{spread:.3g} (layer {hi}: "
            f"{grad_rms[hi]:.3g}, layer {lo}: {grad_rms[lo]:.3g}; bound ×{bound:g})",
            "keep the residual stream's RMS flat across depth: depth-scale the "
            "residual output projections (scheme 'gpt2' or 'depth_scaled')",
        )
    ]


def _check_grad_nonfinite(paths: list[str]) -> list[InitFlag]:
    if not paths:
        return []
    more = " ..." if len(paths) > 4 else ""
    return [
        InitFlag(
            "grad_nonfinite",
            float(len(paths)),
            0.0,
            f"non-finite gradients at init in {', '.join(paths[:4])}{more}",
            "lower the init std (an overflow) or look for a 0/0 in the model",
        )
    ]


def _check_grad_zero(grad_rms: np.ndarray) -> list[InitFlag]:
    dead = [i for i, g in enumerate(grad_rms) if g == 0]
    if not dead:
        return []
    return [
        InitFlag(
            "grad_zero",
            float(len(dead)),
            0.0,
            f"layers {dead} get exactly zero gradient at init",
            "a zero-initialised path blocks the gradient: give one of its weights a nonzero std",
        )
    ]


def _check_logit_std(logit_std: float, bound: float) -> list[InitFlag]:
    if np.isfinite(logit_std) and logit_std <= bound:
        return []
    if np.isfinite(logit_std) and logit_std > 0:
        fix = (
            "multiply the unembedding std (the embedding's, when tied) by "
            f"≤ {bound / logit_std:.2g}"
        )
    else:
        fix = "lower the unembedding std (the embedding's, when tied)"
    return [
        InitFlag(
            "logit_std", logit_std, bound, f"output-logit std {logit_std:.3g} > {bound:.3g}", fix
        )
    ]


def _check_initial_loss(loss: float, log_vocab: float, bound: float) -> list[InitFlag]:
    excess = loss - log_vocab
    if math.isfinite(loss) and abs(excess) <= bound:
        return []
    if not math.isfinite(loss) or excess > 0:
        fix = (
            "bring the output-logit std down (std of the unembedding, or of the "
            "embedding when tied) so the model starts near uniform"
        )
    else:
        fix = "the loss is below chance at init: check that targets are not inputs"
    return [
        InitFlag(
            "initial_loss",
            loss,
            bound,
            f"initial loss {loss:.4g} is {excess:+.3g} from log(vocab) = {log_vocab:.4g} "
            f"(bound ±{bound:g})",
            fix,
        )
    ]


def _check_attn_logit(max_attn: float | None, seq_len: int) -> list[InitFlag]:
    bound = 2.0 * math.log(max(seq_len, 2))
    if max_attn is None or (math.isfinite(max_attn) and max_attn <= bound):
        return []
    return [
        InitFlag(
            "attn_logit",
            max_attn,
            bound,
            f"max attention logit {max_attn:.3g} > 2·log T = {bound:.3g}: "
            "attention is saturated at init",
            "lower the std of the query/key projections (e.g. 1/√d_model or 0.02) or "
            "turn on qk_norm",
        )
    ]
