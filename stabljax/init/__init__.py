"""Initialisation: the schemes in use today, a per-group plan, and a check at init.

Three pieces, usable on their own:

- **Initializers** with the ``jax.nn.initializers`` signature
  ``init(key, shape, dtype=None, out_sharding=None) -> Array``, one per published scheme
  (:func:`normal`, :func:`small_init`, :func:`wang_init`, :func:`scaled_residual`,
  :func:`depth_scaled`, :func:`mitchell`, :func:`fan_in`, :func:`deepnet`), so they drop
  into ``nnx.Linear(kernel_init=...)`` or any linen module.
- **Plans**: :func:`init_plan` turns an architecture description (:class:`ArchSpec`) and a
  scheme name into the std of every parameter group and the formula behind it
  (:class:`InitPlan`, printable as a table). ``stabljax.reference.TransformerLM`` is built from one.
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

The package's modules: :mod:`~stabljax.init.initializers`, :mod:`~stabljax.init.plan` (the
:data:`SCHEMES` table), :mod:`~stabljax.init.check` and :mod:`~stabljax.init.report`.
"""

from stabljax.init.check import check_init as check_init
from stabljax.init.initializers import deepnet as deepnet
from stabljax.init.initializers import deepnet_alpha as deepnet_alpha
from stabljax.init.initializers import deepnet_beta as deepnet_beta
from stabljax.init.initializers import depth_scaled as depth_scaled
from stabljax.init.initializers import fan_in as fan_in
from stabljax.init.initializers import mitchell as mitchell
from stabljax.init.initializers import normal as normal
from stabljax.init.initializers import scaled_residual as scaled_residual
from stabljax.init.initializers import small_init as small_init
from stabljax.init.initializers import truncated_std_factor as truncated_std_factor
from stabljax.init.initializers import wang_init as wang_init
from stabljax.init.plan import SCHEMES as SCHEMES
from stabljax.init.plan import ArchSpec as ArchSpec
from stabljax.init.plan import InitPlan as InitPlan
from stabljax.init.plan import PlanEntry as PlanEntry
from stabljax.init.plan import init_plan as init_plan
from stabljax.init.report import InitFlag as InitFlag
from stabljax.init.report import InitReport as InitReport

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
