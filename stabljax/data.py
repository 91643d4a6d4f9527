"""Deprecated name for :mod:`stabljax.reference.corpus`, the embedded corpus.

``stabljax.data`` read like ``stabljax.control.data`` (the data iterators). Use
``stabljax.reference.corpus``, or ``stabljax.default_corpus`` / ``stabljax.lm_batch_fn``.
Every name read from here is the same object as there, after a ``DeprecationWarning``.
"""

import warnings

from stabljax.reference import corpus as _corpus

_NAMES = ("VOCAB_SIZE", "default_corpus", "lm_batch_fn")


def __getattr__(name: str):
    if name in _NAMES:
        warnings.warn(
            f"stabljax.data.{name} is deprecated: use stabljax.reference.corpus.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_corpus, name)
    raise AttributeError(f"module 'stabljax.data' has no attribute {name!r}")
