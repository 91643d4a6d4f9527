"""The jitted train step: cross-entropy + z-loss, precision, any Optax optimizer, metrics.

One ``jax.jit`` region per step (flax's performance guide; equinox's "one big JIT
region"): forward, backward, loss scaling, the guarded optimizer update and every
metric. Nothing inside it talks to the host, so the host can dispatch step ``t + 1``
before it reads the metrics of step ``t``.

Metrics (all ``jax.Array`` scalars):

- ``loss``, ``ce``, ``z_loss``, ``log_z``, ``log_z_max``: see
  :func:`stabljax.losses.cross_entropy_with_z_loss` (``loss == ce + z_loss``);
- ``grad_norm``: global norm of the unscaled gradients; ``param_norm``: of the
  parameters the gradients were taken at; ``update_norm``: of the update applied
  (0 on a skipped step);
- ``skipped`` (bool): a stabljax guard anywhere in the optimizer state skipped this
  step; ``skip_streak`` (int32): the longest current run of guard skips, 0 without
  guards;
- ``overflow`` (bool): float16 loss scaling found non-finite gradients and skipped the
  step (always False without loss scaling); it is not a guard skip;
- ``loss_scale`` (float32): the scale this step ran at, 1.0 without loss scaling;
- ``layers`` (with ``layer_metrics=True``): :func:`stabljax.telemetry.layer_metrics`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from stabljax import telemetry
from stabljax.losses import _check_coefficient, cross_entropy_with_z_loss
from stabljax.optim import guards
from stabljax.optim._base import with_extra_args
from stabljax.precision import LossScaleState, Precision, all_finite, scale_loss, unscale_grads

__all__ = ("TrainState", "make_train_step", "nnx_apply", "nnx_merge")

ApplyFn = Callable[[Any, jax.Array], jax.Array]
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
    """

    step: jax.Array
    params: Any
    opt_state: Any
    loss_scale_state: LossScaleState | None = None

    @classmethod
    def create(
        cls,
        params: Any,
        optimizer: optax.GradientTransformation,
        precision: Precision = _FP32,
    ) -> TrainState:
        """Builds the initial state; it is safe to donate.

        Floating parameters are cast to ``precision.param_dtype``; the optimizer is
        initialised on them. Every leaf is then copied into its own buffer (so an
        ``init`` that reuses one zeros array for two fields, or tied weights, can still
        be donated), and when the parameters live on one mesh, leaves that are on no
        mesh (scalars) are replicated over it, so the step keeps all shardings and
        compiles once.

        Args:
          params: the parameters (a pytree; an ``nnx.State`` from :func:`nnx_apply`,
            or linen variables).
          optimizer: any Optax transformation (the one given to :func:`make_train_step`).
          precision: the policy given to :func:`make_train_step`.

        Returns:
          A :class:`TrainState` with ``step == 0``.
        """
        params = precision.cast_to_param(params)
        mesh = _common_mesh(params)
        params = _place(params, mesh)
        opt_state = _place(optimizer.init(params), mesh)
        ls_state = precision.init_loss_scale()
        return cls(
            step=_place(jnp.zeros([], jnp.int32), mesh),
            params=params,
            opt_state=opt_state,
            loss_scale_state=None if ls_state is None else _place(ls_state, mesh),
        )


