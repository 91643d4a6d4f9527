"""Adopting stabljax inside someone else's trainer (examples/trainer_before.py, trainer_after.py).

The adoption guide's recipe (docs/guides/adopting.md) is the diff between the two trainers:
checked here line for line, with at most 15 changed lines. The adopted trainer keeps its
own ``optax.MultiSteps``, its own Grain ``DataLoader`` and its own Orbax
``CheckpointManager`` (which saves the controller's Grain wrapper and restores it on a
restart), and is run on bad data: one NaN micro-batch and a 20-batch window of random
bytes (about 2x the loss).
"""

from __future__ import annotations

import difflib
import pathlib
import re

import grain
import jax
import numpy as np
import optax
import pytest

import stabljax
from examples import trainer_after as adopt_after
from examples import trainer_before as adopt_before
from examples import trainer_handover as adopt_handover
from stabljax.control import read_events
from stabljax.reference import default_corpus

GUIDE = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "adopting.md"
HERE = pathlib.Path(__file__).parents[1] / "examples"
NAN_BATCH = 61  # the second micro-batch of optimizer update 30
GARBAGE = range(250, 270)  # 20 batches of uniform random bytes, after the step-100 checkpoint
STEPS = 400


def make_docs(cfg, n_batches, *, nan_batch=None, garbage=()):
    """``n_batches`` batches of corpus documents (batch i is docs[B i : B (i + 1)]), drawn
    at random from the corpus, so that which batches a run trains on does not change
    what it learns; the held-out documents are drawn from the rest."""
    n = cfg.seq_len + 1
    corpus = np.asarray(default_corpus(2_000_000))
    rng = np.random.default_rng(0)
    chunks = rng.permutation(len(corpus) // n)
    docs = []
    for i in range(n_batches * cfg.batch_size):
        doc, weight = corpus[chunks[i] * n : (chunks[i] + 1) * n].tobytes(), 1.0
        if i // cfg.batch_size in garbage:
            doc = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        if nan_batch is not None and i == nan_batch * cfg.batch_size:
            weight = float("nan")
        docs.append((doc, weight))
    held_out = [(corpus[c * n : (c + 1) * n].tobytes(), 1.0) for c in chunks[-256:]]
    return docs, held_out


def readme_diff(name: str = "adoption") -> str:
    text = GUIDE.read_text()
    m = re.search(rf"<!-- recipe: {name} -->\n```diff\n(.*?)```", text, re.S)
    assert m, f"docs/guides/adopting.md has no '<!-- recipe: {name} -->' diff block"
    return m.group(1)


def handover_diff() -> str:
    """trainer_before.py -> trainer_handover.py, less the module docstring's hunk."""
    before = (HERE / "trainer_before.py").read_text().splitlines(keepends=True)
    after = (HERE / "trainer_handover.py").read_text().splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(before, after, "trainer.py", "trainer.py", n=1))
    head, *hunks = re.split(r"(?m)^(?=@@ )", diff)
    assert hunks[0].startswith("@@ -1,"), hunks[0]  # the docstring
    return head + "".join(hunks[1:])


def test_readme_recipe_is_the_diff_of_the_two_trainers_in_at_most_15_lines():
    before = (HERE / "trainer_before.py").read_text().splitlines(keepends=True)
    after = (HERE / "trainer_after.py").read_text().splitlines(keepends=True)
    diff = difflib.unified_diff(before, after, "trainer.py", "trainer.py", n=1)
    diff = "".join(diff)
    assert readme_diff() == diff
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert len(changed) <= 15, changed


