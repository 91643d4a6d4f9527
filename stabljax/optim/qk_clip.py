"""QK-Clip (MuonClip's attention-logit control) as an Optax transformation.

:func:`qk_clip` rescales the query and key projections of every attention head whose
max pre-softmax logit passed a threshold, as Kimi K2 does after each Muon step. The
heads are declared once, per layer, with :class:`QKLayer` and :class:`QKHeads` (which
parameter leaf, which axis, where the heads lie along it); the step's per-head max
logits arrive as the ``max_logits=`` extra argument of ``update``. Multi-head latent
attention (MLA) is declared with ``QKLayer(q_rope=...)`` (Kimi K2's per-component rule);
inside ``optax.MultiSteps`` wrap it in :func:`max_logits_over_micro_batches`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from stabljax.base import path_str, validate

__all__ = (
    "QKClipState",
    "QKHeads",
    "QKLayer",
    "check_layers",
    "layer_logits",
    "max_logits_over_micro_batches",
    "qk_clip",
    "qk_clip_scales",
    "qk_logit_proxy",
)

_OWNER = "qk_clip"


class QKHeads(NamedTuple):
    """Where the heads of one projection lie in one parameter leaf.

    Along ``axis`` of the leaf at ``path``, head ``h`` owns the ``head_width`` entries
    starting at ``offset + h * head_stride``; every other entry is untouched (the v block
    of a fused qkv kernel, or the rotary part of an MLA head declared by another entry).

    Attributes:
      path: the leaf's key path joined with ``/`` (:func:`stabljax.telemetry.path_str`),
        e.g. ``"blocks/0/attn/qkv/kernel"``.
      n_heads: heads of this projection (query heads for ``q``, KV heads for ``k``).
      axis: the axis that holds the heads (negative counts from the end).
      offset: where the first head starts along ``axis`` (a fused kernel's k block).
      head_width: entries per head along ``axis``: the head dim for a ``[d, H·d_h]``
        kernel, 1 for a ``[d, H, d_h]`` kernel with ``axis=-2``. ``None``: the rest of
        the axis after ``offset`` divided evenly by ``n_heads``.
      head_stride: entries from one head's start to the next's (>= ``head_width``);
        ``None``: ``head_width`` (heads back to back). An MLA up-projection that emits
        ``[n_heads, d_nope + d_rope]`` per head has stride ``d_nope + d_rope``: its
        content part is ``offset=0, head_width=d_nope`` and its rotary part
        ``offset=d_nope, head_width=d_rope``.
    """

    path: str
    n_heads: int
    axis: int = -1
    offset: int = 0
    head_width: int | None = None
    head_stride: int | None = None


class QKLayer(NamedTuple):
    r"""The query and key projections of one attention layer.

    Attributes:
      q: the query heads: one :class:`QKHeads`, or several that share the heads (a
        kernel and its bias).
      k: the key heads, the same way. With fewer key than query heads (GQA, MQA) query
        head ``h`` reads key head ``h // (n_q / n_kv)``, the layout of
        ``jnp.repeat(k, n_q // n_kv, axis=heads)``.
      head_dim: :math:`d_h`, for the telemetry proxy :math:`\|W_q^h\|\|W_k^h\|/\sqrt{d_h}`
        only; ``None``: the ``head_width`` of the first ``q`` entry.
      q_rope: MLA only: the head-specific rotary query :math:`q^R` (one entry per query
        head, ``n_heads`` as ``q``), scaled by :math:`\gamma_h`; ``q`` and ``k`` are then
        the head-specific content parts :math:`q^C, k^C`. The rotary key :math:`k^R` is
        shared by all heads and is not declared: it is never rescaled. ``None``: no
        rotary part of its own (MHA, GQA, MQA).
    """

    q: QKHeads | Sequence[QKHeads]
    k: QKHeads | Sequence[QKHeads]
    head_dim: int | None = None
    q_rope: QKHeads | Sequence[QKHeads] | None = None


class QKClipState(NamedTuple):
    """State of :func:`qk_clip`."""

    qk_clipped_heads: jax.Array  # shape=(), int32: query heads clipped on the last update


def _as_tuple(owner: str, arg: str, spec: Any) -> tuple[QKHeads, ...]:
    specs = (spec,) if isinstance(spec, QKHeads) else tuple(spec) if spec is not None else ()
    if not specs or not all(isinstance(s, QKHeads) for s in specs):
        raise ValueError(
            f"{owner}: `{arg}` must be a QKHeads or a non-empty sequence of them; got {spec!r}."
        )
    for s in specs:
        if not (isinstance(s.path, str) and s.path):
            raise ValueError(f"{owner}: `{arg}.path` must be a non-empty str; got {s!r}.")
        for field in ("n_heads", "axis", "offset"):
            v = getattr(s, field)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{owner}: `{arg}.{field}` must be an int; got {s!r}.")
        if s.n_heads < 1:
            raise ValueError(f"{owner}: `{arg}.n_heads` must be >= 1; got {s!r}.")
        if s.offset < 0:
            raise ValueError(f"{owner}: `{arg}.offset` must be >= 0; got {s!r}.")
        w = s.head_width
        if w is not None and not (isinstance(w, int) and not isinstance(w, bool) and w >= 1):
            raise ValueError(f"{owner}: `{arg}.head_width` must be None or an int >= 1; got {s!r}.")
        st = s.head_stride
        if st is not None and not (
            isinstance(st, int) and not isinstance(st, bool) and w is not None and st >= w
        ):
            raise ValueError(
                f"{owner}: `{arg}.head_stride` must be None, or an int >= head_width with "
                f"head_width given; got {s!r}."
            )
    if len({s.n_heads for s in specs}) != 1:
        raise ValueError(f"{owner}: every `{arg}` entry must have the same n_heads: {specs}")
    return specs


Specs = tuple[QKHeads, ...]


def check_layers(
    layers: Any, *, owner: str = _OWNER, arg: str = "layers"
) -> dict[Hashable, tuple[Specs, Specs, Specs]]:
    """``{layer: (q specs, k specs, q_rope specs)}`` of a :func:`qk_clip` ``layers`` map
    (``q_rope`` empty when not declared), or a ValueError that names the argument
    (``owner``: who asks, ``arg``: the argument's name)."""
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError(
            f"{owner}: `{arg}` must be a non-empty mapping {{layer: QKLayer}}; got {layers!r}."
        )
    out = {}
    for name, layer in layers.items():
        where = f"{arg}[{name!r}]"
        if not isinstance(layer, QKLayer):
            raise ValueError(f"{owner}: `{where}` must be a QKLayer(q=..., k=...); got {layer!r}.")
        q = _as_tuple(owner, f"{where}.q", layer.q)
        k = _as_tuple(owner, f"{where}.k", layer.k)
        n_q, n_kv = q[0].n_heads, k[0].n_heads
        if n_q % n_kv:
            raise ValueError(
                f"{owner}: `{where}`: the {n_kv} key heads must divide the {n_q} query heads "
                "(GQA groups)."
            )
        hd = layer.head_dim
        if hd is not None and not (isinstance(hd, int) and not isinstance(hd, bool) and hd >= 1):
            raise ValueError(
                f"{owner}: `{where}.head_dim` must be None or an int >= 1; got {hd!r}."
            )
        r = () if layer.q_rope is None else _as_tuple(owner, f"{where}.q_rope", layer.q_rope)
        if r and r[0].n_heads != n_q:
            raise ValueError(
                f"{owner}: `{where}.q_rope` must have the {n_q} query heads of `q`; "
                f"got n_heads={r[0].n_heads}."
            )
        out[name] = (q, k, r)
    return out


def _leaves_by_path(tree: Any) -> tuple[dict[str, int], list[Any], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    index = {path_str(p): i for i, (p, _) in enumerate(flat)}
    return index, [x for _, x in flat], treedef


def _span(spec: QKHeads, shape: tuple[int, ...], where: str) -> tuple[int, int, int]:
    """(axis, head width, head stride) of ``spec`` in a leaf of ``shape``; ValueError if it
    does not fit."""
    if not -len(shape) <= spec.axis < len(shape):
        raise ValueError(f"{_OWNER}: {where}: axis {spec.axis} is out of range for {shape}.")
    axis = spec.axis % len(shape)
    size = shape[axis]
    width = spec.head_width
    if width is None:
        rest = size - spec.offset
        if rest <= 0 or rest % spec.n_heads:
            raise ValueError(
                f"{_OWNER}: {where}: {size - spec.offset} entries after offset {spec.offset} on "
                f"axis {axis} do not split into {spec.n_heads} heads; give head_width."
            )
        width = rest // spec.n_heads
    stride = spec.head_stride or width
    if spec.offset + (spec.n_heads - 1) * stride + width > size:
        raise ValueError(
            f"{_OWNER}: {where}: {spec.n_heads} heads of width {width} (stride {stride}) from "
            f"offset {spec.offset} do not fit in axis {axis} of size {size} (shape {shape})."
        )
    return axis, width, stride


def _head_index(spec: QKHeads, shape: tuple[int, ...]) -> tuple[int, jax.Array]:
    """(axis, int32 ``[n_heads, width]`` positions along it of each head's entries)."""
    axis, width, stride = _span(spec, shape, spec.path)
    starts = spec.offset + stride * jnp.arange(spec.n_heads)
    return axis, starts[:, None] + jnp.arange(width)[None, :]


def _check_params(layers, params: Any) -> None:
    index, leaves, _ = _leaves_by_path(params)
    for name, (q, k, r) in layers.items():
        for role, specs in (("q", q), ("k", k), ("q_rope", r)):
            for s in specs:
                where = f"layers[{name!r}].{role}"
                if s.path not in index:
                    raise ValueError(
                        f"{_OWNER}: {where}.path {s.path!r} is not a parameter path; "
                        f"the paths are {sorted(index)}."
                    )
                _span(s, jnp.shape(leaves[index[s.path]]), where)


def _head_gammas(s: jax.Array, tau: jax.Array, n_kv: int) -> tuple[jax.Array, jax.Array]:
    """γ per query head and per key head (the min over its group), both float32."""
    s = jnp.asarray(s, jnp.float32)
    # A non-finite max logit leaves its head alone: a guard decides about such steps.
    clip = jnp.logical_and(jnp.isfinite(s), s > tau)
    gamma = jnp.where(clip, tau / jnp.where(clip, s, 1.0), 1.0)
    gamma_kv = jnp.min(gamma.reshape(n_kv, -1), axis=1)
    return gamma, gamma_kv


def _scale_vector(spec: QKHeads, shape: tuple[int, ...], factors: jax.Array) -> jax.Array:
    """A per-entry factor broadcastable to ``shape``: ``factors[h]`` on head h, 1 elsewhere."""
    axis, idx = _head_index(spec, shape)
    vec = jnp.ones((shape[axis],), jnp.float32)
    vec = vec.at[idx.ravel()].set(jnp.repeat(factors, idx.shape[1]))
    return vec.reshape([-1 if a == axis else 1 for a in range(len(shape))])


def _head_sq_norms(spec: QKHeads, leaf: jax.Array) -> jax.Array:
    """float32 ``[n_heads]``: the squared norm of each head's slice of ``leaf``."""
    axis, idx = _head_index(spec, jnp.shape(leaf))
    x = jnp.take(jnp.moveaxis(jnp.asarray(leaf), axis, -1), idx, axis=-1)
    x = x.reshape(-1, *idx.shape).astype(jnp.float32)
    return jnp.sum(jnp.square(x), axis=(0, 2))


def qk_logit_proxy(layers: Mapping[Hashable, QKLayer], params: Any) -> dict[str, jax.Array]:
    r"""Per layer, :math:`\max_h \|W_q^h\|_F \|W_k^{g(h)}\|_F / \sqrt{d_h}` (float32).

    A bound on the attention logit per unit input norm
    (:math:`|x W_q^h \cdot y W_k^h| \le \|x\|\|y\|\,\|W_q^h\|\|W_k^h\|`), the proxy
    Megatron-LM and Levanter log when the logits themselves are not at hand. Every
    entry of a ``q``/``k`` (a kernel and its bias) counts in its head's norm; for MLA
    the content parts only (the shared rotary key is not declared).

    Returns:
      ``{str(layer): scalar}``.
    """
    specs = check_layers(layers)
    index, leaves, _ = _leaves_by_path(params)
    out = {}
    for name, (q, k, _) in specs.items():
        nq = sum(_head_sq_norms(s, leaves[index[s.path]]) for s in q)
        nk = sum(_head_sq_norms(s, leaves[index[s.path]]) for s in k)
        nk = jnp.repeat(nk, q[0].n_heads // k[0].n_heads)
        d_h = layers[name].head_dim or _span(q[0], jnp.shape(leaves[index[q[0].path]]), "")[1]
        out[str(name)] = jnp.max(jnp.sqrt(nq * nk)) / math.sqrt(d_h)
    return out


def layer_logits(max_logits: Any, name: Hashable, owner: str = _OWNER) -> jax.Array:
    """``max_logits[name]``, or a ValueError naming the layer when it has no such entry
    (a ``[n_layers, n_heads]`` array is checked too: indexing would clamp, not fail)."""
    if isinstance(max_logits, Mapping):
        ok = name in max_logits
    else:  # an array or a list indexed by the layer number
        n = (jnp.shape(max_logits) or (0,))[0] if hasattr(max_logits, "shape") else None
        n = len(max_logits) if n is None and isinstance(max_logits, Sequence) else n
        ok = n is not None and isinstance(name, int) and not isinstance(name, bool)
        ok = ok and 0 <= name < n
    if not ok:
        raise ValueError(
            f"{owner}: `max_logits` has no entry for layer {name!r} (declared in `layers`); "
            "it must map every layer key to that layer's [n_q_heads] max logits."
        )
    return jnp.asarray(max_logits[name])


def qk_clip_scales(
    layers: Mapping[Hashable, QKLayer],
    params: Any,
    max_logits: Any,
    *,
    tau: jax.typing.ArrayLike = 100.0,
    alpha: float = 0.5,
) -> tuple[dict[str, jax.Array], jax.Array]:
    """The multiplicative factor of every touched leaf, and the number of clipped heads.

    The pure core of :func:`qk_clip` (see it for the algorithm): ``{path: factor}``
    with each factor float32 and broadcastable to its leaf (1 on entries of no head).
    """
    specs = check_layers(layers)
    index, leaves, _ = _leaves_by_path(params)
    tau = jnp.asarray(tau, jnp.float32)
    scales: dict[str, jax.Array] = {}
    clipped = jnp.zeros([], jnp.int32)
    for name, (q, k, r) in specs.items():
        s = layer_logits(max_logits, name, _OWNER)
        if s.shape != (q[0].n_heads,):
            raise ValueError(
                f"{_OWNER}: `max_logits[{name!r}]` must have shape ({q[0].n_heads},) (one max "
                f"logit per query head); got {s.shape}."
            )
        gamma, gamma_kv = _head_gammas(s, tau, k[0].n_heads)
        clipped = clipped + jnp.sum(gamma < 1.0).astype(jnp.int32)
        parts = ((q, gamma**alpha), (k, gamma_kv ** (1.0 - alpha)), (r, gamma))
        for specs_, factors in parts:
            for spec in specs_:
                shape = jnp.shape(leaves[index[spec.path]])
                vec = _scale_vector(spec, shape, factors)
                scales[spec.path] = scales[spec.path] * vec if spec.path in scales else vec
    return scales, clipped


def qk_clip(
    layers: Mapping[Hashable, QKLayer],
    *,
    tau: jax.typing.ArrayLike = 100.0,
    alpha: float = 0.5,
) -> optax.GradientTransformationExtraArgs:
    r"""Rescales W_q and W_k of every attention head whose max logit exceeds ``tau``.

    QK-Clip, the attention-logit control of MuonClip (Kimi K2). For each declared layer
    and query head :math:`h`, with :math:`S_h = \max_{i,j} q_i^h \cdot k_j^h / \sqrt{d_h}`
    the head's max pre-softmax logit on this step's batch (passed as ``max_logits``):

    .. math::

      \gamma_h = \min(1, \tau / S_h), \qquad
      W_q^h \leftarrow \gamma_h^{\alpha} W_q^h, \qquad
      W_k^{g} \leftarrow \bigl(\min_{h \in g} \gamma_h\bigr)^{1-\alpha} W_k^{g}.

    With one key head per query head (multi-head attention) the group :math:`g` is the
    head itself and this is Kimi K2's rule: every logit of head :math:`h` is multiplied by
    exactly :math:`\gamma_h`, so at the weights :math:`S_h` was measured at the head's
    max logit becomes :math:`\min(S_h, \tau)`. With grouped key heads (GQA, MQA; query
    head :math:`h` reads key head :math:`g = \lfloor h / (n_q/n_{kv}) \rfloor`) the
    shared key head is scaled by the smallest :math:`\gamma` of its group (the max logit
    over the group) and each query head by its own :math:`\gamma_h`, so a head's logits
    are multiplied by :math:`\gamma_h^{\alpha}\gamma_g^{1-\alpha} \le \gamma_h`: every
    head of the group ends at or below :math:`\tau`, and a query head that did not pass
    :math:`\tau` is not rescaled itself (Kimi K2 defines the rule per head for MLA, which
    has no shared keys; Megatron-LM's and MaxText's implementations are MLA-only too).
    A head with a non-finite :math:`S_h` is left alone (a guard decides about that step).

    Multi-head latent attention (MLA, Kimi K2's attention): a head's logit is
    :math:`q^C_h \cdot k^C_h + q^R_h \cdot k^R`, with head-specific content parts
    :math:`q^C, k^C`, a head-specific rotary query :math:`q^R` and a rotary key
    :math:`k^R` that every head shares. Declared with ``QKLayer(q=q^C, k=k^C,
    q_rope=q^R)``, the rule is Kimi K2's: :math:`W_{q^C}^h \leftarrow \gamma_h^{\alpha}
    W_{q^C}^h`, :math:`W_{k^C}^h \leftarrow \gamma_h^{1-\alpha} W_{k^C}^h` (both
    :math:`\sqrt{\gamma_h}` at :math:`\alpha = 1/2`), :math:`W_{q^R}^h \leftarrow
    \gamma_h W_{q^R}^h`, and :math:`k^R` untouched (scaling it would rescale every head's
    logits, not only the clipped ones'). Both terms, and so the logit, scale by
    :math:`\gamma_h`.

    Micro-batches: inside ``optax.MultiSteps`` the inner update runs on every
    micro-batch but only the last one's state and update count, so a bare ``qk_clip``
    there clips with the *last* micro-batch's ``max_logits`` and ignores the others.
    Wrap the ``MultiSteps`` in :func:`max_logits_over_micro_batches`, which passes the
    max over all micro-batches of the accumulation.

    The rescaling is written as an update, so it composes with any optimizer placed
    before it in ``optax.chain``: with :math:`p` the params and :math:`u` the incoming
    update, a scaled leaf gets :math:`u' = u + (p + u)(c - 1)`, i.e.
    :math:`p + u' = c\,(p + u)` with :math:`c` the per-entry factor (exactly :math:`u`
    where :math:`c = 1`).

    What it guarantees: the logits are scaled by :math:`\gamma` *at the weights*
    :math:`S` *was measured at*. The train step (and Kimi K2) measure :math:`S` in the
    forward pass, at :math:`p`, and clip :math:`p + u`; after the step a clipped head's
    max logit on the same batch is :math:`\gamma_h S'_h`, where :math:`S'_h` is its max
    logit at :math:`p + u`: :math:`\tau` up to one update's change of the logits, not a
    bound. Passing logits measured at :math:`p + u` (a second forward) makes it exact.

    Placement: last in the chain, and *inside* any skip guard, e.g.
    ``skip_nonfinite(optax.chain(optax.contrib.muon(lr), qk_clip(layers)))``: a
    skipped step then returns exact zeros and keeps this state, so nothing is clipped
    on it. Placed after (outside) a guard it would still rescale on a skipped step,
    because a transform cannot see its sibling's decision in ``optax.chain``.

    Args:
      layers: ``{layer: QKLayer(q=QKHeads(...), k=QKHeads(...))}``; the keys index
        ``max_logits`` (ints for a ``[n_layers, n_heads]`` array, or any keys of a dict).
        :meth:`stabljax.reference.TransformerLM.qk_layers` gives it for the reference model.
      tau: the threshold :math:`\tau` > 0 (Kimi K2: 100).
      alpha: the share :math:`\alpha \in [0, 1]` of the rescaling that goes to
        :math:`W_q` (Kimi K2: 0.5).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` whose ``update`` is
      ``update(updates, state, params, *, max_logits, **extra_args)``; ``max_logits``
      maps each layer key to a float ``[n_q_heads]`` array; ``params`` are required. Its
      state is a :class:`QKClipState`.

    Raises:
      ValueError: at construction for an invalid ``layers``, ``tau`` or ``alpha``; in
        ``init`` when a declared path or span does not fit the parameters; in
        ``update`` without ``params`` or ``max_logits``, or for a wrong shape.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from stabljax.optim.qk_clip import QKHeads, QKLayer, qk_clip
      >>> params = {"wq": jnp.ones((4, 2 * 2)), "wk": jnp.ones((4, 2 * 2))}  # 2 heads of dim 2
      >>> layers = {0: QKLayer(q=QKHeads("wq", n_heads=2), k=QKHeads("wk", n_heads=2))}
      >>> opt = optax.chain(optax.sgd(0.0), qk_clip(layers, tau=10.0))
      >>> state = opt.init(params)
      >>> max_logits = {0: jnp.array([40.0, 5.0])}  # head 0 is 4x over tau
      >>> updates, state = jax.jit(opt.update)(
      ...     optax.tree.zeros_like(params), state, params, max_logits=max_logits)
      >>> print(optax.apply_updates(params, updates)["wq"][0])  # head 0 scaled by (1/4)^0.5
      [0.5 0.5 1.  1. ]
      >>> print(int(state[1].qk_clipped_heads))
      1

    References:
      Kimi Team, `Kimi K2: Open Agentic Intelligence
      <https://arxiv.org/abs/2507.20534>`_, 2025 (Section 2.1, Algorithm 1)
    """
    specs = check_layers(layers)
    validate(
        _OWNER, "tau", tau, lambda v: (v.ndim == 0) & (v > 0) & (v < math.inf), "finite and > 0"
    )
    validate(_OWNER, "alpha", alpha, lambda v: (v.ndim == 0) & (v >= 0) & (v <= 1), "in [0, 1]")

    def init_fn(params: optax.Params) -> QKClipState:
        _check_params(specs, params)
        return QKClipState(qk_clipped_heads=jnp.zeros([], jnp.int32))

    def update_fn(
        updates: optax.Updates,
        state: QKClipState,
        params: optax.Params | None = None,
        *,
        max_logits: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, QKClipState]:
        del extra_args
        if params is None:
            raise ValueError(f"{_OWNER}: update needs `params` (it rescales p + u).")
        if max_logits is None:
            raise ValueError(
                f"{_OWNER}: update needs `max_logits=` (per layer, the max attention logit of "
                "each query head); make_train_step passes aux['max_attn_logits'] as it."
            )
        scales, clipped = qk_clip_scales(layers, params, max_logits, tau=tau, alpha=alpha)
        index, u_leaves, treedef = _leaves_by_path(updates)
        p_leaves = treedef.flatten_up_to(params)
        for path, c in scales.items():
            i = index[path]
            u, p = u_leaves[i], p_leaves[i]
            u_leaves[i] = u + ((p + u) * (c - 1.0).astype(u.dtype)).astype(u.dtype)
        return jax.tree.unflatten(treedef, u_leaves), QKClipState(qk_clipped_heads=clipped)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class MaxLogitsState(NamedTuple):
    """State of :func:`max_logits_over_micro_batches`."""

    micro_max_logits: dict  # {layer: shape=(n_q_heads,), float32}: max so far, -inf at start
    inner: Any  # the MultiStepsState


def max_logits_over_micro_batches(
    multi_steps: optax.MultiSteps, layers: Mapping[Hashable, QKLayer]
) -> optax.GradientTransformationExtraArgs:
    r"""``optax.MultiSteps`` whose inner :func:`qk_clip` sees the max logit over all micro-batches.

    ``MultiSteps`` calls its inner optimizer on every micro-batch with that micro-batch's
    extra arguments and keeps only the emitting call's result, so a :func:`qk_clip` inside
    it would clip with the last micro-batch's ``max_logits`` alone. This wrapper keeps the
    running elementwise max of ``max_logits`` over the micro-batches of the current
    accumulation and passes that max instead: on the emitting micro-batch the clip uses
    :math:`S_h = \max_{m} S_h^{(m)}`, the max over the whole accumulated batch, as a
    single large batch would. The max restarts after each emitted update. A micro-batch
    that ``MultiSteps`` drops (its ``should_skip_update_fn``) does not enter the max; a
    non-finite value does (and :func:`qk_clip` then leaves that head alone).

    Args:
      multi_steps: the ``optax.MultiSteps`` (its inner optimizer holds the ``qk_clip``).
      layers: the ``layers`` of that :func:`qk_clip` (the keys and head counts of the max).

    Returns:
      A :class:`optax.GradientTransformationExtraArgs` with the same updates as
      ``multi_steps``; ``update(..., max_logits=...)`` takes what :func:`qk_clip` takes
      (indexed by the layer keys) and passes the inner one a dict ``{layer: [n_q_heads]}``.
      Its state is a :class:`MaxLogitsState`.

    Raises:
      ValueError: at construction if ``multi_steps`` is not an ``optax.MultiSteps`` or
        ``layers`` is invalid; in ``update`` without ``max_logits``, or with a layer
        missing or of the wrong shape.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from stabljax.optim.qk_clip import QKHeads, QKLayer, qk_clip
      >>> from stabljax.optim.qk_clip import max_logits_over_micro_batches
      >>> params = {"wq": jnp.ones((4, 4)), "wk": jnp.ones((4, 4))}
      >>> layers = {0: QKLayer(q=QKHeads("wq", n_heads=2), k=QKHeads("wk", n_heads=2))}
      >>> inner = optax.chain(optax.sgd(0.0), qk_clip(layers, tau=10.0))
      >>> opt = max_logits_over_micro_batches(optax.MultiSteps(inner, 2), layers)
      >>> state = opt.init(params)
      >>> zeros = optax.tree.zeros_like(params)
      >>> _, state = opt.update(zeros, state, params, max_logits={0: jnp.array([40.0, 1.0])})
      >>> u, state = opt.update(zeros, state, params, max_logits={0: jnp.array([1.0, 1.0])})
      >>> print(optax.apply_updates(params, u)["wq"][0])  # head 0: micro-batch 1's 40
      [0.5 0.5 1.  1. ]
    """
    if not isinstance(multi_steps, optax.MultiSteps):
        raise ValueError(
            "max_logits_over_micro_batches: `multi_steps` must be an optax.MultiSteps; "
            f"got {type(multi_steps).__name__}."
        )
    owner = "max_logits_over_micro_batches"
    specs = check_layers(layers, owner=owner)
    n_q = {name: q[0].n_heads for name, (q, _, _) in specs.items()}

    def init_fn(params: optax.Params) -> MaxLogitsState:
        start = {name: jnp.full((n,), -jnp.inf, jnp.float32) for name, n in n_q.items()}
        return MaxLogitsState(micro_max_logits=start, inner=multi_steps.init(params))

    def update_fn(
        updates: optax.Updates,
        state: MaxLogitsState,
        params: optax.Params | None = None,
        *,
        max_logits: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MaxLogitsState]:
        if max_logits is None:
            raise ValueError(
                "max_logits_over_micro_batches: update needs `max_logits=` (per layer, the "
                "max attention logit of each query head on this micro-batch)."
            )
        now = {}
        for name, n in n_q.items():
            now[name] = layer_logits(max_logits, name, owner).astype(jnp.float32)
            if now[name].shape != (n,):
                raise ValueError(
                    f"max_logits_over_micro_batches: `max_logits[{name!r}]` must have shape "
                    f"({n},); got {now[name].shape}."
                )
        prev = state.micro_max_logits
        running = jax.tree.map(jnp.maximum, prev, now)
        out, inner = multi_steps.update(
            updates, state.inner, params, max_logits=running, **extra_args
        )
        emitted = inner.gradient_step != state.inner.gradient_step
        dropped = jnp.logical_and(~emitted, inner.mini_step == state.inner.mini_step)
        nxt = jax.tree.map(
            lambda r, p: jnp.where(emitted, -jnp.inf, jnp.where(dropped, p, r)), running, prev
        )
        return out, MaxLogitsState(micro_max_logits=nxt, inner=inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
