"""``python -m experiments.spike_recovery --quick``: what it writes and what it must show;
the Slingshot task's pieces; the repeated-n-gram filter of :mod:`experiments.faults`."""

import types

import numpy as np
import pytest
from experiment_runs import run_quick

from experiments import faults, slingshot, spike_recovery

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


def test_results_go_to_the_run_folder_unless_committed():
    assert spike_recovery.output_argv(["--quick"]) == ["--quick", "--out", "runs/spike_recovery"]
    assert spike_recovery.output_argv(["--commit-results"]) == []
    assert spike_recovery.output_argv(["--out", "x"]) == ["--out", "x"]


def test_spike_recovery(tmp_path):
    res, cfg, s = run_quick("spike_recovery", tmp_path, figures=FIGURES, script=True)
    arms = res["arms"]
    assert set(arms) == set(spike_recovery.ARMS)
    seeds = cfg["seeds"]
    for arm, a in arms.items():
        assert len(a["rollbacks_per_seed"]) == len(seeds)
        if arm not in spike_recovery.CONTROLLED:
            assert a["rollbacks_per_seed"] == [0] * len(seeds)
    for r in res["runs"]:
        assert len(r["kept_losses"]) == cfg["steps"] or r["gave_up"]
        assert r["compute_steps"] == cfg["steps"] + r["steps_lost"]
        if not r["gave_up"]:
            tail = np.asarray(r["kept_losses"][cfg["metric_from"] :], float)
            assert r["primary"] == pytest.approx(float(np.mean(tail)), rel=1e-3)
        if r["arm"] == "lower_lr":
            assert r["final_lr"] == pytest.approx(cfg["lr"] * cfg["lower_lr_factor"])
        if r["arm"] == "remedy":
            assert r["remedies"] == r["rollbacks"]
            want = cfg["lr"] * cfg["remedy_factor"] ** r["rollbacks"]
            assert r["final_lr"] == pytest.approx(want, rel=1e-5)
    assert s["primary_metric"] == spike_recovery.PRIMARY
    assert set(s["remedies"]) == {
        f"{a} @ lr {cfg['lr']:g}, d{cfg['d_model']}x{cfg['n_layers']}"
        for a in spike_recovery.REMEDIES
    }
    assert s["failure_made_by_model"] is True
    assert s["lr_grid"]["lrs"] == sorted(cfg["scan_lrs"]) and s["lr_grid"]["main_lr"] == cfg["lr"]