def test_adopted_trainer_keeps_its_own_checkpoint_beside_the_controller(tmp_path):
    """A restart restores the trainer's own Orbax checkpoint (the controller's Grain
    wrapper saved in it) and the controller's, and ends where an uninterrupted run does."""
    cfg = adopt_after.Config(steps=40, save_every=20)
    docs, held_out = make_docs(cfg, 60)
    _, ref_eval, _ = adopt_after.train(cfg, docs, held_out, tmp_path / "ref")
    half = adopt_after.Config(steps=20, save_every=20)
    adopt_after.train(half, docs, held_out, tmp_path / "run")
    assert (tmp_path / "run" / "ckpt" / "20").is_dir()  # the trainer's own checkpoint
    state2, eval2, _ = adopt_after.train(cfg, docs, held_out, tmp_path / "run")
    assert int(state2.step) == 40
    np.testing.assert_allclose(eval2, ref_eval, rtol=1e-6)
    events = [e.kind for e in read_events(tmp_path / "run" / "ctl" / "events.jsonl")]
    assert "restore" in events
    # gradient_step read the optax way through the guards: 2 micro-batches per update.
    assert int(optax.tree.get(state2.opt_state, "gradient_step")) == 20


def test_readme_handover_recipe_is_the_diff_of_the_two_trainers():
    diff = handover_diff()
    assert readme_diff("handover") == diff
    assert "ocp." not in "".join(ln for ln in diff.splitlines(True) if ln[:1] in " +")


def test_handover_trainer_checkpoints_through_the_controller_and_resumes_exactly(tmp_path):
    """With its own CheckpointManager handed over, the trainer's only checkpoint is the
    controller's: a run stopped at step 50 and started again ends where an uninterrupted
    run does (train state and Grain iterator restored by ``restore_or_init``)."""
    cfg = adopt_handover.Config(steps=100, save_every=50)
    docs, held_out = make_docs(cfg, 120)
    _, ref_eval, ref_log = adopt_handover.train(cfg, docs, held_out, tmp_path / "ref")
    half = adopt_handover.Config(steps=50, save_every=50)
    adopt_handover.train(half, docs, held_out, tmp_path / "run")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ctl"]
    state, eval2, log = adopt_handover.train(cfg, docs, held_out, tmp_path / "run")
    assert int(state.step) == 100 and log == ref_log[1:]
    np.testing.assert_allclose(eval2, ref_eval, rtol=1e-6)
    events = read_events(tmp_path / "run" / "ctl" / "events.jsonl")
    assert [e.step for e in events if e.kind == "restore"] == [50]


def test_the_original_trainer_runs_unchanged(tmp_path):
    cfg = adopt_before.Config(steps=20, save_every=10)
    docs, held_out = make_docs(cfg, 30)
    state, ev, log = adopt_before.train(cfg, docs, held_out, tmp_path)
    assert int(state.step) == 20 and np.isfinite(ev)


class _Inside:
    """Puts the recipe's guards *inside* MultiSteps, with stabljax's micro-batch filter:
    stands in for the trainer's ``optax`` and ``stabljax`` names (the other placement)."""

    def __init__(self):
        self.optax, self.stabljax = _Namespace(optax), _Namespace(stabljax)
        self.optax.MultiSteps = lambda opt, every_k_schedule: optax.MultiSteps(
            stabljax.skip_nonfinite(stabljax.skip_spikes(opt)),
            every_k_schedule,
            should_skip_update_fn=stabljax.skip_nonfinite_micro_batch,
        )
        self.stabljax.skip_nonfinite = self.stabljax.skip_spikes = lambda tx: tx


class _Namespace:
    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["outside", "inside"])
