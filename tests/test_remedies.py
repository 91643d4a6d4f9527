"""Remedies: the built-ins against hand-computed values, and the controller applying them
at a rollback (values, the training after it against an optax reference run, events, and a
restart right after the rollback)."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import host
from toy import BAD, batch_fn_factory, controller_kwargs, make_toy

from stabljax.control import (
    IndexedBatches,
    RollbackController,
    RollbackInfo,
    by_verdict,
    chain_remedies,
    lower_lr,
    read_events,
    reset_second_moment,
    scale_hyperparam,
)
from stabljax.control.decide.remedies import describe

INFO = RollbackInfo(step=30, onset=35, rollbacks=1, skip=(30, 40), kinds=("spike",))
LR = 0.05
PARAMS = {"w": jnp.ones((3,), jnp.float32), "b": jnp.zeros((), jnp.bfloat16)}


def _lr(state, name="learning_rate"):
    found = optax.tree.get_all_with_path(state, name)
    return [float(v) for _, v in found if isinstance(v, jax.Array)]


# ---------------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("factor", [0.5, 0.1, 3.0])
def test_scale_hyperparam_multiplies_the_stored_value_exactly(factor):
    state = optax.inject_hyperparams(optax.adam)(learning_rate=LR).init(PARAMS)
    out = scale_hyperparam(factor)(state, INFO)
    got = out.hyperparams["learning_rate"]
    assert got.dtype == jnp.float32
    assert float(got) == float(np.float32(LR) * np.float32(factor))
    assert float(out.hyperparams["b1"]) == float(np.float32(0.9))  # others untouched
    chex.assert_trees_all_equal(out.inner_state, state.inner_state)


def test_scale_hyperparam_scales_every_injected_state_on_its_own():
    opt = optax.multi_transform(
        {
            "a": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
            "b": optax.inject_hyperparams(optax.adam)(learning_rate=0.3),
        },
        {"w": "a", "b": "b"},
    )
    state = {"opt_state": opt.init(PARAMS), "step": jnp.int32(3)}
    out = scale_hyperparam(0.5)(state, INFO)
    # "b" is bfloat16, and inject_hyperparams holds its group's LR in bfloat16: kept.
    half = jnp.bfloat16(0.3) * jnp.bfloat16(0.5)
    expect = [float(np.float32(0.1) * np.float32(0.5)), float(half)]
    assert sorted(_lr(out)) == sorted(expect)
    lrs = [v for _, v in optax.tree.get_all_with_path(out, "learning_rate")]
    assert sorted(str(v.dtype) for v in lrs) == ["bfloat16", "float32"]
    assert int(out["step"]) == 3


def test_scale_hyperparam_without_an_injected_value_names_the_fix():
    state = optax.adam(LR).init(PARAMS)
    with pytest.raises(ValueError, match="inject_hyperparams") as e:
        scale_hyperparam(0.5)(state, INFO)
    assert "step_size" in str(e.value)
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=LR).init(PARAMS)
    with pytest.raises(ValueError, match=r"'momentum'.*found: \['learning_rate'\]"):
        scale_hyperparam(0.5, "momentum")(injected, INFO)


@pytest.mark.parametrize("factor", [0, -0.5, math.nan, math.inf, True, "0.5", None])
def test_a_bad_factor_is_refused_naming_it(factor):
    with pytest.raises(ValueError, match="factor"):
        scale_hyperparam(factor)
    with pytest.raises(ValueError, match="factor"):
        lower_lr(factor)


def test_scaling_a_schedule_lasts_one_step_and_the_multiplier_form_lasts():
    """inject_hyperparams recomputes a callable hyperparameter each update (documented)."""
    sched = optax.linear_schedule(0.1, 0.0, 100)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    direct = optax.inject_hyperparams(optax.sgd)(learning_rate=sched)
    state = scale_hyperparam(0.5)(direct.init(PARAMS), INFO)
    _, state = direct.update(grads, state, PARAMS)
    assert _lr(state) == [float(sched(0))]  # the schedule is back, the remedy gone
    chained = optax.chain(optax.sgd(sched), optax.inject_hyperparams(optax.scale)(step_size=1.0))
    state = scale_hyperparam(0.5, "step_size")(chained.init(PARAMS), INFO)
    for _ in range(3):
        updates, state = chained.update(grads, state, PARAMS)
    assert _lr(state, "step_size") == [0.5]
    # the third update, by hand: -lr(2) * 1 * 0.5
    assert float(updates["w"][0]) == pytest.approx(-float(sched(2)) * 0.5, rel=1e-6)


def test_reset_second_moment_zeroes_nu_and_keeps_mu():
    opt = optax.adam(1e-3)
    grads = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.ones((), jnp.bfloat16)}
    _, state = opt.update(grads, opt.init(PARAMS), PARAMS)
    out = reset_second_moment()(state, INFO)
    chex.assert_trees_all_equal(out[0].nu, jax.tree.map(jnp.zeros_like, state[0].nu))
    assert out[0].nu["b"].dtype == jnp.bfloat16
    chex.assert_trees_all_equal(out[0].mu, state[0].mu)
    np.testing.assert_allclose(np.asarray(state[0].nu["w"]), [1e-3, 4e-3, 9e-3], rtol=1e-6)
    with pytest.raises(ValueError, match="'nu'"):
        reset_second_moment()(optax.sgd(0.1).init(PARAMS), INFO)


@pytest.mark.parametrize(
    "verdict, expect", [("data", LR), ("state", LR / 2), (None, LR / 4), ("inconclusive", LR / 4)]
)
def test_by_verdict_follows_triage(verdict, expect):
    state = optax.inject_hyperparams(optax.sgd)(learning_rate=LR).init(PARAMS)
    remedy = by_verdict(default=lower_lr(0.25))
    info = RollbackInfo(30, 35, 1, (30, 40), verdict=verdict)
    assert _lr(remedy(state, info)) == pytest.approx([expect], rel=1e-7)
    applied = describe(remedy, info)["applied"]
    names = {"data": None, "state": 0.5}
    if verdict in names:
        assert (applied and applied["params"]["factor"]) == names[verdict]
    else:
        assert applied["params"]["factor"] == 0.25


def test_chain_applies_in_order_and_describes_its_parts():
    seen = []

    def note(state, info):
        seen.append(_lr(state)[0])
        return state

    chained = chain_remedies(note, lower_lr(0.5), note, scale_hyperparam(0.5))
    out = chained(optax.inject_hyperparams(optax.sgd)(learning_rate=0.2).init(PARAMS), INFO)
    assert seen == pytest.approx([0.2, 0.1]) and _lr(out) == pytest.approx([0.05])
    parts = describe(chained, INFO)["applied"]
    assert [p["remedy"] for p in parts] == ["note", "scale_hyperparam", "note", "scale_hyperparam"]
    with pytest.raises(TypeError, match=r"remedies\[1\]"):
        chain_remedies(lower_lr(), 0.5)
    with pytest.raises(TypeError, match="state"):
        by_verdict(state="lower")


def test_rollback_info_round_trips_through_json():
    info = RollbackInfo(30, 35, 2, (31, 45), "state", ("spike", "divergence"), 40)
    assert RollbackInfo.from_json(info.to_json()) == info


def test_the_controller_refuses_a_remedy_that_is_not_callable(tmp_path):
    with pytest.raises(TypeError, match="remedy"):
        RollbackController(tmp_path, remedy=0.5)


# --------------------------------------------------------------------------------- controller


@functools.cache
def _injected_toy():
    return make_toy(optax.inject_hyperparams(optax.sgd)(learning_rate=LR))


class _Recorder:
    """A remedy that records the learning rate it got and gave, around ``inner``."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.__name__ = "recorder"

    def __call__(self, state, info):
        out = self.inner(state, info)
        self.calls.append((_lr(state)[0], _lr(out)[0], info, int(state.step)))
        return out


