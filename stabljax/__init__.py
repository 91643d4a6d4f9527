"""stabljax: training-stability components for JAX (Optax, Flax, Orbax, Grain).

The public API is flat: ``stabljax.safe_adamw``, ``stabljax.RollbackController``.
"""

from stabljax.data import default_corpus as default_corpus
from stabljax.data import lm_batch_fn as lm_batch_fn

__version__ = "0.1.0"

__all__ = (
    "default_corpus",
    "lm_batch_fn",
)
