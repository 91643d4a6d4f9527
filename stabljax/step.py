"""The jitted train step: any loss, precision, any Optax optimizer, model state, metrics.

:func:`make_train_step` takes ``loss_fn(params, batch, *, rng, model_state) -> (loss,
aux)``; :func:`lm_loss` is the language-model loss (cross-entropy + z-loss) for it. One
``jax.jit`` region per step (flax's performance guide; equinox's "one big JIT
region"): forward, backward, loss scaling, the guarded optimizer update and every
metric. Nothing inside it talks to the host, so the host can dispatch step ``t + 1``
before it reads the metrics of step ``t``.

Metrics (all ``jax.Array`` scalars):

- ``loss``: the loss ``loss_fn`` returned (unscaled, float32); with :func:`lm_loss` also
  ``ce``, ``z_loss``, ``log_z``, ``log_z_max``: see
  :func:`stabljax.losses.cross_entropy_with_z_loss` (``loss == ce + z_loss``); in
  general every entry of ``aux`` but ``model_state``;
- ``grad_norm``: global norm of the unscaled gradients; ``param_norm``: of the
  parameters the gradients were taken at; ``update_norm``: of the update applied
  (0 on a skipped step);
- ``skipped`` (bool): a stabljax guard anywhere in the optimizer state skipped this
  step; ``skip_streak`` (int32): the longest current run of guard skips, 0 without
  guards; ``spike_rebaselines`` (int32): level shifts the ``skip_spikes`` guards absorbed
  so far (cumulative; it rises by one on the step that re-baselined), 0 without them;
- ``overflow`` (bool): float16 loss scaling found non-finite gradients and skipped the
  step (always False without loss scaling); it is not a guard skip;
- ``loss_scale`` (float32): the scale this step ran at, 1.0 without loss scaling;
- ``layers`` (with ``layer_metrics=True``): :func:`stabljax.telemetry.layer_metrics`;
- ``max_attn_logit`` and ``max_attn_logit_layers`` (``{layer: scalar}``), when
  ``aux["max_attn_logits"]`` holds the per-layer, per-head max attention logits (the
  reference Transformer's ``return_aux=True``): the max overall and per layer. That
  entry is not returned itself; it goes to the optimizer as ``max_logits=`` (read by
  :func:`stabljax.qk_clip`, ignored by everything else);
- ``attn_logit_proxy`` (``{layer: scalar}``, with ``qk_layers=``): per layer
  :func:`stabljax.optim.qk_clip.qk_logit_proxy`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from stabljax import metrics, telemetry
from stabljax.base import all_finite, global_norm_f32, with_extra_args
from stabljax.losses import LossFn, lm_loss
from stabljax.nnx_bridge import nnx_apply, nnx_merge
from stabljax.optim.guards.multisteps import check_multisteps_placement
from stabljax.optim.guards.skips import any_skipped, skip_streak, spike_rebaselines
from stabljax.optim.qk_clip import QKLayer, check_layers, qk_logit_proxy
from stabljax.precision import LossScaleState, Precision, scale_loss, unscale_grads

__all__ = (
    "TrainState",
    "lm_loss",
    "make_train_step",
    "nnx_apply",
    "nnx_merge",
    "recommended_compiler_options",
)

_FP32 = Precision.fp32()  # the default policy: everything float32


def _copy_leaf(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return x.copy()
    return jnp.array(x, copy=True)


def _common_mesh(tree: Any) -> jax.sharding.Mesh | None:
    meshes = {
        x.sharding.mesh
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
    }
    return meshes.pop() if len(meshes) == 1 else None


def _canonical(sharding: NamedSharding) -> NamedSharding:
    # jit returns P("data") for an input sharded P("data", None): the same layout, but a
    # different cache key, so the second call would compile again. Strip trailing Nones.
    spec = tuple(sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec), memory_kind=sharding.memory_kind)


def _place(tree: Any, mesh: jax.sharding.Mesh | None) -> Any:
    """Copies every leaf; on a mesh, leaves not yet on it are replicated over it.

    Copying gives every leaf its own buffer, so the state can be donated even when an
    ``init`` returned one array for several fields (or params hold tied weights).
    Replicating the stray leaves (step counters, scalars an ``init`` made with
    ``jnp.zeros``) and writing specs as jit writes them makes the input shardings equal
    to the step's output shardings, so the second call does not compile again.
    """
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())

    def place(x):
        x = _copy_leaf(x)
        if replicated is not None and not isinstance(x.sharding, NamedSharding):
            x = jax.device_put(x, replicated)
        elif isinstance(x.sharding, NamedSharding):
            canonical = _canonical(x.sharding)
            if canonical != x.sharding:
                x = jax.device_put(x, canonical)
        return x

    return jax.tree.map(place, tree)


def _is_traced(tree: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _as_key(rng: Any) -> jax.Array | None:
    if rng is None:
        return None
    if isinstance(rng, int) and not isinstance(rng, bool):
        return jax.random.key(rng)
    if isinstance(rng, jax.Array) and (
        jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
        or (rng.dtype == jnp.uint32 and rng.shape == (2,))
    ):
        return rng
    raise TypeError(
        f"TrainState.create: `rng` must be None, an int seed or a jax.random key; got {rng!r}."
    )


@flax.struct.dataclass
class TrainState:
    """Everything the train step updates, as one pytree.

    Attributes:
      step: int32 scalar, the number of step calls (batches consumed), skipped or not,
        as in flax's ``TrainState`` and Megatron; the optimizer's own count stays
        frozen on a skipped step.
      params: the parameters (master weights, ``Precision.param_dtype``).
      opt_state: the optimizer state.
      loss_scale_state: a :class:`~stabljax.precision.LossScaleState` with float16
        loss scaling, else ``None``.
      rng: a ``jax.random`` key, split on every step taken (``None``: no randomness);
        kept bit-for-bit on a skipped or overflowed step.
      model_state: non-parameter state the forward pass updates (``nnx.BatchStat``,
        linen's ``batch_stats``), or ``None``; kept bit-for-bit on a skipped or
        overflowed step, exactly as the params are.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale_state: LossScaleState | None = None
    rng: jax.Array | None = None
    model_state: Any = None

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: optax.GradientTransformation,
        precision: Precision = _FP32,
        *,
        model_state: Any = None,
        rng: jax.Array | int | None = None,
    ) -> TrainState:
        """Builds the initial state; it is safe to donate.

        Floating parameters are cast to ``precision.param_dtype``; the optimizer is
        initialised on them. Every leaf is then copied into its own buffer (so an
        ``init`` that reuses one zeros array for two fields, or tied weights, can still
        be donated), and when the parameters live on one mesh, leaves that are on no
        mesh (scalars) are replicated over it, so the step keeps all shardings and
        compiles once.

        Under :func:`jax.eval_shape` (e.g. with ``jax.ShapeDtypeStruct`` params that
        carry shardings, to plan shardings and AOT-compile as MaxText does) there are no
        buffers to copy or place: it returns the abstract state, with the structure,
        shapes and dtypes of the real one.

        Args:
          params: the parameters (a pytree; an ``nnx.State`` from :func:`nnx_apply`,
            or linen variables).
          optimizer: any Optax transformation (the one given to :func:`make_train_step`).
          precision: the policy given to :func:`make_train_step`.
          model_state: the non-parameter state ``loss_fn`` reads and returns (see
            :func:`make_train_step`); it is not cast.
          rng: a ``jax.random`` key or an int seed for the step's ``rng``; ``None`` for
            none.

        Returns:
          A :class:`TrainState` with ``step == 0``.

        Raises:
          ValueError: if a stabljax guard in ``optimizer`` sits inside an
            ``optax.MultiSteps`` that keeps non-finite micro-batches
            (:func:`stabljax.optim.guards.multisteps.check_multisteps_placement`).

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from stabljax.step import TrainState
          >>> params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
          >>> abstract = jax.eval_shape(lambda p: TrainState.create(p, optax.adam(1e-3)), params)
          >>> abstract.opt_state[0].mu["w"].shape, abstract.step.dtype
          ((4, 2), dtype('int32'))
        """
        params = precision.cast_to_param(params)
        opt_state = optimizer.init(params)
        check_multisteps_placement(opt_state)  # a guard inside an unsafe optax.MultiSteps
        ls_state = precision.init_loss_scale()
        fields = dict(
            step=jnp.zeros([], jnp.int32),
            params=params,
            opt_state=opt_state,
            loss_scale_state=ls_state,
            rng=_as_key(rng),
            model_state=model_state,
        )
        if _is_traced(fields):
            return cls(**fields)
        mesh = _common_mesh(params)
        return cls(**{k: None if v is None else _place(v, mesh) for k, v in fields.items()})