def _loop(ctl, state, data, until, fed, *, stop_after_rollback=False):
    """A hand-written loop to step ``until``; returns the state right after each rollback."""
    _, train_step = _injected_toy()
    after = []
    while ctl.current_step < until:
        state, metrics = train_step(state, next(data))
        before = ctl.rollbacks
        state, data = ctl.step(state, metrics, data)
        if ctl.rollbacks > before:
            after.append((state, len(fed)))
            if stop_after_rollback:
                return state, data, after
        if ctl.current_step >= until:
            state, data = ctl.finish(state, data)
    return state, data, after


def _fed_batches(fed):
    base = batch_fn_factory(BAD)

    def batch_fn(i):
        fed.append(i)
        return base(i)

    return batch_fn


def _half_lr_run(directory, until):
    state0, _ = _injected_toy()
    remedy, fed = _Recorder(lower_lr(0.5)), []
    ctl = RollbackController(directory, **controller_kwargs(remedy=remedy, async_save=False))
    state, data = ctl.restore_or_init(state0, IndexedBatches(_fed_batches(fed)))
    state, data, after = _loop(ctl, state, data, until, fed)
    ctl.close()
    return ctl, state, data, after, remedy, fed


def test_a_rollback_applies_the_remedy_and_training_uses_it(tmp_path):
    ctl, state, data, after, remedy, fed = _half_lr_run(tmp_path, 60)
    assert ctl.rollbacks == 1 and len(remedy.calls) == 1
    got_in, got_out, info, step = remedy.calls[0]
    rollback = next(e for e in ctl.events if e.kind == "rollback")
    skip = next(e for e in ctl.events if e.kind == "skip")
    # The checkpoint's LR, and exactly half of it in the state training resumes with.
    assert got_in == float(np.float32(LR))
    assert got_out == float(np.float32(LR) * np.float32(0.5))
    assert info.step == step == rollback.details["restored_step"]
    assert info.onset == rollback.details["onset"] and info.rollbacks == 1
    assert list(info.skip) == skip.details["range"] and info.verdict is None
    assert info.kinds == ("spike",) and info.detected == rollback.step
    restored, n_fed = after[0]
    assert _lr(restored) == [got_out]
    # An optax reference run from the restored state, plain SGD at half the LR, on the
    # batches the controller fed after the rollback, ends where the controller did.
    ref_state0, ref_step = make_toy(optax.sgd(LR * 0.5))
    ref = ref_state0.replace(step=restored.step, params=restored.params)
    batches = batch_fn_factory(BAD)
    for i in fed[n_fed:]:
        ref, _ = ref_step(ref, batches(i))
    assert int(ref.step) == int(state.step) == 60
    chex.assert_trees_all_close(host(state.params), host(ref.params), rtol=1e-6, atol=1e-7)
    # A reference at the old LR does not (the test can fail).
    old_state0, old_step = make_toy(optax.sgd(LR))
    old = old_state0.replace(step=restored.step, params=restored.params)
    for i in fed[n_fed:]:
        old, _ = old_step(old, batches(i))
    assert not np.allclose(host(old.params)["w"], host(state.params)["w"], rtol=1e-4)
    # The event, right after the rollback's others.
    kinds = [e.kind for e in ctl.events]
    at = kinds.index("rollback")
    assert kinds[at : at + 4] == ["rollback", "skip", "remedy", "restore"]
    event = ctl.events[at + 2]
    assert event.details["remedy"] == "recorder" and event.details["reapplied"] is False
    assert event.details["restored_step"] == step and event.details["rollbacks"] == 1
    assert event.details["info"] == info.to_json()
    on_disk = [e for e in read_events(tmp_path / "events.jsonl") if e.kind == "remedy"]
    assert [e.details for e in on_disk] == [event.details]


