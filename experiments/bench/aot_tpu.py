"""XLA:TPU compiled cost without a TPU: ahead-of-time compiles for a TPU topology.

``jax.experimental.topologies.get_topology_desc(topology, platform="tpu")`` gives TPU
devices that ``jax.jit(f).lower(*abstract_args).compile()`` compiles for, on any host
with libtpu installed (``pip install -e ".[tpu]"``); nothing runs. The compiler's own
figures are reported: bytes accessed and flops (cost analysis) and the per-device
argument, output, alias and temp sizes (memory analysis). No wall time: none is
measured, and the cost model's ``optimal_seconds`` is not trustworthy (REFERENCES.md).
This is how MaxText's ``train_compile.py`` checks TPU memory ahead of time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.bench.timing import compiled_cost

HBM_BYTES = {"v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30}


def available() -> bool:
    """Whether libtpu is importable, so that TPU topologies can be compiled for."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def topology_devices(topology: str) -> list[Any]:
    """The TPU devices of ``topology`` (e.g. ``"v5e:2x2"``), for AOT compiles only."""
    if not available():
        raise RuntimeError(
            "--aot-tpu needs libtpu: pip install -e '.[tpu]' (it brings jax[tpu] for the "
            "installed jax version; no TPU is needed)."
        )
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def hbm_bytes(topology: str) -> int | None:
    """HBM of one chip of ``topology`` in bytes, when known."""
    return HBM_BYTES.get(topology.split(":")[0].lower())


def report(compiled: Any) -> dict[str, float]:
    """Cost and per-device memory of a compiled TPU program."""
    ma = compiled.memory_analysis()
    mem = {
        "argument": float(ma.argument_size_in_bytes),
        "output": float(ma.output_size_in_bytes),
        "alias": float(ma.alias_size_in_bytes),
        "temp": float(ma.temp_size_in_bytes),
        "code": float(ma.generated_code_size_in_bytes),
    }
    # Live at once on a device: the inputs, the outputs not written in place, the scratch.
    mem["peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["code"]
    return {**compiled_cost(compiled), **mem}


def abstract(tree: Any, sharding: Callable[[jax.ShapeDtypeStruct], NamedSharding]) -> Any:
    """``ShapeDtypeStruct``s of ``tree`` (arrays or abstract values), each with a sharding."""

    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x))

    return jax.tree.map(one, tree)


def train_state_args(opt: optax.GradientTransformation) -> Callable[..., tuple[Any, Any]]:
    """``args(params, rule, batch) -> (state, batch)``: the abstract ``stabljax.TrainState``
    of ``opt`` on ``params`` (its optimizer state sharded by ``rule``), for a jitted
    ``make_train_step`` step, and the batch."""
    import stabljax

    def args(params, rule, batch):
        mesh = batch["inputs"].sharding.mesh
        state = stabljax.TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
            params=params,
            opt_state=abstract(jax.eval_shape(opt.init, params), rule),
            loss_scale_state=None,
        )
        return state, batch

    return args


def fsdp_rule(mesh: Mesh, axis: str, min_size: int = 1) -> Callable[[Any], NamedSharding]:
    """Shards each leaf along its largest axis that the mesh axis divides; replicates the rest.

    ``min_size`` keeps leaves with fewer elements replicated (norm scales, biases).
    """
    n = mesh.shape[axis]

    def rule(x):
        dims = [d for d in np.argsort(x.shape)[::-1] if x.shape[d] % n == 0 and x.shape[d] >= n]
        if not dims or math.prod(x.shape) < min_size:
            return NamedSharding(mesh, P())
        spec = [None] * len(x.shape)
        spec[int(dims[0])] = axis
        return NamedSharding(mesh, P(*spec))

    return rule