_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def recommended_compiler_options(backend: str | None = None) -> dict[str, Any]:
    """XLA options for compiling a guarded train step on ``backend`` (default: JAX's).

    On CPU, ``{"xla_cpu_copy_insertion_use_region_analysis": True}``: XLA:CPU's default
    copy insertion copies every donated optimizer moment that two fusions read while one
    of them overwrites it in place, which a guarded update (skip and select) always has:
    4 extra passes over the parameters with Adam (see BUILD.md, Performance). The region
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


def make_train_step(
    apply_fn: ApplyFn,
    optimizer: optax.GradientTransformation,
    *,
    z_loss: float = 1e-4,
    precision: Precision = _FP32,
    layer_metrics: bool = False,
    donate: bool = True,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[[TrainState, Mapping[str, jax.Array]], tuple[TrainState, dict[str, Any]]]:
    r"""Returns the jitted ``step(state, batch) -> (state, metrics)`` of a language model.

    With :math:`\theta` the master weights, :math:`S` the loss scale (1 without one) and
    :math:`\mathcal{L}` :func:`~stabljax.losses.cross_entropy_with_z_loss` of
    ``apply_fn(cast(θ), batch["inputs"])`` against ``batch["targets"]`` (masked by the
    optional ``batch["mask"]``):

    .. math::

      g = \nabla_\theta (S \cdot \mathcal{L}) / S, \qquad
      (u, s') = \mathrm{optimizer.update}(g, s, \theta, \mathrm{loss}=\mathcal{L}), \qquad
      \theta' = \theta + u.

    The loss is always passed as ``loss=`` (a plain Optax optimizer ignores it;
    ``skip_nonfinite`` / ``skip_spikes`` read it). With float16 loss scaling the
    overflow check comes first: if :math:`g` or :math:`\mathcal{L}` is non-finite the
    optimizer is not called at all, so neither the parameters nor the optimizer state
    change (zeroed gradients would still move them through momentum),
    ``metrics["overflow"]`` is true, ``metrics["skipped"]`` (guards only) is false, and
    the scale backs off. ``state.step`` counts every call. The metrics are listed in
    :mod:`stabljax.step`; every one is a device scalar and nothing is fetched.

    Shardings: the step is a plain ``jax.jit``; parameters sharded on a mesh (data
    parallel with replicated params, FSDP-style with sharded params) keep their
    shardings, and a batch sharded along its leading axis is data parallel.

    Args:
      apply_fn: ``apply_fn(params, inputs) -> logits`` (``[..., vocab]``). For linen,
        ``module.apply`` with ``params`` the variables dict; for nnx, see
        :func:`nnx_apply`.
      optimizer: any Optax transformation, guarded or not.
      z_loss: z-loss weight (>= 0); 0 gives plain cross-entropy.
      precision: the :class:`~stabljax.precision.Precision` policy (the one the state
        was created with).
      layer_metrics: also return ``metrics["layers"]``, per-parameter-path norms
        (:func:`stabljax.telemetry.layer_metrics`).
      donate: donate the input state's buffers to the output (the input state is
        invalid after the call).
      compiler_options: XLA options for ``jax.jit``, e.g.
        :func:`recommended_compiler_options`. JAX accepts them on a top-level jit only:
        a step built with them cannot be traced inside another ``jax.jit`` (or
        ``jax.make_jaxpr``).

    Returns:
      The jitted step. ``batch`` is a dict with ``inputs``, integer ``targets`` and an
      optional boolean ``mask`` of the targets' shape.

    Example:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from stabljax.step import TrainState, make_train_step
      >>> def apply_fn(params, inputs):  # a bigram model
      ...     return params["table"][inputs]
      >>> params = {"table": jnp.zeros((4, 4))}
      >>> opt = optax.sgd(1.0)
      >>> step = make_train_step(apply_fn, opt)
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
    _check_coefficient(z_loss)
    if not isinstance(precision, Precision):
        raise ValueError(f"precision must be a stabljax Precision, got {type(precision)}")
    tx = with_extra_args(optimizer)
    dls = precision.loss_scale

    def loss_fn(params, batch, ls_state):
        logits = apply_fn(precision.cast_to_compute(params), batch["inputs"])
        loss, aux = cross_entropy_with_z_loss(
            logits, batch["targets"], z_loss=z_loss, where=batch.get("mask")
        )
        return scale_loss(loss, ls_state), (loss, aux)

    def step(state: TrainState, batch: Mapping[str, jax.Array]):
        ls_state = state.loss_scale_state
        if (ls_state is None) != (dls is None):
            raise ValueError(
                "state.loss_scale_state does not match the precision policy: create the "
                "state with TrainState.create(..., precision=precision)"
            )
        grads, (loss, aux) = jax.grad(loss_fn, has_aux=True)(state.params, batch, ls_state)
        grads = unscale_grads(grads, ls_state)

        def apply(_):
            updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=loss)
            return optax.apply_updates(state.params, updates), opt_state, updates

        def skip(_):
            return state.params, state.opt_state, optax.tree.zeros_like(state.params)

        if ls_state is None:
            params, opt_state, updates = apply(None)
            overflow = jnp.zeros([], jnp.bool_)
            scale = jnp.ones([], jnp.float32)
            new_ls_state = None
        else:
            finite = jnp.logical_and(all_finite(grads), jnp.isfinite(loss))
            params, opt_state, updates = jax.lax.cond(finite, apply, skip, None)
            overflow = jnp.logical_not(finite)
            scale = ls_state.loss_scale
            new_ls_state = dls.adjust(ls_state, finite)

        metrics = {
            "loss": loss,
            "ce": aux["ce"],
            "z_loss": aux["z_loss"],
            "log_z": aux["log_z"],
            "log_z_max": aux["log_z_max"],
            "grad_norm": telemetry.global_norm(grads),
            "update_norm": telemetry.global_norm(updates),
            "param_norm": telemetry.global_norm(state.params),
            # On an overflow the optimizer did not run: its flags are the previous step's.
            "skipped": jnp.logical_and(jnp.logical_not(overflow), guards.any_skipped(opt_state)),
            "skip_streak": jnp.asarray(guards.skip_streak(opt_state), jnp.int32),
            "overflow": overflow,
            "loss_scale": scale,
        }
        if layer_metrics:
            metrics["layers"] = telemetry.layer_metrics(grads, state.params, updates)
        new_state = TrainState(
            step=optax.safe_increment(state.step),
            params=params,
            opt_state=opt_state,
            loss_scale_state=new_ls_state,
        )
        return new_state, metrics

    options = _jit_options(compiler_options)
    return jax.jit(step, donate_argnums=(0,) if donate else (), compiler_options=options)


