"""Embedded default data: byte-level language modelling on Python's own sources.

Every machine with Python has its standard library's ``.py`` files, so the experiments
and the main job need no download. Tokens are bytes (vocabulary 256). Batches are a pure
function of their index, which is what lets the rollback controller skip and replay data
exactly.
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Callable

import numpy as np

VOCAB_SIZE = 256


def default_corpus(max_bytes: int = 4_000_000, *, path: str | None = None) -> np.ndarray:
    """Returns a corpus as a ``uint8`` array of byte tokens.

    By default the bytes of the standard library's ``*.py`` files (sorted by path, so
    the corpus is the same on every run with the same Python), up to ``max_bytes``.

    Args:
      max_bytes: the corpus is cut to this many bytes (must be > 0).
      path: optional text file or directory of text files to read instead.

    Returns:
      A 1-D ``np.uint8`` array.

    Example:
      >>> from stabljax.reference.corpus import default_corpus
      >>> corpus = default_corpus(10_000)
      >>> corpus.shape, corpus.dtype
      ((10000,), dtype('uint8'))
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if path is not None:
        root = pathlib.Path(path)
        if not root.exists():
            raise FileNotFoundError(f"corpus path {str(root)!r} does not exist")
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    else:
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks, total = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 2:
        raise ValueError(f"corpus at {str(root)!r} has fewer than 2 bytes")
    return np.frombuffer(data, dtype=np.uint8).copy()


def lm_batch_fn(
    corpus: np.ndarray, *, batch_size: int, seq_len: int, seed: int = 0
) -> Callable[[int], dict[str, np.ndarray]]:
    """Returns ``batch_fn(i)``: the i-th batch of next-byte prediction windows.

    Window starts are drawn from a counter-based generator keyed by ``(seed, i)``, so
    batch ``i`` is the same whenever and wherever it is asked for, and skipping a range
    of indices costs nothing.

    Args:
      corpus: 1-D token array (``default_corpus()``).
      batch_size: sequences per batch.
      seq_len: tokens per sequence.
      seed: selects the sampling stream.

    Returns:
      A function of a non-negative int returning ``{"inputs", "targets"}``, each
      ``int32[batch_size, seq_len]``.

    Example:
      >>> from stabljax.reference.corpus import default_corpus, lm_batch_fn
      >>> fn = lm_batch_fn(default_corpus(10_000), batch_size=2, seq_len=8)
      >>> b = fn(3)
      >>> b["inputs"].shape, bool((b["inputs"][:, 1:] == b["targets"][:, :-1]).all())
      ((2, 8), True)
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    n = corpus.shape[0] - seq_len - 1
    if n < 1:
        raise ValueError(f"corpus of {corpus.shape[0]} tokens is too short for seq_len={seq_len}")
    offsets = np.arange(seq_len + 1)

    def batch_fn(i: int) -> dict[str, np.ndarray]:
        if i < 0:
            raise IndexError(f"batch index must be >= 0, got {i}")
        rng = np.random.default_rng([seed, i])
        starts = rng.integers(0, n, size=batch_size)
        window = corpus[starts[:, None] + offsets].astype(np.int32)
        return {"inputs": window[:, :-1], "targets": window[:, 1:]}

    return batch_fn
