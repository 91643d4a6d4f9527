"""Guards and :class:`optax.MultiSteps`: a micro-batch filter, and a loud unsafe placement.

optax 0.2.8's ``MultiSteps`` resets its accumulator as ``(1 - emit) * acc``, so one
micro-batch with a NaN gradient stays in it for good (``0 * nan = nan``): a guard *inside*
``MultiSteps`` then sees a non-finite accumulated gradient at every later emission and skips
every later step, silently (optax issue #828; ``optax.apply_if_finite`` stalls the same way).
Two placements are safe, and the third is refused (:func:`check_multisteps_placement`) as
soon as a whole optimizer state is seen: by ``TrainState.create``, the train step,
:func:`~stabljax.optim.guards.skips.any_skipped`, or the ``init`` of a guard around it:

* the guard *outside*, ``skip_nonfinite(optax.MultiSteps(opt, k))``: it sees each micro-batch
  and skips a bad one before it is accumulated, keeping ``MultiSteps``' state (accumulator and
  counters) bit for bit; read that state with ``optax.tree.get(opt_state, "gradient_step")``;
* the guard *inside*, with ``optax.MultiSteps(..., should_skip_update_fn=``
  :func:`skip_nonfinite_micro_batch` ``)`` (or ``optax.skip_not_finite``): ``MultiSteps``
  drops a non-finite micro-batch before accumulating it;
* the guard inside a ``MultiSteps`` with neither raises a ``ValueError`` saying both.

``optax.MultiSteps.init`` does not tell its inner ``init`` that it is inside, so a bare
``optax.MultiSteps(guard(opt), k).init(params)`` returns a state; the first of the calls
above that sees that state raises.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from stabljax.base import AxisName, global_norm_f32

# The skip_state key MultiSteps keeps for the last micro-batch; any_skipped reads it.
MICRO_BATCH_SKIPPED = "micro_batch_skipped"


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


# Fields only the stabljax guard states have (state field names are unique in stabljax):
# the marker by which a guard's state is told from any other in an optimizer state.
GUARD_FLAGS = ("nonfinite_skipped", "spike_skipped")
# The skip_state keys of the should_skip_update_fns that drop a non-finite micro-batch:
# ours, and optax.skip_not_finite's (documented in its docstring).
_DROPS_NONFINITE = (MICRO_BATCH_SKIPPED, "num_not_finite")


def _is_guard_state(node: Any) -> bool:
    return isinstance(node, tuple) and any(f in getattr(node, "_fields", ()) for f in GUARD_FLAGS)


def _holds_guard(tree: Any) -> bool:
    return any(optax.tree.get_all_with_path(tree, flag) for flag in GUARD_FLAGS)


def _children(node: Any) -> list[Any]:
    leaves = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
    return [c for c in leaves if c is not node]


def unguarded_multisteps(opt_state: Any, *, guarded: bool = False) -> bool:
    """Whether ``opt_state`` holds an unsafe :class:`optax.MultiStepsState`.

    Unsafe: a stabljax guard's state inside it, a ``skip_state`` that does not come from a
    ``should_skip_update_fn`` dropping non-finite micro-batches
    (:func:`skip_nonfinite_micro_batch`, ``optax.skip_not_finite``), and no guard state
    above it (an outer guard has judged the placement in its own ``init``). Read from the
    state's structure only (node types, field names and dict keys), so it works on
    concrete, traced and abstract states alike.
    """
    if isinstance(opt_state, optax.MultiStepsState) and not guarded:
        skip_state = opt_state.skip_state
        drops = isinstance(skip_state, dict) and any(k in skip_state for k in _DROPS_NONFINITE)
        if not drops and _holds_guard(opt_state.inner_opt_state):
            return True
    guarded = guarded or _is_guard_state(opt_state)
    return any(unguarded_multisteps(c, guarded=guarded) for c in _children(opt_state))


def check_multisteps_placement(opt_state: Any, owner: str = "a stabljax guard") -> None:
    """Raises if a guard sits inside an :class:`optax.MultiSteps` that keeps NaN micro-batches.

    Called by a guard's ``init`` on its inner state when the guard does not itself skip
    non-finite gradients (one that does protects a ``MultiSteps`` inside it), and by
    ``TrainState.create``, the train step and :func:`~stabljax.optim.guards.skips.any_skipped`
    on a whole optimizer state. ``optax.MultiSteps`` calls its inner ``init`` without
    telling it where it sits, so a bare ``optax.MultiSteps(guard(opt), k).init`` cannot
    see the problem; these calls, which see the whole state, do. See
    :func:`unguarded_multisteps` for the rule.

    Raises:
      ValueError: naming both safe placements.
    """
    if unguarded_multisteps(opt_state):
        raise ValueError(
            f"{owner} is inside optax.MultiSteps, whose accumulator keeps a NaN micro-batch "
            "for good (it resets by multiplying by 0), so the guard would skip every later "
            "step, silently. Put the guard outside, skip_nonfinite(optax.MultiSteps(opt, k)), "
            "or let MultiSteps drop such micro-batches: optax.MultiSteps(opt, k, "
            "should_skip_update_fn=stabljax.skip_nonfinite_micro_batch) (or "
            "should_skip_update_fn=optax.skip_not_finite)."
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