def optimizer_update_costs(
    topology: str,
    optimizers: dict[str, optax.GradientTransformation],
    *,
    n_params: int,
    n_leaves: int,
    chips: tuple[int, ...] = (1, 4),
) -> dict[int, dict[str, dict[str, float]]]:
    """Compiled cost of ``params, state = update(params, state, grads, loss)`` per optimizer.

    ``n_params`` float32 parameters in ``n_leaves`` vectors, state donated, on 1 chip and
    sharded over ``c`` chips for each ``c`` in ``chips`` (leaves and their moments split
    along their one axis; scalars replicated).
    """
    devices = topology_devices(topology)
    per = n_params // n_leaves
    out: dict[int, dict[str, dict[str, float]]] = {}
    for c in chips:
        if c > len(devices):
            raise ValueError(f"{topology} has {len(devices)} chips; cannot shard over {c}")
        mesh = Mesh(np.array(devices[:c]), ("d",))
        rule = fsdp_rule(mesh, "d", min_size=per)
        params = abstract(
            {f"w{i}": jax.ShapeDtypeStruct((per,), jnp.float32) for i in range(n_leaves)}, rule
        )
        loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, P()))
        out[c] = {}
        for name, opt in optimizers.items():
            opt = optax.with_extra_args_support(opt)
            state = abstract(jax.eval_shape(opt.init, params), rule)

            def update(p, s, g, ell, opt=opt):
                u, s = opt.update(g, s, p, value=ell)
                return optax.apply_updates(p, u), s

            compiled = jax.jit(update, donate_argnums=(0, 1)).lower(params, state, params, loss)
            out[c][name] = report(compiled.compile())
            out[c][name]["state_bytes"] = float(
                sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, state))) / c
            )
    return out


def where_guard(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """The five-line reference guard: ``ok = isfinite(global_norm(g))``, then two selects."""
    inner = optax.with_extra_args_support(inner)

    def update(g, s, p=None, **extra):
        ok = jnp.isfinite(optax.tree.norm(g))
        u, new = inner.update(g, s, p, **extra)
        u = jax.tree.map(lambda x: jnp.where(ok, x, jnp.zeros_like(x)), u)
        return u, jax.tree.map(lambda o, n: jnp.where(ok, n, o), s, new)

    return optax.GradientTransformationExtraArgs(inner.init, update)


@functools.cache
def abstract_model(d_model: int, n_layers: int, n_heads: int, vocab: int, seq_len: int):
    """The reference Transformer of one benchmark size, abstract (``nnx.eval_shape``)."""
    from flax import nnx

    from stabljax.reference.nn import TransformerConfig, TransformerLM

    cfg = TransformerConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        max_len=seq_len,
        dtype=jnp.bfloat16,  # activations; the step casts params to bf16 (Precision.bf16)
        remat=True,  # as MaxText trains at these sizes; without it 185M needs 18 GiB a chip
    )
    return nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))


def _model_shapes(d_model: int, n_layers: int, n_heads: int, vocab: int, seq_len: int):
    import stabljax

    return stabljax.nnx_apply(abstract_model(d_model, n_layers, n_heads, vocab, seq_len))


def train_step_costs(
    topology: str,
    steps: dict[str, Callable[[Any], tuple[Callable, Any]]],
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    vocab: int,
    seq_len: int,
    batch_size: int,
    parallelism: str,
) -> dict[str, Any]:
    """Compiled cost of one train step per entry of ``steps`` on all chips of ``topology``.

    ``steps[name](apply_fn) -> (jitted_step, abstract_args_fn)`` where
    ``abstract_args_fn(params, rule, batch)`` returns the step's abstract arguments.
    ``parallelism`` is ``"data"`` (params replicated, batch split) or ``"fsdp"``
    (params, moments and batch split over one axis).
    """
    devices = topology_devices(topology)
    mesh = Mesh(np.array(devices), ("data",))
    apply_fn, params = _model_shapes(d_model, n_layers, n_heads, vocab, seq_len)
    if parallelism == "data":
        rule = lambda x: NamedSharding(mesh, P())  # noqa: E731
    elif parallelism == "fsdp":
        rule = fsdp_rule(mesh, "data", min_size=4 * d_model)
    else:
        raise ValueError(f"parallelism must be 'data' or 'fsdp', got {parallelism!r}")
    params = abstract(params, rule)
    batch_sharding = NamedSharding(mesh, P("data"))
    batch = {
        k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=batch_sharding)
        for k in ("inputs", "targets")
    }
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    out: dict[str, Any] = {"n_params": n, "chips": len(devices), "per_step": {}}
    for name, make in steps.items():
        step, args_fn = make(apply_fn)
        compiled = step.lower(*args_fn(params, rule, batch)).compile()
        out["per_step"][name] = report(compiled)
    return out
