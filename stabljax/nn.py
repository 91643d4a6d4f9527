"""Another name for :mod:`stabljax.reference.nn`, the reference Transformer.

``import stabljax.nn`` and ``from stabljax import nn`` keep working: this module re-exports
the public classes of :mod:`stabljax.reference.nn`, the very same objects.
"""

from stabljax.reference.nn import MLP as MLP
from stabljax.reference.nn import Attention as Attention
from stabljax.reference.nn import Block as Block
from stabljax.reference.nn import TransformerConfig as TransformerConfig
from stabljax.reference.nn import TransformerLM as TransformerLM

__all__ = ("TransformerConfig", "TransformerLM")
