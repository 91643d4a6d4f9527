"""Reference material: the Transformer the tests and experiments train, and their corpus.

Not part of the stability machinery (``stabljax.optim`` -> the step -> ``stabljax.control``):
a model and data to run it on, so that a test, a benchmark or the README needs nothing
from outside.

- :mod:`stabljax.reference.nn`: a small Flax NNX decoder-only Transformer LM
  (``TransformerConfig``, ``TransformerLM``), built from a :mod:`stabljax.init` plan.
- :mod:`stabljax.reference.corpus`: byte-level language modelling on Python's own
  standard library (``default_corpus``, ``lm_batch_fn``).
"""

from stabljax.reference.corpus import VOCAB_SIZE as VOCAB_SIZE
from stabljax.reference.corpus import default_corpus as default_corpus
from stabljax.reference.corpus import lm_batch_fn as lm_batch_fn
from stabljax.reference.nn import TransformerConfig as TransformerConfig
from stabljax.reference.nn import TransformerLM as TransformerLM

__all__ = ("VOCAB_SIZE", "TransformerConfig", "TransformerLM", "default_corpus", "lm_batch_fn")
