"""A small Flax NNX decoder-only Transformer LM, the reference model of stabljax.

For tests, experiments and benchmarks: learned token and positional embeddings, causal
multi-head attention with a fused qkv projection, a GELU MLP, pre-norm (``x + f(LN(x))``)
or post-norm / DeepNorm (``LN(α·x + f(x))``) blocks, LayerNorm or RMSNorm, optional
qk-norm, biases, attention-logit soft-capping, tied or untied embeddings. Compute runs in
``config.dtype`` (bfloat16 works), parameters live in ``config.param_dtype``, attention
scores, softmax and output logits are float32.

Every weight is drawn from an :class:`~stabljax.init.InitPlan` —
``init_plan(config.arch_spec(), config.init_scheme)`` by default, or any plan passed as
``plan=`` — so each parameter group has the planned std (q, k and v are separate groups,
drawn slice by slice into the fused kernel). Biases start at 0, norm scales at 1.

``model(tokens, return_aux=True)`` returns ``(logits, aux)`` with

- ``aux["max_attn_logit"]``: f32 scalar, the max over layers, heads and causal positions
  of the raw pre-softmax logit q·k/√d_head (before any soft-cap, which would hide its
  growth), the quantity Wortsman et al. watch;
- ``aux["max_attn_logits"]``: f32[n_layers, n_heads], the same max per layer and head,
  what :func:`stabljax.qk_clip` reads (``make_train_step`` passes it as ``max_logits=``);
- ``aux["residual_rms"]``: f32[n_layers + 1], the RMS of the residual stream at the input
  of the first block and after each block.

That ``(logits, aux)`` pair is the contract :func:`stabljax.init.check_init` reads;
:func:`stabljax.step.nnx_apply` turns a model into the ``apply_fn(params, inputs)`` it takes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from stabljax.init.plan import ArchSpec, InitPlan, init_plan
from stabljax.metrics import MAX_ATTN_LOGIT, MAX_ATTN_LOGITS, RESIDUAL_RMS
from stabljax.optim.qk_clip import QKHeads, QKLayer

__all__ = ("TransformerConfig", "TransformerLM", "norm_layer")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Configuration of :class:`TransformerLM`.

    Attributes:
      vocab_size: vocabulary size.
      d_model: width.
      n_layers: number of blocks.
      n_heads: attention heads (must divide ``d_model``).
      d_ff: MLP hidden width; None means ``4 * d_model``.
      max_len: longest sequence (size of the positional embedding).
      norm: ``"layernorm"`` or ``"rmsnorm"``.
      norm_placement: ``"pre"`` (``x + f(norm(x))``, then a final norm) or ``"post"``
        (``norm(α·x + f(x))`` with α from the plan, DeepNorm; the embeddings are normed too).
      qk_norm: normalise queries and keys per head (with ``norm``) before the dot product.
      use_bias: biases in the linear layers and LayerNorms.
      tie_embeddings: the unembedding is the transposed token embedding.
      init_scheme: a scheme name :func:`stabljax.init.init_plan` knows.
      dtype: compute dtype (activations), e.g. ``jnp.bfloat16``.
      param_dtype: parameter dtype.
      attn_logit_softcap: if set, attention logits become ``c·tanh(logits/c)``.
      norm_eps: epsilon of the norms.
      remat: recompute each block's activations in the backward pass
        (``nnx.remat``) instead of keeping them: less memory, about one more forward.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int | None = None
    max_len: int = 256
    norm: str = "layernorm"
    norm_placement: str = "pre"
    qk_norm: bool = False
    use_bias: bool = False
    tie_embeddings: bool = True
    init_scheme: str = "gpt2"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    attn_logit_softcap: float | None = None
    norm_eps: float = 1e-5
    remat: bool = False

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if not (isinstance(self.max_len, int) and self.max_len >= 1):
            raise ValueError(f"max_len must be an integer >= 1, got {self.max_len!r}")
        if self.attn_logit_softcap is not None and not self.attn_logit_softcap > 0:
            raise ValueError(
                f"attn_logit_softcap must be None or > 0, got {self.attn_logit_softcap}"
            )
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
        self.arch_spec()  # validates the shared fields

    def arch_spec(self) -> ArchSpec:
        """The :class:`~stabljax.init.ArchSpec` an init plan for this model needs."""
        return ArchSpec(
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            vocab_size=self.vocab_size,
            tie_embeddings=self.tie_embeddings,
            norm_placement=self.norm_placement,
            pos_embed=True,
        )


def _concat_init(inits: Sequence[Callable[..., jax.Array]], sizes: Sequence[int]):
    """An initializer that draws column blocks of a kernel with different initializers."""

    def init(key, shape, dtype=None, out_sharding=None):
        keys = jax.random.split(key, len(inits))
        parts = [f(k, (*shape[:-1], n), dtype) for f, k, n in zip(inits, keys, sizes, strict=True)]
        return jnp.concatenate(parts, axis=-1)

    return init


def norm_layer(config: TransformerConfig, features: int, rngs: nnx.Rngs) -> nnx.Module:
    """The model's norm (``config.norm``: LayerNorm or RMSNorm) over ``features``."""
    common = dict(
        epsilon=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs
    )
    if config.norm == "rmsnorm":
        return nnx.RMSNorm(features, **common)
    return nnx.LayerNorm(features, use_bias=config.use_bias, **common)