def test_adopted_trainer_on_bad_data_never_stalls_and_ends_near_the_clean_run(
    tmp_path, monkeypatch, placement
):
    if placement == "inside":
        inside = _Inside()
        monkeypatch.setattr(adopt_after, "optax", inside.optax)
        monkeypatch.setattr(adopt_after, "stabljax", inside.stabljax)
    cfg = adopt_after.Config(batch_size=32, steps=STEPS)  # less data-order noise
    clean_docs, held_out = make_docs(cfg, 2 * STEPS)
    _, clean_eval, _ = adopt_after.train(cfg, clean_docs, held_out, tmp_path / "clean")
    docs, _ = make_docs(cfg, 2 * STEPS, nan_batch=NAN_BATCH, garbage=GARBAGE)
    updates, finite = [], []

    def on_step(state, metrics):
        updates.append(int(optax.tree.get(state.opt_state, "gradient_step")))
        finite.append(all(bool(np.isfinite(x).all()) for x in jax.tree.leaves(state.params)))

    state, bad_eval, _ = adopt_after.train(cfg, docs, held_out, tmp_path / "bad", on_step)
    assert all(finite), "NaN reached the params"
    # Never stalls: after the NaN micro-batch's window, optimizer updates keep coming.
    assert updates[-1] > updates[NAN_BATCH + 2] > 0
    events = read_events(tmp_path / "bad" / "ctl" / "events.jsonl")
    rollbacks = [e for e in events if e.kind == "rollback"]
    skips = [e.details["range"] for e in events if e.kind == "skip"]
    assert len(rollbacks) == 1, skips
    covered = set().union(*(range(a, b) for a, b in skips))
    assert set(GARBAGE) <= covered, skips
    assert abs(bad_eval - clean_eval) <= 0.01 * clean_eval, (bad_eval, clean_eval)


def _contract_controller(tmp_path):
    from toy import toy_controller

    return toy_controller(tmp_path, save_every=100, rollback_margin=10)


def test_a_per_token_loss_is_refused_on_the_call_that_passes_it(tmp_path):
    from toy import batch_fn_factory, toy_problem

    state0, step = toy_problem()
    with _contract_controller(tmp_path) as ctl:
        state, data = ctl.restore_or_init(state0, stabljax.IndexedBatches(batch_fn_factory()))
        for _ in range(3):
            state, metrics = step(state, next(data))
            state, data = ctl.step(state, metrics, data)
        state, metrics = step(state, next(data))
        per_token = {**metrics, "loss": jax.numpy.full((16,), metrics["loss"])}
        with pytest.raises(ValueError, match=r"metrics\['loss'\] \(step 3\) must be a scalar.*16"):
            ctl.step(state, per_token, data)
        with pytest.raises(ValueError, match=r"step 3\).*scalar 'loss'.*got \['grad_norm'"):
            ctl.step(state, {"grad_norm": metrics["grad_norm"]}, data)


def test_a_step_counter_that_did_not_advance_is_named_one_call_later(tmp_path):
    """A guard's skip under MultiSteps leaves gradient_step where it was: a train step that
    counts with it stalls state.step, and the controller says so at once (not at a save)."""
    from toy import batch_fn_factory, toy_problem

    state0, step = toy_problem()
    with _contract_controller(tmp_path) as ctl:
        state, data = ctl.restore_or_init(state0, stabljax.IndexedBatches(batch_fn_factory()))
        for _ in range(5):
            state, metrics = step(state, next(data))
            state, data = ctl.step(state, metrics, data)
        state, metrics = step(state, next(data))
        stalled = state.replace(step=state.step - 1)  # step 5 did not advance state.step
        state, data = ctl.step(stalled, metrics, data)  # read one call late: no wait
        state, metrics = step(state, next(data))
        with pytest.raises(
            ValueError,
            match=r"state.step is 5 but the controller counted 6 "
            r"steps \(train step 5\).*gradient_step",
        ):
            ctl.step(state, metrics, data)
        assert ctl.current_step == 6  # well before the next save (step 100)


# ---------------------------------------------------------------------- the garbage window
# Issue 52: a 20-batch window at about 2x the loss, right after a checkpoint. How many
# rollbacks pass it, and how many of its batches are trained on again after the first one.


class _KeepAll(grain.transforms.Filter):
    """Keeps every record: the loader's position can then no longer be moved by state
    arithmetic, so it can neither rewind nor be screened in place (a packed loader's case)."""

    def filter(self, element) -> bool:
        return True


