"""``python -m experiments.spike_recovery --quick``: what it writes and what it must show;
the LM task's spike criterion and the equal-compute bookkeeping (:mod:`experiments.lm_spikes`,
:mod:`experiments.equal_compute`); the Slingshot task's pieces (the old main job, kept for
``experiments/bench/detectors.py``); the repeated-n-gram filter of :mod:`experiments.faults`."""

import json
import math
import types

import numpy as np
import pytest
from experiment_runs import run_quick

from experiments import equal_compute, faults, lm_spikes, slingshot, spike_recovery, stats

FIGURES = ("loss.png", "effects.png")


def _bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32)


@pytest.mark.parametrize(
    ("doc", "repeats"),
    [
        ("ab" * 40, 40),  # a 2-gram 40 times (also a 4-gram 20 times)
        ("x" * 31 + "def f(): pass", 31),  # one short of OLMo's 32
        (" " * 32 + "return x", 32),  # 32 spaces: a 1-gram 32 times, flagged
        ("g4OD" * 33, 33),  # OLMo 2's example
        ("abcdefghijklm" * 32, 32),  # a 13-gram, the longest period the filter looks at
        ("abcdefghijklmn" * 40, 1),  # a 14-gram: beyond the filter's periods
        ("import os\nfor k in range(3):\n    print(k)\n", 4),  # 4 spaces of indent
    ],
)
def test_repeated_ngram_filter_on_hand_built_documents(doc, repeats):
    x = _bytes(doc)
    # An independent count: for each period p, the longest prefix-free span with period p.
    best = 1
    for p in range(1, 14):
        for i in range(len(x)):
            j = i
            while j + p < len(x) and x[j + p] == x[j]:
                j += 1
            best = max(best, (j - i + p) // p)
    assert best == repeats
    assert faults.max_repeats(x) == repeats
    assert faults.repeated_ngram_flag(x) == (repeats >= 32)


def test_bad_batches_are_repeated_ngrams_the_filter_drops():
    cfg = types.SimpleNamespace(
        batch_size=4, seq_len=64, bad_start=3, bad_len=2, bad_frac=1.0, ngram_max=2
    )
    corpus = np.frombuffer(b"def main():\n    return 0\n" * 50, np.uint8)
    clean = lambda i: {  # noqa: E731
        "inputs": np.zeros((cfg.batch_size, cfg.seq_len), np.int32) + (np.arange(cfg.seq_len) % 7),
        "targets": np.zeros((cfg.batch_size, cfg.seq_len), np.int32) + (np.arange(cfg.seq_len) % 7),
    }
    src = faults.poisoned(clean, cfg, 0, corpus)
    b = src(cfg.bad_start)
    assert b["bad"].sum() == cfg.batch_size and src(cfg.bad_start - 1)["bad"].sum() == 0
    w = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
    for row in w:  # periodic with a period <= ngram_max, so >= 32 repeats in seq_len + 1
        assert any(np.all(row[n:] == row[:-n]) for n in range(1, cfg.ngram_max + 1))
    kept = faults.filtered(src)(cfg.bad_start)["weight"]
    assert kept.sum() == 0 and faults.filtered(src)(0)["weight"].sum() == cfg.batch_size


def test_modular_addition_split_and_batches():
    task = slingshot.Task(p=7, train_frac=0.5, batch_size=5)
    train, test = task.split()
    assert len(train) + len(test) == 49 and len(train) == round(0.5 * 49)
    rows = np.concatenate([train, test])
    assert np.all(rows[:, 2] == 7) and np.all(rows[:, 3] == (rows[:, 0] + rows[:, 1]) % 7)
    assert len({tuple(r) for r in rows}) == 49  # every pair once, in one split only
    b = task.batches(3)
    assert np.array_equal(b(10), b(10)) and not np.array_equal(b(10), b(11))
    assert len({tuple(r) for r in b(10)}) == 5  # drawn without replacement


def test_spike_criterion_on_hand_built_losses():
    x = [3.0, 2.0, 1.0, 0.1, 0.0, 0.4, 0.0, 0.7, 0.8, 0.2, 0.0, float("nan"), 0.0]
    # running min 0 from step 4: 0.4 is not a spike (<= 0.5), 0.7 at step 7 is one episode
    # (8 continues it), NaN at 11 is another.
    assert slingshot.spikes(x) == [7, 11]
    assert slingshot.spikes([1.0, 1.4, 1.6, 0.9]) == [2]
    assert slingshot.spikes(np.linspace(3, 0, 50)) == []


def test_kept_trajectory_follows_the_last_replay():
    steps = [0, 1, 2, 3, 4, 2, 3, 4, 5, 3, 4, 5, 6]  # rolled back to 2 after 4, to 3 after 5
    calls = [{"step": s} for s in steps]
    got = [{"loss": 10.0 * k} for k in range(len(steps))]
    kept = slingshot.kept_losses(calls, got)
    assert kept.tolist() == [0.0, 10.0, 50.0, 90.0, 100.0, 110.0, 120.0]
    # stopped right after a rollback to 2: the kept trajectory ends at the last call
    assert slingshot.kept_losses(calls[:6], got[:6]).tolist() == [0.0, 10.0, 50.0]


def test_rises_and_the_spike_criterion_on_hand_built_losses():
    x = [5.0, 4.0, 3.0, 3.0, 3.0, 4.5, 3.0, float("nan"), 3.0]
    # window 3: step i minus the median of the finite ones among the (up to) 3 before it
    want = [0.0, -1.0, 3.0 - 4.5, 3.0 - 4.0, 0.0, 1.5, 0.0, math.inf, 3.0 - 3.75]
    assert lm_spikes.rises(x, window=3).tolist() == pytest.approx(want)
    assert lm_spikes.spikes(x, nats=1.0, window=3) == [5, 7]
    assert lm_spikes.spikes(x, nats=1.5, window=3) == [7]  # 1.5 is not above 1.5
    assert lm_spikes.SPIKE_NATS == 1.0 and lm_spikes.FAILURE_LR == 1.0


def test_rollback_rises_follow_the_executed_calls_and_the_events():
    # calls train steps 0..5, a rollback seen after call 6 (onset 4, detected 5) restores 2
    # and replays 2, 3; a second rollback, seen after call 8, has onset 3, detected 3.
    calls = [0, 1, 2, 3, 4, 5, 2, 3]
    losses = np.array([3.0, 3.0, 3.0, 3.0, 5.0, 3.5, 3.0, 3.2])
    ev = {"kind": "rollback", "onset": 4, "step": 5, "reason": "r1"}
    det = {"kind": "spike", "action": "rollback", "step": 5, "onset": 4}
    ev2 = {"kind": "rollback", "onset": 3, "step": 3, "reason": "r2"}
    out = equal_compute.rollback_rises(calls, losses, [(6, det), (6, ev), (8, ev2)])
    assert [o["call"] for o in out] == [6, 8] and out[0]["kinds"] == ["spike"]
    assert out[0]["rise"] == pytest.approx(2.0)  # call 4: 5.0 - median(3, 3, 3, 3)
    # the second: step 3's last call before it is call 7 (3.2), median of calls 0..6 is 3.0
    assert out[1]["rise"] == pytest.approx(0.2) and out[1]["kinds"] == []


def test_record_counts_every_executed_call_and_scores_a_divergence():
    r = equal_compute.record(
        [2.0, 4.0, float("inf")],
        2.5,
        rollbacks=[{"rise": 0.3}, {"rise": 1.5}, {"rise": 1.0}],
    )
    assert r["steps_executed"] == 3 and r["rollbacks"] == 3
    assert r["rollbacks_below_criterion"] == 2  # 0.3 and 1.0 (not above 1 nat)
    assert r["mean_train"] == pytest.approx((2.0 + 4.0 + math.log(256)) / 3)
    assert not r["diverged"]
    assert equal_compute.record([2.0], float("nan"))["diverged"]
    assert equal_compute.record([2.0], 6.0)["diverged"]  # above ln 256: worse than uniform
    assert equal_compute.record([2.0], 2.0, gave_up=True)["diverged"]


def test_results_go_to_the_run_folder_unless_committed():
    assert spike_recovery.output_argv(["--quick"]) == ["--quick", "--out", "runs/spike_recovery"]
    assert spike_recovery.output_argv(["--commit-results"]) == []
    assert spike_recovery.output_argv(["--out", "x"]) == ["--out", "x"]


def test_spike_recovery(tmp_path):
    res, cfg, s = run_quick("spike_recovery", tmp_path, figures=FIGURES, script=True)
    ec = s["equal_compute"]
    assert res["equal_compute"] == ec and set(ec) == set(spike_recovery.ARMS)
    top = json.loads((tmp_path / "spike_recovery" / "results.json").read_text())
    assert top["equal_compute"] == ec and top["task"] == s["task"]
    assert top["healthy_rollbacks_per_1000"] == s["healthy_rollbacks_per_1000"]
    assert {"unguarded", "best_fixed_lr", "cosine"} <= set(ec)
    assert s["failure_made_by_model"] is True and "Transformer" in s["task"]
    assert "corpus" in s["task"]
    n = len(cfg["seeds"])
    for arm, a in ec.items():
        for key in ("final_heldout", "steps_executed", "rollbacks", "rollbacks_below_criterion"):
            assert len(a[key]) == n, (arm, key)
        assert all(isinstance(d, bool) for d in a["diverged"])
        # equal compute: every arm the same number of train-step calls (none gave up here)
        assert a["steps_executed"] == [cfg["steps"]] * n or any(a["gave_up"]), arm
        for rises, k, below in zip(
            a["rollback_rises"], a["rollbacks"], a["rollbacks_below_criterion"], strict=True
        ):
            assert len(rises) == k and below == sum(r <= lm_spikes.SPIKE_NATS for r in rises)
        if arm not in spike_recovery.CONTROLLED:
            assert a["rollbacks"] == [0] * n
    runs = {(r["arm"], r["seed"]): r for r in res["runs"]}
    for r in runs.values():
        x = np.array([float(v) for v in r["losses"]])
        assert len(x) == r["steps_executed"]
        assert r["mean_train"] == pytest.approx(
            np.mean(np.where(np.isfinite(x), x, math.log(256))), rel=1e-3
        )
    healthy = ec["best_lr_rollback"]
    want = 1000 * sum(healthy["rollbacks"]) / sum(healthy["steps_executed"])
    assert s["healthy_rollbacks_per_1000"] == pytest.approx(want)
    # the family: 12 comparisons, paired t p-values, Holm over all of them, recomputed here
    fam = s["remedies"]
    assert len(fam) == len(spike_recovery.COMPARISONS) == s["family_size"] == 12
    raw = [stats.paired_t_p(r["per_seed"]) for r in fam.values()]
    for r, p, adj in zip(fam.values(), raw, stats.holm(raw), strict=True):
        assert r["test"] == "paired_t"
        assert r["p_test"] == pytest.approx(p, nan_ok=True)
        assert r["p_holm"] == pytest.approx(adj, nan_ok=True)
    held = {a: np.array(ec[a]["final_heldout"], float) for a in ec}
    held = {a: np.where(np.isfinite(v), v, math.log(256)) for a, v in held.items()}
    for a, b in spike_recovery.COMPARISONS:  # results.json sorts its keys: find each by name
        (k,) = [k for k in fam if k.startswith(f"{a} − {b} @ lr ")]
        assert fam[k]["per_seed"] == pytest.approx((held[a] - held[b]).tolist()), k
    g = s["lr_grid"]
    assert g["seeds"] == len(cfg["scan_seeds"]) >= 3 and g["lrs"] == sorted(cfg["scan_lrs"])
    assert s["p_floor_sign_flip"] == 2 / 2**n


def test_a_given_up_run_is_scored_on_its_last_kept_state(tmp_path):
    """The controller gives up (max_rollbacks 0) on a NaN loss from step 12 on; the run is
    scored on the newest save-boundary state at or before that onset (step 10, saves every
    5), recomputed here by training 10 steps by hand: not the initial state, not the last."""
    import dataclasses

    import jax.numpy as jnp

    cfg = dataclasses.replace(spike_recovery.Config.quick(), steps=30, max_rollbacks=0)
    progs = equal_compute.Programs(cfg)
    clean = progs.steps["plain"]

    def poisoned(state, batch):
        new, m = clean(state, batch)
        return new, dict(m, loss=jnp.where(state.step >= 12, jnp.nan, m["loss"]))

    progs.steps["plain"] = poisoned
    r = equal_compute.run_controlled(cfg, progs, 0, 1e-2, tmp_path / "ckpt", remedy=False)
    assert r["gave_up"] and r["diverged"] and r["rollbacks"] == 0
    assert 13 <= r["steps_executed"] < cfg.steps  # stopped once the NaN was seen
    state, fn = progs.state("plain", 0, 1e-2), progs.task.batches(0)
    for i in range(10):
        state, _ = clean(state, fn(i))
    want = progs.evaluate(state.params)
    assert r["final_heldout"] == pytest.approx(want, rel=1e-5)
    assert want != pytest.approx(progs.evaluate(progs.state("plain", 0, 1e-2).params), rel=1e-4)
