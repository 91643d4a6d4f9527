"""Measurements the experiments take of a model or an optimizer, beyond the train step's
metrics: Adam's normalized update (sign-like fraction, bimodality; :mod:`experiments.adam_eps`)
and where float16 overflows, op by op (:mod:`experiments.precision`).
"""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stabljax
from experiments import proxy
from experiments.trainer import FAST_COMPILE

#: Adam's eps per arm of :mod:`experiments.adam_eps`.
EPS = {"adamw_eps1e-8": 1e-8, "safe_adamw_eps0": 0.0, "adamw_atan2": 0.0}
#: |u| within this of 1 counts as a sign-like update.
SIGN_TOL = 0.1
_ROOT = str(pathlib.Path(__file__).resolve().parents[1]) + "/"


# --------------------------------------------------------------------------- Adam's update


def adam_moments(opt_state):
    """The first state in ``opt_state`` with ``count``, ``mu`` and ``nu`` (Adam's moments,
    whichever of optax's, safe_adamw's or adamw_atan2's), searched depth first."""
    if all(hasattr(opt_state, k) for k in ("count", "mu", "nu")):
        return opt_state
    children = (
        [opt_state.inner_state]
        if hasattr(opt_state, "inner_state")
        else list(opt_state)
        if isinstance(opt_state, tuple)
        else []
    )
    for c in children:
        found = adam_moments(c)
        if found is not None:
            return found
    return None


def normalized_update(m_hat, v_hat, arm: str):
    """The update before the learning rate, from the bias-corrected moments."""
    sv = jnp.sqrt(v_hat)
    if arm == "adamw_atan2":
        return 1.27 * jnp.arctan2(m_hat, sv)
    if EPS[arm] > 0:
        return m_hat / (sv + EPS[arm])
    return jnp.where(sv > 0, m_hat / jnp.where(sv > 0, sv, 1.0), 0.0)


def bimodality(u) -> jax.Array:
    """The bimodality coefficient (skew² + 1) / kurtosis of the values ``u`` (population
    moments; 1/3 for a Gaussian, 1 for two equal spikes, above 5/9 read as bimodal)."""
    u = jnp.ravel(u).astype(jnp.float32)
    d = u - jnp.mean(u)
    m2 = jnp.mean(d**2)
    skew = jnp.mean(d**3) / jnp.maximum(m2, 1e-38) ** 1.5
    kurt = jnp.mean(d**4) / jnp.maximum(m2, 1e-38) ** 2
    return jnp.where(m2 > 0, (skew**2 + 1) / jnp.maximum(kurt, 1e-38), 0.0)


def mechanism(mu, nu, count, arm: str, b1: float, b2: float, shallow=None) -> dict:
    """Molybog et al.'s quantities of one optimizer state (see the module docstring).
    ``shallow``: a pytree of bools like ``mu`` (which leaves count as shallow)."""
    c = jnp.asarray(count, jnp.float32)
    leaves_m, leaves_v = jax.tree.leaves(mu), jax.tree.leaves(nu)
    m = jnp.concatenate([x.ravel() for x in leaves_m]) / (1 - b1**c)
    v = jnp.concatenate([x.ravel() for x in leaves_v]) / (1 - b2**c)
    u = normalized_update(m, v, arm)
    sign = jnp.abs(jnp.abs(u) - 1.0) < SIGN_TOL
    sv = jnp.sqrt(v)
    out = {
        "sign_frac": jnp.mean(sign),
        "bimodality": bimodality(u),
        "eps_bound_frac": jnp.mean((sv > 0) & (sv < 1e-8)),
    }
    if shallow is not None:
        mask = jnp.concatenate(
            [jnp.full(x.size, f) for x, f in zip(leaves_m, jax.tree.leaves(shallow), strict=True)]
        )
        out["sign_frac_shallow"] = jnp.sum(sign & mask) / jnp.maximum(jnp.sum(mask), 1)
    return out


# --------------------------------------------------------------------------- float16 overflow


def _sub_jaxpr(eqn):
    """The closed jaxpr of a call-like eqn (jit, closed_call, remat), else None."""
    for key in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None and hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
            return sub
    return None


