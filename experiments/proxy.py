"""The reference proxy every experiment trains: model, data and optimizer of one setup.

Wortsman et al.'s small-scale proxy: a pre-LN decoder, AdamW (0.9, 0.95), linear warmup
then cosine decay to 0, a byte-level LM on the embedded corpus
(:func:`stabljax.reference.corpus.default_corpus`). :class:`ModelSize` is the base of every
experiment's and benchmark's config; :class:`SweepConfig` adds what every sweep shares.
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Setup:
    """Model, data and optimizer of one training run.

    Pre-LN decoder, AdamW (0.9, 0.95), eps 1e-8, clip 1.0, linear warmup then cosine decay
    to 0, byte-level LM on the embedded corpus
    (:func:`stabljax.reference.corpus.default_corpus`).
    """

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    batch_size: int = 16
    norm: str = "layernorm"
    qk_norm: bool = False
    init_scheme: str = "gpt2"
    embed: str = "plain"
    lr: float = 3e-3
    warmup_frac: float = 0.05
    steps: int = 300
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 1e-4
    clip: float = 1.0
    z_loss: float = 0.0
    precision: str = "fp32"
    seed: int = 0
    corpus_bytes: int = 2_000_000
    corpus: str | None = None
    eval_batches: int = 8


def precision_of(name: str):
    """``"fp32" | "bf16" | "fp16" | "fp16-noscale"`` -> a :class:`stabljax.Precision`."""
    import jax.numpy as jnp

    import stabljax

    if name == "fp32":
        return stabljax.Precision.fp32()
    if name == "bf16":
        return stabljax.Precision.bf16()
    if name == "fp16":
        return stabljax.Precision.fp16()
    if name == "fp16-noscale":
        return stabljax.Precision(compute_dtype=jnp.float16)
    raise ValueError(f"precision must be fp32, bf16, fp16 or fp16-noscale, got {name!r}")


def model_config(s: Setup, *, n_layers: int | None = None):
    """The :class:`stabljax.reference.nn.TransformerConfig` of the reference model of ``s``.

    The model computes in ``s.precision``'s compute dtype: :class:`stabljax.Precision`
    casts the parameters to it, but a Flax layer promotes its inputs to the layer's own
    ``dtype``, so without this the float16 arms would compute in float32 and never
    overflow.
    """
    import jax.numpy as jnp

    from stabljax.reference.nn import TransformerConfig

    return TransformerConfig(
        vocab_size=256,
        d_model=s.d_model,
        n_layers=n_layers or s.n_layers,
        n_heads=s.n_heads,
        max_len=s.seq_len,
        norm=s.norm,
        qk_norm=s.qk_norm,
        init_scheme=s.init_scheme,
        dtype=jnp.dtype(precision_of(s.precision).compute_dtype),
    )


#: ``Setup.embed``: how the token embeddings enter the residual stream. ``"plain"``: as
#: they are (the reference model). Takase et al.'s remedies (`Spike No More
#: <https://arxiv.org/abs/2312.16903>`_, 2023), which give the embeddings a std near 1:
#: ``"scaled"`` multiplies them by √d_model in the forward pass (Scaled Embed; a tied
#: unembedding keeps the unscaled weight), ``"layernorm"`` normalises token + position
#: embedding before the first block (Embed LN). Same parameters as ``"plain"`` (``"layernorm"``
#: adds the norm's), drawn from the same seed.
EMBEDS = ("plain", "scaled", "layernorm")


def _embedded_model(cfg, seed: int, embed: str):
    """The reference Transformer with ``embed`` (see :data:`EMBEDS`)."""
    import math

    from flax import nnx

    from stabljax.reference.nn import TransformerLM, norm_layer

    if embed not in EMBEDS:
        raise ValueError(f"embed must be one of {EMBEDS}, got {embed!r}")
    model = TransformerLM(cfg, rngs=nnx.Rngs(seed))
    if embed == "scaled":
        model.embed.__class__ = _ScaledEmbed()
        model.embed.embed_scale = math.sqrt(cfg.d_model)
    elif embed == "layernorm":
        if cfg.norm_placement != "pre":
            raise ValueError("embed='layernorm' needs a pre-LN model (post-LN norms them already)")
        model.embed_norm = norm_layer(cfg, cfg.d_model, nnx.Rngs(seed))
    return model


@functools.cache
def _ScaledEmbed():
    """``nnx.Embed`` whose lookup is multiplied by ``embed_scale`` (its ``attend``, the tied
    unembedding, is not: the model reads ``embedding`` directly)."""
    from flax import nnx

    class ScaledEmbed(nnx.Embed):
        def __call__(self, inputs):
            return super().__call__(inputs) * self.embed_scale

    return ScaledEmbed


def build_model(s: Setup, *, n_layers: int | None = None):
    """The reference Transformer of ``s``; returns ``(model, config)``."""
    cfg = model_config(s, n_layers=n_layers)
    return _embedded_model(cfg, s.seed, s.embed), cfg


@functools.lru_cache(maxsize=64)
def _initial_model(cfg, seed: int, embed: str = "plain"):
    import stabljax

    model = _embedded_model(cfg, seed, embed)
    return model, stabljax.nnx_apply(model)[1]


def initial_model(s: Setup):
    """``(model, params)`` of :func:`build_model`, built once per model config, seed and
    ``embed``."""
    return _initial_model(model_config(s), s.seed, s.embed)


def lr_schedule(s: Setup):
    """Linear warmup over ``warmup_frac`` of the run, then cosine decay to 0."""
    import optax

    warmup = int(round(s.warmup_frac * s.steps))
    if warmup == 0:
        return optax.cosine_decay_schedule(s.lr, s.steps)
    return optax.warmup_cosine_decay_schedule(0.0, s.lr, warmup, s.steps, end_value=0.0)


def unit_schedule(s: Setup):
    """:func:`lr_schedule` of ``s`` with peak 1 (multiplied by a traced learning rate)."""
    return lr_schedule(dataclasses.replace(s, lr=1.0))


def adamw(s: Setup):
    """The proxy's optimizer: ``clip_by_global_norm(clip)`` then AdamW (0 clip: none)."""
    import optax

    opt = optax.adamw(lr_schedule(s), b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay)
    return optax.chain(optax.clip_by_global_norm(s.clip), opt) if s.clip > 0 else opt


