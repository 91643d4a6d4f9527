"""Detectors: statistics against float64 references, onsets, guards, trend tests, state."""

from __future__ import annotations

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stabljax.control.detect import (
    Detector,
    DivergenceDetector,
    SlowDivergenceDetector,
    SpikeDetector,
    default_detectors,
    mann_kendall,
    sen_slope,
)
from stabljax.optim.guards import any_skipped, skip_nonfinite, skip_spikes, skip_streak


def _median_mad_reference(xs):
    """Median and 1.4826 * MAD by sorting in plain Python floats (no numpy)."""

    def med(v):
        v = sorted(v)
        k = len(v) // 2
        return v[k] if len(v) % 2 else (v[k - 1] + v[k]) / 2

    m = med(xs)
    return m, 1.482602218505602 * med([abs(x - m) for x in xs])


def _feed(det, values, *, start=0, skipped=False):
    out = []
    for k, v in enumerate(values):
        d = det.update(start + k, {"loss": v, "skipped": skipped})
        out.append(d)
    return out


@pytest.mark.parametrize("window", [16, 128])
def test_spike_statistics_match_median_mad_reference(window):
    rng = np.random.default_rng(0)
    xs = 3.0 + 0.1 * rng.standard_normal(200)
    det = SpikeDetector(window=window, warmup=5)
    assert all(d is None for d in _feed(det, xs))
    median, scale = _median_mad_reference([float(x) for x in xs[-window:]])
    assert det.count == 200 and len(det.get_state()["values"]) == window
    np.testing.assert_allclose(det.median, median, rtol=1e-12)
    np.testing.assert_allclose(det.scale, scale, rtol=1e-12)


def test_spike_z_score_and_required_excess_by_hand():
    xs = [2.0, 2.1, 1.9, 2.0, 2.05, 2.02]
    det = SpikeDetector(warmup=5)
    _feed(det, xs)
    # sorted: 1.9 2.0 2.0 2.02 2.05 2.1 -> median 2.01; |x - 2.01|: .01 .01 .01 .04 .09 .11
    median, scale = 2.01, 1.482602218505602 * 0.025
    d = det.update(6, {"loss": 9.0})
    assert d is not None and d.kind == "spike" and d.step == 6 and d.onset == 6
    np.testing.assert_allclose(d.details["median"], median, rtol=1e-12)
    np.testing.assert_allclose(d.details["scale"], scale, rtol=1e-9)
    np.testing.assert_allclose(d.details["z"], (9.0 - median) / scale, rtol=1e-9)
    # max(8 * 0.0371, 1.5 * 2.01, 1e-3): the relative floor decides.
    np.testing.assert_allclose(d.details["required"], 1.5 * median, rtol=1e-12)
    assert d.action == "rollback"  # not skipped: its update was applied
    # Just under the floor is not a spike.
    assert det.update(7, {"loss": median + 0.999 * 1.5 * median}) is None


def test_spike_threshold_boundary():
    # A value just under / over median + threshold * scale (floors 0): only the second fires.
    rng = np.random.default_rng(1)
    xs = 1.0 + 0.05 * rng.standard_normal(50)
    for margin, fires in [(0.99, False), (1.01, True)]:
        det = SpikeDetector(threshold=4.0, rel_floor=0.0, abs_floor=0.0, warmup=10)
        _feed(det, xs)
        x = det.median + margin * 4.0 * det.scale
        assert (det.update(50, {"loss": x}) is not None) is fires


def test_relative_floor_keeps_a_plateau_quiet():
    # A plateau with tiny noise: 1% above the mean is hundreds of sigmas.
    rng = np.random.default_rng(2)
    xs = 2.0 + 1e-5 * rng.standard_normal(100)
    bump = 2.0 * 1.01
    quiet = SpikeDetector(warmup=10, rel_floor=0.1)
    _feed(quiet, xs)
    assert quiet.update(100, {"loss": bump}) is None
    loud = SpikeDetector(warmup=10, rel_floor=0.0, abs_floor=0.0)
    _feed(loud, xs)
    d = loud.update(100, {"loss": bump})
    assert d is not None and d.details["z"] > 100
    # Beyond the floor the plateau detector fires too.
    assert quiet.update(101, {"loss": 2.0 * 1.2}) is not None