def _interpret(jaxpr, consts, vals, backward, stats_out, metas):
    """Binds ``jaxpr``'s ops one by one on ``vals`` (inlining jit calls) and appends, per
    floating output, its (max finite |x|, all finite) to ``stats_out`` and its description
    to ``metas``; returns the outputs."""
    from jax._src import source_info_util
    from jax.extend import core as jcore

    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, vals, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        bwd = backward or "transpose" in str(eqn.source_info.name_stack)
        sub = _sub_jaxpr(eqn)
        if sub is not None and eqn.primitive.name in ("pjit", "jit", "closed_call", "remat"):
            outs = _interpret(sub.jaxpr, sub.consts, ins, bwd, stats_out, metas)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for o in outs:
                if not jnp.issubdtype(o.dtype, jnp.floating):
                    continue
                a = jnp.abs(o.astype(jnp.float32))
                fin = jnp.isfinite(a)
                stats_out.append((jnp.max(jnp.where(fin, a, 0.0), initial=0.0), jnp.all(fin)))
                metas.append(
                    {
                        "primitive": eqn.primitive.name,
                        "phase": "backward" if bwd else "forward",
                        "dtype": str(o.dtype),
                        "source": source_info_util.summarize(eqn.source_info)
                        .split("site-packages/")[-1]
                        .replace(_ROOT, ""),
                    }
                )
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def value_tracer(fn):
    """``trace(*args) -> records``: evaluates ``fn(*args)`` op by op (its jaxpr, inlined
    into one jitted program, compiled once per argument shape, that also returns every
    op's statistics) and returns one record per floating output of every op, in execution
    order: ``primitive``, ``phase`` (``"backward"`` where the op belongs to a transpose,
    i.e. a VJP; else ``"forward"``), ``dtype``, ``max_abs`` (over the finite entries; 0 if
    none), ``finite`` (all entries) and ``source`` (file:line of the code that made it)."""
    metas: list[dict] = []

    def program(*args):
        closed = jax.make_jaxpr(fn)(*args)
        stats_out: list = []
        metas.clear()
        _interpret(closed.jaxpr, closed.consts, jax.tree.leaves(args), False, stats_out, metas)
        return stats_out

    compiled = jax.jit(program, compiler_options=FAST_COMPILE)

    def trace(*args) -> list[dict]:
        values = jax.device_get(compiled(*args))
        return [
            {**m, "max_abs": float(mx), "finite": bool(ok)}
            for m, (mx, ok) in zip(metas, values, strict=True)
        ]

    return trace


def trace_values(fn, *args) -> list[dict]:
    """:func:`value_tracer` of ``fn``, called once on ``args``."""
    return value_tracer(fn)(*args)


def locate(records: list[dict], dtype: str = "float16") -> dict:
    """What :func:`trace_values`' records say about ``dtype``'s range: the largest finite
    value of the forward and of the backward pass (and the op that made it), the number of
    ops with a non-finite output in each, and the first op whose ``dtype`` output is
    non-finite (float32 values such as the attention mask's -inf are not overflow)."""
    out: dict = {}
    for phase in ("forward", "backward"):
        rr = [r for r in records if r["phase"] == phase and r["dtype"] == dtype]
        top = max(rr, key=lambda r: r["max_abs"], default=None)
        out[f"{phase}_max_abs"] = top["max_abs"] if top else 0.0
        out[f"{phase}_max_abs_op"] = f"{top['primitive']} @ {top['source']}" if top else ""
        out[f"{phase}_nonfinite_ops"] = sum(not r["finite"] for r in rr)
    first = next((r for r in records if not r["finite"] and r["dtype"] == dtype), None)
    out["first_nonfinite"] = (
        None
        if first is None
        else {k: first[k] for k in ("phase", "primitive", "dtype", "source", "max_abs")}
    )
    return out


class Diagnoser:
    """One float16 forward and backward pass of a batch (float32 master weights cast to
    float16 inside the differentiated function, as the train step does), the loss
    multiplied by a loss scale, op by op (:func:`value_tracer`; compiled once)."""

    def __init__(self, s16: proxy.Setup):
        model = proxy.build_model(s16)[0]
        apply_fn = stabljax.nnx_apply(model)[0]
        prec = proxy.precision_of("fp16-noscale")

        def loss16(p16, inputs, targets):
            logits = apply_fn(p16, inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        def grad32(p32, inputs, targets, scale):
            return jax.grad(lambda p: loss16(prec.cast_to_compute(p), inputs, targets) * scale)(p32)

        self._trace = value_tracer(grad32)
        self._grad16 = jax.jit(
            lambda p16, i, t, sc: jax.value_and_grad(lambda p: loss16(p, i, t) * sc)(p16),
            compiler_options=FAST_COMPILE,
        )
        self._prec = prec

    def __call__(self, params, batch: dict, scale: float) -> dict:
        """:func:`locate` of the pass, the scaled loss and the largest float16 gradient
        per top-level layer (``embed``, ``blocks/0``, ...)."""
        inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
        sc = jnp.float32(scale)
        out = locate(self._trace(params, inputs, targets, sc))
        loss, g16 = self._grad16(self._prec.cast_to_compute(params), inputs, targets, sc)
        per_layer: dict[str, float] = {}
        for path, g in jax.tree_util.tree_leaves_with_path(g16):
            keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
            name = "/".join(keys[:2]) if keys[0] == "blocks" else keys[0]
            a = np.asarray(g, np.float32)
            v = float(np.max(np.abs(a))) if np.all(np.isfinite(a)) else math.inf
            per_layer[name] = max(per_layer.get(name, 0.0), v)
        out["loss_scale"] = float(scale)
        out["scaled_loss"] = float(loss)
        out["grad16_max_abs_per_layer"] = per_layer
        return out
