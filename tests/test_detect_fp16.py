"""Detectors on the real float16 train step: an overflow is a skip, a stuck scale an event.

The step is :func:`stabljax.make_train_step` with ``Precision.fp16()`` on a tiny bigram
model; a batch whose first token is ``NAN_TOKEN`` gives NaN logits, so its gradients
overflow and the step reports ``overflow=True``, ``skipped=False`` and a NaN loss. The
same batches through a float32 step guarded by ``skip_nonfinite`` give ``skipped=True``:
the detectors must decide the same on both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stabljax import Precision, TrainState, lm_loss, make_train_step
from stabljax.control import (
    DivergenceDetector,
    IndexedBatches,
    RollbackController,
    SlowDivergenceDetector,
    SpikeDetector,
    TrainingDiverged,
)
from stabljax.optim.guards.skips import skip_nonfinite

V = 16
NAN_TOKEN = V - 1  # never produced by the batch generator below


def apply_fn(params, tokens):
    """A bigram table; a batch starting with NAN_TOKEN has NaN logits."""
    poison = tokens.reshape(-1)[0] == NAN_TOKEN
    return params["table"][tokens] * jnp.where(poison, jnp.nan, 1.0).astype(params["table"].dtype)


def batch_fn(nan=()):
    nan = frozenset(nan)

    def fn(i):
        rng = np.random.default_rng(i)
        inputs = rng.integers(0, V - 1, size=(4, 8), dtype=np.int32)
        if i in nan:
            inputs[0, 0] = NAN_TOKEN
        return {"inputs": inputs, "targets": (inputs + 1) % (V - 1)}

    return fn


SGD = optax.sgd(0.1)
GUARD = skip_nonfinite(optax.sgd(0.1))


def fp16(**kw):
    return Precision.fp16(growth_interval=1000, **kw)


@functools.cache
def fp16_step(initial_scale: float, min_scale: float):
    return make_train_step(
        lm_loss(apply_fn), SGD, precision=fp16(initial_scale=initial_scale, min_scale=min_scale)
    )


@functools.cache
def guarded_step():
    return make_train_step(lm_loss(apply_fn), GUARD)


def fp16_state(initial_scale: float, min_scale: float = 1.0):
    params = {"table": jnp.zeros((V, V))}
    return TrainState.create(params, SGD, fp16(initial_scale=initial_scale, min_scale=min_scale))


def run_metrics(step, state, fn, n):
    out = []
    for i in range(n):
        state, m = step(state, {k: jnp.asarray(v) for k, v in fn(i).items()})
        out.append({k: v.item() for k, v in jax.device_get(m).items() if np.ndim(v) == 0})
    return out


def decisions(det, metrics):
    out = []
    for s, m in enumerate(metrics):
        d = det.update(s, m)
        out.append(None if d is None else (d.kind, d.step, d.onset, d.action))
    return out


@pytest.fixture(scope="module")
def nan_runs():
    """40 steps, NaN batches 20..24, through the fp16 step and the guarded fp32 step."""
    fn = batch_fn(nan=range(20, 25))
    fp = run_metrics(fp16_step(2.0**10, 1.0), fp16_state(2.0**10), fn, 40)
    guarded = run_metrics(
        guarded_step(), TrainState.create({"table": jnp.zeros((V, V))}, GUARD), fn, 40
    )
    return fp, guarded


def test_real_fp16_step_reports_an_overflow_as_the_issue_describes(nan_runs):
    fp, guarded = nan_runs
    for m in fp[20:25]:
        assert m["overflow"] and not m["skipped"] and not np.isfinite(m["loss"])
    assert not any(m["overflow"] for m in fp[:20] + fp[25:])
    assert [m["loss_scale"] for m in fp[19:26]] == [1024.0, 1024, 512, 256, 128, 64, 32]
    for m in guarded[20:25]:
        assert m["skipped"] and not m["overflow"] and not np.isfinite(m["loss"])


@pytest.mark.parametrize("limit", [3, 10])
def test_an_overflow_is_decided_exactly_as_a_guard_skip(nan_runs, limit):
    fp, guarded = nan_runs

    def dets():
        return [
            SpikeDetector(warmup=5, patience=limit),
            DivergenceDetector(max_skip_streak=limit),
            SlowDivergenceDetector(window=8, block=2, history=1),
        ]

    for a, b in zip(dets(), dets(), strict=True):
        da, db = decisions(a, fp), decisions(b, guarded)
        assert da == db, type(a).__name__
        # Same counts and episodes; the losses themselves differ by float16 rounding.
        sa, sb = a.get_state(), b.get_state()
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], list):
                np.testing.assert_allclose(sa[k], sb[k], rtol=1e-3)
            elif isinstance(sa[k], float):
                np.testing.assert_allclose(sa[k], sb[k], rtol=1e-3)
            else:
                assert sa[k] == sb[k], k
    div = decisions(DivergenceDetector(max_skip_streak=limit), fp)
    assert div[20] == ("divergence", 20, 20, "record")  # not a rollback
    if limit == 3:  # the 4th overflow in a row passes the limit
        assert div[23] == ("divergence", 23, 20, "rollback")
    else:
        assert [d for d in div if d is not None] == [div[20]]
    # Without the overflow flag the same NaN reads as an applied one: the defect fixed.
    unflagged = [{k: v for k, v in m.items() if k != "overflow"} for m in fp]
    assert decisions(DivergenceDetector(), unflagged)[20][3] == "rollback"


@pytest.mark.parametrize("on_stuck", ["rollback", "raise"])
def test_a_scale_at_its_floor_that_keeps_overflowing_is_stuck(on_stuck):
    # Scale 8 -> 1 in 3 overflows, then every step overflows at the floor.
    fn = batch_fn(nan=range(10, 60))
    fp = run_metrics(fp16_step(8.0, 1.0), fp16_state(8.0), fn, 30)
    assert [m["loss_scale"] for m in fp[10:15]] == [8.0, 4.0, 2.0, 1.0, 1.0]
    det = DivergenceDetector(max_skip_streak=100, max_overflow_streak=12, on_stuck=on_stuck)
    out = decisions(det, fp)
    found = {s: d for s, d in enumerate(out) if d is not None}
    # The first NaN is recorded; the first overflow at the floor is recorded; 13 in a row stop.
    assert found[10] == ("divergence", 10, 10, "record")
    assert found[13] == ("divergence", 13, 13, "record")
    assert found[22] == ("divergence", 22, 10, on_stuck)
    assert min(s for s, d in found.items() if d[3] != "record") == 22


def test_a_scale_pinned_at_the_floor_with_intermittent_overflows_is_stuck():
    # initial_scale == min_scale: every third batch overflows, the scale never grows
    # (growth_interval 1000), and only 2 of 3 steps make progress.
    fn = batch_fn(nan=range(5, 200, 3))
    fp = run_metrics(fp16_step(1.0, 1.0), fp16_state(1.0, 1.0), fn, 60)
    assert all(m["loss_scale"] == 1.0 for m in fp)
    det = DivergenceDetector(max_floor_steps=40)
    out = decisions(det, fp)
    found = {s: d for s, d in enumerate(out) if d is not None}
    assert found[5][3] == "record"  # the NaN and the first overflow at the floor
    assert found[44] == ("divergence", 44, 5, "rollback")  # 40 steps at the floor since 5
    assert all(d[3] == "record" for s, d in found.items() if s != 44)
    # The same scale without overflows (an fp32 run reports loss_scale 1.0) never arms.
    clean = run_metrics(fp16_step(1.0, 1.0), fp16_state(1.0, 1.0), batch_fn(), 60)
    assert all(d is None for d in decisions(DivergenceDetector(max_floor_steps=40), clean))


def _controller(tmp_path, **kw):
    return RollbackController(
        tmp_path,
        save_every=10,
        keep=3,
        rollback_margin=5,
        async_save=False,
        detectors=[SpikeDetector(warmup=5), DivergenceDetector(max_skip_streak=4, **kw)],
    )


def test_controller_records_a_short_overflow_run_and_rolls_back_a_long_one(tmp_path):
    step = fp16_step(2.0**10, 1.0)

    def run(name, nan):
        with _controller(tmp_path / name) as ctl:
            data = IndexedBatches(batch_fn(nan=nan))
            state, _ = ctl.run(step, fp16_state(2.0**10), data, 40, progress=False)
        return ctl, state

    # A short run of overflows (3 <= 4): recorded, no rollback, training reaches the end.
    ctl, state = run("short", range(22, 25))
    assert ctl.rollbacks == 0 and int(state.step) == 40
    div = [e for e in ctl.events if e.kind == "divergence"]
    assert [(e.step, e.details["action"]) for e in div] == [(22, "record")]
    # Eight in a row pass the limit: one rollback past them, then a clean finish.
    ctl, state = run("long", range(22, 30))
    assert ctl.rollbacks == 1 and int(state.step) == 40
    rb = next(e for e in ctl.events if e.kind == "rollback")
    assert rb.details["onset"] == 22 and rb.details["restored_step"] <= 17
    ((start, end),) = ctl.skipped_ranges
    assert start <= 22 and end >= 27


def test_controller_raises_on_a_stuck_scale_when_asked(tmp_path):
    step = fp16_step(8.0, 1.0)
    with _controller(tmp_path, max_overflow_streak=6, on_stuck="raise") as ctl:
        with pytest.raises(TrainingDiverged, match="float16 overflows"):
            ctl.run(
                step,
                fp16_state(8.0),
                IndexedBatches(batch_fn(nan=range(15, 100))),
                40,
                progress=False,
            )
    assert ctl.rollbacks == 0
