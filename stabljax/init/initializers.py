"""Initializers with the ``jax.nn.initializers`` signature, one per published scheme.

Each returns ``init(key, shape, dtype=None, out_sharding=None) -> Array``, so it drops into
``nnx.Linear(kernel_init=...)`` or any linen module. ``std`` is always the σ of the
*untruncated* normal (see :mod:`stabljax.init`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from stabljax.base import validate

Initializer = Callable[..., jax.Array]


def check_std(owner: str, value: float, name: str = "std") -> float:
    """``value`` as a float, or ``ValueError`` naming ``name`` unless finite and >= 0."""
    validate(owner, name, value, _finite_nonneg, "a finite number >= 0")
    return float(value)


def check_int(owner: str, value: int, name: str, low: int = 1) -> int:
    """``value`` as an int, or ``ValueError`` naming ``name`` unless an integer >= ``low``."""
    validate(owner, name, value, lambda a: _is_int(a) and a >= low, f"an integer >= {low}")
    return int(value)


def _is_int(a: np.ndarray) -> bool:
    return a.ndim == 0 and a.dtype.kind in "iu"


def _finite_nonneg(a: np.ndarray) -> bool:
    return a.ndim == 0 and a.dtype.kind in "iuf" and bool(np.isfinite(a)) and a >= 0


def _check_bound(owner: str, bound: float) -> float:
    validate(owner, "bound", bound, lambda a: a > 0, "> 0")
    return float(bound)


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
    bound = _check_bound("truncated_std_factor", bound)
    pdf = math.exp(-0.5 * bound * bound) / math.sqrt(2.0 * math.pi)
    mass = math.erf(bound / math.sqrt(2.0))
    return math.sqrt(1.0 - 2.0 * bound * pdf / mass)


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
    std = check_std("normal", std)
    bound = _check_bound("normal", bound)

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
    d = check_int("small_init", d_model, "d_model")
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
    d = check_int("wang_init", d_model, "d_model")
    n = check_int("wang_init", n_layers, "n_layers")
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
    n = check_int("scaled_residual", n_layers, "n_layers")
    return normal(check_std("scaled_residual", std) / math.sqrt(2.0 * n), truncate=truncate)


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
    std = check_std("depth_scaled", std)
    layer = check_int("depth_scaled", layer, "layer", low=0)
    return normal(std / math.sqrt(2.0 * (layer + 1)), truncate=truncate)


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
    n = check_int("mitchell", fan_in_dim, "fan_in_dim")
    std = 1.0 / math.sqrt(n)
    if layer is not None:
        std /= math.sqrt(2.0 * (check_int("mitchell", layer, "layer", low=0) + 1))
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
        return normal(1.0 / math.sqrt(check_int("fan_in", fan_in_dim, "fan_in_dim")))

    def init(key, shape, dtype=None, out_sharding=None) -> jax.Array:
        n = check_int("fan_in", int(shape[in_axis]), "shape[in_axis]")
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
    return (2.0 * check_int("deepnet_alpha", n_layers, "n_layers")) ** 0.25


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
    return (8.0 * check_int("deepnet_beta", n_layers, "n_layers")) ** -0.25


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
    gain = check_std("deepnet", gain, "gain")

    def init(key, shape, dtype=None, out_sharding=None) -> jax.Array:
        n_in = int(shape[-2]) if fan_in_dim is None else fan_in_dim
        n_out = int(shape[-1]) if fan_out_dim is None else fan_out_dim
        std = gain * math.sqrt(2.0 / (n_in + n_out))
        return normal(std)(key, shape, dtype, out_sharding)

    return init
