"""``python -m experiments.spike_recovery --quick``: what it writes and what it must show."""

import json

import numpy as np
import pytest
from experiment_runs import run_quick

from experiments import faults, spike_recovery

FIGURES = ("loss.png", "effects.png", "lr_scan.png")


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
    cfg = spike_recovery.Config.quick()
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


def test_spike_recovery(tmp_path):
    res, cfg, s = run_quick("spike_recovery", tmp_path, figures=FIGURES, script=True)
    arms = res["arms"]
    assert set(arms) == set(spike_recovery.ARMS)
    n_bad = cfg["bad_len"] * round(cfg["bad_frac"] * cfg["batch_size"])
    for r in res["runs"]:
        if r["arm"] == "unguarded":  # every bad sequence is trained on
            assert r["bad_sequences_trained"] == n_bad
        if r["arm"] in ("clean", "filter"):  # none: the filter drops them all
            assert r["bad_sequences_trained"] == 0
        if r["arm"] != "filter":
            assert r["clean_dropped"] == 0
    assert s["primary_metric"] == spike_recovery.PRIMARY
    assert set(s["remedies"]) == {
        f"{a} @ lr {cfg['lr']:g}, d{cfg['d_model']}x{cfg['n_layers']}"
        for a in spike_recovery.REMEDIES
    }
    assert s["failure_made_by_model"] is True
    assert s["lr_grid"]["lrs"] == sorted(cfg["scan_lrs"]) and s["lr_grid"]["main_lr"] == cfg["lr"]
    # The "both" arm keeps its checkpoints and per-step metrics under <out>/ckpt and writes
    # a stability report per seed; a triage verdict, where a rollback happened, is a known one.
    out = tmp_path / "spike_recovery"
    for r in res["runs"]:
        if r["arm"] != "both":
            assert "report" not in r
            continue
        ckpt = out / "ckpt" / f"both-{r['seed']}"
        lines = (ckpt / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == r["compute_steps"] and json.loads(lines[0])["step"] == 0
        html = out / "reports" / f"seed{r['seed']}" / "report.html"
        assert r["report"] == f"reports/seed{r['seed']}/report.html"  # relative to --out
        assert "<html" in html.read_text()[:500].lower()
        assert len(r["triage"]) == r["rollbacks"]
        assert all(
            t["verdict"] in ("data", "state", "nondeterministic", "inconclusive")
            for t in r["triage"]
        )
