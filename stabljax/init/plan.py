"""Init plans: the std of every parameter group of a Transformer under a named scheme.

:func:`init_plan` turns an architecture description (:class:`ArchSpec`) and a scheme name
into an :class:`InitPlan`. Each scheme is one small function in :data:`SCHEMES`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from stabljax.init.initializers import (
    Initializer,
    check_int,
    check_std,
    deepnet_alpha,
    deepnet_beta,
    normal,
    truncated_std_factor,
)

_BLOCK_GROUPS = ("attn_q", "attn_k", "attn_v", "attn_out", "mlp_in", "mlp_out")
_OUTS = ("attn_out", "mlp_out")


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
            check_int("ArchSpec", getattr(self, name), name)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        check_int("ArchSpec", self.d_ff, "d_ff")
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


@dataclasses.dataclass
class _Entries:
    """The entries a scheme function fills in, and the residual α it may set."""

    spec: ArchSpec
    entries: dict[str, PlanEntry] = dataclasses.field(default_factory=dict)
    alpha: float = 1.0
    alpha_formula: str = "1"

    @property
    def ins(self) -> tuple[str, ...]:
        """Every group but the residual output projections."""
        return tuple(g for g in self.spec.groups() if g not in _OUTS)

    def uniform(self, value: float, formula: str, truncated: bool, which=None) -> None:
        for g in self.spec.groups() if which is None else which:
            self.entries[g] = PlanEntry(value, formula, truncated)

    def per_layer(self, group: str, fn: Callable[[int], tuple[float, str]], truncated: bool):
        for layer in range(self.spec.n_layers):
            value, formula = fn(layer)
            self.entries[f"blocks.{layer}.{group}"] = PlanEntry(value, formula, truncated)


def _gpt2(p: _Entries, std: float) -> None:
    n = p.spec.n_layers
    p.uniform(std, f"σ = {_fmt(std)}", False)
    p.uniform(std / math.sqrt(2 * n), f"σ/√(2L) = {_fmt(std)}/√(2·{n})", False, _OUTS)


def _olmo2(p: _Entries, std: float) -> None:
    p.uniform(std, f"σ = {_fmt(std)}", True)


def _small_init(p: _Entries, std: float) -> None:
    del std  # the scheme's stds follow from d and L alone
    d, n = p.spec.d_model, p.spec.n_layers
    p.uniform(math.sqrt(2 / (5 * d)), f"√(2/(5d)) = √(2/(5·{d}))", False)
    p.uniform(2 / (n * math.sqrt(d)), f"2/(L·√d) = 2/({n}·√{d})", False, _OUTS)


def _depth_scaled(p: _Entries, std: float) -> None:
    p.uniform(std, f"σ = {_fmt(std)}", True, p.ins)
    for g in _OUTS:
        p.per_layer(
            g,
            lambda i: (std / math.sqrt(2 * (i + 1)), f"σ/√(2(l+1)) = {_fmt(std)}/√(2·{i + 1})"),
            True,
        )


def _mitchell(p: _Entries, std: float) -> None:
    del std  # 1/√(fan-in) throughout
    d, d_ff = p.spec.d_model, p.spec.d_ff
    p.uniform(1 / math.sqrt(d), f"1/√d = 1/√{d}", True, p.ins)
    for group, n, name in (("attn_out", d, "d"), ("mlp_out", d_ff, "d_ff")):
        p.per_layer(
            group,
            lambda i, n=n, name=name: (
                1 / math.sqrt(2 * n * (i + 1)),
                f"1/√(2·{name}·(l+1)) = 1/√(2·{n}·{i + 1})",
            ),
            True,
        )


def _fan_in(p: _Entries, std: float) -> None:
    del std  # 1/√(fan-in) throughout
    d, d_ff = p.spec.d_model, p.spec.d_ff
    p.uniform(1 / math.sqrt(d), f"1/√fan_in = 1/√{d}", False)
    p.uniform(1 / math.sqrt(d_ff), f"1/√fan_in = 1/√{d_ff}", False, ("mlp_out",))


def _deepnet(p: _Entries, std: float) -> None:
    del std  # Xavier with DeepNet's gain
    if p.spec.norm_placement != "post":
        raise ValueError(
            "scheme 'deepnet' is DeepNorm, x <- LN(α·x + f(x)): it needs "
            "norm_placement='post' in the ArchSpec (and the model)"
        )
    d, d_ff, n = p.spec.d_model, p.spec.d_ff, p.spec.n_layers
    beta = deepnet_beta(n)
    p.alpha, p.alpha_formula = deepnet_alpha(n), f"(2L)^(1/4) = (2·{n})^(1/4)"
    b = f"β = (8L)^(-1/4) = {beta:.4g}"
    p.uniform(1 / math.sqrt(d), f"1/√d = 1/√{d}", False, p.ins)
    xavier_dd = math.sqrt(2 / (d + d))
    xavier_df = math.sqrt(2 / (d + d_ff))
    p.uniform(xavier_dd, f"√(2/(d+d)) = √(2/({d}+{d}))", False, ("attn_q", "attn_k"))
    p.uniform(beta * xavier_dd, f"β·√(2/(d+d)), {b}, d={d}", False, ("attn_v", "attn_out"))
    p.uniform(
        beta * xavier_df, f"β·√(2/(d+d_ff)), {b}, d={d}, d_ff={d_ff}", False, ("mlp_in", "mlp_out")
    )


def _fixed(p: _Entries, std: float) -> None:
    p.uniform(std, f"σ = {_fmt(std)} (fixed)", False)


def _fixed_std(scheme: str) -> float:
    try:
        return check_std("init_plan", float(scheme.split(":", 1)[1]), "scheme")
    except ValueError as e:
        raise ValueError(f"scheme 'fixed:<std>' needs a number >= 0, got {scheme!r}") from e


#: Scheme name -> the function that fills in a plan's entries, given the base σ (the σ
#: of ``fixed:<std>`` for that one; ``fixed:<std>`` takes any std, e.g. ``fixed:1.0``).
SCHEMES: Mapping[str, Callable[[_Entries, float], None]] = {
    "deepnet": _deepnet,
    "depth_scaled": _depth_scaled,
    "fan_in": _fan_in,
    "fixed:<std>": _fixed,
    "gpt2": _gpt2,
    "llama_depth": _depth_scaled,
    "mitchell": _mitchell,
    "olmo2": _olmo2,
    "small_init": _small_init,
}


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
    base = check_std("init_plan", std)
    if scheme.startswith("fixed:"):
        fill, arg = SCHEMES["fixed:<std>"], _fixed_std(scheme)
    elif scheme in SCHEMES and scheme != "fixed:<std>":
        fill, arg = SCHEMES[scheme], base
    else:
        raise ValueError(f"unknown init scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    plan = _Entries(spec)
    fill(plan, arg)
    order = {g: i for i, g in enumerate(spec.groups())}

    def sort_key(k: str):
        g, layer = _split_key(k)
        return (order[g], -1 if layer is None else layer)

    entries = {k: plan.entries[k] for k in sorted(plan.entries, key=sort_key)}
    return InitPlan(spec, scheme, entries, plan.alpha, plan.alpha_formula)
