"""Guards and :class:`optax.MultiSteps`: a micro-batch filter, and a loud unsafe placement.

optax 0.2.8's ``MultiSteps`` resets its accumulator as ``(1 - emit) * acc``, so one
micro-batch with a NaN gradient stays in it for good (``0 * nan = nan``): a guard *inside*
``MultiSteps`` then sees a non-finite accumulated gradient at every later emission and skips
every later step, silently (optax issue #828; ``optax.apply_if_finite`` stalls the same way).
Two placements are safe, and :func:`skip_step` refuses the third at ``init``:

* the guard *outside*, ``skip_nonfinite(optax.MultiSteps(opt, k))``: it sees each micro-batch
  and skips a bad one before it is accumulated, keeping ``MultiSteps``' state (accumulator and
  counters) bit for bit; read that state with ``optax.tree.get(opt_state, "gradient_step")``;
* the guard *inside*, with ``optax.MultiSteps(..., should_skip_update_fn=``
  :func:`skip_nonfinite_micro_batch` ``)`` (or ``optax.skip_not_finite``): ``MultiSteps``
  drops a non-finite micro-batch before accumulating it;
* the guard inside a ``MultiSteps`` with neither raises a ``ValueError`` saying both.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax

from stabljax.base import AxisName, global_norm_f32

# The skip_state key MultiSteps keeps for the last micro-batch; any_skipped reads it.
MICRO_BATCH_SKIPPED = "micro_batch_skipped"
# A guard's init is a few calls below MultiSteps.init (chain, inject_hyperparams): look this far.
_MAX_DEPTH = 64


def skip_nonfinite_micro_batch(
    updates: optax.Updates,
    gradient_step: jax.typing.ArrayLike,
    params: optax.Params | None,
    *,
    axis_name: AxisName | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A ``should_skip_update_fn`` for :class:`optax.MultiSteps`: drops a non-finite micro-batch.

    The micro-batch is dropped (not accumulated, the mini-step not counted) when the float32
    global norm of its gradients is NaN or Inf: a NaN or Inf anywhere, or finite gradients
    whose norm overflows float32, the same test as :func:`skip_nonfinite`. With it a guard
    may sit inside ``MultiSteps``: the accumulator stays finite, and the emission after a NaN
    micro-batch averages the window's other micro-batches. ``MultiSteps`` keeps the returned
    dict as its ``skip_state``; :func:`~stabljax.optim.guards.skips.any_skipped` reads its
    ``micro_batch_skipped`` flag, so the train step reports the drop as ``skipped``. Inside
    ``shard_map`` bind ``axis_name`` with :func:`functools.partial`.

    Args:
      updates: the micro-batch's gradients.
      gradient_step: ``MultiSteps``' gradient step (unused).
      params: the parameters (unused).
      axis_name: the ``shard_map``/``pmap`` axes the gradients are sharded over.

    Returns:
      ``(skip, {"micro_batch_skipped": skip})``, a bool scalar and ``MultiSteps``' skip state.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import stabljax
      >>> opt = optax.MultiSteps(
      ...     stabljax.skip_nonfinite(optax.sgd(1.0)),
      ...     every_k_schedule=2,
      ...     should_skip_update_fn=stabljax.skip_nonfinite_micro_batch,
      ... )
      >>> state = opt.init(jnp.zeros(2))
      >>> for g in [[1.0, 1.0], [jnp.nan, 1.0], [3.0, 3.0]]:
      ...     u, state = opt.update(jnp.array(g), state)
      ...     print(bool(state.skip_state["micro_batch_skipped"]), int(state.gradient_step))
      False 0
      True 0
      False 1
      >>> print(u)  # the mean of the two finite micro-batches, times -1
      [-2. -2.]
    """
    del gradient_step, params
    skip = jnp.logical_not(jnp.isfinite(global_norm_f32(updates, axis_name)))
    return skip, {MICRO_BATCH_SKIPPED: skip}


def _drops_nonfinite(multi_steps: optax.MultiSteps) -> bool | None:
    """Whether ``multi_steps`` drops non-finite micro-batches; None if it cannot be told."""
    # optax 0.2.8 keeps the function here (a no-op closure when none was given); a test pins it.
    fn = getattr(multi_steps, "_should_skip_update_fn", None)
    if fn is None:
        return None
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn is skip_nonfinite_micro_batch or fn is optax.skip_not_finite


def check_multisteps_placement(owner: str) -> None:
    """Raises if the calling guard ``init`` runs inside an unsafe :class:`optax.MultiSteps`.

    Called from a guard's ``init`` (a Python-level look at the calls above it, once per
    ``init``; nothing is traced). Safe, and silent: no ``MultiSteps.init`` above; one whose
    ``should_skip_update_fn`` drops non-finite micro-batches; or another guard's ``init``
    above that ``MultiSteps`` whose local ``drops_nonfinite_gradients`` is true (a guard
    outside skips a bad micro-batch before ``MultiSteps`` sees it).
    """
    guard = sys._getframe(1)
    frame: Any = guard.f_back
    inside = None
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        local = frame.f_locals
        if inside is None:
            if frame.f_code.co_name == "init" and isinstance(local.get("self"), optax.MultiSteps):
                inside = local["self"]
                if _drops_nonfinite(inside) is not False:
                    return
        elif frame.f_code is guard.f_code and local.get("drops_nonfinite_gradients") is True:
            return
        frame = frame.f_back
    if inside is not None:
        raise ValueError(
            f"{owner} is inside optax.MultiSteps, whose accumulator keeps a NaN micro-batch "
            "for good (it resets by multiplying by 0), so the guard would skip every later "
            f"step, silently. Put the guard outside, {owner}(optax.MultiSteps(opt, k)), or "
            "let MultiSteps drop such micro-batches: optax.MultiSteps(opt, k, "
            "should_skip_update_fn=stabljax.skip_nonfinite_micro_batch)."
        )


def missing_field(state: tuple, name: str) -> Any:
    """``__getattr__`` of the guard states: a field of the wrapped state gets a pointer.

    ``opt_state.gradient_step`` on ``skip_nonfinite(optax.MultiSteps(...))``'s state fails, as
    on any wrapper's; the error says to read it the optax way, ``optax.tree.get``, which looks
    through every wrapper.
    """
    if not name.startswith("_") and optax.tree.get_all_with_path(tuple(state), name):
        raise AttributeError(
            f"'{type(state).__name__}' object has no attribute '{name}': a stabljax guard wraps "
            f"the optimizer's state; read the field with optax.tree.get(opt_state, '{name}')."
        )
    raise AttributeError(f"'{type(state).__name__}' object has no attribute '{name}'")