def test_onset_is_the_start_of_the_rise():
    rng = np.random.default_rng(3)
    xs = 1.0 + 0.01 * rng.standard_normal(60)
    det = SpikeDetector(warmup=20, threshold=6.0, onset_threshold=3.0, rel_floor=0.0)
    _feed(det, xs)
    m, s = det.median, det.scale
    # Steps 60, 61 climb above 3 scales (still accepted), 62 is the spike.
    assert det.update(60, {"loss": m + 4 * s}) is None
    assert det.update(61, {"loss": m + 5 * s}) is None
    d = det.update(62, {"loss": m + 50 * s})
    assert d.step == 62 and d.onset == 60


def test_onset_resets_when_the_loss_comes_back():
    rng = np.random.default_rng(4)
    det = SpikeDetector(warmup=20, rel_floor=0.0)
    _feed(det, 1.0 + 0.01 * rng.standard_normal(60))
    s = det.scale
    det.update(60, {"loss": det.median + 4 * s})  # elevated
    det.update(61, {"loss": det.median})  # back to normal: the rise is over
    d = det.update(62, {"loss": det.median + 100 * s})
    assert d.onset == 62


def test_anomalous_and_nonfinite_values_never_enter_the_statistics():
    rng = np.random.default_rng(5)
    det = SpikeDetector(warmup=10)
    _feed(det, 1.0 + 0.01 * rng.standard_normal(30))
    before = det.get_state()
    assert det.update(30, {"loss": 100.0}) is not None
    assert det.update(31, {"loss": float("nan")}) is None
    assert det.update(32, {"loss": float("inf")}) is None
    after = det.get_state()
    assert (after["n"], after["values"]) == (before["n"], before["values"])


def test_guarded_spikes_record_then_roll_back_after_patience():
    rng = np.random.default_rng(6)
    det = SpikeDetector(warmup=10, patience=3)
    _feed(det, 1.0 + 0.01 * rng.standard_normal(30))
    out = _feed(det, [50.0, 51.0, 52.0], start=30, skipped=True)
    assert out[0].action == "record" and out[0].onset == 30
    assert out[1] is None  # same episode, still within patience
    assert out[2].action == "rollback" and out[2].onset == 30 and out[2].details["streak"] == 3
    # A new episode after a normal value starts counting again.
    det2 = SpikeDetector(warmup=10, patience=3)
    _feed(det2, 1.0 + 0.01 * rng.standard_normal(30))
    out = _feed(det2, [50.0, 1.0, 50.0, 1.0, 50.0], start=30, skipped=True)
    assert [d.action if d else None for d in out] == ["record", None, "record", None, "record"]


def test_unguarded_value_inside_a_guarded_episode_rolls_back():
    rng = np.random.default_rng(7)
    det = SpikeDetector(warmup=10, patience=10)
    _feed(det, 1.0 + 0.01 * rng.standard_normal(30))
    assert det.update(30, {"loss": 50.0, "skipped": True}).action == "record"
    d = det.update(31, {"loss": 50.0, "skipped": False})
    assert d.action == "rollback" and d.onset == 30
    assert det.active_onset == 30