def test_a_later_rollback_restores_the_earlier_remedy_with_the_checkpoint(tmp_path):
    ctl, state, data, after, remedy, fed = _half_lr_run(tmp_path, 120)
    assert ctl.rollbacks == 2
    (in1, out1, _, s1), (in2, out2, _, s2) = remedy.calls
    assert s2 > s1  # the second target was saved after the first remedy
    assert in1 == float(np.float32(LR)) and out1 == in2  # the checkpoint held the remedy
    assert out2 == float(np.float32(in2) * np.float32(0.5))
    assert _lr(state) == [out2]


def test_builtin_remedy_events_name_it(tmp_path):
    state0, train_step = _injected_toy()
    kw = controller_kwargs(remedy=by_verdict(state=None, default=lower_lr(0.25)))
    with RollbackController(tmp_path, **kw, async_save=False) as ctl:
        state, _ = ctl.run(
            train_step, state0, IndexedBatches(batch_fn_factory(BAD)), 60, progress=False
        )
    event = next(e for e in ctl.events if e.kind == "remedy")
    assert event.details["remedy"] == "by_verdict"
    assert event.details["applied"] == {
        "remedy": "scale_hyperparam",
        "params": {"factor": 0.25, "name": "learning_rate"},
    }
    assert _lr(state) == [float(np.float32(LR) * np.float32(0.25))]


