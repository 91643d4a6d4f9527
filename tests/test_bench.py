"""Smoke runs of the benchmarks: each ``--quick`` run writes its JSON and Markdown table.

No timing is asserted (timing belongs in the benchmarks); only that each benchmark runs
end to end and records the numbers its table reports.
"""

import importlib
import json

import gcs
import pytest

BENCHES = {
    "optimizer_update": ("per_optimizer", "ratios", "targets", "n_params"),
    "train_step": ("per_step", "ratios", "targets", "n_params"),
    "controller": ("steps_per_s", "ratios", "targets", "n_params"),
    "rollback": ("seconds", "checkpoint_bytes", "ratios", "targets", "n_params"),
    "digest": ("seconds", "checkpoint_bytes", "ratios", "targets", "n_params"),
    "detectors": ("slow_false_alarms", "slow_delay", "spike", "real_curves", "ratios", "targets"),
    "triage": ("ratios", "targets", "samples"),
    "guard_streams": ("per_stream", "ratios", "targets"),
    "adoption": ("seconds", "save_ms", "ratios", "targets", "n_params"),
    "fast_tier": ("seconds", "restored_steps", "ratios", "targets", "n_params"),
}
RATIOS = {
    "optimizer_update": (
        "bytes_B/A",
        "wall_B/A",
        "wall_C/A",
        "bandwidth_B",
        "copy_bytes_per_s",
        "bytes_B/A (cpu_options)",
        "wall_B/A (cpu_options)",
        "bandwidth_B (cpu_options)",
    ),
    "train_step": ("wall_guarded/plain", "wall_guarded+layers/plain"),
    "controller": ("steps_per_s_controlled/bare", "steps_per_s_controlled+background/bare"),
    "rollback": ("restore/read_bytes", "skip_s"),
    "digest": ("save_digest/fingerprint", "restore_digest/fingerprint", "save_hmac/fingerprint"),
    "detectors": (
        "slow_alarms_per_1e5_iid",
        "slow_alarms_per_1e5_phi0.99",
        "slow_alarms_per_1e5_real",
        "slow_delay_max_steps_iid",
        "spike_false_per_1000_student_t3",
        "spike_false_per_1000_lognormal",
        "spike_5x_caught_student_t3",
        "spike_5x_caught_lognormal",
    ),
    "triage": ("triage/plain_large", "triage/plain_small"),
    "adoption": (
        "trainer_without/before",
        "trainer_both_async/without",
        "trainer_both_sync/without",
        "trainer_handover_async/without",
        "trainer_handover_sync/without",
        "trainer_handover_background/without",
        "bare_loop_async/bare",
    ),
    "fast_tier": ("fast_save/bucket_save", "fast_rollback/bucket_rollback"),
    "guard_streams": (
        "stabljax_bad_max",
        "stabljax_nan_seeds_max",
        "stabljax_healthy_skipped_max",
        "stabljax_shift_skipped_max",
    ),
}
# Those that compile a whole train step several times take tens of seconds.
SLOW = {"train_step", "controller", "triage", "guard_streams", "adoption"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in BENCHES],
)
def test_quick_run_writes_results(name, tmp_path):
    if name == "fast_tier" and gcs.binary() is None:
        pytest.skip("no fake-gcs-server binary for this platform (the bench's bucket)")
    mod = importlib.import_module(f"experiments.bench.{name}")
    returned = mod.main(["--quick", "--out", str(tmp_path), "--no-progress"])

    payload = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(payload) == {"command", "config", "environment", "library", "results", "wall_s"}
    assert payload["command"].startswith(f"python -m experiments.bench.{name} --quick")
    results = payload["results"]
    for key in BENCHES[name]:
        assert key in results, key
    for key in RATIOS[name]:
        assert key in results["ratios"], key
        assert isinstance(results["ratios"][key], float), key
    assert set(returned["ratios"]) == set(results["ratios"])
    if name == "triage":  # it timed the triage it meant to: the garbage batch, named
        runs = results["samples"]["large"]
        assert [(r["verdict"], r["culprits"]) for r in runs] == [("data", [mod.Config.bad])]
        # (the quick "small" model, 7.5k params, calls it "state": from the earlier
        # checkpoint its NUL-batch loss is not a spike by the triage rule)
    table = (tmp_path / f"{name}.md").read_text()
    assert table.startswith("# ") and "| ratio | value | target |" in table


def test_optimizer_update_compares_all_three_under_both_compile_modes(tmp_path):
    mod = importlib.import_module("experiments.bench.optimizer_update")
    results = mod.main(["--quick", "--out", str(tmp_path)])
    per = results["per_optimizer"]
    assert set(per) == {"default", "cpu_options"}  # this machine is XLA:CPU
    for mode in per.values():
        assert set(mode) == {"A", "B", "C"}
        for r in mode.values():
            assert r["bytes"] > 0 and r["wall_s"] > 0
    # The options remove B's copies of its donated moments (4 passes over the
    # parameters with Adam) and change nothing for plain Optax's A.
    n = results["n_params"]
    assert per["default"]["A"]["bytes"] == per["cpu_options"]["A"]["bytes"]
    saved = per["default"]["B"]["bytes"] - per["cpu_options"]["B"]["bytes"]
    assert saved == pytest.approx(4 * 4 * n, abs=256)  # (and a few scalar copies)


def test_gpu_script_quick_runs_on_cpu(tmp_path):
    # The script prepared for a lent accelerator; here tiny sizes on the CPU (its controller
    # part is the controller bench, smoke-run above).
    mod = importlib.import_module("experiments.bench.gpu")
    argv = ["--quick", "--out", str(tmp_path), "--no-progress", "--controller", "false"]
    returned = mod.main(argv)
    payload = json.loads((tmp_path / "gpu.json").read_text())
    results = payload["results"]
    assert results["device"].startswith("cpu:") and results["device"] == returned["device"]
    for key in ("wall_B/A (2^12)", "wall_C/A (2^12)", "wall_guarded/plain (tiny bf16)"):
        assert isinstance(results["ratios"][key], float), key
    assert results["ratios"]["tokens_per_s_guarded (tiny bf16)"] > 0
    assert (tmp_path / "gpu.md").read_text().startswith("# Accelerator bench on cpu:")