def _rms(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))


class Attention(nnx.Module):
    """Causal multi-head self-attention with a fused qkv projection."""

    def __init__(self, config: TransformerConfig, plan: InitPlan, layer: int, *, rngs: nnx.Rngs):
        d = config.d_model
        self.n_heads = config.n_heads
        self.head_dim = d // config.n_heads
        self.softcap = config.attn_logit_softcap
        self.dtype = config.dtype
        qkv_init = _concat_init(
            [plan.initializer(g, layer) for g in ("attn_q", "attn_k", "attn_v")], [d, d, d]
        )
        common = dict(
            use_bias=config.use_bias,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=qkv_init, **common)
        self.out = nnx.Linear(d, d, kernel_init=plan.initializer("attn_out", layer), **common)
        if config.qk_norm:
            self.q_norm = norm_layer(config, self.head_dim, rngs)
            self.k_norm = norm_layer(config, self.head_dim, rngs)
        else:
            self.q_norm = nnx.data(None)
            self.k_norm = nnx.data(None)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.n_heads, self.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        scores = scores * (1.0 / math.sqrt(self.head_dim))
        causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
        max_logit = jnp.max(jnp.where(causal, scores, -jnp.inf), axis=(0, 2, 3))  # per head
        if self.softcap is not None:
            scores = self.softcap * jnp.tanh(scores / self.softcap)
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        y = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d)
        return self.out(y), max_logit


