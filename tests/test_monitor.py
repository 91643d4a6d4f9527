"""stabljax.control.detect.monitor: what is fetched from the device, what the detectors see, the
loss EMA, the recent losses and the monitor's part of a checkpoint.

That the controller hands the monitor a step's metrics one step late (so the device is
never idle) is tested on the controller: test_controller.py's
``test_step_does_not_read_the_current_metrics``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CountedReads

from stabljax.control.detect.detectors import Detection
from stabljax.control.detect.monitor import EMA_DECAY, Monitor


class _Threshold:
    """A detector flagging every loss above ``limit``; records what it was given."""

    active_onset = None

    def __init__(self, name="thr", keys=("loss",), action="rollback", limit=5.0):
        self.name, self.keys, self.action, self.limit = name, keys, action, limit
        self.seen, self.state = [], {}

    def update(self, step, metrics):
        self.seen.append((step, dict(metrics)))
        loss = metrics["loss"]
        if loss > self.limit:
            reason = f"loss {loss} above {self.limit}"
            return Detection("spike", step, step - 1, self.action, reason, loss, {"limit": 5})
        return None

    def get_state(self):
        return {"seen": len(self.seen)}

    def set_state(self, state):
        self.state = state


def _monitor(*detectors):
    log = []
    return Monitor(list(detectors), lambda kind, step, **d: log.append((kind, step, d))), log


def test_only_the_scalars_some_detector_reads_are_fetched():
    a, b = _Threshold("a", keys=("loss",)), _Threshold("b", keys=("grad_norm",))
    monitor, _ = _monitor(a, b)
    # The detectors' keys, plus what the monitor itself reads (the skip flag for the
    # recent losses, the guards' re-baseline count for its events).
    assert monitor.keys == {"loss", "grad_norm", "skipped", "spike_rebaselines"}
    unread = CountedReads(0.1)
    metrics = {
        "loss": jnp.float32(1.5),
        "grad_norm": jnp.float32(2.0),
        "lr": unread,
        "layers": {"grad_norm": {"w": jnp.float32(3.0)}},
    }
    monitor.observe(7, metrics)
    assert unread.reads == 0
    # Every detector sees the same host dict of Python scalars.
    assert a.seen == b.seen == [(7, {"loss": 1.5, "grad_norm": 2.0})]
    assert all(type(v) is float for v in a.seen[0][1].values())


def test_a_detector_without_keys_gets_every_scalar_and_no_array_or_tree():
    det = _Threshold(keys=None)
    monitor, _ = _monitor(det)
    assert monitor.keys is None
    metrics = {
        "loss": jnp.float32(1.0),
        "skipped": jnp.bool_(True),
        "count": np.int32(3),
        "hist": jnp.ones(3),
        "layers": {"w": jnp.float32(1.0)},
        "none": None,
    }
    monitor.observe(0, metrics)
    assert det.seen == [(0, {"loss": 1.0, "skipped": True, "count": 3})]


def test_the_smoothed_loss_is_a_bias_corrected_ema_that_skips_non_finite_losses():
    monitor, _ = _monitor(_Threshold(limit=100.0))
    assert monitor.smoothed_loss is None
    monitor.observe(0, {"loss": 1.0})
    assert monitor.smoothed_loss == pytest.approx(1.0, rel=1e-12)
    monitor.observe(1, {"loss": 3.0})
    # (0.98 * 1 + 3) * 0.02 / (1 - 0.98**2)
    want = (EMA_DECAY * 1.0 + 3.0) * (1 - EMA_DECAY) / (1 - EMA_DECAY**2)
    assert monitor.smoothed_loss == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(3.98 / 1.98, rel=1e-12)
    monitor.observe(2, {"loss": float("nan")})
    assert monitor.smoothed_loss == pytest.approx(want, rel=1e-12)
    assert monitor.ema[1] == 2 and np.isnan(monitor.last_loss)


def test_detections_are_returned_and_logged_with_their_details():
    det = _Threshold()
    monitor, log = _monitor(det)
    assert monitor.observe(3, {"loss": 1.0}) == []
    found = monitor.observe(4, {"loss": 9.0})
    assert [(d.step, d.onset, d.action) for d in found] == [(4, 3, "rollback")]
    assert log == [
        (
            "spike",
            4,
            {
                "action": "rollback",
                "onset": 3,
                "value": 9.0,
                "reason": "loss 9.0 above 5.0",
                "detector": "thr",
                "limit": 5,
            },
        )
    ]


def test_a_warn_detection_warns_and_an_unknown_action_is_an_error_naming_it():
    monitor, log = _monitor(_Threshold(action="warn"))
    with pytest.warns(RuntimeWarning, match="loss 9.0 above 5.0"):
        monitor.observe(1, {"loss": 9.0})
    assert [k for k, _, _ in log] == ["spike"]
    monitor, log = _monitor(_Threshold("odd", action="explode"))
    with pytest.raises(ValueError, match="'odd'.*'explode'"):
        monitor.observe(1, {"loss": 9.0})
    assert log == []


def test_the_recent_losses_keep_64_steps_and_a_rollback_trims_them():
    monitor, _ = _monitor(_Threshold(keys=("loss", "skipped"), limit=1e9))
    for step in range(70):
        monitor.observe(step, {"loss": float(step), "skipped": step == 68})
    assert len(monitor.recent) == 64 and monitor.recent[0] == (6, 6.0, False)
    assert monitor.losses_before(69)[-2:] == [[68, 68.0, True], [69, 69.0, False]]
    monitor.trim(60)  # a rollback to checkpoint 60
    assert [s for s, _, _ in monitor.recent] == list(range(6, 60))
    assert monitor.losses_before(100)[-1] == [59, 59.0, False]


def test_a_loss_only_detector_still_gets_the_skip_flags_recorded():
    monitor, _ = _monitor(_Threshold(keys=("loss",), limit=1e9))
    unread = CountedReads(0.1)
    monitor.observe(3, {"loss": jnp.float32(2.0), "skipped": jnp.bool_(True), "lr": unread})
    assert list(monitor.recent) == [(3, 2.0, True)] and unread.reads == 0
    assert monitor.losses_before(4) == [[3, 2.0, True]]


def test_the_checkpoint_part_round_trips_and_a_missing_detector_state_is_empty():
    a, b = _Threshold("a"), _Threshold("b")
    monitor, _ = _monitor(a, b)
    monitor.observe(0, {"loss": 2.0})
    meta = monitor.to_meta()
    assert meta == {
        "detectors": {"a": {"seen": 1}, "b": {"seen": 1}},
        "ema": [(1 - EMA_DECAY) * 2.0, 1],
        "spike_rebaselines": None,  # no guard count in these metrics
    }
    fresh_a, fresh_b = _Threshold("a"), _Threshold("b")
    fresh, _ = _monitor(fresh_a, fresh_b)
    fresh.last_loss = 5.0
    fresh.load({"detectors": {"a": {"seen": 1}}, "ema": meta["ema"]})
    assert fresh_a.state == {"seen": 1} and fresh_b.state == {}
    assert fresh.ema == meta["ema"] and fresh.last_loss is None
    assert fresh.smoothed_loss == pytest.approx(2.0, rel=1e-12)


def test_rolls_back_to_best_only_with_a_rollback_best_detector():
    assert not _monitor(_Threshold())[0].rolls_back_to_best
    assert _monitor(_Threshold("a"), _Threshold("b", action="rollback_best"))[0].rolls_back_to_best


def test_bad_detectors_and_bad_metrics_are_clear_errors():
    with pytest.raises(ValueError, match="unique.*'a', 'a'"):
        _monitor(_Threshold("a"), _Threshold("a"))
    with pytest.raises(TypeError, match="lacks the Detector interface"):
        _monitor(object())
    with pytest.raises(ValueError, match=r"'loss' entry.*\['acc'\]"):
        Monitor.check_metrics({"acc": 1.0})
    with pytest.raises(ValueError, match="got tuple"):
        Monitor.check_metrics((1.0,))
    Monitor.check_metrics({"loss": 1.0})
