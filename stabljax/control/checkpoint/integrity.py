"""A checkpoint's meta item: the state's fingerprint and digests, the meta digest, the
resume checks.

The fingerprint is two wrap-around uint32 sums per leaf, computed on device: it catches
accidents (a flipped bit, a truncated or swapped file), not values chosen to keep its sums.
``verify="digest"`` adds a SHA-256 of each leaf's host bytes (:func:`leaf_digests`), which
catches any change of values. The meta item carries a SHA-256 digest of itself; anyone who
can write the checkpoint can recompute the plain digests, so with a key in
``STABLJAX_CHECKPOINT_KEY`` every digest is an HMAC-SHA256 instead (:class:`Seal`), and only
someone holding the key can forge one. :func:`check_compatible` compares leaves, tree
structure and data config, so a changed model, optimizer or dtype is a
:class:`~stabljax.control.errors.CheckpointMismatch`, never corruption.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import hmac
import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from stabljax.control.errors import CheckpointMismatch
from stabljax.control.hosts import to_host

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


def _hasher(key: bytes | None) -> Any:
    return hashlib.sha256() if key is None else hmac.new(key, digestmod=hashlib.sha256)


def meta_digest(meta: Mapping[str, Any], key: bytes | None = None) -> str:
    """SHA-256 (HMAC-SHA256 with ``key``) of the meta item's canonical JSON, its own
    ``digest`` field left out."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    h = _hasher(key)
    h.update(json.dumps(body, sort_keys=True).encode())
    return h.hexdigest()


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


# ---------------------------------------------------------------------------------- digests

ENV_KEY = "STABLJAX_CHECKPOINT_KEY"
"""The environment variable whose value keys the digests (HMAC-SHA256), when set."""


class CheckpointKeyError(CheckpointMismatch):
    """A checkpoint sealed with another key, or with none where a key is set (or the
    reverse): a setting to fix, not corruption, so nothing is set aside."""


def check_verify(verify: Any) -> bool | str:
    """``verify`` if it is ``True`` (fingerprint), ``False`` or ``"digest"``; else ValueError."""
    if verify is True or verify is False or verify == "digest":
        return verify
    raise ValueError(f"verify must be True (fingerprint), False or 'digest', got {verify!r}")


def _host_bytes(x: Any) -> tuple[str, np.ndarray]:
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.ascontiguousarray(to_host(x))
    return f"{a.dtype.str}{list(a.shape)}", a.reshape(-1).view(np.uint8)


