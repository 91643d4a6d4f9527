"""Bridges a flax ``nnx.Module`` to the pure functions :func:`stabljax.make_train_step` takes.

:func:`nnx_apply` splits a module into ``apply_fn`` and its params (and, with
``stateful=True``, its other state); :func:`nnx_merge` puts trained state back. Both
are re-exported from :mod:`stabljax.step` and flat as ``stabljax.nnx_apply``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ("nnx_apply", "nnx_merge")


def _reseed(model_state: nnx.State, rng: jax.Array) -> nnx.State:
    """``model_state`` with every RNG stream's key drawn from ``rng`` and its count at 0.

    Functional, as ``nnx.reseed`` may not write, inside ``jax.grad``, to Variables that
    came in from the outer ``jit``: stream ``tag`` gets ``fold_in(rng, i)``, ``i`` its
    rank among the tags.
    """

    def is_var(x):
        return isinstance(x, nnx.Variable)

    variables = jax.tree.leaves(model_state, is_leaf=is_var)
    tags = sorted({v.tag for v in variables if isinstance(v, (nnx.RngKey, nnx.RngCount))})
    index = {t: i for i, t in enumerate(tags)}

    def reseed(v):
        if isinstance(v, nnx.RngKey):
            return v.replace(jax.random.fold_in(rng, index[v.tag]))
        if isinstance(v, nnx.RngCount):
            return v.replace(jnp.zeros_like(v[...]))
        return v

    return jax.tree.map(reseed, model_state, is_leaf=is_var)


def nnx_apply(
    model: nnx.Module, *, stateful: bool = False, **call_kwargs: Any
) -> tuple[Callable[..., Any], nnx.State] | tuple[Callable[..., Any], nnx.State, nnx.State]:
    """Splits an ``nnx.Module`` into a pure apply function and its state.

    As flax's performance guide does: ``graphdef, params, rest = nnx.split(model,
    nnx.Param, ...)`` once, and ``nnx.merge`` inside the jitted step. Only the
    ``nnx.Param`` variables are trained.

    - ``stateful=False``: ``(apply_fn, params)`` with ``apply_fn(params, inputs) ->
      model(inputs)``. The rest of the model's state (RNG streams, batch statistics) is
      frozen at its value now and closed over as a constant: whatever ``__call__``
      writes to it is discarded, so dropout would draw the same mask every step. Use
      it for models without such state, or in eval mode (``model.eval()``).
    - ``stateful=True``: ``(apply_fn, params, model_state)`` with ``model_state`` the
      ``nnx.State`` of every other variable (``nnx.BatchStat``, RNG keys and counts, ...)
      and ``apply_fn(params, inputs, *, rng=None, model_state) -> (outputs,
      new_model_state)``. With a key ``rng``, every RNG stream of the model (dropout,
      ...) is reseeded from it first, so the train step's ``TrainState.rng`` drives
      the randomness; without one, the streams' own counters advance in the model
      state. Call ``model.train()`` (or ``.eval()``) before, to fix the mode.

    Args:
      model: the module; it is not modified.
      stateful: return the non-param state and an ``apply_fn`` that threads it and RNG.
      **call_kwargs: passed to every call, e.g. ``return_aux=True`` for a
        :class:`~stabljax.reference.TransformerLM` whose aux :func:`stabljax.init.check_init` reads.

    Returns:
      ``(apply_fn, params)`` or, with ``stateful=True``, ``(apply_fn, params,
      model_state)``, for :func:`stabljax.lm_loss` or your own ``loss_fn`` and for
      :meth:`stabljax.TrainState.create`. :func:`nnx_merge` puts trained state back.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from stabljax.nnx_bridge import nnx_apply, nnx_merge
      >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
      >>> apply_fn, params = nnx_apply(model)
      >>> apply_fn(params, jnp.ones((1, 3))).shape
      (1, 2)
      >>> nnx_merge(model, params).kernel[...].shape
      (3, 2)
      >>> bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
      >>> apply_fn, params, model_state = nnx_apply(bn, stateful=True)
      >>> y, model_state = apply_fn(params, jnp.array([[0.0, 2.0], [2.0, 4.0]]),
      ...                           model_state=model_state)
      >>> print(model_state["mean"][...])  # 0.99 * 0 + 0.01 * [1, 3]
      [0.01 0.03]
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if stateful:

        def stateful_apply(params, inputs, *, rng=None, model_state):
            if rng is not None:
                model_state = _reseed(model_state, rng)
            # copy: fresh Variables at this trace level (inside jax.grad), which the call
            # may write to; the ones passed in belong to the outer jit.
            module = nnx.merge(graphdef, params, model_state, copy=True)
            out = module(inputs, **call_kwargs)
            _, _, new_state = nnx.split(module, nnx.Param, ...)
            return out, new_state

        return stateful_apply, params, rest
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


def nnx_merge(
    model_or_graphdef: nnx.Module | nnx.GraphDef, params: nnx.State, model_state: Any = None
) -> nnx.Module:
    """Returns a new module with trained ``params`` (the inverse of :func:`nnx_apply`).

    Args:
      model_or_graphdef: the module given to :func:`nnx_apply` (its non-param state
        is kept unless ``model_state`` is given; the module itself is not modified), or
        a ``GraphDef`` of a module whose whole state is params (plus ``model_state``).
      params: ``state.params`` of a :class:`stabljax.TrainState`. With ``donate=True`` the
        next step call invalidates these buffers: merge after the last step, or merge
        a copy.
      model_state: ``state.model_state`` (trained BatchNorm statistics, ...), or None.

    Returns:
      The module, with ``params`` as its ``nnx.Param`` values.
    """
    if isinstance(model_or_graphdef, nnx.Module):
        graphdef, _, rest = nnx.split(model_or_graphdef, nnx.Param, ...)
        return nnx.merge(graphdef, params, rest if model_state is None else model_state)
    if model_state is None:
        return nnx.merge(model_or_graphdef, params)
    return nnx.merge(model_or_graphdef, params, model_state)
