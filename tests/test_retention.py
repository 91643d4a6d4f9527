"""Retention: the Orbax preservation policy keeps exactly the checkpoints the old rule kept.

``kept_steps`` below is stabljax's own retention rule as it was before Orbax took it over
(``policy.kept_steps``, with the best step as ``policy.best_step`` chose it), copied here
as the reference.
"""

from __future__ import annotations

import dataclasses
import random

import jax.numpy as jnp
import pytest

from stabljax.control.checkpoint.integrity import META_VERSION, fingerprint
from stabljax.control.checkpoint.items import data_item
from stabljax.control.checkpoint.retention import Retention
from stabljax.control.checkpoint.store import CheckpointStore
from stabljax.control.data.iterators import IndexedBatches
from stabljax.control.decide.policy import Ledger, best_step


def kept_steps(steps, *, keep, best, resume_only=()):
    """The old rule: the ``keep`` newest regular checkpoints, the best, and a resume-only
    one newer than every regular one."""
    steps = sorted(steps)
    special = set(resume_only)
    regular = [s for s in steps if s not in special]
    out = set(regular[-keep:])
    newest = max(regular, default=-1)
    out.update(s for s in steps if s in special and s > newest)
    if best is not None and best in steps:
        out.add(best)
    return sorted(out)


@dataclasses.dataclass
class Run:
    """A store's bookkeeping, as the policy reads it."""

    keep: int
    keeps_best: bool = False
    scores: dict = dataclasses.field(default_factory=dict)
    resume_only: set = dataclasses.field(default_factory=set)
    foreign: set = dataclasses.field(default_factory=set)

    def holds(self, step):
        return step not in self.foreign


def _reference(run, steps):
    ours = [s for s in steps if run.holds(s)]
    best = best_step(ours, run.scores) if run.keeps_best else None
    return kept_steps(ours, keep=run.keep, best=best, resume_only=run.resume_only)


@pytest.mark.parametrize(
    "steps, kw, want",
    [
        ([0, 10, 20, 30], dict(keep=3), [10, 20, 30]),
        ([0, 10, 20, 30], dict(keep=2, keeps_best=True, scores={0: 0.1, 10: 0.5}), [0, 20, 30]),
        ([0, 10, 20, 23], dict(keep=2, resume_only={23}), [10, 20, 23]),
        # An older resume-only checkpoint goes once a regular one is newer.
        ([10, 20, 23, 30], dict(keep=2, resume_only={23}), [20, 30]),
        # A folder that is no checkpoint is neither counted nor deleted.
        ([0, 5, 10, 20], dict(keep=2, foreign={5}), [10, 20]),
        # Ties of the smoothed loss go to the older step, as the rollback's choice does.
        ([0, 10, 20, 30], dict(keep=1, keeps_best=True, scores={10: 1.0, 20: 1.0}), [10, 30]),
        ([], dict(keep=3), []),
    ],
)
def test_the_policy_keeps_what_the_old_rule_kept_by_hand(steps, kw, want):
    run = Run(**kw)
    assert Retention(run).kept(steps) == want == _reference(run, steps)


def _random_run(rng):
    n = rng.randint(0, 12)
    steps = sorted(rng.sample(range(0, 200), n))
    run = Run(keep=rng.randint(1, 5), keeps_best=rng.random() < 0.5)
    for s in steps:
        r = rng.random()
        if r < 0.1:
            run.foreign.add(s)
        elif r < 0.3:
            run.resume_only.add(s)
        elif rng.random() < 0.8:  # few distinct values: ties happen
            run.scores[s] = float(rng.randint(0, 5)) if rng.random() < 0.5 else rng.random()
    # Scores the store still holds for steps gone from disk (a loaded meta item).
    for s in rng.sample(range(200, 260), rng.randint(0, 2)):
        run.scores[s] = rng.random()
    return run, steps


def test_the_policy_keeps_what_the_old_rule_kept_on_random_cases():
    rng = random.Random(38)
    cases = 5000
    for _ in range(cases):
        run, steps = _random_run(rng)
        got = Retention(run).kept(steps)
        assert got == _reference(run, steps), (run, steps)
        # What Orbax deletes: the run's checkpoints it does not preserve, never a foreign one.
        flags = Retention(run).should_preserve(
            [type("I", (), {"step": s, "metrics": None, "time": None})() for s in steps],
            context=None,
        )
        deleted = {s for s, k in zip(steps, flags, strict=True) if not k}
        assert deleted == set(steps) - set(got) - run.foreign


# ------------------------------------------------------------------ with Orbax's own saves


def test_orbax_deletes_what_the_old_rule_dropped_once_each_save_commits(tmp_path, toy):
    """Real saves: after each one commits, the directory holds exactly the old rule's
    choice among the steps before it and the new one (a preemption's resume-only step,
    the best checkpoint, a user's folder included)."""
    store = CheckpointStore(tmp_path / "ckpt", async_save=True, log=lambda *a, **k: None, keep=2)
    store.keeps_best = True
    user = store.directory / "15"  # a user's folder, made once step 20 exists
    run = Run(keep=2, keeps_best=True, foreign={15})
    on_disk = []
    losses = {0: 3.0, 10: 1.0, 20: 2.5, 30: 2.0, 37: None, 40: 2.2, 50: 2.1, 53: None, 60: 2.4}
    try:
        for step, loss in losses.items():
            state = toy[0].replace(step=jnp.asarray(step, jnp.int32))
            meta = {"version": META_VERSION, "step": step, "data_index": step}
            meta |= Ledger().to_meta()
            item = data_item(IndexedBatches(lambda i: i, start=step), restore=False)
            args = (fingerprint(state), meta, item, loss)
            store.write(step, state, *args, wait=True, resume_only=loss is None)
            if loss is None:
                run.resume_only.add(step)
            else:
                run.scores[step] = loss
            on_disk = _reference(run, on_disk + [step]) + ([15] if user.exists() else [])
            assert store.steps() == sorted(set(on_disk) - {15}), step
            names = sorted(p.name for p in store.directory.iterdir() if p.name.isdigit())
            assert names == sorted(map(str, on_disk)), step
            if step == 20:
                user.mkdir()
                (user / "notes.txt").write_text("mine")
                store.manager.reload()
        assert store.steps() == [10, 50, 60]  # the best (10) and the newest two
        assert (user / "notes.txt").read_text() == "mine"
    finally:
        store.close()
