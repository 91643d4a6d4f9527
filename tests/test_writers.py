"""Metrics writers and RollbackController.run(metrics_writer=, log_every=)."""

from __future__ import annotations

import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from toy import batch_fn_factory, toy_problem
from toy import toy_controller as _controller

from stabljax.control import IndexedBatches, JsonlMetricsWriter
from stabljax.control.checkpoint.fsutil import UnsafePathError
from stabljax.control.events import TensorBoardMetricsWriter, host_metrics

STATE0, STEP = toy_problem()


def test_host_metrics_flattens_scalars_and_drops_arrays():
    out = host_metrics(
        {"loss": jnp.float32(1.5), "n": jnp.int32(3), "ok": jnp.bool_(True),
         "layers": {"a": {"w": jnp.float32(2.0)}}, "vec": jnp.ones(2)}
    )  # fmt: skip
    assert out == {"loss": 1.5, "n": 3, "ok": True, "layers/a/w": 2.0}
    assert type(out["n"]) is int and type(out["ok"]) is bool


def test_writer_is_fed_one_step_late_and_every_step_once_without_rollbacks(tmp_path):
    written: list[tuple[int, dict]] = []
    seen_at_call: list[int] = []

    def step(state, batch):
        seen_at_call.append(len(written))
        return STEP(state, batch)

    ctl = _controller(tmp_path / "ckpt")
    losses = {}

    def writer(s, m):
        written.append((s, m))

    state, _ = ctl.run(
        step, STATE0, IndexedBatches(batch_fn_factory(())), 25, progress=False,
        metrics_writer=writer,
    )  # fmt: skip
    # When step k is computed, steps 0..k-2 have been written: never the step just before,
    # whose metrics may still be in flight on the device.
    assert seen_at_call == [max(k - 1, 0) for k in range(25)]
    assert [s for s, _ in written] == list(range(25))
    for s, m in written:
        assert set(m) >= {"loss"} and isinstance(m["loss"], float)
        losses[s] = m["loss"]
    assert int(state.step) == 25 and ctl.rollbacks == 0


def test_log_every_and_replays_after_a_rollback(tmp_path):
    written: list[int] = []
    ctl = _controller(tmp_path / "ckpt")
    ctl.run(
        STEP, STATE0, IndexedBatches(batch_fn_factory((35,))), 60, progress=False,
        metrics_writer=lambda s, m: written.append(s), log_every=5,
    )  # fmt: skip
    assert ctl.rollbacks == 1
    assert all(s % 5 == 0 for s in written)
    # The rolled-back steps are written again: some step numbers appear twice, in order.
    assert len(written) > len(set(written)) and sorted(set(written)) == list(range(0, 60, 5))


def test_bad_writer_arguments(tmp_path):
    ctl = _controller(tmp_path / "ckpt")
    data = IndexedBatches(batch_fn_factory(()))
    with pytest.raises(ValueError, match="log_every"):
        ctl.run(STEP, STATE0, data, 5, progress=False, metrics_writer=print, log_every=0)
    ctl = _controller(tmp_path / "ckpt2")
    with pytest.raises(TypeError, match="metrics_writer"):
        ctl.run(STEP, STATE0, IndexedBatches(batch_fn_factory(())), 5, metrics_writer=3)


def test_jsonl_writer_end_to_end_and_a_torn_line_is_healed(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    with JsonlMetricsWriter(path) as w:
        ctl = _controller(tmp_path / "ckpt")
        ctl.run(
            STEP, STATE0, IndexedBatches(batch_fn_factory(())), 12, progress=False,
            metrics_writer=w,
        )  # fmt: skip
        w(99, {"loss": float("nan"), "x": float("inf")})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [*range(12), 99]
    assert rows[-1] == {"step": 99, "loss": "nan", "x": "inf"}
    assert all(np.isfinite(r["loss"]) for r in rows[:-1])
    with open(path, "a") as f:  # a crash in the middle of a write
        f.write('{"step": 100, "lo')
    with JsonlMetricsWriter(path) as w:
        w(101, {"loss": 1.0})
    lines = path.read_text().splitlines()
    assert lines[-2] == '{"step": 100, "lo' and json.loads(lines[-1]) == {"step": 101, "loss": 1.0}
    with pytest.raises(ValueError, match="closed"):
        w(102, {"loss": 1.0})


def test_jsonl_writer_refuses_a_symlink_and_writes_nothing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UnsafePathError, match="refusing to follow the symlink"):
        JsonlMetricsWriter(tmp_path / "run" / "metrics.jsonl")
    assert victim.read_text() == "precious\n"


def _tfrecords(path):
    data = path.read_bytes()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        yield data[i + 12 : i + 12 + n]
        i += 12 + n + 4


def test_tensorboard_writer_writes_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto import event_pb2

    with TensorBoardMetricsWriter(tmp_path / "tb") as w:
        w(3, {"loss": jnp.float32(2.5), "layers": {"w": 1.0}, "hist": jnp.ones(4)})
    (events,) = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    scalars = {}
    for rec in _tfrecords(events):
        ev = event_pb2.Event.FromString(rec)
        for v in ev.summary.value:
            scalars[v.tag] = (ev.step, v.simple_value)
    assert scalars == {"loss": (3, 2.5), "layers/w": (3, 1.0)}


def test_tensorboard_writer_without_tensorboardx_is_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("tensorboardX"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"\.\[tensorboard\]"):
        TensorBoardMetricsWriter("unused")