def nnx_apply(model: nnx.Module, **call_kwargs: Any) -> tuple[ApplyFn, nnx.State]:
    """Splits an ``nnx.Module`` into a pure ``apply_fn(params, inputs)`` and its params.

    As flax's performance guide does: ``graphdef, params, rest = nnx.split(model,
    nnx.Param, ...)`` once, and ``nnx.merge`` inside the jitted step. Only the
    ``nnx.Param`` variables are trained. The rest of the model's state (RNG streams,
    batch statistics, any other ``nnx.Variable``) is frozen at its value now and closed
    over as a constant: whatever ``__call__`` writes to it is discarded, so dropout
    would draw the same mask every step. Put such a model in eval mode
    (``model.eval()``), or pass keys through the inputs.

    Args:
      model: the module; it is not modified.
      **call_kwargs: passed to every call, e.g. ``return_aux=True`` for a
        :class:`~stabljax.nn.TransformerLM` whose aux :func:`stabljax.check_init` reads.

    Returns:
      ``(apply_fn, params)``: ``apply_fn(params, inputs) -> model(inputs)`` for
      :func:`make_train_step`, and the ``nnx.State`` of the params for
      :meth:`TrainState.create`. :func:`nnx_merge` puts trained params back.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from stabljax.step import nnx_apply, nnx_merge
      >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> apply_fn, params = nnx_apply(model)
      >>> apply_fn(params, jnp.ones((1, 3))).shape
      (1, 2)
      >>> nnx_merge(model, params).kernel[...].shape
      (3, 2)
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if not jax.tree.leaves(rest):
        # Hashable by value: two models of one architecture share jit caches keyed on it
        # (check_init compiles once for several inits of the same model).
        return _MergeApply(graphdef, tuple(sorted(call_kwargs.items()))), params

    def apply_fn(params: nnx.State, inputs: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params, rest)(inputs, **call_kwargs)

    return apply_fn, params


@dataclasses.dataclass(frozen=True)
class _MergeApply:
    graphdef: Any
    call_kwargs: tuple[tuple[str, Any], ...]

    def __call__(self, params: nnx.State, inputs: jax.Array) -> Any:
        return nnx.merge(self.graphdef, params)(inputs, **dict(self.call_kwargs))


def nnx_merge(model_or_graphdef: nnx.Module | nnx.GraphDef, params: nnx.State) -> nnx.Module:
    """Returns a new module with trained ``params`` (the inverse of :func:`nnx_apply`).

    Args:
      model_or_graphdef: the module given to :func:`nnx_apply` (its non-param state
        is kept; the module itself is not modified), or a ``GraphDef`` of a module
        whose whole state is params.
      params: ``state.params`` of a :class:`TrainState`. With ``donate=True`` the
        next step call invalidates these buffers: merge after the last step, or merge
        a copy.

    Returns:
      The module, with ``params`` as its ``nnx.Param`` values.
    """
    if isinstance(model_or_graphdef, nnx.Module):
        graphdef, _, rest = nnx.split(model_or_graphdef, nnx.Param, ...)
        return nnx.merge(graphdef, params, rest)
    return nnx.merge(model_or_graphdef, params)
