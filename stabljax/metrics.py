"""The metric keys: what the train step writes and what the host control reads.

One place for the contract between layer 2 (:func:`stabljax.make_train_step`, which writes
these keys into its metrics dict) and layer 3 (the detectors, the controller, triage and
the report, which read them). Reading a key by its constant here instead of a string
literal means a misspelt or renamed key is an ``AttributeError`` at import time, and
:func:`check_key` makes a detector that asks for a key nobody writes fail when it is
built, not silently at every step (a missing ``"overflow"`` once read as "never").

Example:
  >>> from stabljax import metrics
  >>> metrics.check_key("SpikeDetector", "metric", "loss")
  >>> metrics.check_key("SpikeDetector", "metric", "los")
  Traceback (most recent call last):
  ...
  ValueError: SpikeDetector: metric 'los' is not a metric the train step writes ...
"""

from __future__ import annotations

from collections.abc import Iterable

# Written by every make_train_step step (all jax.Array scalars).
LOSS = "loss"  # float32: the loss loss_fn returned, unscaled
GRAD_NORM = "grad_norm"  # float32: global norm of the unscaled gradients
UPDATE_NORM = "update_norm"  # float32: global norm of the applied update (0 on a skip)
PARAM_NORM = "param_norm"  # float32: global norm of the params the grads were taken at
SKIPPED = "skipped"  # bool: a stabljax guard skipped this step's update
SKIP_STREAK = "skip_streak"  # int32: the longest current run of guard skips
SPIKE_REBASELINES = "spike_rebaselines"  # int32: level shifts skip_spikes absorbed, cumulative
OVERFLOW = "overflow"  # bool: float16 loss scaling found non-finite grads and skipped
LOSS_SCALE = "loss_scale"  # float32: the loss scale this step ran at (1.0 without)

# Written with layer_metrics=True: {metric: {param path: scalar}} under LAYERS.
LAYERS = "layers"
LAYER_GRAD_NORM = "grad_norm"
LAYER_PARAM_NORM = "param_norm"
LAYER_UPDATE_RATIO = "update_ratio"
LAYER_NONFINITE_GRAD = "nonfinite_grad"
LAYER_KEYS = (LAYER_GRAD_NORM, LAYER_PARAM_NORM, LAYER_UPDATE_RATIO, LAYER_NONFINITE_GRAD)

# Written by lm_loss (stabljax.losses.cross_entropy_with_z_loss) through the step's aux.
CE = "ce"  # float32: cross-entropy part of the loss
Z_LOSS = "z_loss"  # float32: the z-loss part (weight · mean log² Z)
LOG_Z = "log_z"  # float32: mean log Z over the tokens
LOG_Z_MAX = "log_z_max"  # float32: max log Z over the tokens

# Written by the reference Transformer (stabljax.reference.nn) into aux with return_aux=True.
MAX_ATTN_LOGIT = "max_attn_logit"  # float32: max over layers, heads, causal positions
# f32[n_layers, n_heads]: the same max per layer and query head; the step passes it to the
# optimizer as max_logits= (stabljax.qk_clip) and reports MAX_ATTN_LOGIT_LAYERS from it.
MAX_ATTN_LOGITS = "max_attn_logits"
# Written by the step from MAX_ATTN_LOGITS: {layer: f32 scalar}, the max over its heads.
MAX_ATTN_LOGIT_LAYERS = "max_attn_logit_layers"
# Written with make_train_step(qk_layers=...): {layer: f32 scalar}, max_h |Wq^h||Wk^h|/sqrt(d_h).
ATTN_LOGIT_PROXY = "attn_logit_proxy"
# f32[n_layers + 1], what check_init reads: not a scalar, so no detector can watch it.
RESIDUAL_RMS = "residual_rms"  # RMS of the residual stream at the input and after each block

# Written with make_train_step(signals=telemetry.Signals(...)): leading indicators of a spike
# (stabljax.telemetry.leading_signals), read by the WarningDetector.
UPDATE_RMS_RATIO = "update_rms_ratio"  # float32: max over layers of RMS(update)/RMS(param)
ADAM_RMS = "adam_rms"  # float32: max over layers of sqrt(mean(g^2 / v_hat)), v_hat after update
UPDATE_RMS_RATIO_LAYERS = "update_rms_ratio_layers"  # {param path: f32 scalar}
ADAM_RMS_LAYERS = "adam_rms_layers"  # {param path: f32 scalar}
SIGNAL_KEYS = (UPDATE_RMS_RATIO, ADAM_RMS)

# Every key the step (with lm_loss and the reference Transformer) can write.
STEP_KEYS = (
    LOSS,
    GRAD_NORM,
    UPDATE_NORM,
    PARAM_NORM,
    SKIPPED,
    SKIP_STREAK,
    SPIKE_REBASELINES,
    OVERFLOW,
    LOSS_SCALE,
)
LM_KEYS = (CE, Z_LOSS, LOG_Z, LOG_Z_MAX)
MODEL_KEYS = (MAX_ATTN_LOGIT,)
KNOWN_KEYS = frozenset(
    STEP_KEYS
    + LM_KEYS
    + MODEL_KEYS
    + SIGNAL_KEYS
    + (LAYERS, MAX_ATTN_LOGIT_LAYERS, ATTN_LOGIT_PROXY)
    + (UPDATE_RMS_RATIO_LAYERS, ADAM_RMS_LAYERS)
)


def check_key(owner: str, name: str, key: object, extra: Iterable[str] = ()) -> None:
    """Raises ``ValueError`` unless ``key`` is a metric the train step writes.

    Args:
      owner: who asks (for the message), e.g. ``"SpikeDetector"``.
      name: the argument that holds the key, e.g. ``"metric"``.
      key: the key asked for.
      extra: keys a custom step is declared to write (``aux`` entries of a user's
        ``loss_fn``), accepted beside :data:`KNOWN_KEYS`.
    """
    allowed = KNOWN_KEYS.union(extra)
    if not isinstance(key, str) or key not in allowed:
        raise ValueError(
            f"{owner}: {name} {key!r} is not a metric the train step writes "
            f"(known: {sorted(allowed)}); a key your own loss_fn returns in aux goes in "
            f"extra_keys="
        )