def window_retrained(events, window) -> tuple[int, list[int]]:
    """``(rollbacks, window batches fed after the first rollback)``, from the events.

    After rollback ``k`` training resumes at the restore event's ``data_index`` and feeds,
    past the ranges skipped so far, up to the next rollback's ``fed_end`` (the end of the
    run after the last one).
    """
    skips = [e for e in events if e.kind == "skip"]
    resumes = [
        e.details["data_index"]
        for e in events
        if e.kind == "restore" and e.details.get("reason") == "rollback"
    ]
    retrained, ranges = [], []
    for k, skip in enumerate(skips):
        ranges.append(range(*skip.details["range"]))
        stop = skips[k + 1].details["fed_end"] if k + 1 < len(skips) else max(window) + 1
        fed = [i for i in range(resumes[k], stop) if not any(i in r for r in ranges)]
        retrained += [i for i in fed if i in window]
    return len(skips), retrained


def run_garbage_window(workdir, *, window=GARBAGE, keep_all=False, steps=STEPS, **ctl_kw):
    """trainer_after on the garbage window, with controller overrides ``ctl_kw`` and, with
    ``keep_all``, a loader that cannot move back. Returns ``(rollbacks, retrained, eval)``."""
    cfg = adopt_after.Config(batch_size=32, steps=steps)
    docs, held_out = make_docs(cfg, 2 * steps, garbage=window)
    ns = _Namespace(stabljax)
    ns.RollbackController = lambda *a, **kw: stabljax.RollbackController(*a, **(kw | ctl_kw))
    loader = adopt_after.make_loader

    def make_loader(docs, cfg):
        made = loader(docs, cfg)
        return grain.DataLoader(
            data_source=docs,
            sampler=grain.samplers.IndexSampler(len(docs), num_epochs=1, shuffle=False),
            operations=[_KeepAll(), *made._operations] if keep_all else made._operations,
            worker_count=0,
        )

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(adopt_after, "stabljax", ns)
        mp.setattr(adopt_after, "make_loader", make_loader)
        _, bad_eval, _ = adopt_after.train(cfg, docs, held_out, workdir)
    rollbacks, retrained = window_retrained(read_events(workdir / "ctl" / "events.jsonl"), window)
    return rollbacks, retrained, bad_eval


EARLY = range(122, 142)  # issue 52's window: right after the step-100 checkpoint, early on


@pytest.mark.slow
@pytest.mark.parametrize("keep_all", [False, True], ids=["loader_rewinds", "loader_cannot"])
@pytest.mark.parametrize("window", [GARBAGE, EARLY], ids=["at_250", "at_122"])
def test_the_garbage_window_is_passed_with_one_rollback_at_the_defaults(tmp_path, keep_all, window):
    """The recipe's settings (the controller's defaults, ``screen_ahead=64``): one rollback
    passes the 20-batch window, and at most 2 of its batches are trained on after it
    (measured: none; BUILD.md, "The garbage window"), whether the loader can rewind (it is
    screened in place) or not (it is read ahead). With the old default margin of 100 the
    window at 122 rolled back to the untrained step 0, whose losses cannot tell garbage
    from text, and 7 of its batches were trained on again."""
    steps = STEPS if window is GARBAGE else 220
    rollbacks, retrained, _ = run_garbage_window(
        tmp_path, window=window, keep_all=keep_all, steps=steps
    )
    assert rollbacks == 1 and len(retrained) <= 2, (rollbacks, retrained)


def test_window_retrained_counts_the_window_batches_fed_after_each_rollback():
    """The count above, on hand-made events: a first skip that ends inside the window
    (two batches fed again before the next rollback), then a doubled one past it."""
    from stabljax.control import Event

    window = range(20, 30)
    events = [
        Event("rollback", 24, details={}),
        Event("skip", 24, details={"range": [10, 25], "fed_end": 25}),
        Event("restore", 10, details={"data_index": 25, "reason": "rollback"}),
        Event("rollback", 26, details={}),
        Event("skip", 26, details={"range": [10, 40], "fed_end": 27}),
        Event("restore", 10, details={"data_index": 40, "reason": "rollback"}),
    ]
    assert window_retrained(events, window) == (2, [25, 26])
    assert window_retrained(events[:3], window) == (1, [25, 26, 27, 28, 29])
