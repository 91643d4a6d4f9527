"""Tests of the leading-indicator warning (stabljax.control.detect.warning)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stabljax.control.detect.warning import DEFAULT_SIGNALS, Signal, WarningDetector


def cusum_reference(y, *, warmup, drift, alpha, clamp, winsor, two_sided=False):
    """Page's CUSUM on z-scores against the documented baseline, float64 numpy.

    Returns ``(s_up, s_down)`` per index (NaN during warmup)."""
    y = np.asarray(y, np.float64)
    first = y[np.isfinite(y)][:warmup]
    end = int(np.flatnonzero(np.isfinite(y))[warmup - 1]) + 1
    mu, var = np.mean(first), np.var(first)
    up, down = np.full(y.size, np.nan), np.full(y.size, np.nan)
    s_up = s_down = 0.0
    for t in range(end, y.size):
        sd = np.sqrt(var)
        z = np.clip((y[t] - mu) / (sd + 1e-12), -clamp, clamp) if np.isfinite(y[t]) else clamp
        s_up = max(0.0, s_up + z - drift)
        if two_sided:
            s_down = max(0.0, s_down - z - drift)
        up[t], down[t] = s_up, s_down
        if np.isfinite(y[t]):
            yw = mu + np.clip(z, -winsor, winsor) * sd
            mu = alpha * mu + (1 - alpha) * yw
            var = alpha * var + (1 - alpha) * (yw - mu) ** 2
    return up, down


PARAMS = dict(warmup=10, drift=0.5, alpha=0.9, clamp=4.0, winsor=2.0)


def run(det, key, xs):
    stats, found = [], []
    for t, x in enumerate(xs):
        d = det.update(t, {key: x})
        stats.append(det.statistics)
        if d is not None:
            found.append(d)
    return stats, found


def test_hand_computed_cusum():
    # warmup 4 of [1, 1.1, 0.9, 1]: mu = 1, var = 0.02 / 4 = 0.005. Step 4 (1.05): z = 0.7071,
    # S = max(0, 0.7071 - 1) = 0; mu = 0.97 + 0.03 * 1.05 = 1.0015, var = 0.97 * 0.005 +
    # 0.03 * 0.0485^2 = 0.004920568. Step 5 (1.6): z = 0.5985 / 0.070147 = 8.53, clamped to
    # 6: S = 5 (not > 5). Step 6 (2.2): S = 5 + 6 - 1 = 10 > 5: the warning, onset 5.
    det = WarningDetector([Signal("grad_norm", "level")], threshold=5.0, warmup=4)
    stats, found = run(det, "grad_norm", [1.0, 1.1, 0.9, 1.0, 1.05, 1.6, 2.2])
    assert [s["grad_norm"] for s in stats] == [0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 10.0]
    st = det.get_state()["signals"][0]
    assert st["n"] == 4
    assert len(found) == 1 and (found[0].step, found[0].onset) == (6, 5)
    assert found[0].kind == "warning" and found[0].action == "warn" and not found[0].rolls_back
    assert det.engaged


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("two_sided", [False, True])
def test_matches_the_float64_reference(seed, two_sided):
    rng = np.random.default_rng(seed)
    x = 1.0 + 0.1 * rng.standard_normal(300)
    x[150:170] += np.linspace(0.0, 1.0, 20)  # a ramp
    x[200] = np.nan
    x[250:260] -= 0.5  # a fall
    det = WarningDetector([Signal("loss", "level", two_sided)], threshold=1e9, name="w", **PARAMS)
    stats, _ = run(det, "loss", x)
    up, down = cusum_reference(x, two_sided=two_sided, **PARAMS)
    got_up = np.array([s["loss"] for s in stats])
    done = ~np.isnan(up)
    assert done.sum() == 290 and np.all(got_up[~done] == 0.0)
    np.testing.assert_allclose(got_up[done], up[done], rtol=1e-12, atol=1e-12)
    assert up[165] > 10  # the ramp is seen
    if two_sided:
        got_down = np.array([s["-loss"] for s in stats])
        np.testing.assert_allclose(got_down[done], down[done], rtol=1e-12, atol=1e-12)
        assert down[258] > 10  # and the fall
    else:
        assert "-loss" not in stats[-1]


def test_transforms_log_and_diff_match_the_reference():
    rng = np.random.default_rng(7)
    x = np.exp(0.05 * rng.standard_normal(200)) * 2.0
    x[120] = 0.0  # a skipped step's zero update ratio: not tested
    logit = np.cumsum(0.01 * rng.standard_normal(200)) + 5.0
    det = WarningDetector(
        [Signal("update_rms_ratio", "log"), Signal("max_attn_logit", "diff")],
        threshold=1e9,
        **PARAMS,
    )
    stats = []
    for t in range(200):
        det.update(t, {"update_rms_ratio": x[t], "max_attn_logit": logit[t]})
        stats.append(det.statistics)
    y_log = np.log(np.delete(x, 120))
    up, _ = cusum_reference(y_log, **PARAMS)
    got = np.delete(np.array([s["update_rms_ratio"] for s in stats]), 120)
    np.testing.assert_allclose(got[~np.isnan(up)], up[~np.isnan(up)], rtol=1e-12, atol=1e-12)
    up, _ = cusum_reference(np.diff(logit), **PARAMS)
    got = np.array([s["max_attn_logit"] for s in stats])[1:]
    np.testing.assert_allclose(got[~np.isnan(up)], up[~np.isnan(up)], rtol=1e-12, atol=1e-12)


def test_nonfinite_counts_as_the_largest_rise_and_leaves_the_baseline():
    det = WarningDetector([Signal("grad_norm", "level")], threshold=100.0, **PARAMS)
    for t in range(10):
        det.update(t, {"grad_norm": 1.0 + 0.01 * (t % 3)})
    before = dict(det.get_state()["signals"][0])
    det.update(10, {"grad_norm": math.inf})
    after = det.get_state()["signals"][0]
    assert after["s_up"] == PARAMS["clamp"] - PARAMS["drift"]
    assert (after["mu"], after["var"]) == (before["mu"], before["var"])


def test_disengages_after_calm_and_warns_again():
    det = WarningDetector([Signal("grad_norm", "level")], threshold=3.0, calm=5, **PARAMS)
    x = [1.0, 1.02, 0.98] * 4 + [3.0, 3.0] + [1.0] * 40 + [3.0, 3.0]
    stats, found = run(det, "grad_norm", x)
    assert [d.step for d in found] == [12, 54]
    quiet = next(t for t in range(13, 54) if stats[t]["grad_norm"] <= 3.0)
    # engaged until 5 quiet steps have passed
    det2 = WarningDetector([Signal("grad_norm", "level")], threshold=3.0, calm=5, **PARAMS)
    engaged = [
        det2.update(t, {"grad_norm": v}) is not None or det2.engaged for t, v in enumerate(x)
    ]
    assert engaged[quiet + 3] and not engaged[quiet + 4]


def test_state_round_trips_through_json():
    rng = np.random.default_rng(3)
    x = np.exp(0.1 * rng.standard_normal(400))
    x[300:] *= np.exp(np.linspace(0, 2, 100))
    metrics = [{"update_rms_ratio": v, "log_z": 0.01 * t} for t, v in enumerate(x)]
    sigs = [Signal("update_rms_ratio"), Signal("log_z", "diff", two_sided=True)]
    whole = WarningDetector(sigs, threshold=8.0, **PARAMS)
    ref = [whole.update(t, m) for t, m in enumerate(metrics)]
    first = WarningDetector(sigs, threshold=8.0, **PARAMS)
    got = [first.update(t, m) for t, m in enumerate(metrics[:250])]
    saved = json.loads(json.dumps(first.get_state()))
    second = WarningDetector(sigs, threshold=8.0, **PARAMS)
    second.set_state(saved)
    got += [second.update(t, m) for t, m in enumerate(metrics[250:], start=250)]
    assert got == ref and any(d is not None for d in ref)
    assert second.get_state() == whole.get_state()
    with pytest.raises(ValueError, match="signals"):
        WarningDetector(sigs[:1]).set_state(saved)


def test_missing_metrics_are_not_tested():
    det = WarningDetector(DEFAULT_SIGNALS, warmup=3)
    for t in range(10):
        assert det.update(t, {"grad_norm": 1.0, "loss": 2.0}) is None
    st = det.get_state()["signals"]
    assert [s["n"] for s in st] == [0, 0, 3, 0, 0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": 0.0}, "threshold"),
        ({"drift": -1.0}, "drift"),
        ({"alpha": 1.0}, "alpha"),
        ({"warmup": 1}, "warmup"),
        ({"calm": 0}, "calm"),
        ({"clamp": math.inf}, "clamp"),
        ({"action": "rollback"}, "action"),
        ({"signals": [Signal("los")]}, "los"),
        ({"signals": [Signal("loss", "sqrt")]}, "transform"),
        ({"signals": []}, "signals"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarningDetector(**kwargs)


# ------------------------------------------------------------------ under the controller


def noisy_batches(start: int, stop: int):
    """The toy's data, with targets noisier on batches [start, stop): the grad norm rises."""
    from toy import batch_fn_factory

    clean = batch_fn_factory()

    def batch_fn(i):
        b = clean(i)
        if start <= i < stop:
            noise = np.random.default_rng(i).normal(size=b["y"].shape).astype(np.float32)
            b["y"] = b["y"] + 5.0 * noise
        return b

    return batch_fn