_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def recommended_compiler_options(backend: str | None = None) -> dict[str, Any]:
    """XLA options for compiling a guarded train step on ``backend`` (default: JAX's).

    On CPU, ``{"xla_cpu_copy_insertion_use_region_analysis": True}``: XLA:CPU's default
    copy insertion copies every donated optimizer moment that two fusions read while one
    of them overwrites it in place, which a guarded update (skip and select) always has:
    extra passes over the parameters (BUILD.md, Performance, counts them). The region
    analysis orders the two fusions instead (a control dependency) and needs no copy;
    the results are the same. Elsewhere ``{}`` (no such copies were found to remove).

    Opt-in, because JAX accepts compiler options on a top-level ``jax.jit`` only (a step
    built with them cannot be traced inside another jit). Pass them to
    ``make_train_step(..., compiler_options=...)``, or to your own ``jax.jit``.

    Args:
      backend: ``"cpu"``, ``"gpu"``, ``"tpu"``…; ``None`` for ``jax.default_backend()``.

    Returns:
      A new dict, empty when there is nothing to recommend for ``backend``.

    Example:
      >>> import jax
      >>> from stabljax.step import recommended_compiler_options
      >>> recommended_compiler_options("cpu")
      {'xla_cpu_copy_insertion_use_region_analysis': True}
      >>> recommended_compiler_options("tpu")
      {}
      >>> f = jax.jit(lambda x: x + 1, compiler_options=recommended_compiler_options())
    """
    backend = jax.default_backend() if backend is None else backend
    return dict(_CPU_OPTIONS) if backend == "cpu" else {}


