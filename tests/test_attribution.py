"""Attribution rules: each on a constructed case that triggers it and one that does not."""

from __future__ import annotations

import math

import pytest

from stabljax.control.diagnose import attribution
from stabljax.metrics import (
    GRAD_NORM,
    LAYER_GRAD_NORM,
    LAYERS,
    LOG_Z,
    LOSS_SCALE,
    MAX_ATTN_LOGIT,
    SKIP_STREAK,
    SKIPPED,
)


def _base(n=8, **fixed):
    """A quiet baseline: grad norm 1.0 ± 1 %, every other signal constant."""
    return [{GRAD_NORM: 1.0 + 0.01 * (i % 3 - 1), **fixed} for i in range(n)]


def _causes(history, onset, **kw):
    return [h["cause"] for h in attribution.attribute(history, onset, **kw)["hints"]]


def test_a_quiet_onset_fires_nothing():
    a = attribution.attribute(_base(), {GRAD_NORM: 1.02})
    assert a["hints"] == [] and a["first_jump"] is None and a["baseline_steps"] == 8


def _layers(**norms):
    return {LAYERS: {LAYER_GRAD_NORM: dict(norms)}}


def test_first_jump_names_the_first_layer_past_the_factor_and_the_largest():
    history = [_layers(embed=1.0, h0=2.0, h1=0.5, head=1.0) for _ in range(4)]
    onset = _layers(embed=9.9, h0=21.0, h1=40.0, head=1.1)  # embed: 9.9x, below 10x
    j = attribution.first_jump(history, onset)
    assert j == {"layer": "h0", "grad_norm": 21.0, "baseline": 2.0, "ratio": 10.5, "largest": "h1"}
    assert attribution.first_jump(history, _layers(embed=9.9, h0=19.0, h1=4.0, head=1.0)) is None
    # A non-finite gradient norm counts as a jump.
    j = attribution.first_jump(history, _layers(embed=1.0, h0=math.inf, h1=0.5, head=1.0))
    assert j["layer"] == "h0" and j["ratio"] == math.inf


def test_attention_logit_growth_points_to_qk_layernorm():
    history = _base(**{MAX_ATTN_LOGIT: 8.0})
    hint = attribution.attention_hint(history, {MAX_ATTN_LOGIT: 24.0})
    assert hint["cause"] == "attention_logit_growth" and "qk" in hint["remedy"]
    assert hint["growth"] == 3.0 and hint["baseline"] == 8.0 and "24" in hint["evidence"]
    assert attribution.attention_hint(history, {MAX_ATTN_LOGIT: 11.0}) is None  # 1.375x
    small = _base(**{MAX_ATTN_LOGIT: 2.0})
    assert attribution.attention_hint(small, {MAX_ATTN_LOGIT: 8.0}) is None  # 4x, but < 10
    assert attribution.attention_hint(_base(), {GRAD_NORM: 1.0}) is None  # not reported


def test_log_z_drift_points_to_z_loss():
    history = _base(**{LOG_Z: 0.5})
    hint = attribution.log_z_hint(history, {LOG_Z: 3.0})
    assert hint["cause"] == "log_z_drift" and "z-loss" in hint["remedy"]
    assert hint["drift"] == pytest.approx(2.5) and "+2.5" in hint["evidence"]
    assert attribution.log_z_hint(history, {LOG_Z: 1.5}) is None  # drift 1.0 < 2.0
    high = attribution.log_z_hint([], {LOG_Z: -6.0})  # no baseline, |log Z| >= 5
    assert high["cause"] == "log_z_drift" and high["drift"] is None
    assert attribution.log_z_hint([], {LOG_Z: -4.0}) is None


def test_eps_dominated_points_to_eps_zero_or_atan2():
    hint = attribution.eps_hint({}, {"embed": 0.1, "h0/kernel": 0.75})
    assert hint["cause"] == "eps_dominated" and hint["layer"] == "h0/kernel"
    assert hint["fraction"] == 0.75 and "75.0%" in hint["evidence"]
    assert "eps=0" in hint["remedy"] and "atan2" in hint["remedy"]
    assert attribution.eps_hint({}, {"embed": 0.1, "h0/kernel": 0.49}) is None
    assert attribution.eps_hint({attribution.EPS_DOMINATED: 0.6}, None)["layer"] == "(all)"
    assert attribution.eps_hint({}, None) is None


def test_a_single_batch_grad_norm_outlier_points_to_the_data():
    hint = attribution.outlier_hint(_base(), {GRAD_NORM: 40.0})
    assert hint["cause"] == "single_batch_outlier" and "skip the data" in hint["remedy"]
    assert hint["value"] == 40.0 and hint["baseline"] == 1.0
    assert attribution.outlier_hint(_base(), {GRAD_NORM: 2.5}) is None  # < 3x
    noisy = [{GRAD_NORM: v} for v in (1.0, 3.0, 0.5, 2.0, 4.0, 1.0)]
    assert attribution.outlier_hint(noisy, {GRAD_NORM: 5.0}) is None  # 3.3x but < 6 sigma
    assert attribution.outlier_hint(_base(2), {GRAD_NORM: 40.0}) is None  # too short a baseline


def test_a_rising_trend_points_to_lr_or_warmup():
    rising = [{GRAD_NORM: 1.0 + 0.2 * i + 0.01 * (i % 2)} for i in range(10)]
    hint = attribution.trend_hint(rising, {GRAD_NORM: 3.0})
    assert hint["cause"] == "rising_trend" and "learning rate" in hint["remedy"]
    # Reference: the OLS line through the points, by hand: slope ~0.2, start ~1.0.
    assert hint["rise"] == pytest.approx(2.8, rel=0.02) and hint["steps"] == 10
    assert attribution.trend_hint(_base(10), {GRAD_NORM: 1.0}) is None  # flat
    slow = [{GRAD_NORM: 1.0 + 0.02 * i} for i in range(10)]  # rises 1.18x only
    assert attribution.trend_hint(slow, {GRAD_NORM: 1.2}) is None
    assert attribution.trend_hint(rising[:3], {GRAD_NORM: 3.0}) is None  # too few steps


def test_attribute_gathers_every_rule_and_the_counters():
    history = [
        {**h, MAX_ATTN_LOGIT: 8.0, LOG_Z: 0.0, SKIPPED: i == 2} for i, h in enumerate(_base())
    ]
    onset = {
        GRAD_NORM: 50.0,
        MAX_ATTN_LOGIT: 30.0,
        LOG_Z: 4.0,
        SKIPPED: False,
        SKIP_STREAK: 0,
        LOSS_SCALE: 1.0,
    }
    a = attribution.attribute(history, onset, eps_fraction={"w": 0.9})
    assert _causes(history, onset, eps_fraction={"w": 0.9}) == [
        "attention_logit_growth",
        "log_z_drift",
        "eps_dominated",
        "single_batch_outlier",
    ]
    assert a["signals"] == {
        SKIPPED: False,
        SKIP_STREAK: 0,
        LOSS_SCALE: 1.0,
        "skips_in_window": 1,
    }
    # Every hint is JSON-able text and numbers, with its remedy.
    assert all(isinstance(h["evidence"], str) and h["remedy"] for h in a["hints"])


def test_the_optimizers_named_in_remedies_exist():
    import re

    import stabljax
    from stabljax.control.decide.policy import ADVICE
    from stabljax.control.diagnose.attribution import REMEDY

    names = set()
    for text in [ADVICE, *REMEDY.values()]:
        names |= set(re.findall(r"\b(\w*adam\w*)\b", text))
    assert names and all(hasattr(stabljax, n) for n in names), names