def lr_of(state):
    return np.float32(state.opt_state.hyperparams["learning_rate"])


def test_controller_lowers_the_lr_on_warning_and_restores_it(tmp_path):
    import optax
    from toy import make_toy

    from stabljax.control import DivergenceDetector, IndexedBatches, RollbackController
    from stabljax.control.decide.remedies import WarningResponse
    from stabljax.control.events import read_events

    state, step = make_toy(optax.inject_hyperparams(optax.sgd)(learning_rate=0.05))

    def controller():
        det = WarningDetector(
            [Signal("grad_norm", "log")],
            threshold=6.0,
            warmup=20,
            alpha=0.8,
            calm=15,
            action="record",
        )
        return RollbackController(
            tmp_path,
            save_every=10,
            keep=3,
            rollback_margin=10,
            detectors=[det, DivergenceDetector()],
            warning_response=WarningResponse(factor=0.5),
        )

    data = IndexedBatches(noisy_batches(40, 55))
    with controller() as ctl:
        state, data = ctl.run(step, state, data, 50, progress=False)
        assert ctl.detectors[0].engaged and ctl.detectors[0].applied
        assert lr_of(state) == np.float32(0.025)
    events = read_events(tmp_path / "events.jsonl")
    warning = [e for e in events if e.kind == "warning"]
    lowered = [e for e in events if e.kind == "warning_response"]
    assert len(warning) == 1 and 40 <= warning[0].step < 50
    assert [e.details["change"] for e in lowered] == ["lowered"]
    # Step s's metrics are read one call late, while step s + 1 runs: step s + 2 is the first
    # to train at the lowered LR, and the event carries that step.
    assert lowered[0].step == warning[0].step + 2
    # A restart from the checkpoint at step 50 brings back the lowered LR and the flag.
    state0, _ = make_toy(optax.inject_hyperparams(optax.sgd)(learning_rate=0.05))
    with controller() as ctl:
        state, data = ctl.restore_or_init(state0, IndexedBatches(noisy_batches(40, 55)))
        assert ctl.detectors[0].applied and lr_of(state) == np.float32(0.025)
        state, data = ctl.run(step, state, data, 120, progress=False)
        assert not ctl.detectors[0].engaged and not ctl.detectors[0].applied
    assert lr_of(state) == np.float32(0.05)  # restored bitwise: 0.025 * 2
    changes = [e.details["change"] for e in read_events(tmp_path / "events.jsonl")
               if e.kind == "warning_response"]  # fmt: skip
    assert changes == ["lowered", "restored"]