def adamw_factory(s: Setup, *, clip: float | None = None):
    """``factory(learning_rate) -> optimizer``: :func:`adamw` of ``s`` with a traced peak LR.

    :class:`experiments.trainer.Trainer` wraps it in ``optax.inject_hyperparams``: the
    learning rate lives in the optimizer state, so every LR of a sweep runs through one
    compiled program.
    """
    import optax

    unit = unit_schedule(s)
    clip = s.clip if clip is None else clip

    def factory(learning_rate):
        opt = optax.adamw(
            lambda c: learning_rate * unit(c),
            b1=s.b1,
            b2=s.b2,
            eps=s.eps,
            weight_decay=s.weight_decay,
        )
        return optax.chain(optax.clip_by_global_norm(clip), opt) if clip > 0 else opt

    return factory


@functools.lru_cache(maxsize=4)
def load_corpus(nbytes: int, path: str | None):
    """:func:`~stabljax.reference.corpus.default_corpus`, read once per process (it walks a
    source tree)."""
    from stabljax.reference.corpus import default_corpus

    return default_corpus(nbytes, path=path)


def corpus_batches(s: Setup, *, seed_offset: int = 0):
    """``batch_fn(i)`` over the corpus of ``s`` (``seed_offset`` 1 is the held-out stream)."""
    from stabljax.reference.corpus import lm_batch_fn

    corpus = load_corpus(s.corpus_bytes, s.corpus)
    return lm_batch_fn(
        corpus, batch_size=s.batch_size, seq_len=s.seq_len, seed=s.seed * 1000 + seed_offset
    )


def log_grid(lo: float, hi: float, n: int) -> tuple[float, ...]:
    """``n`` log-spaced values from ``lo`` to ``hi`` (both included), rounded to 3 digits."""
    import numpy as np

    return tuple(float(f"{v:.3g}") for v in np.geomspace(lo, hi, n))


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """The reference model's size and batch: the base of every experiment's and benchmark's
    config (each subclass sets its own defaults and adds its own fields)."""

    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 8

    def setup(self, **fields) -> Setup:
        """The :class:`Setup` of this size, with ``fields`` (any :class:`Setup` field) set."""
        size = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelSize)}
        return Setup(**{**size, **fields})


@dataclasses.dataclass(frozen=True)
class BenchSize(ModelSize):
    """The reference model the benchmarks time by default: about 10.8M parameters."""

    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 6
    seq_len: int = 128


#: The model of a benchmark's ``--quick`` smoke run: ``Config(**QUICK_SIZE, ...)``.
QUICK_SIZE = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 2}


@dataclasses.dataclass(frozen=True)
class SweepConfig(ModelSize):
    """The fields every sweep experiment shares; each experiment subclasses it.

    ``quick()`` is the smoke-test size a test runs in seconds.
    """

    steps: int = 200
    warmup_frac: float = 0.05
    weight_decay: float = 1e-4
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    corpus: str | None = None

    @classmethod
    def quick(cls):
        return cls(
            d_model=16, n_layers=1, n_heads=2, seq_len=16, batch_size=8, steps=6, seeds=(0, 1)
        )

    def setup(self, **overrides) -> Setup:
        """The :class:`Setup` of this config, with ``overrides`` applied."""
        shared = {
            "steps": self.steps,
            "warmup_frac": self.warmup_frac,
            "weight_decay": self.weight_decay,
            "corpus": self.corpus,
            "eval_batches": 2 if self.steps < 20 else 8,
        }
        return super().setup(**{**shared, **overrides})


def independent_adamw(
    learning_rate,
    unit,
    *,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    clip: float = 1.0,
):
    """AdamW with Wortsman et al.'s independent weight decay.

    θ ← θ − s_t·(η·u_t + λ·θ): ``unit`` is the schedule s_t (peak 1), ``learning_rate``
    the peak η, ``weight_decay`` λ. The decay is added after the LR scaling, so it follows
    the schedule but not η (optax's ``adamw`` would decay by η·s_t·λ). Global-norm
    clipping at ``clip`` first (0: none).
    """
    import optax

    parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
    parts += [
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.scale_by_learning_rate(lambda c: learning_rate * unit(c)),
        # updates are already negated here: add −λ·s_t·θ
        optax.add_decayed_weights(lambda c: -weight_decay * unit(c)),
    ]
    return optax.chain(*parts)
