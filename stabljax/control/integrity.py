"""A checkpoint's meta item: the state's fingerprint, the meta digest, the resume checks.

The fingerprint is two wrap-around uint32 sums per leaf, computed on device; the meta
item carries its own SHA-256 digest; :func:`check_compatible` compares leaves, tree
structure and data config, so a changed model, optimizer or dtype is a
:class:`~stabljax.control.errors.CheckpointMismatch`, never corruption.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stabljax.control.errors import CheckpointMismatch

META_VERSION = 1


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag])
    words = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    u = lax.bitcast_convert_type(x, words).astype(jnp.uint32)
    # A position-dependent odd weight, built per axis (no reshape of a sharded array).
    w = jnp.ones(u.shape, jnp.uint32)
    mults = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
    for axis in range(u.ndim):
        iota = lax.broadcasted_iota(jnp.uint32, u.shape, axis)
        w = w + iota * jnp.uint32(mults[axis % 4]) * jnp.uint32(2)
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * w, dtype=jnp.uint32)])


@jax.jit
def fingerprint(tree: Any) -> jax.Array:
    """Two uint32 sums per leaf of ``tree`` (dispatched on device, read later)."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.concatenate([_leaf_fingerprint(x) for x in leaves])


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (a deep copy), or ``None``."""
    return None if value is None else json.loads(json.dumps(value))


def meta_digest(meta: Mapping[str, Any]) -> str:
    """SHA-256 of the meta item's canonical JSON, its own ``digest`` field left out."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def leaf_specs(abstract: Any) -> list[list[Any]]:
    """``[path, dtype, shape]`` of every leaf of ``abstract``, ``None`` leaves included."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: x is None)
    out = []
    for path, x in flat:
        dtype = getattr(x, "dtype", None)
        shape = getattr(x, "shape", None)
        out.append(
            [
                jax.tree_util.keystr(path),
                None if x is None else str(dtype if dtype is not None else type(x).__name__),
                None if shape is None else [int(d) for d in shape],
            ]
        )
    return out


def node_specs(abstract: Any) -> list[list[str]]:
    """``[path, type name]`` of every inner node of ``abstract`` (``None`` aside).

    Two states can have the same leaves and still differ in structure: ``optax.sgd``'s
    state and ``optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05))``'s hold no
    arrays at all, yet one is a pair of ``EmptyState`` and the other a pair whose second
    element is itself a pair. These lines tell them apart, with the NamedTuple type of
    each state.
    """
    out: list[list[str]] = []

    def walk(path: tuple[Any, ...], x: Any) -> None:
        if x is None:
            return
        children, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        if len(children) == 1 and children[0][0] == ():
            return  # a leaf: leaf_specs lists it
        out.append([jax.tree_util.keystr(path), type(x).__name__])
        for p, c in children:
            walk(path + tuple(p), c)

    walk((), abstract)
    return out


def describe_nodes(saved: Sequence[Sequence[str]], current: Sequence[Sequence[str]]) -> list[str]:
    """Lines naming each inner node of the state added, removed or of another type."""
    old, new = dict(map(tuple, saved)), dict(map(tuple, current))
    lines = []
    for p, t in new.items():
        if p not in old:
            lines.append(f"structure: {p or 'the state'} ({t}) is not in the checkpoint")
        elif old[p] != t:
            lines.append(f"structure: {p or 'the state'} is {old[p]} in the checkpoint, {t} now")
    lines += [
        f"structure: {p or 'the state'} ({t}) of the checkpoint is gone from the state"
        for p, t in old.items()
        if p not in new
    ]
    return lines


def describe_mismatch(
    saved: Sequence[Sequence[Any]], current: Sequence[Sequence[Any]]
) -> list[str]:
    """Lines naming each leaf that was added, removed, or changed dtype or shape."""
    old = {p: (d, s) for p, d, s in saved}
    new = {p: (d, s) for p, d, s in current}
    lines = []
    for p, (d, s) in new.items():
        if p not in old:
            lines.append(f"new leaf {p} ({d}{s if s is not None else ''}) not in the checkpoint")
        elif old[p][0] is None and d is not None:
            lines.append(f"leaf {p} is {d}{s} now but was None in the checkpoint")
        elif d is None and old[p][0] is not None:
            lines.append(f"leaf {p} is None now but was {old[p][0]}{old[p][1]} in the checkpoint")
        elif old[p][0] != d:
            lines.append(f"leaf {p}: dtype {old[p][0]} in the checkpoint, {d} now")
        elif old[p][1] != s:
            lines.append(f"leaf {p}: shape {old[p][1]} in the checkpoint, {s} now")
    lines += [f"leaf {p} of the checkpoint is gone from the state" for p in old if p not in new]
    return lines


def state_bytes(abstract: Any) -> int:
    """Bytes of the arrays in ``abstract`` (the size of one checkpoint, roughly)."""
    total = 0
    for x in jax.tree.leaves(abstract):
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is not None and dtype is not None:
            try:
                total += int(np.prod(shape)) * np.dtype(dtype).itemsize
            except TypeError:  # a PRNG key dtype
                total += int(np.prod(shape)) * 8
    return total


def check_compatible(
    meta: Mapping[str, Any], abstract: Any, data_config: Any, directory: pathlib.Path
) -> None:
    """Raises :class:`CheckpointMismatch` listing how the state or data config differs."""
    lines = []
    if meta.get("leaves") is not None:
        lines = describe_mismatch(meta["leaves"], leaf_specs(abstract))
    if meta.get("nodes") is not None:
        lines += describe_nodes(meta["nodes"], node_specs(abstract))
    saved = meta.get("data_config")
    if saved is not None and saved != data_config:
        lines.append(f"data config {saved} in the checkpoint, {data_config} now")
    if lines:
        raise CheckpointMismatch(
            f"cannot resume from checkpoint {meta['step']} in {str(directory)!r}: the train "
            "state's structure changed or the data config changed since it was written (a "
            "config change, not corruption):\n  " + "\n  ".join(lines) + "\nResume with the "
            "original model, optimizer, dtypes and data, or use a new directory."
        )