def test_warning_response_needs_its_detector():
    from stabljax.control.decide.remedies import WarningResponse

    with pytest.raises(ValueError, match="factor"):
        WarningResponse(factor=1.0)
    with pytest.raises(ValueError, match="no warning detector"):
        WarningResponse()(None, [], lambda *a, **k: None, 0)


# ------------------------------------------------------------------ the benchmark


def test_bench_warning_quick(tmp_path):
    from experiments.bench import warning

    res = warning.main(["--quick", "--out", str(tmp_path), "--no-progress", "--steps", "100"])
    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("summary", "rows", "threshold", "calib_peak", "events_per_arm", "goal"):
        assert key in saved["results"], key
    assert res["calib_peak"] > 0  # 100 steps pass the 60-step warmup
    assert res["threshold"] == float(f"{1.25 * res['calib_peak']:.3g}")  # margin 1.25
    for name, s in res["summary"].items():
        assert s["healthy_steps"] == 2 * 100, name


def test_bench_event_rule():
    from experiments.bench.warning import event_step

    loss = np.full(60, 2.0) + 0.01 * np.sin(np.arange(60))
    assert event_step(loss, 0) is None
    loss[30] = 4.0  # one batch's outlier: not an event
    assert event_step(loss, 0) is None
    loss[40:43] = 2.6  # 0.6 nats above the median of the 20 before, for 3 of 5 steps
    assert event_step(loss, 0) == 40 and event_step(loss, 41) is None
    loss[50] = np.nan
    assert event_step(loss, 41) == 50
    loss[50], loss[58] = 2.0, 4.0  # an outlier two steps from the end: no full window
    assert event_step(loss, 41) is None
