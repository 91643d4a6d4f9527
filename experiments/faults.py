"""The bad data, the repeated-n-gram filter, the compiled programs and the controller of
:mod:`experiments.spike_recovery`.

The bad data is OLMo 2's (Team OLMo, `2 OLMo 2 Furious <https://arxiv.org/abs/2501.00656>`_,
2024, §3.1): documents made of one short n-gram repeated over and over (their example:
``g4ODg4OD...``), which they found behind loss and gradient-norm spikes. A window of
``bad_len`` batches from ``bad_start`` on is replaced by such documents: each sequence
repeats one n-gram of 1..``ngram_max`` tokens, half of them random bytes, half an n-gram
cut from the corpus. Nothing is set by hand in the loss or the gradient: whatever spike
follows is the model's own response to training on that data.

The filter is OLMo 2's remedy as OLMo-core applies it to every training instance
(``InstanceFilterConfig(repetition_min_period=1, repetition_max_period=13,
repetition_max_count=32)``): an instance in which some n-gram of 1-13 tokens repeats 32
or more times in a row is dropped (here: its loss weight is 0).
``cfg`` is a :class:`experiments.spike_recovery.Config`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import stabljax
from experiments import proxy

#: OLMo-core's instance filter, as OLMo 2 trained with it.
FILTER_MIN_PERIOD = 1
FILTER_MAX_PERIOD = 13
FILTER_MAX_COUNT = 32


def bad_window(cfg: Any) -> range:
    return range(cfg.bad_start, cfg.bad_start + cfg.bad_len)


def max_repeats(
    tokens: np.ndarray, *, min_period: int = FILTER_MIN_PERIOD, max_period: int = FILTER_MAX_PERIOD
) -> int:
    """The most times any n-gram of ``min_period..max_period`` tokens repeats back to back
    in the 1-D ``tokens`` (a span of length L with period p counts ``L // p`` repeats; 1 if
    nothing repeats)."""
    x = np.asarray(tokens)
    best = 1
    for p in range(min_period, min(max_period, x.size - 1) + 1):
        eq = np.concatenate([[False], x[p:] == x[:-p], [False]])
        edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
        if edges.size:
            run = int(np.max(edges[1::2] - edges[::2]))  # longest run of x[i + p] == x[i]
            best = max(best, (run + p) // p)
    return best


def repeated_ngram_flag(tokens: np.ndarray, *, max_count: int = FILTER_MAX_COUNT) -> bool:
    """OLMo 2's filter: True (drop) when an n-gram of 1-13 tokens repeats >= ``max_count``
    times in a row in ``tokens``."""
    return max_repeats(tokens) >= max_count


def _window(b: dict) -> np.ndarray:
    return np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)


def repeated_ngram_window(rng: np.random.Generator, length: int, n_max: int, corpus, j: int):
    """One bad document of ``length`` tokens: an n-gram (1..``n_max`` tokens; random bytes for
    even ``j``, cut from ``corpus`` for odd) repeated, from a random phase."""
    n = int(rng.integers(1, n_max + 1))
    if j % 2 == 0:
        gram = rng.integers(0, 256, n)
    else:
        at = int(rng.integers(0, corpus.shape[0] - n))
        gram = corpus[at : at + n].astype(np.int64)
    reps = np.tile(gram, length // n + 2)
    phase = int(rng.integers(0, n))
    return reps[phase : phase + length].astype(np.int32)


def poisoned(batch_fn, cfg: Any, seed: int, corpus: np.ndarray):
    """``batch_fn`` with the bad window's batches replaced by repeated-n-gram documents
    (``bad_frac`` of each batch's sequences); every batch gets a per-sequence ``weight`` 1
    and a ``bad`` flag (1 for a repeated-n-gram document)."""

    def fn(i: int):
        b = dict(batch_fn(i))
        w = _window(b)
        bad = np.zeros(w.shape[0], np.int32)
        if i in bad_window(cfg):
            rng = np.random.default_rng([seed, 7, i])
            for j in range(int(round(cfg.bad_frac * w.shape[0]))):
                w[j] = repeated_ngram_window(rng, w.shape[1], cfg.ngram_max, corpus, j)
                bad[j] = 1
        return {
            "inputs": w[:, :-1],
            "targets": w[:, 1:],
            "weight": np.ones(w.shape[0], np.float32),
            "bad": bad,
        }

    return fn


def clean_batches(batch_fn):
    def fn(i: int):
        b = dict(batch_fn(i))
        n = b["inputs"].shape[0]
        return {**b, "weight": np.ones(n, np.float32), "bad": np.zeros(n, np.int32)}

    return fn


def filtered(batch_fn):
    """``batch_fn`` with OLMo 2's repeated-n-gram filter: a flagged sequence (clean or bad)
    gets loss weight 0, so it contributes nothing to the loss or the gradient."""

    def fn(i: int):
        b = dict(batch_fn(i))
        w = _window(b)
        keep = np.array([not repeated_ngram_flag(row) for row in w], np.float32)
        return {**b, "weight": b["weight"] * keep}

    return fn


def weighted_loss(apply_fn):
    """Cross-entropy averaged over the sequences of weight 1 (0 if all are dropped)."""

    def loss_fn(params, batch):
        logits = apply_fn(params, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1)
        w = batch["weight"]
        kept = jnp.sum(w)
        loss = jnp.sum(w * ce) / jnp.maximum(kept, 1.0)
        return loss, {"kept": kept, "bad_trained": jnp.sum(w * batch["bad"])}

    return loss_fn


class Programs:
    """The jitted step of each optimizer kind and the held-out loss, compiled once."""

    def __init__(self, cfg: Any):
        s = cfg.setup(seed=0)
        self.model, _ = proxy.initial_model(s)
        self.apply_fn, _ = stabljax.nnx_apply(self.model)
        base = proxy.adamw(s)
        self.optimizers = {
            "plain": base,
            "guarded": stabljax.skip_nonfinite(
                stabljax.skip_spikes(base, warmup_steps=cfg.spike_warmup)
            ),
        }
        loss = weighted_loss(self.apply_fn)
        self.steps = {k: stabljax.make_train_step(loss, o) for k, o in self.optimizers.items()}
        apply_fn = self.apply_fn

        @jax.jit
        def ce(params, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(apply_fn(params, x), y).mean()

        self.ce = ce
        mesh = Mesh(np.array(jax.devices()), ("data",))
        self.rep = NamedSharding(mesh, PartitionSpec())
        self.shard = NamedSharding(mesh, PartitionSpec("data"))

    def put(self, batch):
        return {
            k: jax.make_array_from_callback(v.shape, self.shard, lambda idx, v=v: v[idx])
            for k, v in batch.items()
        }

    def evaluate(self, s: proxy.Setup, params) -> float:
        held = proxy.corpus_batches(s, seed_offset=1)
        vals = []
        for i in range(s.eval_batches):
            b = self.put(held(i))
            vals.append(self.ce(params, b["inputs"], b["targets"]))
        return float(np.mean(jax.device_get(vals)))


def source_for(cfg: Any, s: proxy.Setup, arm: str, seed: int):
    """The batches arm ``arm`` trains on (a pure function of the index)."""
    source = proxy.corpus_batches(s)
    if arm == "clean":
        return clean_batches(source)
    corpus = proxy.load_corpus(s.corpus_bytes, s.corpus)
    source = poisoned(source, cfg, seed, corpus)
    return filtered(source) if arm == "filter" else source


#: DivergenceDetector's default max_skip_streak, plus one.
DETECTION_DELAY = 21


def controller(cfg: Any, ckpt, triage) -> stabljax.RollbackController:
    """The rollback arms' controller: PaLM's margins scaled to the run, the three detectors."""
    return stabljax.RollbackController(
        ckpt,
        triage=triage,
        save_every=cfg.save_every,
        # Enough checkpoints that one lies `margin` before an onset even when the
        # detection comes late (a 20-step skip streak, or 10 steps of patience).
        keep=(cfg.margin + DETECTION_DELAY) // cfg.save_every + 2,
        rollback_margin=cfg.margin,
        extra_skip=cfg.bad_len,
        detectors=[
            stabljax.control.SpikeDetector(),
            stabljax.control.DivergenceDetector(),
            stabljax.control.SlowDivergenceDetector(),
        ],
    )


def trajectory_counts(cfg: Any, arm: str, calls: list[dict], got: list[dict]):
    """Over the final trajectory (the last call that trained each step): bad sequences
    trained on, sequences given loss weight 0, bad sequences fed. ``calls`` are the step
    calls in order (``step``, data ``index``), ``got`` their fetched metrics."""
    final_call = {}  # the call that trained each step of the final trajectory
    for k, c in enumerate(calls):
        final_call[c["step"]] = k
    bad_trained = kept = 0
    for k in final_call.values():
        m = got[k]
        kept += float(m["kept"])
        if not bool(m["skipped"]):
            bad_trained += int(round(float(m["bad_trained"])))
    final_idx = [calls[k]["index"] for k in final_call.values()]
    per_batch = int(round(cfg.bad_frac * cfg.batch_size)) if arm != "clean" else 0
    bad_in_traj = per_batch * sum(i in bad_window(cfg) for i in final_idx)
    dropped = int(round(len(final_idx) * cfg.batch_size - kept))
    return bad_trained, dropped, bad_in_traj
