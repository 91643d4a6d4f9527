"""``python -m experiments.lr_sensitivity --quick``: what it writes and what it must show."""

import numpy as np
import pytest
from experiment_runs import run_quick

FIGURES = ("loss_vs_lr.png", "logits.png", "log_z.png", "sensitivity_vs_size.png")


@pytest.mark.slow
def test_lr_sensitivity(tmp_path):
    res, cfg, s = run_quick("lr_sensitivity", tmp_path, figures=FIGURES)
    n = len(cfg["widths"]) * len(cfg["arms"]) * len(cfg["lrs"]) * len(cfg["seeds"])
    assert len(res["rows"]) == n and len(s["sizes"]) == len(cfg["widths"])
    both = [r for r in res["rows"] if r["arm"] == "both"]
    base = [r for r in res["rows"] if r["arm"] == "base"]
    # qk-layernorm bounds the attention logits at every LR and size.
    assert np.mean([r["max_attn_logit"] for r in both]) < np.mean(
        [r["max_attn_logit"] for r in base]
    )
