"""Initialisation: the schemes in use today, a per-group plan, and a check at init.

Three pieces, usable on their own:

- **Initializers** with the ``jax.nn.initializers`` signature
  ``init(key, shape, dtype=None, out_sharding=None) -> Array``, one per published scheme
  (:func:`normal`, :func:`small_init`, :func:`wang_init`, :func:`scaled_residual`,
  :func:`depth_scaled`, :func:`mitchell`, :func:`fan_in`, :func:`deepnet`), so they drop
  into ``nnx.Linear(kernel_init=...)`` or any linen module.
- **Plans**: :func:`init_plan` turns an architecture description (:class:`ArchSpec`) and a
  scheme name into the std of every parameter group and the formula behind it
  (:class:`InitPlan`, printable as a table). ``stabljax.nn.TransformerLM`` is built from one.
- **A check at init**: :func:`check_init` runs one forward and backward pass and reports
  the residual-stream RMS per layer, gradient RMS per layer, the growth exponent, the
  output-logit std and the initial loss against ``log(vocab)``, with a concrete fix for
  whatever is out of range (:class:`InitReport`).

**Truncation convention.** ``std`` is always the σ of the *untruncated* normal, as in
``torch.nn.init.trunc_normal_(std=σ, a=-3σ, b=3σ)`` (OLMo, OLMo-core) and
``jax.nn.initializers.truncated_normal``. Values drawn with ``truncate=True`` therefore have
a slightly smaller std, σ·:func:`truncated_std_factor` (0.98658σ at ±3σ);
:attr:`PlanEntry.effective_std` gives the std the drawn values actually have.

Groups of a plan, for a decoder-only Transformer: ``embed``, ``pos_embed``, ``attn_q``,
``attn_k``, ``attn_v`` (the three slices of a fused qkv kernel), ``attn_out``, ``mlp_in``,
``mlp_out`` and, when the embeddings are not tied, ``unembed``. A group whose std depends on
the layer is stored once per layer as ``blocks.<l>.<group>`` (``l`` counts from 0). Biases
start at 0 and norm scales at 1 in every scheme; they are not part of a plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = (
    "ArchSpec",
    "InitFlag",
    "InitPlan",
    "InitReport",
    "PlanEntry",
    "SCHEMES",
    "check_init",
    "deepnet",
    "deepnet_alpha",
    "deepnet_beta",
    "depth_scaled",
    "fan_in",
    "init_plan",
    "mitchell",
    "normal",
    "scaled_residual",
    "small_init",
    "truncated_std_factor",
    "wang_init",
)

Initializer = Callable[..., jax.Array]

#: Scheme names :func:`init_plan` accepts (``fixed:<std>`` takes any std, e.g. ``fixed:1.0``).
SCHEMES = (
    "deepnet",
    "depth_scaled",
    "fan_in",
    "fixed:<std>",
    "gpt2",
    "llama_depth",
    "mitchell",
    "olmo2",
    "small_init",
)

_BLOCK_GROUPS = ("attn_q", "attn_k", "attn_v", "attn_out", "mlp_in", "mlp_out")


# ---------------------------------------------------------------------------------------
# Initializers
# ---------------------------------------------------------------------------------------


def truncated_std_factor(bound: float = 3.0) -> float:
    r"""Std of a unit normal truncated to ``[-bound, bound]``.

    .. math::

      c(b) = \sqrt{1 - \frac{2 b\, \varphi(b)}{2\Phi(b) - 1}}

    Args:
      bound: the truncation point in units of σ, > 0.

    Returns:
      The factor :math:`c(b) < 1`; a normal of std σ truncated at ±bound·σ has std c·σ.

    Example:
      >>> from stabljax.init import truncated_std_factor
      >>> print(round(truncated_std_factor(3.0), 5), round(truncated_std_factor(2.0), 5))
      0.98658 0.87963
    """
    if not bound > 0:
        raise ValueError(f"bound must be > 0, got {bound}")
    pdf = math.exp(-0.5 * bound * bound) / math.sqrt(2.0 * math.pi)
    mass = math.erf(bound / math.sqrt(2.0))
    return math.sqrt(1.0 - 2.0 * bound * pdf / mass)


def _check_std(std: float, name: str = "std") -> float:
    std = float(std)
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {std}")
    return std


def _check_positive_int(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def normal(std: float, *, truncate: bool = False, bound: float = 3.0) -> Initializer:
    r"""Zero-mean normal initializer, optionally truncated at ±``bound``·σ.

    ``std`` is the σ of the untruncated normal (the OLMo / ``trunc_normal_`` / jax
    convention); with ``truncate=True`` the drawn values have std
    σ·:func:`truncated_std_factor` ``(bound)``. Values are drawn in float32 (or wider) and
    cast to the requested dtype, so a bfloat16 parameter gets the same distribution.

    Args:
      std: σ, >= 0 (0 gives zeros).
      truncate: resample values outside ±bound·σ (as ``jax.random.truncated_normal``).
      bound: the truncation point in units of σ.

    Returns:
      An initializer ``init(key, shape, dtype=None, out_sharding=None) -> Array`` with the
      ``jax.nn.initializers`` signature.

    Example:
      >>> import jax
      >>> from stabljax.init import normal
      >>> w = normal(0.02, truncate=True)(jax.random.key(0), (256, 256))
      >>> print(w.shape, w.dtype, bool(abs(w).max() <= 3 * 0.02))
      (256, 256) float32 True
    """
    std = _check_std(std)
    if not bound > 0:
        raise ValueError(f"bound must be > 0, got {bound}")

    def init(key, shape, dtype=None, out_sharding=None) -> jax.Array:
        dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
        return _draw(key, std, tuple(shape), dtype, truncate, float(bound), out_sharding)

    return init


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _draw(key, std, shape, dtype, truncate, bound, out_sharding):
    # One compiled program per (shape, dtype, truncate): models draw their many weights
    # without a compile per elementwise op, and std is traced so every scheme shares it.
    draw = dtype if dtype.itemsize >= 4 else jnp.dtype(jnp.float32)
    kwargs = {} if out_sharding is None else {"out_sharding": out_sharding}
    if truncate:
        x = jax.random.truncated_normal(key, -bound, bound, shape, draw, **kwargs)
    else:
        x = jax.random.normal(key, shape, draw, **kwargs)
    return (x * std.astype(draw)).astype(dtype)


def small_init(d_model: int, *, truncate: bool = False) -> Initializer:
    r"""Nguyen & Salazar's small init: :math:`\sigma = \sqrt{2 / (5 d)}`.

    The Xavier std of a ``d × 4d`` layer, used by GPT-NeoX for every weight but the
    residual output projections (which get :func:`wang_init`).

    Args:
      d_model: the model width :math:`d`.
      truncate: truncate at ±3σ (see :func:`normal`).

    Returns:
      A :func:`normal` initializer.

    Example:
      >>> from stabljax.init import init_plan, ArchSpec
      >>> spec = ArchSpec(d_model=640, n_layers=4, n_heads=8, vocab_size=256)
      >>> print(init_plan(spec, "small_init")["embed"].std)  # sqrt(2 / 3200)
      0.025

    References:
      Nguyen & Salazar, `Transformers without Tears: Improving the Normalization of
      Self-Attention <https://arxiv.org/abs/1910.05895>`_, 2019
    """
    d = _check_positive_int(d_model, "d_model")
    return normal(math.sqrt(2.0 / (5.0 * d)), truncate=truncate)


def wang_init(d_model: int, n_layers: int, *, truncate: bool = False) -> Initializer:
    r"""GPT-NeoX's ``wang_init`` for residual output projections: :math:`2 / (L \sqrt{d})`.

    Args:
      d_model: the model width :math:`d`.
      n_layers: the number of Transformer layers :math:`L`.
      truncate: truncate at ±3σ (see :func:`normal`).

    Returns:
      A :func:`normal` initializer.

    Example:
      >>> from stabljax.init import ArchSpec, init_plan
      >>> spec = ArchSpec(d_model=64, n_layers=10, n_heads=4, vocab_size=256)
      >>> print(init_plan(spec, "small_init")["attn_out"].std)  # 2 / (10 * 8)
      0.025

    References:
      Black et al., `GPT-NeoX-20B: An Open-Source Autoregressive Language Model
      <https://arxiv.org/abs/2204.06745>`_, 2022
    """
    d = _check_positive_int(d_model, "d_model")
    n = _check_positive_int(n_layers, "n_layers")
    return normal(2.0 / (n * math.sqrt(d)), truncate=truncate)


def scaled_residual(std: float, n_layers: int, *, truncate: bool = False) -> Initializer:
    r"""GPT-2 / Megatron residual output projections: :math:`\sigma / \sqrt{2L}`.

    A pre-norm stack of :math:`L` layers adds :math:`2L` sublayer outputs to the residual
    stream; dividing their std by :math:`\sqrt{2L}` keeps the variance they add together
    independent of depth.

    Args:
      std: the base σ (0.02 in GPT-2 and Megatron).
      n_layers: the number of Transformer layers :math:`L`.
      truncate: truncate at ±3σ (see :func:`normal`).

    Returns:
      A :func:`normal` initializer.

    Example:
      >>> import jax
      >>> from stabljax.init import scaled_residual
      >>> w = scaled_residual(0.02, 8)(jax.random.key(0), (512, 512))  # std 0.005
      >>> print(round(float(w.std()), 3))
      0.005

    References:
      Radford et al., `Language Models are Unsupervised Multitask Learners
      <https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf>`_,
      2019

      Shoeybi et al., `Megatron-LM: Training Multi-Billion Parameter Language Models Using
      Model Parallelism <https://arxiv.org/abs/1909.08053>`_, 2019
    """
    n = _check_positive_int(n_layers, "n_layers")
    return normal(_check_std(std) / math.sqrt(2.0 * n), truncate=truncate)


def depth_scaled(std: float, layer: int, *, truncate: bool = False) -> Initializer:
    r"""Per-layer depth scaling (OLMo-core ``llama_depth``): :math:`\sigma / \sqrt{2(l + 1)}`.

    Args:
      std: the base σ.
      layer: the layer index :math:`l`, counting from 0.
      truncate: truncate at ±3σ (see :func:`normal`).

    Returns:
      A :func:`normal` initializer.

    Example:
      >>> from stabljax.init import ArchSpec, init_plan
      >>> plan = init_plan(ArchSpec(64, 4, 4, vocab_size=256), "depth_scaled")
      >>> print(plan["blocks.1.attn_out"].std, plan["blocks.1.attn_out"].formula)
      0.01 σ/√(2(l+1)) = 0.02/√(2·2)
    """
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
        raise ValueError(f"layer must be an integer >= 0, got {layer!r}")
    return normal(_check_std(std) / math.sqrt(2.0 * (int(layer) + 1)), truncate=truncate)


def mitchell(fan_in_dim: int, layer: int | None = None, *, truncate: bool = True) -> Initializer:
    r"""OLMo's "mitchell" init for one group: :math:`1/\sqrt{n}`, over :math:`\sqrt{2(l+1)}`.

    :math:`n` is the group's fan-in (``d_model`` for embeddings, q/k/v, the MLP input and the
    unembedding; ``d_ff`` for the MLP output). Residual output projections pass their
    ``layer`` and get :math:`1/\sqrt{2 n (l+1)}`. Truncated at ±3σ, as in OLMo.

    Args:
      fan_in_dim: :math:`n`.
      layer: the layer index :math:`l` (from 0) for residual output projections, else None.
      truncate: truncate at ±3σ (OLMo does).

    Returns:
      A :func:`normal` initializer.

    Example:
      >>> from stabljax.init import ArchSpec, init_plan
      >>> plan = init_plan(ArchSpec(128, 4, 4, d_ff=512, vocab_size=256), "mitchell")
      >>> print(plan["blocks.3.mlp_out"].std, plan["blocks.3.mlp_out"].formula)
      0.015625 1/√(2·d_ff·(l+1)) = 1/√(2·512·4)

    References:
      Groeneveld et al., `OLMo: Accelerating the Science of Language Models
      <https://arxiv.org/abs/2402.00838>`_, 2024
    """
    n = _check_positive_int(fan_in_dim, "fan_in_dim")
    std = 1.0 / math.sqrt(n)
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or layer < 0:
            raise ValueError(f"layer must be None or an integer >= 0, got {layer!r}")
        std /= math.sqrt(2.0 * (int(layer) + 1))
    return normal(std, truncate=truncate)


def fan_in(fan_in_dim: int | None = None, *, in_axis: int = -2) -> Initializer:
    r"""Fan-in init: :math:`\sigma = 1/\sqrt{n_\text{in}}` (OLMo's ``fan_in``), untruncated.

    Args:
      fan_in_dim: :math:`n_\text{in}`; None reads it from the shape (``shape[in_axis]``),
        as ``jax.nn.initializers.lecun_normal`` does (which truncates at ±2 and rescales).
      in_axis: the input axis when ``fan_in_dim`` is None.

    Returns:
      An initializer with the ``jax.nn.initializers`` signature.

    Example:
      >>> import jax
      >>> from stabljax.init import fan_in
      >>> w = fan_in()(jax.random.key(0), (400, 300))  # std 1/20
      >>> print(round(float(w.std()), 3))
      0.05
    """
    if fan_in_dim is not None:
        return normal(1.0 / math.sqrt(_check_positive_int(fan_in_dim, "fan_in_dim")))

    def init(key, shape, dtype=None, out_sharding=None) -> jax.Array:
        n = _check_positive_int(int(shape[in_axis]), "shape[in_axis]")
        return normal(1.0 / math.sqrt(n))(key, shape, dtype, out_sharding)

    return init


def deepnet_alpha(n_layers: int) -> float:
    r"""DeepNet's residual scale for a decoder-only model of :math:`M` layers: :math:`(2M)^{1/4}`.

    DeepNorm's residual is :math:`x \leftarrow \mathrm{LN}(\alpha x + f(x))`.

    Args:
      n_layers: :math:`M`.

    Returns:
      :math:`\alpha`.

    Example:
      >>> from stabljax.init import deepnet_alpha, deepnet_beta
      >>> print(round(deepnet_alpha(8), 4), round(deepnet_beta(8), 4))
      2.0 0.3536

    References:
      Wang et al., `DeepNet: Scaling Transformers to 1,000 Layers
      <https://arxiv.org/abs/2203.00555>`_, 2022
    """
    return (2.0 * _check_positive_int(n_layers, "n_layers")) ** 0.25


def deepnet_beta(n_layers: int) -> float:
    r"""DeepNet's init gain for a decoder-only model of :math:`M` layers: :math:`(8M)^{-1/4}`.

    It multiplies the Xavier std of the FFN, value and output projections (:func:`deepnet`).

    Args:
      n_layers: :math:`M`.

    Returns:
      :math:`\beta`.

    Example:
      >>> from stabljax.init import deepnet_beta
      >>> print(round(deepnet_beta(2), 4))  # 16 ** -0.25
      0.5

    References:
      Wang et al., `DeepNet: Scaling Transformers to 1,000 Layers
      <https://arxiv.org/abs/2203.00555>`_, 2022
    """
    return (8.0 * _check_positive_int(n_layers, "n_layers")) ** -0.25


def deepnet(
    gain: float = 1.0, *, fan_in_dim: int | None = None, fan_out_dim: int | None = None
) -> Initializer:
    r"""Xavier-normal init with a gain β, as DeepNet uses it.

    .. math::

      \sigma = \beta \sqrt{2 / (n_\text{in} + n_\text{out})}

    DeepNet draws the FFN, value and output projections with ``gain=deepnet_beta(M)`` and the
    query and key projections with ``gain=1``.

    Args:
      gain: :math:`\beta` (:func:`deepnet_beta`), or 1 for queries and keys.
      fan_in_dim: :math:`n_\text{in}`; None reads ``shape[-2]``.
      fan_out_dim: :math:`n_\text{out}`; None reads ``shape[-1]``.

    Returns:
      An initializer with the ``jax.nn.initializers`` signature.

    Example:
      >>> import jax
      >>> from stabljax.init import deepnet, deepnet_beta
      >>> w = deepnet(deepnet_beta(2))(jax.random.key(0), (200, 200))  # 0.5 * sqrt(2/400)
      >>> print(round(float(w.std()), 3))
      0.035

    References:
      Wang et al., `DeepNet: Scaling Transformers to 1,000 Layers
      <https://arxiv.org/abs/2203.00555>`_, 2022

      Glorot & Bengio, `Understanding the difficulty of training deep feedforward neural
      networks <https://proceedings.mlr.press/v9/glorot10a.html>`_, 2010
    """
    gain = _check_std(gain, "gain")

    def init(key, shape, dtype=None, out_sharding=None) -> jax.Array:
        n_in = int(shape[-2]) if fan_in_dim is None else fan_in_dim
        n_out = int(shape[-1]) if fan_out_dim is None else fan_out_dim
        std = gain * math.sqrt(2.0 / (n_in + n_out))
        return normal(std)(key, shape, dtype, out_sharding)

    return init


# ---------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """What an init scheme needs to know about a decoder-only Transformer.

    Attributes:
      d_model: width :math:`d`.
      n_layers: number of Transformer layers :math:`L` (each an attention and an MLP
        sublayer).
      n_heads: attention heads (must divide ``d_model``).
      d_ff: MLP hidden width; None means ``4 * d_model``.
      vocab_size: vocabulary size.
      tie_embeddings: the unembedding is the transposed token embedding.
      norm_placement: ``"pre"`` (``x + f(LN(x))``) or ``"post"``
        (``LN(α·x + f(x))``, DeepNorm when α > 1).
      pos_embed: the model has a learned positional embedding.
    """

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None
    vocab_size: int = 256
    tie_embeddings: bool = True
    norm_placement: str = "pre"
    pos_embed: bool = True

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "vocab_size"):
            _check_positive_int(getattr(self, name), name)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        _check_positive_int(self.d_ff, "d_ff")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads must divide d_model, got d_model={self.d_model}, n_heads={self.n_heads}"
            )
        if self.norm_placement not in ("pre", "post"):
            raise ValueError(f"norm_placement must be 'pre' or 'post', got {self.norm_placement!r}")

    def groups(self) -> tuple[str, ...]:
        """The parameter groups this architecture has (per-layer groups named once)."""
        head = ("embed",) + (("pos_embed",) if self.pos_embed else ())
        tail = () if self.tie_embeddings else ("unembed",)
        return head + _BLOCK_GROUPS + tail


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """The init of one parameter group.

    Attributes:
      std: σ of the (untruncated) normal the group is drawn from.
      formula: how ``std`` was computed, with the numbers substituted.
      truncated: whether draws are truncated at ±3σ.
    """

    std: float
    formula: str
    truncated: bool = False

    @property
    def effective_std(self) -> float:
        """The std the drawn values actually have (σ·0.98658 when truncated at ±3σ)."""
        return self.std * truncated_std_factor(3.0) if self.truncated else self.std

    @property
    def initializer(self) -> Initializer:
        """A :func:`normal` initializer for this entry."""
        return normal(self.std, truncate=self.truncated)


def _split_key(key: str) -> tuple[str, int | None]:
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit():
        return parts[2], int(parts[1])
    return key, None


@dataclasses.dataclass(frozen=True)
class InitPlan:
    """The std of every parameter group of a model, and the formula that gave it.

    Look an entry up with ``plan["attn_q"]`` or ``plan["blocks.3.attn_out"]``: a per-layer
    key falls back to the group's layer-independent entry, so both spellings work for
    every scheme. ``str(plan)`` is a readable table.

    Attributes:
      spec: the architecture.
      scheme: the scheme name given to :func:`init_plan`.
      entries: group (or ``blocks.<l>.<group>``) -> :class:`PlanEntry`, in table order.
      residual_alpha: the residual scale α of ``LN(α·x + f(x))`` (1 except for DeepNet).
      residual_alpha_formula: how α was computed.
    """

    spec: ArchSpec
    scheme: str
    entries: Mapping[str, PlanEntry]
    residual_alpha: float = 1.0
    residual_alpha_formula: str = "1"

    def entry(self, group: str, layer: int | None = None) -> PlanEntry:
        """The entry of ``group`` (in ``layer``, for per-layer groups)."""
        if layer is not None and f"blocks.{layer}.{group}" in self.entries:
            return self.entries[f"blocks.{layer}.{group}"]
        if group in self.entries:
            return self.entries[group]
        raise KeyError(
            f"no init for group {group!r}"
            + ("" if layer is None else f" in layer {layer}")
            + f" in plan {self.scheme!r}; groups: {list(self.entries)}"
        )

    def __getitem__(self, key: str) -> PlanEntry:
        if key in self.entries:
            return self.entries[key]
        group, layer = _split_key(key)
        return self.entry(group, layer)

    def initializer(self, group: str, layer: int | None = None) -> Initializer:
        """The initializer of ``group`` (in ``layer``)."""
        return self.entry(group, layer).initializer

    def table(self) -> str:
        """The plan as a fixed-width text table."""
        s = self.spec
        header = (
            f"init plan {self.scheme!r}: d_model={s.d_model}, n_layers={s.n_layers}, "
            f"n_heads={s.n_heads}, d_ff={s.d_ff}, vocab={s.vocab_size}, "
            f"{'tied' if s.tie_embeddings else 'untied'}, {s.norm_placement}-norm"
        )
        rows = [("group", "std", "trunc", "formula")]
        for name, e in self.entries.items():
            rows.append((name, f"{e.std:.4g}", "±3σ" if e.truncated else "-", e.formula))
        rows.append(("residual α", f"{self.residual_alpha:.4g}", "", self.residual_alpha_formula))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [header]
        for r in rows:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3]
            )
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.table()


def _fmt(x: float) -> str:
    return f"{x:g}"


def init_plan(spec: ArchSpec, scheme: str = "gpt2", *, std: float = 0.02) -> InitPlan:
    r"""The std of every parameter group of ``spec`` under ``scheme``.

    Schemes (:math:`d` = ``d_model``, :math:`L` = ``n_layers``, :math:`l` = layer from 0,
    "outs" = the residual output projections ``attn_out`` and ``mlp_out``):

    - ``"gpt2"``: σ = ``std`` (0.02) everywhere, outs σ/√(2L) (GPT-2, Megatron).
    - ``"olmo2"``: σ everywhere, truncated at ±3σ (OLMo 2; no depth scaling — OLMo 2
      reorders its norms, so in a pre-norm stack this is :func:`check_init`'s bad case
      at depth).
    - ``"small_init"``: √(2/(5d)) everywhere, outs ``wang_init`` 2/(L√d) (GPT-NeoX's
      pairing of the two).
    - ``"depth_scaled"`` / ``"llama_depth"``: σ everywhere, outs σ/√(2(l+1)), truncated
      (OLMo-core ``llama_depth``; OLMo-core also draws its untied embeddings from N(0, 1)
      and its output layer with 1/√d, which a tied model cannot share — here embeddings keep σ).
    - ``"mitchell"``: 1/√(fan-in) for embeddings, q/k/v, MLP input and unembedding;
      outs 1/√(2·d·(l+1)) and 1/√(2·d_ff·(l+1)); truncated (OLMo).
    - ``"fan_in"``: 1/√(fan-in) everywhere (embeddings 1/√d; MLP output 1/√d_ff).
    - ``"deepnet"`` (``norm_placement="post"`` only): Xavier normal, gain β = (8L)^(-1/4) on
      v, out and MLP weights, gain 1 on q and k; embeddings 1/√d; residual α = (2L)^(1/4).
    - ``"fixed:<s>"``: σ = s everywhere, no depth scaling (e.g. ``"fixed:1.0"``, a
      deliberately bad init).

    Args:
      spec: the architecture.
      scheme: one of :data:`SCHEMES`.
      std: the base σ of ``"gpt2"``, ``"olmo2"``, ``"depth_scaled"`` / ``"llama_depth"``.

    Returns:
      An :class:`InitPlan`.

    Raises:
      ValueError: an unknown scheme, or ``"deepnet"`` with pre-norm.

    Example:
      >>> from stabljax.init import ArchSpec, init_plan
      >>> print(init_plan(ArchSpec(d_model=128, n_layers=8, n_heads=4, vocab_size=256)))
      init plan 'gpt2': d_model=128, n_layers=8, n_heads=4, d_ff=512, vocab=256, tied, pre-norm
      group       std    trunc  formula
      embed       0.02   -      σ = 0.02
      pos_embed   0.02   -      σ = 0.02
      attn_q      0.02   -      σ = 0.02
      attn_k      0.02   -      σ = 0.02
      attn_v      0.02   -      σ = 0.02
      attn_out    0.005  -      σ/√(2L) = 0.02/√(2·8)
      mlp_in      0.02   -      σ = 0.02
      mlp_out     0.005  -      σ/√(2L) = 0.02/√(2·8)
      residual α  1             1

    References:
      Radford et al., `Language Models are Unsupervised Multitask Learners
      <https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf>`_,
      2019

      Team OLMo et al., `2 OLMo 2 Furious <https://arxiv.org/abs/2501.00656>`_, 2024

      Wang et al., `DeepNet: Scaling Transformers to 1,000 Layers
      <https://arxiv.org/abs/2203.00555>`_, 2022
    """
    if not isinstance(spec, ArchSpec):
        raise TypeError(f"spec must be an ArchSpec, got {type(spec).__name__}")
    base = _check_std(std)
    d, n_layers, d_ff = spec.d_model, spec.n_layers, spec.d_ff
    groups = spec.groups()
    entries: dict[str, PlanEntry] = {}
    alpha, alpha_formula = 1.0, "1"

    def uniform(value: float, formula: str, truncated: bool, which=groups) -> None:
        for g in which:
            entries[g] = PlanEntry(value, formula, truncated)

    def per_layer(group: str, fn: Callable[[int], tuple[float, str]], truncated: bool) -> None:
        for layer in range(n_layers):
            value, formula = fn(layer)
            entries[f"blocks.{layer}.{group}"] = PlanEntry(value, formula, truncated)

    outs = ("attn_out", "mlp_out")
    ins = tuple(g for g in groups if g not in outs)
    if scheme in ("gpt2", "olmo2"):
        truncated = scheme == "olmo2"
        uniform(base, f"σ = {_fmt(base)}", truncated)
        if scheme == "gpt2":
            value = base / math.sqrt(2 * n_layers)
            uniform(value, f"σ/√(2L) = {_fmt(base)}/√(2·{n_layers})", False, outs)
    elif scheme == "small_init":
        uniform(math.sqrt(2 / (5 * d)), f"√(2/(5d)) = √(2/(5·{d}))", False)
        uniform(2 / (n_layers * math.sqrt(d)), f"2/(L·√d) = 2/({n_layers}·√{d})", False, outs)
    elif scheme in ("depth_scaled", "llama_depth"):
        uniform(base, f"σ = {_fmt(base)}", True, ins)
        for g in outs:
            per_layer(
                g,
                lambda layer: (
                    base / math.sqrt(2 * (layer + 1)),
                    f"σ/√(2(l+1)) = {_fmt(base)}/√(2·{layer + 1})",
                ),
                True,
            )
    elif scheme == "mitchell":
        uniform(1 / math.sqrt(d), f"1/√d = 1/√{d}", True, ins)
        per_layer(
            "attn_out",
            lambda layer: (
                1 / math.sqrt(2 * d * (layer + 1)),
                f"1/√(2·d·(l+1)) = 1/√(2·{d}·{layer + 1})",
            ),
            True,
        )
        per_layer(
            "mlp_out",
            lambda layer: (
                1 / math.sqrt(2 * d_ff * (layer + 1)),
                f"1/√(2·d_ff·(l+1)) = 1/√(2·{d_ff}·{layer + 1})",
            ),
            True,
        )
    elif scheme == "fan_in":
        uniform(1 / math.sqrt(d), f"1/√fan_in = 1/√{d}", False)
        uniform(1 / math.sqrt(d_ff), f"1/√fan_in = 1/√{d_ff}", False, ("mlp_out",))
    elif scheme == "deepnet":
        if spec.norm_placement != "post":
            raise ValueError(
                "scheme 'deepnet' is DeepNorm, x <- LN(α·x + f(x)): it needs "
                "norm_placement='post' in the ArchSpec (and the model)"
            )
        beta = deepnet_beta(n_layers)
        alpha = deepnet_alpha(n_layers)
        alpha_formula = f"(2L)^(1/4) = (2·{n_layers})^(1/4)"
        b = f"β = (8L)^(-1/4) = {beta:.4g}"
        uniform(1 / math.sqrt(d), f"1/√d = 1/√{d}", False, ins)
        xavier_dd = math.sqrt(2 / (d + d))
        xavier_df = math.sqrt(2 / (d + d_ff))
        uniform(xavier_dd, f"√(2/(d+d)) = √(2/({d}+{d}))", False, ("attn_q", "attn_k"))
        uniform(beta * xavier_dd, f"β·√(2/(d+d)), {b}, d={d}", False, ("attn_v", "attn_out"))
        uniform(
            beta * xavier_df,
            f"β·√(2/(d+d_ff)), {b}, d={d}, d_ff={d_ff}",
            False,
            ("mlp_in", "mlp_out"),
        )
    elif scheme.startswith("fixed:"):
        try:
            value = _check_std(float(scheme.split(":", 1)[1]))
        except ValueError as e:
            raise ValueError(f"scheme 'fixed:<std>' needs a number >= 0, got {scheme!r}") from e
        uniform(value, f"σ = {_fmt(value)} (fixed)", False)
    else:
        raise ValueError(f"unknown init scheme {scheme!r}; known: {', '.join(SCHEMES)}")

    order = {g: i for i, g in enumerate(groups)}

    def sort_key(k: str):
        g, layer = _split_key(k)
        return (order[g], -1 if layer is None else layer)

    entries = {k: entries[k] for k in sorted(entries, key=sort_key)}
    return InitPlan(spec, scheme, entries, alpha, alpha_formula)


# ---------------------------------------------------------------------------------------
# The check at init
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InitFlag:
    """One out-of-range finding of :func:`check_init`.

    Attributes:
      name: what was measured (``"residual_growth"``, ``"logit_std"``, ...).
      value: the measured value.
      bound: the bound it broke.
      message: what is wrong, with numbers.
      fix: a concrete change that brings it back in range.
    """

    name: str
    value: float
    bound: float
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}: {self.fix}"


@dataclasses.dataclass(frozen=True)
class InitReport:
    """What :func:`check_init` measured, and what it flagged.

    Attributes:
      loss: the initial loss.
      log_vocab: ``log(vocab_size)``, the loss of a uniform prediction.
      logit_std: std of the output logits over the vocabulary (RMS over positions).
      residual_rms: RMS of the residual stream at the input and after each block
        (``n_layers + 1`` values), or None when ``apply_fn`` returns no aux.
      growth_exponent: λ = (1/L)·log(‖h_L‖/‖h_0‖), or None without ``residual_rms``.
      grad_rms: gradient RMS of each layer's parameters, layer 0 first (empty when no
        parameter path holds a layer index).
      grad_growth_exponent: (1/L)·log(g_0/g_{L-1}), the growth of the gradient RMS from
        the last layer back to the first, or None with fewer than 2 layers.
      max_attn_logit: the max pre-softmax attention logit, when ``apply_fn`` reports it.
      seq_len: the sequence length of the batch.
      flags: the findings out of range, each with a fix.
    """

    loss: float
    log_vocab: float
    logit_std: float
    residual_rms: np.ndarray | None
    growth_exponent: float | None
    grad_rms: np.ndarray
    grad_growth_exponent: float | None
    max_attn_logit: float | None
    seq_len: int
    flags: tuple[InitFlag, ...]

    @property
    def ok(self) -> bool:
        """True when nothing was flagged."""
        return not self.flags

    @property
    def n_layers(self) -> int:
        """The depth the report saw (from ``residual_rms``, else from ``grad_rms``)."""
        if self.residual_rms is not None:
            return len(self.residual_rms) - 1
        return len(self.grad_rms)

    def __str__(self) -> str:
        def f(x):
            return "n/a" if x is None else f"{x:.4g}"

        lines = [
            f"init check: {'ok' if self.ok else f'{len(self.flags)} flag(s)'}",
            f"  initial loss    {f(self.loss)}  (log vocab {f(self.log_vocab)}, "
            f"excess {f(self.loss - self.log_vocab)})",
            f"  logit std       {f(self.logit_std)}",
            f"  growth λ        {f(self.growth_exponent)}  (residual ×"
            + (
                f(float(self.residual_rms[-1] / self.residual_rms[0]))
                if self.residual_rms is not None
                else "n/a"
            )
            + f" over {self.n_layers} layers)",
            f"  grad growth     {f(self.grad_growth_exponent)}",
            f"  max attn logit  {f(self.max_attn_logit)}  (seq len {self.seq_len})",
        ]
        n = max(self.n_layers, len(self.grad_rms))
        if n:
            lines.append("  layer  residual RMS  grad RMS")
            for i in range(n + 1):
                res = self.residual_rms[i] if self.residual_rms is not None else None
                if i == 0:
                    name, g = "input", None
                else:
                    name = str(i - 1)
                    g = self.grad_rms[i - 1] if i - 1 < len(self.grad_rms) else None
                lines.append(f"  {name:<5}  {f(res):<12}  {f(g)}")
        for flag in self.flags:
            lines.append(f"  FLAG {flag.name}: {flag}")
        return "\n".join(lines)


def _default_loss(logits: jax.Array, batch: Mapping[str, Any]) -> jax.Array:
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]
    )
    mask = batch.get("mask")
    if mask is None:
        return jnp.mean(ce)
    mask = jnp.asarray(mask, jnp.bool_)
    return jnp.sum(jnp.where(mask, ce, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _layer_of(path) -> int | None:
    for k in path:
        v = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, str) and v.isdigit():
            return int(v)
    return None


def _measure(apply_fn, loss_fn, params, batch):
    """Loss, logit/aux statistics and per-leaf gradient sum of squares, in one pass."""
    mask = batch.get("mask")

    def forward(p):
        out = apply_fn(p, batch["inputs"])
        logits, aux = out if isinstance(out, tuple) else (out, {})
        loss = loss_fn(logits, batch)
        var = jnp.var(logits.astype(jnp.float32), axis=-1)
        if mask is None:
            logit_var = jnp.mean(var)
        else:
            m = jnp.asarray(mask, jnp.bool_)
            logit_var = jnp.sum(jnp.where(m, var, 0.0)) / jnp.maximum(jnp.sum(m), 1)
        stats = {"logit_std": jnp.sqrt(logit_var)}
        for name in ("residual_rms", "max_attn_logit"):
            if name in aux:
                stats[name] = jnp.asarray(aux[name], jnp.float32)
        # A zero-size array carries the vocabulary size out as a static shape.
        return jnp.asarray(loss, jnp.float32), (stats, jnp.zeros((0, logits.shape[-1])))

    (loss, (stats, vocab)), grads = jax.value_and_grad(forward, has_aux=True)(params)
    sumsq = jax.tree.map(lambda g: jnp.sum(jnp.square(g.astype(jnp.float32))), grads)
    return loss, stats, sumsq, vocab


# Keyed on (apply_fn, loss_fn): checking several inits of one architecture compiles once.
_measure_cached = jax.jit(_measure, static_argnums=(0, 1))


def _measure_jit(apply_fn, loss_fn, params, batch):
    return jax.jit(lambda p, b: _measure(apply_fn, loss_fn, p, b))(params, batch)


def check_init(
    apply_fn: Callable[[Any, jax.Array], Any],
    params: Any,
    batch: Mapping[str, Any],
    *,
    loss_fn: Callable[[jax.Array, Mapping[str, Any]], jax.Array] | None = None,
    growth_bound: float = 2.0,
    logit_std_bound: float = math.sqrt(2.0),
    loss_excess_bound: float = 1.0,
    grad_spread_bound: float = 4.0,
) -> InitReport:
    r"""Measures a model at init and flags what is out of range, each with a fix.

    One jitted forward and backward pass on ``batch``. The checks, and where their default
    bounds come from (every bound is an argument):

    - **Residual growth** :math:`R = \|h_L\|/\|h_0\| = e^{\lambda L}` within
      [1/``growth_bound``, ``growth_bound``] (2). Each pre-norm block divides its input by
      the stream's RMS, so that RMS sets the size of every block's gradient (Xiong et al.
      2020); :math:`R > 2` means the sublayers together add more than 3× the input's variance
      and the first and last blocks see gradients of different size, the setting Takase et
      al. (2023) tie to loss spikes. OLMo 2 measures the same λ at init. The fix scales the
      output projections by :math:`\sqrt{(b^2-1)/(R^2-1)}`, which brings R to the bound b
      when the sublayer outputs add independently (in a pre-norm stack their size does not
      depend on the stream's scale), and names the depth-scaled schemes.
    - **Output-logit std** s ≤ ``logit_std_bound`` (√2) and **initial loss** within
      ``loss_excess_bound`` (1 nat = (√2)²/2) of log V. For logits independent of the labels
      the expected loss is log V + s²/2: fan-in-scaled (1/√d) output layers give s ≈ 1 by
      design, half a nat; the bound allows that with a factor √2 in std and flags a model
      that starts over a nat (a factor e in perplexity) worse than uniform. A non-finite
      loss is always flagged.
    - **Gradient spread**: max/min of the per-layer gradient RMS ≤ ``grad_spread_bound``
      (4). A pre-norm block's gradient scales like 1/RMS of the stream at its input, so the
      residual bound alone allows ×2; the second factor 2 leaves room for everything else
      (attention vs MLP mix, post-norm paths, where R says nothing). Non-finite and all-zero
      layer gradients are flagged too.
    - **Attention logits**, when ``aux`` reports them: max pre-softmax logit ≤ 2·log T (T =
      sequence length). A softmax over T logits of std s is dominated by its few largest
      terms once s > √(2 log T) (the freezing point of Derrida's random energy model), where
      a row's max is s·√(2 log T) = 2·log T. Unit-variance logits, what the 1/√d_head scale
      aims for, stay well below it; the max is over all rows, so the check errs early.

    ``apply_fn(params, inputs)`` returns the logits ``[..., T, V]``, or ``(logits, aux)``
    with ``aux["residual_rms"]`` (f32[L+1]: RMS of the residual stream at the input and
    after each block) and optionally ``aux["max_attn_logit"]`` —
    ``stabljax.nn.TransformerLM(..., return_aux=True)`` reports both. Without
    ``residual_rms`` the growth checks are skipped. Per-layer gradients group the parameter
    leaves by the first integer in their path (``blocks/3/...``).

    Args:
      apply_fn: ``apply_fn(params, inputs) -> logits`` or ``(logits, aux)``.
      params: the parameters at init (any pytree, e.g. an ``nnx.State``).
      batch: a dict with ``inputs`` (int tokens ``[B, T]``), ``targets`` (``[B, T]``) and
        optionally ``mask`` (``[B, T]`` bool), as the train step takes it.
      loss_fn: ``loss_fn(logits, batch) -> scalar``; default: mean cross-entropy over the
        mask.
      growth_bound: bound on the residual growth factor and its inverse, > 1.
      logit_std_bound: bound on the output-logit std.
      loss_excess_bound: bound on ``|loss - log V|`` in nats.
      grad_spread_bound: bound on the max/min ratio of per-layer gradient RMS.

    Returns:
      An :class:`InitReport`; ``report.ok`` is true when nothing was flagged, and
      ``print(report)`` shows a table.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> from stabljax import nn
      >>> from stabljax.init import check_init
      >>> from stabljax.step import nnx_apply
      >>> model = nn.TransformerLM(nn.TransformerConfig(d_model=32, n_layers=2), rngs=nnx.Rngs(0))
      >>> apply_fn, params = nnx_apply(model, return_aux=True)
      >>> tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
      >>> batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
      >>> report = check_init(apply_fn, params, batch)
      >>> print(report.ok, round(report.loss - report.log_vocab, 1))
      True 0.0

    References:
      Xiong et al., `On Layer Normalization in the Transformer Architecture
      <https://arxiv.org/abs/2002.04745>`_, 2020

      Takase et al., `Spike No More: Stabilizing the Pre-training of Large Language Models
      <https://arxiv.org/abs/2312.16903>`_, 2023

      Team OLMo et al., `2 OLMo 2 Furious <https://arxiv.org/abs/2501.00656>`_, 2024

      Wortsman et al., `Small-scale proxies for large-scale Transformer training
      instabilities <https://arxiv.org/abs/2309.14322>`_, 2023

      Derrida, `Random-energy model: An exactly solvable model of disordered systems
      <https://doi.org/10.1103/PhysRevB.24.2613>`_, 1981
    """
    if not growth_bound > 1:
        raise ValueError(f"growth_bound must be > 1, got {growth_bound}")
    for name, value in (
        ("logit_std_bound", logit_std_bound),
        ("loss_excess_bound", loss_excess_bound),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if not grad_spread_bound > 1:
        raise ValueError(f"grad_spread_bound must be > 1, got {grad_spread_bound}")
    for key in ("inputs", "targets"):
        if key not in batch:
            raise ValueError(f"batch needs an {key!r} entry, got keys {list(batch)}")
    loss_fn = _default_loss if loss_fn is None else loss_fn
    try:
        hash((apply_fn, loss_fn))
        measure = _measure_cached
    except TypeError:
        measure = _measure_jit
    loss, stats, sumsq, vocab = measure(apply_fn, loss_fn, params, dict(batch))
    loss, stats, sumsq = jax.device_get((loss, stats, sumsq))
    vocab = int(vocab.shape[-1])

    # Per-layer gradient RMS, grouping leaves by the layer index in their path.
    sizes = jax.tree.map(lambda x: int(np.size(x)), params)
    by_layer: dict[int, list[float]] = {}
    nonfinite_paths = []
    for (path, s), n in zip(
        jax.tree_util.tree_flatten_with_path(sumsq)[0], jax.tree.leaves(sizes), strict=True
    ):
        if not np.isfinite(s):
            nonfinite_paths.append(jax.tree_util.keystr(path))
        layer = _layer_of(path)
        if layer is not None:
            acc = by_layer.setdefault(layer, [0.0, 0])
            acc[0] += float(s)
            acc[1] += n
    grad_rms = np.array(
        [np.sqrt(by_layer[i][0] / max(by_layer[i][1], 1)) for i in sorted(by_layer)],
        np.float64,
    )

    loss = float(loss)
    log_vocab = math.log(vocab)
    logit_std = float(stats["logit_std"])
    residual = stats.get("residual_rms")
    residual = None if residual is None else np.asarray(residual, np.float64)
    max_attn = stats.get("max_attn_logit")
    max_attn = None if max_attn is None else float(max_attn)
    seq_len = int(np.shape(batch["inputs"])[-1])
    flags: list[InitFlag] = []

    growth = None
    if residual is not None and len(residual) >= 2:
        n_layers = len(residual) - 1
        ratio = float(residual[-1] / residual[0])
        growth = math.log(ratio) / n_layers if ratio > 0 and np.isfinite(ratio) else math.nan
        if not np.isfinite(ratio) or ratio > growth_bound:
            if np.isfinite(ratio) and ratio > 1:
                factor = math.sqrt((growth_bound**2 - 1) / (ratio**2 - 1))
                how = f"multiply the std of the residual output projections by ≤ {factor:.2g}"
            else:
                how = "lower the std of the residual output projections"
            flags.append(
                InitFlag(
                    "residual_growth",
                    ratio,
                    growth_bound,
                    f"residual RMS grows ×{ratio:.3g} over {n_layers} layers "
                    f"(λ = {growth:.3g}; bound ×{growth_bound:g})",
                    f"{how}, e.g. σ/√(2L) = σ/{math.sqrt(2 * n_layers):.3g} (scheme 'gpt2') "
                    "or σ/√(2(l+1)) ('depth_scaled'), or raise the embedding std",
                )
            )
        elif ratio < 1 / growth_bound:
            flags.append(
                InitFlag(
                    "residual_growth",
                    ratio,
                    1 / growth_bound,
                    f"residual RMS shrinks ×{ratio:.3g} over {n_layers} layers "
                    f"(λ = {growth:.3g}; bound ×{1 / growth_bound:g})",
                    "the blocks cancel the input stream: check the sign/scale of the residual "
                    "path (residual α, output-projection std)",
                )
            )

    grad_growth = None
    if len(grad_rms) >= 2 and np.all(grad_rms > 0) and np.all(np.isfinite(grad_rms)):
        grad_growth = math.log(grad_rms[0] / grad_rms[-1]) / len(grad_rms)
        spread = float(grad_rms.max() / grad_rms.min())
        if spread > grad_spread_bound:
            lo, hi = int(np.argmin(grad_rms)), int(np.argmax(grad_rms))
            flags.append(
                InitFlag(
                    "grad_spread",
                    spread,
                    grad_spread_bound,
                    f"per-layer gradient RMS spans ×{spread:.3g} (layer {hi}: "
                    f"{grad_rms[hi]:.3g}, layer {lo}: {grad_rms[lo]:.3g}; "
                    f"bound ×{grad_spread_bound:g})",
                    "keep the residual stream's RMS flat across depth: depth-scale the "
                    "residual output projections (scheme 'gpt2' or 'depth_scaled')",
                )
            )
    if nonfinite_paths:
        flags.append(
            InitFlag(
                "grad_nonfinite",
                float(len(nonfinite_paths)),
                0.0,
                f"non-finite gradients at init in {', '.join(nonfinite_paths[:4])}"
                + (" ..." if len(nonfinite_paths) > 4 else ""),
                "lower the init std (an overflow) or look for a 0/0 in the model",
            )
        )
    dead = [i for i, g in enumerate(grad_rms) if g == 0]
    if dead:
        flags.append(
            InitFlag(
                "grad_zero",
                float(len(dead)),
                0.0,
                f"layers {dead} get exactly zero gradient at init",
                "a zero-initialised path blocks the gradient: give one of its weights a "
                "nonzero std",
            )
        )

    if not np.isfinite(logit_std) or logit_std > logit_std_bound:
        flags.append(
            InitFlag(
                "logit_std",
                logit_std,
                logit_std_bound,
                f"output-logit std {logit_std:.3g} > {logit_std_bound:.3g}",
                f"multiply the unembedding std (the embedding's, when tied) by "
                f"≤ {logit_std_bound / logit_std:.2g}"
                if np.isfinite(logit_std) and logit_std > 0
                else "lower the unembedding std (the embedding's, when tied)",
            )
        )
    excess = loss - log_vocab
    if not math.isfinite(loss) or abs(excess) > loss_excess_bound:
        flags.append(
            InitFlag(
                "initial_loss",
                loss,
                loss_excess_bound,
                f"initial loss {loss:.4g} is {excess:+.3g} from log(vocab) = {log_vocab:.4g} "
                f"(bound ±{loss_excess_bound:g})",
                "bring the output-logit std down (std of the unembedding, or of the "
                "embedding when tied) so the model starts near uniform"
                if not math.isfinite(loss) or excess > 0
                else "the loss is below chance at init: check that targets are not inputs",
            )
        )
    attn_bound = 2.0 * math.log(max(seq_len, 2))
    if max_attn is not None and (not math.isfinite(max_attn) or max_attn > attn_bound):
        flags.append(
            InitFlag(
                "attn_logit",
                max_attn,
                attn_bound,
                f"max attention logit {max_attn:.3g} > 2·log T = {attn_bound:.3g}: "
                "attention is saturated at init",
                "lower the std of the query/key projections (e.g. 1/√d_model or 0.02) or "
                "turn on qk_norm",
            )
        )

    return InitReport(
        loss=loss,
        log_vocab=log_vocab,
        logit_std=logit_std,
        residual_rms=residual,
        growth_exponent=growth,
        grad_rms=grad_rms,
        grad_growth_exponent=grad_growth,
        max_attn_logit=max_attn,
        seq_len=seq_len,
        flags=tuple(flags),
    )
