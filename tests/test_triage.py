"""Spike triage after a rollback: verdicts on constructed runs, bounds, crash safety.

The toy (tests/toy.py) is a linear regression with SGD, so the replayed losses
can be checked against a float64 numpy re-implementation of the same training.
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import warnings

import chex
import grain
import jax
import numpy as np
import pytest
import toy

from stabljax.control import (
    SCHEMA_VERSION,
    IndexedBatches,
    PlainIterator,
    RollbackController,
    TriageConfig,
    read_events,
)
from stabljax.control.data.grain_iterators import GrainDatasetIterator
from stabljax.control.diagnose.triage import is_spike, robust_spikes, window_indices

WORKER = pathlib.Path(__file__).with_name("triage_worker.py")
ROOT = pathlib.Path(__file__).parent.parent


def _run(tmp_path, name="ckpt", steps=60, triage=..., **data):
    state, step = toy.triage_toy()
    kw = toy.triage_controller_kwargs()
    if triage is not ...:
        kw["triage"] = triage
    with RollbackController(tmp_path / name, **kw) as ctl:
        state, it = ctl.run(
            step, state, IndexedBatches(toy.triage_batches(**data)), steps, progress=False
        )
    return ctl, state, it


def _triage_event(ctl):
    found = [e for e in ctl.events if e.kind == "triage"]
    assert len(found) == 1, [e.kind for e in ctl.events]
    return found[0].details


# --------------------------------------------------------------- float64 reference


def _np_step(w, b, batch, step):
    """One SGD step of the toy in float64: (loss, new w, new b)."""
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    amp = 1.0 + 1e3 * batch["trigger"].astype(np.float64) * (step >= toy.STATE_FROM)
    r = x @ w + b - y
    loss = np.mean(amp * r**2)
    gw = 2.0 * x.T @ (amp * r) / r.size
    gb = 2.0 * np.mean(amp * r, axis=0)
    return loss, w - 0.05 * gw, b - 0.05 * gb


def _np_params_at(batch_fn, indices):
    w, b = np.zeros((4, 1)), np.zeros((1,))
    for s, i in enumerate(indices):
        _, w, b = _np_step(w, b, batch_fn(i), s)
    return w, b


def _np_replay(batch_fn, w, b, first_step, indices):
    losses = []
    for k, i in enumerate(indices):
        loss, w, b = _np_step(w, b, batch_fn(i), first_step + k)
        losses.append(loss)
    return losses


# ----------------------------------------------------------------------- verdicts


def test_a_garbage_batch_is_data_and_named_with_its_replayed_losses(tmp_path):
    ctl, _, _ = _run(tmp_path, triage=True, bad=[35])
    t = _triage_event(ctl)
    assert t["verdict"] == "data"
    assert t["culprits"] == [35]
    assert t["window"] == [30, 35] and t["restored_step"] == 30 and t["earlier_step"] == 20
    assert t["indices"] == [30, 31, 32, 33, 34, 35]
    ev = t["evidence"]
    # The replay from the restored checkpoint is the run itself, exactly.
    assert ev["restored"] == ev["run"]
    assert ev["rerun"] == ev["restored"][-1]
    # From two checkpoints back, against float64 numpy: the sequential replay and each
    # batch alone; only batch 35 spikes.
    batch_fn = toy.triage_batches(bad=[35])
    w20, b20 = _np_params_at(batch_fn, range(20))
    ref = _np_replay(batch_fn, w20, b20, 20, t["indices"])
    np.testing.assert_allclose(ev["earlier"], ref, rtol=2e-4)
    alone = [_np_replay(batch_fn, w20, b20, 20, [i])[0] for i in t["indices"]]
    np.testing.assert_allclose(ev["culprit"], alone, rtol=2e-4)
    assert ev["culprit"][-1] > 1000 * max(ev["culprit"][:-1])
    # Every replayed step is logged: 6 + 1 + 6 + 6.
    phases = [r["phase"] for r in t["replayed"]]
    assert phases == ["restored"] * 6 + ["rerun"] + ["earlier"] * 6 + ["culprit"] * 6
    assert t["steps"] == 19 and "skip" in t["remedy"]
    # The ledger entry carries the verdict; the default skip is PaLM's whole window.
    assert ctl.skipped_ranges == [(30, 37)] and not t["narrowed"]


def test_a_spike_that_needs_this_state_is_state(tmp_path):
    ctl, _, _ = _run(tmp_path, triage=True, trigger=[35])
    t = _triage_event(ctl)
    assert t["verdict"] == "state", t["reason"]
    assert t["culprits"] == [] and t["earlier_step"] == 20
    ev = t["evidence"]
    assert ev["restored"] == ev["run"] and ev["restored"][-1] > 100 * ev["restored"][0]
    # From checkpoint 20 the trigger batch comes at step 25 < STATE_FROM: no spike.
    batch_fn = toy.triage_batches(trigger=[35])
    w20, b20 = _np_params_at(batch_fn, range(20))
    np.testing.assert_allclose(
        ev["earlier"], _np_replay(batch_fn, w20, b20, 20, t["indices"]), rtol=2e-4
    )
    assert not any(robust_spikes(ev["earlier"], [], TriageConfig()))
    assert "culprit" not in ev and "learning rate" in t["remedy"]


def test_a_perturbed_rerun_is_nondeterministic_and_names_the_host(tmp_path):
    def hook(phase, step, m):
        return {**m, "loss": m["loss"] * (1 + 1e-3)} if phase == "rerun" else m

    ctl, _, _ = _run(tmp_path, triage=TriageConfig(_fault_hook=hook), bad=[35])
    t = _triage_event(ctl)
    assert t["verdict"] == "nondeterministic", t["reason"]
    ev = t["evidence"]
    np.testing.assert_allclose(ev["rerun"], ev["restored"][-1] * (1 + 1e-3), rtol=1e-12)
    assert t["host"]["process_index"] == 0
    assert t["host"]["device_ids"] == [d.id for d in jax.local_devices()]
    assert t["host"]["platform"] == jax.local_devices()[0].platform
    assert "hardware" in t["remedy"]


def test_a_perturbation_below_rtol_is_not_nondeterministic(tmp_path):
    def hook(phase, step, m):
        return {**m, "loss": m["loss"] * (1 + 1e-7)} if phase == "rerun" else m

    ctl, _, _ = _run(tmp_path, triage=TriageConfig(_fault_hook=hook, rtol=1e-5), bad=[35])
    assert _triage_event(ctl)["verdict"] == "data"


def test_narrow_skip_skips_only_from_the_culprit_and_trains_on_the_rest(tmp_path):
    ctl, state, it = _run(tmp_path, triage=TriageConfig(narrow_skip=True), bad=[35])
    t = _triage_event(ctl)
    assert t["verdict"] == "data" and t["narrowed"]
    assert ctl.skipped_ranges == [(35, 37)]  # instead of [(30, 37)]
    # The final state is exactly a plain loop over the batches fed: 0..34, then 37...
    fed = list(range(35)) + list(range(37, 37 + 25))
    assert it.index == fed[-1] + 1
    ref, step = toy.triage_toy()
    batch_fn = toy.triage_batches(bad=[35])
    for i in fed:
        ref, _ = step(ref, batch_fn(i))
    chex.assert_trees_all_equal(state.params, ref.params)
    skip = [e for e in ctl.events if e.kind == "skip"][0]
    assert skip.details["range"] == [35, 37] and skip.details["length"] == 2


# ------------------------------------------------------------- triage=False unchanged


def test_triage_false_is_bit_for_bit_the_run_without_it(tmp_path):
    runs = {
        "absent": _run(tmp_path, "a", bad=[35]),
        "false": _run(tmp_path, "b", triage=False, bad=[35]),
        "true": _run(tmp_path, "c", triage=True, bad=[35]),
    }
    (a_ctl, a_state, a_it), (b_ctl, b_state, b_it) = runs["absent"], runs["false"]
    for x, y in zip(jax.tree.leaves(a_state), jax.tree.leaves(b_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a_ctl.skipped_ranges == b_ctl.skipped_ranges and a_it.index == b_it.index
    assert a_ctl.rollbacks == b_ctl.rollbacks == 1
    assert toy.comparable(a_ctl.events) == toy.comparable(b_ctl.events)
    on_disk = [toy.comparable(read_events(tmp_path / n / "events.jsonl")) for n in "ab"]
    assert on_disk[0] == on_disk[1]
    # Triage on (whole-window skip) never touches the run's buffers, though the step
    # donates: the same final state, and the same events but its own.
    c_ctl, c_state, _ = runs["true"]
    for x, y in zip(jax.tree.leaves(a_state), jax.tree.leaves(c_state), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    c_events = [e for e in toy.comparable(c_ctl.events) if e["kind"] != "triage"]
    assert c_events == toy.comparable(a_ctl.events)
    assert c_ctl.skipped_ranges == a_ctl.skipped_ranges


# --------------------------------------------------------------------------- bounds


def test_max_steps_stops_with_inconclusive_and_the_evidence_so_far(tmp_path):
    ctl, _, _ = _run(tmp_path, triage=TriageConfig(max_steps=4), bad=[35])
    t = _triage_event(ctl)
    assert t["verdict"] == "inconclusive" and "max_steps" in t["reason"]
    assert t["steps"] == 4 and len(t["replayed"]) == 4
    assert t["evidence"]["restored (partial)"] == t["evidence"]["run"][:4]


def test_time_budget_stops_with_inconclusive(tmp_path):
    ctl, _, _ = _run(tmp_path, triage=TriageConfig(time_budget_s=0.0), bad=[35])
    t = _triage_event(ctl)
    assert t["verdict"] == "inconclusive" and "time_budget_s" in t["reason"]
    assert t["steps"] == 0 and t["replayed"] == []


def _hand_written_loop(tmp_path, triage, state, step):
    """50 steps of a loop calling ``ctl.step`` (not ``run``), bad batch 35: the triage event."""
    data = IndexedBatches(toy.triage_batches(bad=[35]))
    with RollbackController(tmp_path, triage=triage, **toy.triage_controller_kwargs()) as ctl:
        state, data = ctl.restore_or_init(state, data)
        while ctl.current_step < 50:
            state, metrics = step(state, next(data))
            state, data = ctl.step(state, metrics, data)
    return _triage_event(ctl)


def test_without_a_train_step_triage_says_so(tmp_path):
    t = _hand_written_loop(tmp_path, True, *toy.triage_toy())
    assert t["verdict"] == "inconclusive" and "RollbackController.run" in t["reason"]


def test_in_a_hand_written_loop_triage_replays_the_step_fn_it_is_given(tmp_path):
    state, step = toy.triage_toy()
    calls = []

    def batch_fn(i):
        calls.append(i)
        return toy.triage_batches(bad=[35])(i)

    cfg = TriageConfig(step_fn=step, batch_fn=batch_fn)
    t = _hand_written_loop(tmp_path, cfg, state, step)
    assert t["verdict"] == "data" and t["culprits"] == [35]
    assert len(calls) == t["steps"] == 19  # every replayed batch came from batch_fn


def test_a_replay_keeps_at_most_two_steps_in_flight(tmp_path, monkeypatch):
    # Unbounded async dispatch of multi-device programs deadlocks XLA:CPU (BUILD.md,
    # "Bounded dispatch"), and a time budget charged at dispatch would not measure work.
    # So before replayed step k is dispatched, step k - 2's loss must have been waited on
    # (jax.block_until_ready) or fetched (jax.device_get, which waits).
    state, step = toy.triage_toy()
    losses, waited, late = [], set(), []
    real_wait, real_get = jax.block_until_ready, jax.device_get

    def seen(x):
        waited.update(id(leaf) for leaf in jax.tree.leaves(x))
        return x

    def replay_step(state, batch):
        k = len(losses)
        if k >= 2 and id(losses[k - 2]) not in waited:
            late.append(k)
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
        return state, metrics

    monkeypatch.setattr(jax, "block_until_ready", lambda x: real_wait(seen(x)))
    monkeypatch.setattr(jax, "device_get", lambda x: real_get(seen(x)))
    ctl, _, _ = _run(tmp_path, triage=TriageConfig(step_fn=replay_step), bad=[35])
    t = _triage_event(ctl)
    assert t["verdict"] == "data" and len(losses) == t["steps"] == 19
    assert late == []


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_steps=0), "max_steps"),
        (dict(max_steps=2.5), "max_steps"),
        (dict(time_budget_s=-1), "time_budget_s"),
        (dict(rtol=float("nan")), "rtol"),
        (dict(spike_ratio=1.0), "spike_ratio"),
        (dict(spike_z=-1), "spike_z"),
        (dict(adam_eps=0.0), "adam_eps"),
        (dict(narrow_skip="yes"), "narrow_skip"),
        (dict(step_fn=3), "step_fn"),
        (dict(batch_fn="f"), "batch_fn"),
    ],
)
def test_bad_config_is_a_value_error_naming_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        TriageConfig(**kw)


def test_triage_must_be_a_bool_or_a_config(tmp_path):
    with pytest.raises(ValueError, match="triage"):
        RollbackController(tmp_path, triage="yes")


def test_the_spike_rule_on_hand_made_cases():
    cfg = TriageConfig()  # ratio 1.5 and 6 robust sigma
    assert is_spike(float("inf"), [], cfg) and not is_spike(5.0, [], cfg)
    ref = [1.0, 1.1, 0.9, 1.0, 1.05]  # median 1.0, MAD 0.05 -> sigma 0.0741
    assert is_spike(1.6, ref, cfg)  # > 1.5 and > 1.0 + 0.445
    assert not is_spike(1.4, ref, cfg)  # below the ratio
    wide = [1.0, 2.0, 0.5, 1.0, 1.5]  # median 1.0, MAD 0.5 -> 6 sigma = 4.45
    assert not is_spike(3.0, wide, cfg) and is_spike(5.5, wide, cfg)
    assert window_indices(30, 4, [(31, 33)]) == [30, 33, 34, 35]


# ------------------------------------------------------------------- crash safety


def _worker(tmp_path, name, *extra):
    out = tmp_path / f"{name}.npz"
    cmd = [sys.executable, str(WORKER), "--dir", str(tmp_path / name), "--bad", "35"]
    proc = subprocess.run(
        [*cmd, "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return proc, out


def test_a_sigkill_during_triage_resumes_as_if_triage_had_not_started(tmp_path):
    ref_proc, ref_out = _worker(tmp_path, "ref")
    assert ref_proc.returncode == 0, ref_proc.stderr[-3000:]
    # The 8th replayed step is the first of the "earlier" phase: mid-triage.
    killed, out = _worker(tmp_path, "job", "--kill-in-triage", "8")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    directory = tmp_path / "job"
    mid = read_events(directory / "events.jsonl")
    assert [e.kind for e in mid].count("rollback") == 0  # nothing of it reached disk
    assert not (directory / "stabljax-rollback.json").exists()
    again, out = _worker(tmp_path, "job")
    assert again.returncode == 0, again.stderr[-3000:]
    got, ref = np.load(out), np.load(ref_out)
    for k in ("w", "b", "step"):
        np.testing.assert_array_equal(got[k], ref[k])
    assert json.loads(pathlib.Path(f"{out}.json").read_text()) == json.loads(
        pathlib.Path(f"{ref_out}.json").read_text()
    )
    ref_events = read_events(tmp_path / "ref" / "events.jsonl")
    got_events = read_events(directory / "events.jsonl")

    def comparable(events):
        # A rollback event's "losses" shows the last 12 losses the process saw: a restarted
        # process has seen only those since its resume (the controller's behaviour on any
        # restart, triage or not), so that one display field is left out.
        out = toy.comparable(events)
        for e in out:
            if e["kind"] == "rollback":
                e["details"].pop("losses")
        return out

    for kind in ("rollback", "skip", "triage"):
        want = [e for e in comparable(ref_events) if e["kind"] == kind]
        have = [e for e in comparable(got_events) if e["kind"] == kind]
        assert have == want and len(want) == 1, kind
    # The restarted run's events after its resume are the uninterrupted run's from the
    # same checkpoint on.
    resumed = max(
        i
        for i, e in enumerate(got_events)
        if e.kind == "restore" and e.details["reason"].startswith("resume")
    )
    start = got_events[resumed].step
    tail = comparable(got_events[resumed + 1 :])
    ref_from = next(i for i, e in enumerate(ref_events) if e.kind == "save" and e.step == start)
    assert tail == comparable(ref_events[ref_from + 1 :])


# ----------------------------------------------------------------- events schema
# The schema itself is tested in test_events.py; here, that a real run writes it.


def test_every_event_line_carries_the_schema_version(tmp_path):
    ctl, _, _ = _run(tmp_path, triage=True, bad=[35])
    lines = (ctl.directory / "events.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line)["schema"] == SCHEMA_VERSION == "1.2" for line in lines)
    kinds = {json.loads(line)["kind"] for line in lines}
    assert {"save", "spike", "rollback", "skip", "triage", "restore"} <= kinds


# ------------------------------------------------------ narrowed skips, every data kind


def _grain_dataset(batch_fn, n=200):
    return iter(grain.MapDataset.range(n).map(batch_fn))


def _grain_loader(batch_fn, n=200):
    return iter(
        grain.DataLoader(
            data_source=[batch_fn(i) for i in range(n)],
            sampler=grain.samplers.IndexSampler(n, num_epochs=1, shuffle=False),
            worker_count=0,
        )
    )


@pytest.mark.parametrize(
    "make",
    [lambda f: IndexedBatches(f), _grain_dataset, _grain_loader],
    ids=["indexed", "grain-dataset", "grain-loader"],
)
def test_a_narrowed_skip_moves_every_seekable_kind_back_to_the_checkpoint(tmp_path, make):
    state, step = toy.triage_toy()
    batch_fn = toy.triage_batches(bad=[35])
    triage = TriageConfig(narrow_skip=True, batch_fn=batch_fn)  # replays read by index
    with RollbackController(tmp_path, **dict(toy.triage_controller_kwargs(), triage=triage)) as ctl:
        state, it = ctl.run(step, state, make(batch_fn), 60, progress=False)
    t = _triage_event(ctl)
    assert t["verdict"] == "data" and t["narrowed"]
    assert ctl.skipped_ranges == [(35, 37)]
    # Exactly a plain loop over the batches fed (30..34 again after the rollback to 30).
    fed = list(range(35)) + list(range(37, 37 + 25))
    assert it.index == fed[-1] + 1
    ref, plain = toy.triage_toy()
    for i in fed:
        ref, _ = plain(ref, batch_fn(i))
    chex.assert_trees_all_equal(state.params, ref.params)


@pytest.mark.parametrize(
    "make",
    [
        lambda f: PlainIterator(map(f, range(200)), warn=False),
        lambda f: iter(grain.MapDataset.range(200).to_iter_dataset().filter(lambda i: True)),
    ],
    ids=["plain", "grain-filtered"],
)
def test_a_narrowed_skip_on_data_that_cannot_go_back_is_refused_before_training(tmp_path, make):
    state, _ = toy.triage_toy()
    kw = dict(toy.triage_controller_kwargs(), triage=TriageConfig(narrow_skip=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        data = make(toy.triage_batches())
    with RollbackController(tmp_path, **kw) as ctl:
        with pytest.raises(ValueError, match="narrow_skip=True.*cannot move back"):
            ctl.restore_or_init(state, data)
    assert not any(p.name.isdigit() for p in tmp_path.iterdir())  # nothing was saved


def test_rewind_and_set_state_put_a_grain_iterator_where_they_say():
    it = GrainDatasetIterator(iter(grain.MapDataset.range(100).batch(4)))
    for _ in range(10):
        next(it)
    it.set_state({**it.get_state(), "index": 4})
    assert it.index == 4 and next(it).tolist() == [16, 17, 18, 19]
    it.rewind(2)
    assert it.index == 2 and next(it).tolist() == [8, 9, 10, 11]
