"""Helpers shared by the transforms, the step, telemetry, init and the detectors (layer 0).

An internal module, as ``optax._src`` is: its names are public so that the other stabljax
modules (and the benchmarks) may import them, but they are not part of the API and may
change without notice.

One definition each of the float32 global norm, the all-finite check, the extra-args
wrapper and the hyperparameter validator, so that the expressions XLA sees are the
same everywhere: two transforms that take the global norm of the same gradients emit
identical HLO, and XLA's common-subexpression elimination computes it once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

AxisName = str | tuple[str, ...]

_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerBoolConversionError,
)


def global_norm_f32(tree: Any, axis_name: AxisName | None = None) -> jax.Array:
    r"""The L2 norm of all leaves of ``tree`` together, :math:`\sqrt{\sum x^2}`, in float32.

    Leaves are upcast to float32 before squaring, so a bf16 or fp16 tree neither
    overflows its own range nor loses small terms. ``None`` leaves are ignored; an empty
    tree has norm 0. A NaN or Inf anywhere makes the norm non-finite, and so do finite
    values whose squares overflow float32 (a norm above about 1.8e19).

    With ``axis_name`` (inside ``shard_map`` or ``pmap``), the sum of squares is
    ``psum``-ed over those axes first: the norm of the whole tree when its leaves are
    sharded over them (FSDP), identical on every shard.

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.base import global_norm_f32
      >>> tree = {"a": jnp.array([3.0]), "b": jnp.array([4.0], jnp.bfloat16)}
      >>> print(float(global_norm_f32(tree)))
      5.0
    """
    squares = [
        jnp.sum(jnp.square(jnp.asarray(x).astype(jnp.float32))) for x in jax.tree.leaves(tree)
    ]
    total = functools.reduce(jnp.add, squares, jnp.zeros([], jnp.float32))
    if axis_name is not None:
        total = jax.lax.psum(total, axis_name)
    return jnp.sqrt(total)


def path_str(path: tuple[Any, ...]) -> str:
    """Joins a pytree key path with ``/`` (``"dense/w"``, ``"blocks/0"``).

    Example:
      >>> import jax
      >>> from stabljax.base import path_str
      >>> tree = {"dense": {"w": 1.0}, "blocks": [2.0]}
      >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
      ['blocks/0', 'dense/w']
    """
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:  # optax's NamedTupleKey and any other key entry
            parts.append(str(getattr(k, "name", k)))
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        parts.pop()  # an nnx.Variable's payload: name the variable, not its field
    return "/".join(parts)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every inexact leaf of ``tree`` is finite (True when empty).

    Example:
      >>> import jax.numpy as jnp
      >>> from stabljax.base import all_finite
      >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return functools.reduce(jnp.logical_and, checks, jnp.array(True))


def with_extra_args(inner: Any) -> optax.GradientTransformationExtraArgs:
    """Like :func:`optax.with_extra_args_support`, but keeps extra args an ``update`` takes.

    ``optax.MultiSteps`` (and its ``gradient_transformation()``) is not a
    ``GradientTransformationExtraArgs`` although its ``update`` takes ``**extra_args``;
    ``optax.with_extra_args_support`` would silently drop ``loss`` on its way in.

    Raises:
      TypeError: when ``inner`` is not a transformation, e.g. a factory such as
        ``stabljax.safe_adamw`` passed without calling it.
    """
    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return inner
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        hint = " (a factory: call it, e.g. safe_adamw(3e-4))" if callable(inner) else ""
        raise TypeError(
            f"expected an optax.GradientTransformation with init and update, got {inner!r}{hint}."
        )
    try:
        params = inspect.signature(inner.update).parameters.values()
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    except (TypeError, ValueError):
        takes_kwargs = False
    if takes_kwargs:
        return optax.GradientTransformationExtraArgs(inner.init, inner.update)
    return optax.with_extra_args_support(inner)


def validate(owner: str, name: str, value: Any, ok: Callable[[Any], Any], allowed: str) -> None:
    """Raises ``ValueError("<owner>: `<name>` must be <allowed>; got <value>.")`` unless ok.

    ``ok`` gets the value as a numpy array and may return an array (all must hold).
    Traced values (``optax.inject_hyperparams`` rebuilds a transform inside ``jit``)
    and schedules are not checked: they were checked when the transform was built, or
    are the schedule's business.
    """
    if isinstance(value, jax.core.Tracer) or callable(value):
        return
    try:
        good = bool(np.all(ok(np.asarray(value))))
    except _TRACER_ERRORS:
        return
    except (TypeError, ValueError):
        good = False
    if not good:
        raise ValueError(f"{owner}: `{name}` must be {allowed}; got {value!r}.")


def is_nonneg_int(v: Any) -> bool:
    """A scalar of integer dtype (Python int or numpy/JAX integer) that is >= 0."""
    a = np.asarray(v)
    return a.ndim == 0 and a.dtype.kind in "iu" and int(a) >= 0
