"""``python -m experiments.precision --quick``: what it writes and what it must show; the
op-by-op overflow locator against hand-computed float16 values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from experiment_runs import run_quick

from experiments import measure, precision

FIGURES = ("loss_vs_lr.png", "nonfinite_grad_steps.png", "effects.png")


@pytest.mark.slow
def test_precision(tmp_path):
    res, cfg, s = run_quick("precision", tmp_path, figures=FIGURES)
    assert s["primary_metric"] == precision.PRIMARY_TEXT and res["primary_metric"] == "primary_loss"
    for r in res["rows"]:
        # the primary metric: the final loss, or the init loss of a failed run
        assert r["primary_loss"] == (r["init_loss"] if r["failed"] else r["final_loss"])
        assert r["backward_only_steps"] <= r["nonfinite_grad_steps"]
        if r["arm"] == "fp16":
            assert cfg["min_scale"] <= r["min_loss_scale"] <= cfg["initial_scale"]
        if r["arm"] == "fp16-noscale":
            assert r["overflows"] == 0 and r["final_loss_scale"] == 1.0
    grid = s["lr_grid"]["fp32"]
    assert grid["lrs"] == sorted(cfg["lrs"]) and grid["best_lr"] in grid["lrs"]
    # the family: both remedies at every grid LR from fp32's best upwards
    above = [lr for lr in cfg["lrs"] if lr >= grid["best_lr"]]
    assert s["family_size"] == 2 * len(above)


def _f16(x):
    return jnp.asarray(x, jnp.float16)


def test_locate_backward_overflow_by_hand():
    # loss = scale * sum(2 x) with x float16 ones: the forward's float16 values are 2; the
    # backward casts the float32 cotangent `scale` to float16 and doubles it: 2 * scale.
    def grad(scale):
        return jax.grad(lambda x: jnp.sum((x * 2).astype(jnp.float32)) * scale)

    ok = measure.locate(measure.trace_values(grad(1e4), _f16(np.ones(3))))
    assert ok["forward_max_abs"] == 2.0 and ok["backward_max_abs"] == 2e4
    assert ok["first_nonfinite"] is None and ok["backward_nonfinite_ops"] == 0
    # 1e5 > 65504: the forward is unchanged, the backward overflows
    bad = measure.locate(measure.trace_values(grad(1e5), _f16(np.ones(3))))
    assert bad["forward_max_abs"] == 2.0 and bad["forward_nonfinite_ops"] == 0
    assert bad["first_nonfinite"]["phase"] == "backward"
    assert bad["backward_nonfinite_ops"] >= 1


def test_locate_forward_overflow_by_hand():
    # 300**2 = 90000 > 65504: the square overflows in the forward pass
    rec = measure.trace_values(lambda x: jnp.sum((x * x).astype(jnp.float32)), _f16([300.0]))
    out = measure.locate(rec)
    assert out["first_nonfinite"]["phase"] == "forward"
    assert out["first_nonfinite"]["primitive"] == "mul"
    # float32 values are not float16 overflow
    f32 = measure.trace_values(lambda x: jnp.sum(x * x), jnp.asarray([300.0], jnp.float32))
    assert measure.locate(f32)["first_nonfinite"] is None


@pytest.mark.slow
def test_precision_diagnosis(tmp_path):
    # the op-by-op diagnosis of the final parameters (Trainer.run_many(keep_params=True))
    res, cfg, s = run_quick("precision", tmp_path, "--diagnose-seed", "0")
    loc = res["overflow_location"]
    assert set(loc) == {"fp16", "fp32"}
    for arm, by_lr in loc.items():
        assert set(by_lr) == {f"{lr:g}" for lr in cfg["lrs"]}
        for d in by_lr.values():
            assert d["loss_scale"] == 1.0 and d["forward_max_abs"] > 0
            assert set(d["grad16_max_abs_per_layer"]) >= {"embed", "blocks/0"}
            assert ("at_run_final_scale" in d) == (arm == "fp16")
            if d["first_nonfinite"] is None:
                assert d["forward_nonfinite_ops"] == d["backward_nonfinite_ops"] == 0