def leaf_digests(tree: Any, key: bytes | None = None) -> list[list[str]]:
    """``[path, hex digest]`` of each leaf of ``tree``: SHA-256 of its dtype, shape and host
    bytes (HMAC-SHA256 with ``key``).

    Args:
      tree: the state (any pytree of arrays; ``None`` leaves are skipped).
      key: the HMAC key, or ``None`` for a plain SHA-256.

    Example:
      >>> import hashlib, numpy as np
      >>> from stabljax.control.checkpoint.integrity import leaf_digests
      >>> w = np.arange(3, dtype=np.float32)
      >>> [(path, digest)] = leaf_digests({"w": w})
      >>> path, digest == hashlib.sha256(b"<f4[3]" + w.tobytes()).hexdigest()
      ("['w']", True)
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    for _, x in flat:  # start every device-to-host copy before reading the first
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            x.copy_to_host_async()

    def one(x: Any) -> str:
        h = _hasher(key)
        spec, raw = _host_bytes(x)
        h.update(spec.encode())
        h.update(raw)  # hashlib releases the GIL here, so leaves hash in parallel
        return h.hexdigest()

    # A leaf sharded across processes is gathered by a collective, which every process
    # must call in the same order: those are read one by one.
    local = all(
        not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated
        for _, x in flat
    )
    workers = min(len(flat), os.cpu_count() or 1, 8) if local else 1
    if workers <= 1:
        digests = [one(x) for _, x in flat]
    else:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            digests = list(pool.map(one, [x for _, x in flat]))
    return [[jax.tree_util.keystr(p), d] for (p, _), d in zip(flat, digests, strict=True)]


@dataclasses.dataclass(frozen=True)
class Seal:
    """What a checkpoint's meta item carries to prove it and the state unchanged.

    ``mode`` is the controller's ``verify``: ``True`` stores the fingerprint (accidents),
    ``"digest"`` also a digest per leaf (any change of values), ``False`` neither. The meta
    item always gets a digest of itself when ``mode`` or ``key`` is set. With ``key``
    (:meth:`from_env`) every digest is an HMAC-SHA256 and the meta names the key by a
    short id (an HMAC of a constant, which says nothing of the key itself).
    """

    mode: bool | str = True
    key: bytes | None = dataclasses.field(default=None, repr=False)

    @classmethod
    def from_env(cls, verify: Any, environ: Mapping[str, str] = os.environ) -> Seal:
        """A seal for ``verify``, keyed by ``STABLJAX_CHECKPOINT_KEY`` if it is set."""
        raw = environ.get(ENV_KEY)
        if raw is not None and not raw:
            raise ValueError(f"{ENV_KEY} is set but empty: unset it or give it a secret value")
        return cls(check_verify(verify), None if raw is None else raw.encode())

    def key_id(self) -> str | None:
        if self.key is None:
            return None
        return hmac.new(self.key, b"stabljax checkpoint key id", hashlib.sha256).hexdigest()[:16]

    def seal(
        self,
        meta: dict[str, Any],
        state: Any,
        fingerprint_words: list[int] | None,
    ) -> None:
        """Adds the fingerprint, the leaf digests, the key id and the meta digest to ``meta``."""
        meta["fingerprint"] = fingerprint_words
        if self.mode == "digest":
            meta["digests"] = leaf_digests(state, self.key)
        if self.key is not None:
            meta["key_id"] = self.key_id()
        if self.mode or self.key is not None:
            meta["digest"] = meta_digest(meta, self.key)

    def check_meta(self, step: int, meta: dict[str, Any], where: str) -> dict[str, Any]:
        """Returns ``meta`` if its digest holds; raises ``ValueError`` (corrupt) or
        :class:`CheckpointKeyError` (a key setting to fix), both naming ``step``."""
        if meta.get("version") != META_VERSION:
            raise ValueError(f"checkpoint {step} has no stabljax meta (version {META_VERSION})")
        name = f"checkpoint {step} in {where!r}"
        if "key_id" in meta and self.key is None:
            raise CheckpointKeyError(
                f"{name} was sealed with a key: set {ENV_KEY} to the key it was written with"
            )
        if self.key is not None and "key_id" not in meta:
            raise CheckpointKeyError(
                f"{name} carries no keyed digest but {ENV_KEY} is set: it was written without "
                "the key, or its meta was replaced. Unset the key to read it as unkeyed, or "
                "use a new directory"
            )
        if self.key is not None and meta["key_id"] != self.key_id():
            raise CheckpointKeyError(
                f"{name} was sealed with another key than the one in {ENV_KEY} (key id "
                f"{meta['key_id']!r}, this key's is {self.key_id()!r}): set the right key"
            )
        expected = meta_digest(meta, self.key if "key_id" in meta else None)
        if (self.key is not None or "digest" in meta) and not (
            isinstance(meta.get("digest"), str) and hmac.compare_digest(meta["digest"], expected)
        ):
            raise ValueError(
                f"checkpoint {step}: meta digest mismatch (its meta item was edited or corrupted)"
            )
        return meta

    def check_state(self, step: int, meta: Mapping[str, Any], state: Any) -> None:
        """Raises ``ValueError`` naming the leaf if ``state`` is not what was saved."""
        if meta.get("fingerprint") is not None:
            got = [int(v) for v in to_host(fingerprint(state))]
            if got != meta["fingerprint"]:
                raise ValueError(f"checkpoint {step}: state fingerprint mismatch (corrupted data)")
        saved = meta.get("digests")
        if saved is None:
            return
        got = leaf_digests(state, self.key if "key_id" in meta else None)
        listed = isinstance(saved, list) and all(
            isinstance(d, list) and len(d) == 2 and all(isinstance(v, str) for v in d)
            for d in saved
        )
        if not listed or [d[0] for d in saved] != [p for p, _ in got]:
            raise ValueError(f"checkpoint {step}: its leaf digests do not list the state's leaves")
        pairs = zip(got, saved, strict=True)
        bad = [p for (p, d), (_, e) in pairs if not hmac.compare_digest(d, e)]
        if bad:
            more = f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""
            raise ValueError(
                f"checkpoint {step}: digest mismatch in leaf {bad[0]}{more}: its values are not "
                "the ones saved"
            )