def test_a_schedule_with_a_multiplier_keeps_the_remedy(tmp_path):
    sched = optax.linear_schedule(LR, LR / 10, 200)
    opt = optax.chain(optax.sgd(sched), optax.inject_hyperparams(optax.scale)(step_size=1.0))
    state0, train_step = make_toy(opt)
    fed = []
    kw = controller_kwargs(remedy=scale_hyperparam(0.5, "step_size"), async_save=False)
    ctl = RollbackController(tmp_path, **kw)
    state, data = ctl.restore_or_init(state0, IndexedBatches(_fed_batches(fed)))
    after = []
    while ctl.current_step < 60:
        state, metrics = train_step(state, next(data))
        before = ctl.rollbacks
        state, data = ctl.step(state, metrics, data)
        if ctl.rollbacks > before:
            after.append((state, len(fed)))
        if ctl.current_step >= 60:
            state, data = ctl.finish(state, data)
    ctl.close()
    assert len(after) == 1 and _lr(state, "step_size") == [0.5]
    restored, n_fed = after[0]
    # Reference: the same schedule (its count carried over) times a constant 0.5.
    ref_state0, ref_step = make_toy(optax.chain(optax.sgd(sched), optax.scale(0.5)))
    opt_state = (restored.opt_state[0], ref_state0.opt_state[1])
    ref = ref_state0.replace(step=restored.step, params=restored.params, opt_state=opt_state)
    batches = batch_fn_factory(BAD)
    for i in fed[n_fed:]:
        ref, _ = ref_step(ref, batches(i))
    chex.assert_trees_all_close(host(state.params), host(ref.params), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("where", ["after_rollback", "before_delete"])
def test_a_restart_right_after_a_rollback_keeps_the_remedy(tmp_path, where):
    _, ref_state, ref_data, _, _, _ = _half_lr_run(tmp_path / "ref", 60)
    d = tmp_path / "run"
    state0, _ = _injected_toy()
    fed, remedy = [], _Recorder(lower_lr(0.5))
    ctl = RollbackController(d, **controller_kwargs(remedy=remedy, async_save=False))
    state, data = ctl.restore_or_init(state0, IndexedBatches(_fed_batches(fed)))
    if where == "after_rollback":  # the process dies before the next save
        _loop(ctl, state, data, 60, fed, stop_after_rollback=True)
    else:  # it dies between the rollback record and the deletes

        class Crash(Exception):
            pass

        def crash(step, **kw):
            raise Crash

        ctl._store.delete_newer_than = crash
        with pytest.raises(Crash):
            _loop(ctl, state, data, 60, fed)
    ctl.close(quiet=True)
    assert len(remedy.calls) == 1
    target = remedy.calls[0][3]

    again = _Recorder(lower_lr(0.5))
    ctl = RollbackController(d, **controller_kwargs(remedy=again, async_save=False))
    state, data = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory(BAD)))
    assert ctl.current_step == target and ctl.rollbacks == 1
    assert _lr(state) == [float(np.float32(LR) * np.float32(0.5))]
    event = [e for e in ctl.events if e.kind == "remedy"][-1]
    assert event.details["reapplied"] is True and event.details["restored_step"] == target
    assert again.calls[0][2] == remedy.calls[0][2]  # told the same as the first time
    state, data, _ = _loop(ctl, state, data, 60, [])
    ctl.close()
    chex.assert_trees_all_equal(host(state.params), host(ref_state.params))
    assert data.index == ref_data.index


def test_a_restart_after_the_next_save_does_not_apply_it_twice(tmp_path):
    _half_lr_run(tmp_path, 60)
    state0, _ = _injected_toy()
    again = _Recorder(lower_lr(0.5))
    ctl = RollbackController(tmp_path, **controller_kwargs(remedy=again, async_save=False))
    state, _ = ctl.restore_or_init(state0, IndexedBatches(batch_fn_factory(BAD)))
    ctl.close()
    assert ctl.current_step == 60 and again.calls == []
    assert _lr(state) == [float(np.float32(LR) * np.float32(0.5))]