class MLP(nnx.Module):
    """Two-layer GELU MLP."""

    def __init__(self, config: TransformerConfig, plan: InitPlan, layer: int, *, rngs: nnx.Rngs):
        common = dict(
            use_bias=config.use_bias,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )
        d, f = config.d_model, config.d_ff
        self.fc_in = nnx.Linear(d, f, kernel_init=plan.initializer("mlp_in", layer), **common)
        self.fc_out = nnx.Linear(f, d, kernel_init=plan.initializer("mlp_out", layer), **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc_out(jax.nn.gelu(self.fc_in(x)))


class Block(nnx.Module):
    """One Transformer layer: attention then MLP, pre-norm or post-norm (DeepNorm)."""

    def __init__(self, config: TransformerConfig, plan: InitPlan, layer: int, *, rngs: nnx.Rngs):
        self.post = config.norm_placement == "post"
        self.alpha = float(plan.residual_alpha)
        self.norm1 = norm_layer(config, config.d_model, rngs)
        self.attn = Attention(config, plan, layer, rngs=rngs)
        self.norm2 = norm_layer(config, config.d_model, rngs)
        self.mlp = MLP(config, plan, layer, rngs=rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.post:
            a, max_logit = self.attn(x)
            x = self.norm1(self.alpha * x + a)
            x = self.norm2(self.alpha * x + self.mlp(x))
        else:
            a, max_logit = self.attn(self.norm1(x))
            x = x + a
            x = x + self.mlp(self.norm2(x))
        return x, max_logit


def _call_block(block: Block, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    return block(h)


class TransformerLM(nnx.Module):
    """Decoder-only Transformer language model, initialised from an init plan.

    Args:
      config: a :class:`TransformerConfig`.
      rngs: ``nnx.Rngs`` for the parameters.
      plan: an :class:`~stabljax.init.InitPlan` for ``config.arch_spec()``; default
        ``init_plan(config.arch_spec(), config.init_scheme)``.

    Call ``model(tokens)`` with int tokens ``[B, T]`` (T ≤ ``max_len``) for float32 logits
    ``[B, T, vocab]``, or ``model(tokens, return_aux=True)`` for ``(logits, aux)`` (see the
    module docstring).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from stabljax.reference.nn import TransformerConfig, TransformerLM
      >>> model = TransformerLM(TransformerConfig(d_model=32, n_layers=2), rngs=nnx.Rngs(0))
      >>> logits, aux = model(jnp.zeros((2, 8), jnp.int32), return_aux=True)
      >>> print(logits.shape, logits.dtype, aux["residual_rms"].shape)
      (2, 8, 256) float32 (3,)

    References:
      Wang et al., `DeepNet: Scaling Transformers to 1,000 Layers
      <https://arxiv.org/abs/2203.00555>`_, 2022

      Wortsman et al., `Small-scale proxies for large-scale Transformer training
      instabilities <https://arxiv.org/abs/2309.14322>`_, 2023
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, plan: InitPlan | None = None):
        spec = config.arch_spec()
        if plan is None:
            plan = init_plan(spec, config.init_scheme)
        elif plan.spec != spec:
            raise ValueError(
                f"plan was made for {plan.spec}, but the model is {spec}; "
                "build it with init_plan(config.arch_spec(), scheme)"
            )
        if config.norm_placement == "pre" and plan.residual_alpha != 1.0:
            raise ValueError(
                f"residual_alpha={plan.residual_alpha} needs norm_placement='post' (DeepNorm)"
            )
        self.config = config
        d = config.d_model
        pdt, dt = config.param_dtype, config.dtype
        self.embed = nnx.Embed(
            config.vocab_size,
            d,
            dtype=dt,
            param_dtype=pdt,
            embedding_init=plan.initializer("embed"),
            rngs=rngs,
        )
        self.pos_embed = nnx.Param(
            plan.initializer("pos_embed")(rngs.params(), (config.max_len, d), pdt)
        )
        self.embed_norm = (
            norm_layer(config, d, rngs) if config.norm_placement == "post" else nnx.data(None)
        )
        self.blocks = nnx.List(
            [Block(config, plan, layer, rngs=rngs) for layer in range(config.n_layers)]
        )
        self.final_norm = (
            norm_layer(config, d, rngs) if config.norm_placement == "pre" else nnx.data(None)
        )
        if config.tie_embeddings:
            self.unembed = nnx.data(None)
        else:
            self.unembed = nnx.Param(
                plan.initializer("unembed")(rngs.params(), (d, config.vocab_size), pdt)
            )

    def __call__(self, tokens: jax.Array, *, return_aux: bool = False):
        t = tokens.shape[-1]
        if t > self.config.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.config.max_len}")
        dt = self.config.dtype
        h = self.embed(tokens) + self.pos_embed[...][:t].astype(dt)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        h, rms, max_logits = self._run_blocks(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        if self.unembed is None:
            w = self.embed.embedding[...].astype(dt)
            logits = jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
        else:
            w = self.unembed[...].astype(dt)
            logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        logits = logits.astype(jnp.float32)
        if not return_aux:
            return logits
        return logits, {
            MAX_ATTN_LOGIT: jnp.max(max_logits),
            MAX_ATTN_LOGITS: max_logits,
            RESIDUAL_RMS: rms,
        }

    def _run_blocks(self, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        rms0 = _rms(h)[None]
        rms, max_logits = [], []
        call = nnx.remat(_call_block) if self.config.remat else _call_block
        for block in self.blocks:
            h, max_logit = call(block, h)
            rms.append(_rms(h))
            max_logits.append(max_logit)
        return h, jnp.concatenate([rms0, jnp.stack(rms)]), jnp.stack(max_logits)

    def qk_layers(self) -> dict[int, QKLayer]:
        """The query and key heads of every layer, for :func:`stabljax.qk_clip`.

        ``{layer: QKLayer(q, k)}`` over the fused qkv kernel (q the first ``d_model``
        columns, k the next, ``n_heads`` heads of ``d_model // n_heads`` each; and the
        fused bias with ``use_bias``), keyed like the rows of ``aux["max_attn_logits"]``.

        Raises:
          ValueError: with ``qk_norm``, where rescaling W_q and W_k does not change the
            logits.
        """
        cfg = self.config
        if cfg.qk_norm:
            raise ValueError(
                "qk_layers: with qk_norm=True the logits do not depend on the scale of W_q "
                "and W_k, so qk_clip cannot act on them"
            )
        d, h = cfg.d_model, cfg.n_heads
        names = ("kernel", "bias") if cfg.use_bias else ("kernel",)
        out = {}
        for layer in range(cfg.n_layers):
            path = f"blocks/{layer}/attn/qkv/"
            q = tuple(QKHeads(path + n, h, axis=-1, offset=0, head_width=d // h) for n in names)
            k = tuple(QKHeads(path + n, h, axis=-1, offset=d, head_width=d // h) for n in names)
            out[layer] = QKLayer(q=q, k=k)
        return out

    def param_groups(self) -> dict[str, jax.Array]:
        """Every planned weight by its plan key (``embed``, ``blocks.<l>.attn_q``, ...).

        q, k and v are the column slices of the fused qkv kernel. This is how tests and
        users compare a built model against its plan.
        """
        d = self.config.d_model
        out = {"embed": self.embed.embedding[...], "pos_embed": self.pos_embed[...]}
        for layer, block in enumerate(self.blocks):
            qkv = block.attn.qkv.kernel[...]
            p = f"blocks.{layer}."
            out[p + "attn_q"] = qkv[:, :d]
            out[p + "attn_k"] = qkv[:, d : 2 * d]
            out[p + "attn_v"] = qkv[:, 2 * d :]
            out[p + "attn_out"] = block.attn.out.kernel[...]
            out[p + "mlp_in"] = block.mlp.fc_in.kernel[...]
            out[p + "mlp_out"] = block.mlp.fc_out.kernel[...]
        if self.unembed is not None:
            out["unembed"] = self.unembed[...]
        return out
