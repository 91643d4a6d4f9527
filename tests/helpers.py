"""Shared test helpers: host copies and bitwise comparison of pytrees, reference problems,
sharding, and pytree builders. (The controller's toy problem is in toy.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def host(tree):
    """A numpy copy of ``tree``, safe from donation; typed PRNG keys as their key data."""
    return jax.tree.map(lambda x: np.array(_raw(x)), tree)


def _raw(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def assert_bitwise_equal(a, b):
    """Same structure, dtypes, shapes and bytes in every leaf (NaN == NaN, 0.0 != -0.0).

    Typed PRNG keys compare by their key data.
    """
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, (ta, tb)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(_raw(x)), np.asarray(_raw(y))
        assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, x.shape, y.dtype, y.shape)
        assert x.tobytes() == y.tobytes(), (x, y)


class CountedReads:
    """A device scalar stand-in whose host reads are counted (``reads``)."""

    shape = ()

    def __init__(self, value):
        self.value, self.reads = value, 0

    def __array__(self, dtype=None, copy=None):
        self.reads += 1
        return np.asarray(self.value, dtype)

    def __float__(self):
        self.reads += 1
        return float(self.value)

    def block_until_ready(self):
        self.reads += 1
        return self


def mesh8(axis: str = "data") -> Mesh:
    """A 1-D mesh over the 8 virtual CPU devices the root conftest.py provides."""
    devices = np.array(jax.devices()[:8])
    assert devices.size == 8, "tests need 8 devices; see conftest.py"
    return Mesh(devices, (axis,))


def shard_leading(tree, mesh: Mesh, axis: str = "data"):
    """Shards every leaf whose leading dim divides the mesh size along it; replicates the rest."""
    n = mesh.devices.size

    def put(x):
        if x is None:
            return None
        x = jnp.asarray(x)
        if x.ndim >= 1 and x.shape[0] % n == 0:
            spec = PartitionSpec(axis, *([None] * (x.ndim - 1)))
        else:
            spec = PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, tree, is_leaf=lambda x: x is None)


def nested_params(dtype=jnp.float32, seed: int = 0):
    """A nested pytree with dicts, a list, a tuple and a None leaf."""
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "dense": {"w": jax.random.normal(k[0], (16, 8), dtype), "b": jnp.zeros((8,), dtype)},
        "blocks": [jax.random.normal(k[1], (8,), dtype), jax.random.normal(k[2], (8, 4), dtype)],
        "pair": (jax.random.normal(k[3], (4,), dtype), None),
    }


def random_grads_like(params, seed: int, scale: float = 1.0):
    """Random gradients with the structure and dtypes of ``params`` (None kept)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), max(len(leaves), 1))
    out = [
        scale * jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
        for k, x in zip(keys[: len(leaves)], leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


# The two targets optax's alias tests use (optax/_src/alias_test.py).
def parabola_problem():
    """Returns (initial params, loss fn, optimum): a 2-D quadratic bowl."""
    initial = jnp.array([-1.0, 10.0, 1.0])
    final = jnp.array([1.0, -1.0, 1.0])

    def loss(params):
        return jnp.sum(jnp.square(params - final))

    return initial, loss, final


def rosenbrock_problem():
    """Returns (initial params, loss fn, optimum) for Rosenbrock with a=1, b=100."""
    a, b = 1.0, 100.0
    initial = jnp.array([0.0, 0.0])
    final = jnp.array([a, a**2])

    def loss(params):
        x, y = params[0], params[1]
        return jnp.square(a - x) + b * jnp.square(y - x**2)

    return initial, loss, final


def run_optimizer(
    opt: optax.GradientTransformation, params, loss_fn, steps: int, *, pass_loss=False
):
    """Runs ``steps`` jitted updates of ``opt`` on ``loss_fn``; returns final params."""

    @jax.jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss_fn)(params)
        if pass_loss:
            updates, state = opt.update(grads, state, params, value=value)
        else:
            updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params