def _jit_options(compiler_options: Any) -> dict[str, Any] | None:
    if compiler_options is None:
        return None
    if not isinstance(compiler_options, Mapping):
        raise ValueError(
            "compiler_options must be None or a mapping of XLA option names to values; got "
            f"{type(compiler_options).__name__}"
        )
    return dict(compiler_options)


# The step's own metric names (one source: stabljax.metrics); aux must not reuse them.
_STEP_METRICS = (*metrics.STEP_KEYS, metrics.LAYERS)


def _accepted_kwargs(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The names among ``rng``/``model_state`` that ``fn`` takes; None if it takes any."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params) & {"rng", "model_state"}


def _select(keep: jax.Array, old: Any, new: Any) -> Any:
    return jax.tree.map(lambda o, n: jnp.where(keep, o, n), old, new)


def _scaled_loss(loss_fn: LossFn, precision: Precision) -> Callable[..., Any]:
    """``loss_fn`` called on the compute-dtype params, checked, its loss scaled.

    The returned function maps ``(params, batch, ls_state, rng, model_state)`` to
    ``(scaled loss, (float32 loss, aux dict))``, the shape ``jax.grad(has_aux=True)`` takes.
    The keywords ``loss_fn`` does not take are left out of its call.
    """
    accepted = _accepted_kwargs(loss_fn)

    def call_loss(params, batch, rng, model_state):
        kwargs = {"rng": rng, "model_state": model_state}
        if accepted is not None:
            for name in ("rng", "model_state"):
                if name not in accepted:
                    if kwargs.pop(name) is not None:
                        raise TypeError(
                            f"make_train_step: the state has a `{name}`, but loss_fn does not "
                            f"take it; give loss_fn a keyword argument `{name}`."
                        )
        loss, aux = loss_fn(params, batch, **kwargs)
        if aux is None:
            aux = {}
        if not isinstance(aux, Mapping):
            raise ValueError(
                f"make_train_step: loss_fn must return (loss, aux) with aux a dict or None; "
                f"got aux of type {type(aux).__name__}."
            )
        return loss, dict(aux)

    def scaled_loss(params, batch, ls_state, rng, model_state):
        loss, aux = call_loss(precision.cast_to_compute(params), batch, rng, model_state)
        loss = jnp.asarray(loss)
        if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
            raise ValueError(
                "make_train_step: loss_fn must return a float scalar loss; got "
                f"{loss.dtype}{list(loss.shape)}. Reduce it (e.g. .mean()) in loss_fn."
            )
        return scale_loss(loss, ls_state), (loss.astype(jnp.float32), aux)

    return scaled_loss


def _check_aux(aux: Mapping[str, Any], model_state: Any, new_model_state: Any) -> None:
    """Raises if ``aux`` brings a model state the state has none of, or reuses a step metric."""
    if model_state is None and new_model_state is not None:
        raise ValueError(
            "make_train_step: loss_fn returned aux['model_state'], but the state has no "
            "model_state; create it with TrainState.create(..., model_state=...)."
        )
    clash = set(aux) & set(_STEP_METRICS)
    if clash:
        raise ValueError(
            f"make_train_step: aux entries {sorted(clash)} clash with the step's own "
            "metrics; rename them in loss_fn."
        )


def _update(
    tx: optax.GradientTransformationExtraArgs,
    state: TrainState,
    grads: Any,
    loss: jax.Array,
    extra: dict[str, Any],
) -> tuple[Any, Any, Any, jax.Array]:
    """The optimizer update, or (with loss scaling, on non-finite grads or loss) none at all.

    Returns the new params, optimizer state, the updates applied (zeros when skipped) and
    the overflow flag (always False without loss scaling).
    """

    def apply(_):
        updates, opt_state = tx.update(grads, state.opt_state, state.params, value=loss, **extra)
        return optax.apply_updates(state.params, updates), opt_state, updates

    def skip(_):
        return state.params, state.opt_state, optax.tree.zeros_like(state.params)

    if state.loss_scale_state is None:
        return (*apply(None), jnp.zeros([], jnp.bool_))
    finite = jnp.logical_and(all_finite(grads), jnp.isfinite(loss))
    params, opt_state, updates = jax.lax.cond(finite, apply, skip, None)
    return params, opt_state, updates, jnp.logical_not(finite)


def _step_metrics(
    state: TrainState,
    grads: Any,
    updates: Any,
    opt_state: Any,
    skipped: jax.Array,
    overflow: jax.Array,
) -> dict[str, jax.Array]:
    """The norms, the guards' flags and the loss scale of a step (metrics.STEP_KEYS)."""
    ls_state = state.loss_scale_state
    scale = jnp.ones([], jnp.float32) if ls_state is None else ls_state.loss_scale
    return {
        metrics.GRAD_NORM: global_norm_f32(grads),
        metrics.UPDATE_NORM: global_norm_f32(updates),
        metrics.PARAM_NORM: global_norm_f32(state.params),
        metrics.SKIPPED: skipped,
        metrics.SKIP_STREAK: jnp.asarray(skip_streak(opt_state), jnp.int32),
        metrics.SPIKE_REBASELINES: spike_rebaselines(opt_state),
        metrics.OVERFLOW: overflow,
        metrics.LOSS_SCALE: scale,
    }


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    precision: Precision = _FP32,
    layer_metrics: bool = False,
    qk_layers: Mapping[Any, QKLayer] | None = None,
    signals: telemetry.Signals | None = None,
    donate: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    r"""Returns the jitted ``step(state, batch) -> (state, metrics)`` for any loss.

    ``loss_fn(params, batch, *, rng, model_state) -> (loss, aux)`` gets the parameters
    cast to ``precision.compute_dtype``, the batch, a fresh key split from
    ``state.rng`` (``None`` without one) and ``state.model_state``; ``loss`` is a float
    scalar and ``aux`` a dict (or ``None``). ``aux["model_state"]``, if present, is the
    updated model state (BatchNorm statistics, ...); every other entry of ``aux`` is
    returned in ``metrics`` under its own name. A ``loss_fn`` that does not take
    ``rng`` or ``model_state`` is called without it. :func:`lm_loss` builds the
    language-model one. With :math:`\theta` the master weights and :math:`S` the loss
    scale (1 without one):

    .. math::

      g = \nabla_\theta (S \cdot \mathrm{loss}) / S, \qquad
      (u, s') = \mathrm{optimizer.update}(g, s, \theta, \mathrm{value}=\mathrm{loss}),
      \qquad \theta' = \theta + u.

    The loss is passed once, as optax's ``value=`` (read by the stabljax guards and
    ``optax.contrib.reduce_on_plateau``; a plain Optax optimizer ignores it). With float16
    loss scaling the overflow check comes first: if :math:`g` or the loss is non-finite the
    optimizer is not called at all, so neither the parameters nor the optimizer state change
    (zeroed gradients would still move them through momentum), ``metrics["overflow"]`` is
    true, ``metrics["skipped"]`` (guards only) is false, and the scale backs off. On an
    overflow or a guard-skipped step (:func:`stabljax.any_skipped`) the model state and the
    RNG key are kept bit-for-bit too, so a NaN batch cannot poison BatchNorm statistics.
    ``state.step`` counts every call. The metrics are listed in :mod:`stabljax.step`; every
    one is a device value and nothing is fetched.

    Shardings: the step is a plain ``jax.jit``; parameters sharded on a mesh (data
    parallel with replicated params, FSDP-style with sharded params) keep their
    shardings, and a batch sharded along its leading axis is data parallel.

    Args:
      loss_fn: ``loss_fn(params, batch, *, rng, model_state) -> (loss, aux)``, e.g.
        :func:`lm_loss`.
      optimizer: any Optax transformation, guarded or not.
      precision: the :class:`~stabljax.precision.Precision` policy (the one the state
        was created with).
      layer_metrics: also return ``metrics["layers"]``, per-parameter-path norms
        (:func:`stabljax.telemetry.layer_metrics`).
      qk_layers: the attention layers' query and key heads (the ``layers`` of
        :func:`stabljax.qk_clip`); with them the step also returns
        ``metrics["attn_logit_proxy"]``, per layer
        :math:`\max_h \|W_q^h\|\|W_k^h\|/\sqrt{d_h}` of the params the gradients were
        taken at.
      signals: also return the leading indicators of a spike
        (:func:`stabljax.telemetry.leading_signals`: update/param RMS ratio and Adam RMS,
        per layer and their max), for
        :class:`stabljax.control.detect.warning.WarningDetector`.
      donate: donate the input state's buffers to the output (the input state is
        invalid after the call).
      compiler_options: XLA options for ``jax.jit``, e.g.
        :func:`recommended_compiler_options`. JAX accepts them on a top-level jit only:
        a step built with them cannot be traced inside another ``jax.jit`` (or
        ``jax.make_jaxpr``).

    Returns:
      The jitted step.

    Raises:
      TypeError: if ``loss_fn`` is not callable.
      ValueError: if ``precision`` is not a ``Precision``; when traced, if the state
        does not match the precision policy, the loss is not a float scalar, ``aux`` is
        not a dict or names a metric of the step, or ``aux`` returns a ``model_state``
        the state has none of.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.step import TrainState, lm_loss, make_train_step
      >>> def apply_fn(params, inputs):  # a bigram model
      ...     return params["table"][inputs]
      >>> params = {"table": jnp.zeros((4, 4))}
      >>> opt = optax.sgd(1.0)
      >>> step = make_train_step(lm_loss(apply_fn), opt)
      >>> state = TrainState.create(params, opt)
      >>> batch = {"inputs": jnp.array([[0, 1, 2]]), "targets": jnp.array([[1, 2, 3]])}
      >>> for _ in range(3):
      ...     state, metrics = step(state, batch)
      ...     print(f"{float(metrics['loss']):.3f}")
      1.386
      1.147
      0.951
      >>> int(state.step), bool(metrics["skipped"]), float(metrics["loss_scale"])
      (3, False, 1.0)
    """
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: `loss_fn` must be callable; got {loss_fn!r}.")
    if not isinstance(precision, Precision):
        raise ValueError(
            f"make_train_step: `precision` must be a stabljax Precision; got {precision!r}."
        )
    if qk_layers is not None:
        check_layers(qk_layers, owner="make_train_step", arg="qk_layers")
    tx = with_extra_args(optimizer)
    dls = precision.loss_scale
    grad_fn = jax.grad(_scaled_loss(loss_fn, precision), has_aux=True)

    def step(state: TrainState, batch: Any):
        ls_state = state.loss_scale_state
        if (ls_state is None) != (dls is None):
            raise ValueError(
                "state.loss_scale_state does not match the precision policy: create the "
                "state with TrainState.create(..., precision=precision)"
            )
        if state.rng is None:
            next_rng = step_rng = None
        else:
            next_rng, step_rng = jax.random.split(state.rng)
        grads, (loss, aux) = grad_fn(state.params, batch, ls_state, step_rng, state.model_state)
        grads = unscale_grads(grads, ls_state)
        new_model_state = aux.pop("model_state", state.model_state)
        max_logits = aux.pop(metrics.MAX_ATTN_LOGITS, None)
        _check_aux(aux, state.model_state, new_model_state)
        extra = {} if max_logits is None else {"max_logits": max_logits}
        params, opt_state, updates, overflow = _update(tx, state, grads, loss, extra)
        new_ls_state = None if ls_state is None else dls.adjust(ls_state, jnp.logical_not(overflow))

        # On an overflow the optimizer did not run: its flags are the previous step's.
        skipped = jnp.logical_and(jnp.logical_not(overflow), any_skipped(opt_state))
        keep = jnp.logical_or(skipped, overflow)
        if state.model_state is not None:
            new_model_state = _select(keep, state.model_state, new_model_state)
        if next_rng is not None:
            next_rng = _select(keep, state.rng, next_rng)
        out = {
            metrics.LOSS: loss,
            **aux,
            **_step_metrics(state, grads, updates, opt_state, skipped, overflow),
        }
        if max_logits is not None:
            out |= telemetry.attn_logit_metrics(max_logits)
        if qk_layers is not None:
            out[metrics.ATTN_LOGIT_PROXY] = qk_logit_proxy(qk_layers, state.params)
        if layer_metrics:
            out[metrics.LAYERS] = telemetry.layer_metrics(grads, state.params, updates)
        if signals is not None:
            out |= telemetry.leading_signals(grads, state.params, updates, opt_state, b2=signals.b2)
        new_state = TrainState(
            step=optax.safe_increment(state.step),
            params=params,
            opt_state=opt_state,
            loss_scale_state=new_ls_state,
            rng=next_rng,
            model_state=new_model_state,
        )
        return new_state, out

    options = _jit_options(compiler_options)
    return jax.jit(step, donate_argnums=(0,) if donate else (), compiler_options=options)