def test_spike_state_round_trip_is_json_and_exact():
    rng = np.random.default_rng(8)
    xs = 1.0 + 0.05 * rng.standard_normal(80)
    xs[60] = 40.0
    a = SpikeDetector(warmup=10)
    outs_a = _feed(a, xs)
    b = SpikeDetector(warmup=10)
    _feed(b, xs[:50])
    c = SpikeDetector(warmup=10)
    c.set_state(json.loads(json.dumps(b.get_state())))
    outs_c = _feed(c, xs[50:], start=50)
    assert outs_a[50:] == outs_c
    assert a.get_state() == c.get_state()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"threshold": 0.0},
        {"rel_floor": -0.1},
        {"abs_floor": -1e-9},
        {"window": 2},
        {"window": 10.5},
        {"warmup": 0},
        {"warmup": 129},
        {"onset_threshold": 9.0},
        {"patience": 0},
    ],
)
def test_spike_detector_validates(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SpikeDetector(**kwargs)


def test_missing_metric_is_a_clear_error():
    with pytest.raises(ValueError, match="'loss'"):
        SpikeDetector().update(0, {"grad_norm": 1.0})


def test_divergence_nonfinite_applied_rolls_back_skipped_is_recorded_once():
    det = DivergenceDetector(max_skip_streak=10)
    d = det.update(3, {"loss": float("nan")})
    assert d.kind == "divergence" and d.action == "rollback" and d.onset == 3
    det = DivergenceDetector(max_skip_streak=10)
    out = [det.update(s, {"loss": float("nan"), "skipped": True}) for s in range(5, 8)]
    assert out[0].action == "record" and out[1] is None and out[2] is None
    assert det.active_onset == 5
    assert det.update(8, {"loss": 1.0, "skipped": False}) is None
    assert det.active_onset is None


def test_divergence_skip_streak_from_metrics_and_own_count():
    det = DivergenceDetector(max_skip_streak=3)
    assert det.update(10, {"loss": 1.0, "skipped": True, "skip_streak": 3}) is None
    d = det.update(11, {"loss": 1.0, "skipped": True, "skip_streak": 4})
    assert d.action == "rollback" and d.onset == 8  # the first of the 4 skipped steps
    own = DivergenceDetector(max_skip_streak=2)
    out = [own.update(s, {"loss": 1.0, "skipped": True}) for s in range(20, 23)]
    assert out[:2] == [None, None] and out[2].onset == 20
    # The count resets after a step that was not skipped.
    own = DivergenceDetector(max_skip_streak=2)
    flags = [True, True, False, True, True]
    assert all(own.update(s, {"loss": 1.0, "skipped": f}) is None for s, f in enumerate(flags))


def test_divergence_state_round_trip():
    a = DivergenceDetector(max_skip_streak=3)
    for s in range(2):
        a.update(s, {"loss": float("inf"), "skipped": True})
    b = DivergenceDetector(max_skip_streak=3)
    b.set_state(json.loads(json.dumps(a.get_state())))
    assert b.get_state() == a.get_state()
    assert [x.update(2, {"loss": 1.0, "skipped": True}) for x in (a, b)] == [None, None]
    da, db = (x.update(3, {"loss": 1.0, "skipped": True}) for x in (a, b))
    assert da == db and da.onset == 0


def _mk_reference(x):
    """Mann-Kendall by double loop and tie groups by counting, in float64."""
    n = len(x)
    s = 0.0
    for i in range(n):
        for j in range(i + 1, n):
            s += (x[j] > x[i]) - (x[j] < x[i])
    groups = {}
    for v in x:
        groups[v] = groups.get(v, 0) + 1
    ties = sum(t * (t - 1) * (2 * t + 5) for t in groups.values())
    var = (n * (n - 1) * (2 * n + 5) - ties) / 18.0
    z = 0.0 if s == 0 else (s - (1 if s > 0 else -1)) / math.sqrt(var)
    return s, var, z


@pytest.mark.parametrize(
    "x",
    [
        [1.0, 2.0, 3.0, 4.0],
        [4.0, 3.0, 2.0, 1.0],
        [1.0, 1.0, 2.0, 2.0, 2.0, 0.5, 3.0],
        [5.0, 5.0, 5.0],
        list(np.round(np.random.default_rng(9).standard_normal(40), 1)),
        list(np.random.default_rng(10).standard_normal(30) + 0.05 * np.arange(30)),
    ],
)
def test_mann_kendall_matches_double_loop_reference(x):
    s, var, z = mann_kendall(x)
    rs, rvar, rz = _mk_reference([float(v) for v in x])
    assert s == rs
    np.testing.assert_allclose(var, rvar, rtol=1e-12)
    np.testing.assert_allclose(z, rz, rtol=1e-12, atol=1e-15)


def test_mann_kendall_rejects_short_series():
    with pytest.raises(ValueError, match=">= 3"):
        mann_kendall([1.0, 2.0])


def test_sen_slope_matches_reference():
    x = list(np.random.default_rng(11).standard_normal(25) + 0.3 * np.arange(25))
    slopes = [(x[j] - x[i]) / (j - i) for i, j in itertools.combinations(range(len(x)), 2)]
    assert sen_slope(x) == pytest.approx(float(np.median(slopes)), rel=1e-12)


def _slow_rise(n, seed, slope=5e-4):
    rng = np.random.default_rng(seed)
    return 3.0 + slope * np.arange(n) + 0.05 * rng.standard_normal(n)


def test_slow_rise_caught_by_trend_test_missed_by_spike_detector():
    xs = _slow_rise(2400, seed=12)
    spike = SpikeDetector()
    assert all(d is None for d in _feed(spike, xs))
    slow = SlowDivergenceDetector(window=40, block=20)
    found = [d for d in _feed(slow, xs) if d is not None]
    assert found, "the slow rise was not detected"
    d = found[0]
    assert d.kind == "slow_divergence" and d.action == "warn"
    assert d.details["z"] > 3.5 and d.details["rel_rise"] >= 0.03
    # The onset is the first step of the window tested.
    assert d.onset == d.step + 1 - 40 * 20
    # One alarm per window: the next needs a fresh window.
    assert all(b.step - a.step >= 40 * 20 for a, b in itertools.pairwise(found))


@pytest.mark.parametrize("seed", range(4))
def test_no_false_alarm_on_a_noisy_decreasing_curve(seed):
    rng = np.random.default_rng(100 + seed)
    t = np.arange(6000)
    # Decreasing, then a long plateau; heavy-tailed noise, an occasional bump.
    xs = 2.0 + 3.0 * np.exp(-t / 500.0) + 0.15 * rng.standard_t(3, size=t.size)
    # The defaults, and the settings that catch the slow rise above.
    for det in (SlowDivergenceDetector(), SlowDivergenceDetector(window=40, block=20)):
        assert all(d is None for d in _feed(det, xs))


def test_tiny_but_significant_drift_is_below_min_rise():
    # Over 1000 steps the loss rises 0.5%: significant with little noise, but negligible.
    # (2000 steps: the test needs a window of history before its first window.)
    xs = _slow_rise(2000, seed=13, slope=1e-5) * 1.0
    xs = 2.0 + (xs - 3.0) * 0.2
    strict = SlowDivergenceDetector(window=50, block=20, min_rise=0.03)
    assert all(d is None for d in _feed(strict, xs))
    lax = SlowDivergenceDetector(window=50, block=20, min_rise=0.0, z_threshold=1.0)
    assert any(d is not None for d in _feed(lax, xs))


def test_slow_detector_action_and_state_round_trip():
    xs = _slow_rise(2000, seed=14)
    a = SlowDivergenceDetector(window=30, block=10, action="rollback_best")
    out_a = _feed(a, xs)
    b = SlowDivergenceDetector(window=30, block=10, action="rollback_best")
    _feed(b, xs[:777])
    c = SlowDivergenceDetector(window=30, block=10, action="rollback_best")
    c.set_state(json.loads(json.dumps(b.get_state())))
    out_c = _feed(c, xs[777:], start=777)
    assert out_a[777:] == out_c
    assert any(d is not None and d.action == "rollback_best" and d.rolls_back for d in out_c)


@pytest.mark.parametrize(
    "kwargs", [{"window": 4}, {"block": 0}, {"z_threshold": 0}, {"min_rise": -1}, {"action": "x"}]
)
def test_slow_detector_validates(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SlowDivergenceDetector(**kwargs)


def test_default_detectors_follow_the_protocol():
    dets = default_detectors()
    assert [type(d).__name__ for d in dets] == [
        "SpikeDetector",
        "DivergenceDetector",
        "SlowDivergenceDetector",
    ]
    assert all(isinstance(d, Detector) for d in dets)
    assert len({d.name for d in dets}) == 3
    for d in dets:
        json.dumps(d.get_state())


def test_divergence_counts_skips_across_nested_guards():
    # skip_nonfinite(skip_spikes(...)): a NaN step restores the inner guard's state, so after
    # NaN, NaN, spike the guards' longest streak reads 1 while 3 steps in a row were skipped.
    opt = skip_nonfinite(skip_spikes(optax.sgd(0.1), warmup_steps=3, watch=("loss",)))
    update = jax.jit(opt.update)
    params = jnp.zeros(2)
    state = opt.init(params)
    det = DivergenceDetector(max_skip_streak=2)
    losses = [1.0, 1.1, 0.9, 1.0, float("nan"), float("nan"), 50.0]
    found = []
    for step, loss in enumerate(losses):
        _, state = update(jnp.ones(2), state, params, loss=loss)
        metrics = {
            "loss": loss,
            "skipped": bool(any_skipped(state)),
            "skip_streak": int(skip_streak(state)),
        }
        found.append(det.update(step, metrics))
    assert metrics["skipped"] and metrics["skip_streak"] == 1  # the guards' own view
    assert found[:6] == [None] * 4 + [found[4], None]
    assert found[4].action == "record"  # the first NaN, skipped: recorded only
    assert found[6].action == "rollback" and found[6].onset == 4
