"""Reference material: the Transformer the tests and experiments train, and their corpus.

Not part of the stability machinery (``stabljax.optim`` -> the step -> ``stabljax.control``):
a model and data to run it on, so that a test, a benchmark or the README needs nothing
from outside.

- :mod:`stabljax.reference.nn`: a small Flax NNX decoder-only Transformer LM
  (``TransformerConfig``, ``TransformerLM``), built from a :mod:`stabljax.init` plan.
- :mod:`stabljax.reference.corpus`: byte-level language modelling on Python's own
  standard library (``default_corpus``, ``lm_batch_fn``).

``stabljax.nn`` stays another name for :mod:`stabljax.reference.nn`; ``stabljax.data`` is a
deprecated name for :mod:`stabljax.reference.corpus` (it was easy to mistake for
``stabljax.control.data``, the data iterators).
"""
