"""Benchmark 5: false alarms and detection delay of the detectors on synthetic and real losses.

Slow divergence (:class:`stabljax.control.SlowDivergenceDetector`, defaults):

* false alarms per 10^5 steps on a flat loss (level 2.0, std 0.05) with iid noise and
  AR(1) noise of marginal std 0.05 (phi = 0.9, 0.99, 0.999), ``seeds`` series of
  ``steps`` steps each;
* the delay from the start of a 10 % rise over 5000 steps (after ``warm_steps`` flat
  ones) to the first alarm, over ``delay_seeds`` series per noise (missed: no alarm by
  ``rise_steps + warm_steps`` after the start; alarms before the start are false ones);
* false alarms per 10^5 steps on real losses: every healthy recorded loss curve under
  ``experiments/results/`` divided by its own smoothed trend (a running median then a
  running mean, ``trend_width`` steps), the first ``skip_frac`` of each curve dropped,
  the ratios pooled, and resampled by a stationary block bootstrap (mean block
  ``bootstrap_block`` steps, which keeps their short-range autocorrelation) to
  ``steps`` steps at level 2.0.

Spike detection (:class:`stabljax.control.SpikeDetector`, defaults): false rollbacks per 1000
steps (episodes of anomalous values whose update was applied) on healthy stationary losses
with Student-t noise (3 degrees of freedom, scale 5 % of the level), lognormal noise
(sigma 0.3), Gaussian noise (std 5 %), AR(1) noise (phi 0.99, 0.999; std 0.05) and the
real-loss resample above; a 5x one-step spike injected every ``spike_every`` steps of each
must be caught at its step. Power: the detection rate and delay of spikes of +0.3, +0.5, +1,
+2 nats lasting 1, 5, 20, 50 steps added to a falling loss (2 + exp(-t/300), Student-t or
AR(1) phi 0.99 noise; ``power_trials`` each), and of the model-made Slingshot spikes of the
committed main job (:mod:`experiments.spike_recovery`'s unguarded runs).

Both are also run with the previous detectors (a Mann-Kendall test on block means taken as
independent: window 50, block 20, z 3.5, rise 3 %; an EMA mean/std spike test: 6 sigma,
10 % floor, decay 0.99) as the baseline, in the same process on the same series. No timing
target: microseconds per ``update`` are reported for the record.

    python -m experiments.bench.detectors [--quick] [--steps 100000 --seeds 8]
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

import stabljax
from experiments import cli
from experiments.bench.detector_baselines import OldSlow, OldSpike
from experiments.bench.detector_power import model_spikes, spike_power
from experiments.bench.detector_streams import LEVEL, STD, ar1, block_bootstrap, real_ratios
from experiments.common import progress_bar

TARGETS = {
    "slow_alarms_per_1e5_phi0.9": 0.0,
    "slow_alarms_per_1e5_phi0.99": 0.0,
    "slow_alarms_per_1e5_iid": 0.0,
    "slow_delay_max_steps_iid": 2000.0,
    "spike_false_per_1000_student_t3": 0.1,
    "spike_false_per_1000_lognormal": 0.1,
    "spike_false_per_1e5_student_t3": 1.0,
    "spike_false_per_1e5_phi0.99": 1.0,
    "spike_false_per_1e5_phi0.999": 1.0,
    "spike_5x_caught_student_t3": 1.0,
    "spike_5x_caught_lognormal": 1.0,
}


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 100_000
    seeds: int = 8
    phis: tuple[float, ...] = (0.0, 0.9, 0.99, 0.999)
    delay_seeds: int = 8
    warm_steps: int = 6000
    rise: float = 0.1
    rise_steps: int = 5000
    spike_every: int = 500
    false_series: int = 10
    power_trials: int = 40
    power_warm: int = 400
    trend_width: int = 51
    skip_frac: float = 0.2
    bootstrap_block: int = 100
    baseline: bool = True
    seed: int = 0

    @classmethod
    def quick(cls) -> Config:
        return cls(
            steps=8000,
            seeds=1,
            phis=(0.0, 0.99),
            delay_seeds=1,
            warm_steps=3000,
            power_trials=3,
            false_series=1,
        )


def alarm_steps(det, x: np.ndarray, bar=None) -> tuple[list[int], float]:
    """Steps where ``det`` fires on ``x``, and microseconds per update."""
    out = []
    t0 = time.perf_counter()
    for s, v in enumerate(x.tolist()):
        if det.update(s, {"loss": v}) is not None:
            out.append(s)
        if bar is not None and s % 10_000 == 9_999:
            bar.update(10_000)
    return out, 1e6 * (time.perf_counter() - t0) / len(x)


def spike_run(det_factory, x: np.ndarray, every: int) -> dict:
    """False rollback episodes (per 1000 steps) and 5x spikes caught, on ``x``."""
    det = det_factory()
    injected = set(range(every, len(x), every))
    false_episodes, caught, inside = 0, 0, False
    t0 = time.perf_counter()
    for s, v in enumerate(x.tolist()):
        spike = s in injected
        d = det.update(s, {"loss": 5.0 * LEVEL if spike else v})
        fired = d is not None and (d is True or d.rolls_back)
        if spike:
            caught += fired
            inside = False
            continue
        if fired and not inside:
            false_episodes += 1
        inside = fired
    us = 1e6 * (time.perf_counter() - t0) / len(x)
    clean = len(x) - len(injected)
    return {
        "false_rollbacks": false_episodes,
        "steps": clean,
        "false_per_1000": 1000.0 * false_episodes / clean,
        "spikes": len(injected),
        "caught": caught,
        "caught_fraction": caught / max(1, len(injected)),
        "us_per_update": us,
    }


def pooled_spike_runs(det_factory, xs: list[np.ndarray], every: int) -> dict:
    """:func:`spike_run` on each series (a fresh detector each), counts pooled."""
    runs = [spike_run(det_factory, x, every) for x in xs]
    total = {k: sum(r[k] for r in runs) for k in ("false_rollbacks", "steps", "spikes", "caught")}
    return {
        **total,
        "series": len(runs),
        "false_per_1000": 1000.0 * total["false_rollbacks"] / total["steps"],
        "caught_fraction": total["caught"] / max(1, total["spikes"]),
        "us_per_update": statistics.mean(r["us_per_update"] for r in runs),
    }


def slow_false_alarms(
    cfg: Config, noises: dict[str, list[np.ndarray]], progress: bool
) -> tuple[list[dict], dict]:
    """False alarms of :class:`SlowDivergenceDetector` (and :class:`OldSlow`) on flat losses
    at :data:`LEVEL` plus each noise's series; table rows and results per noise."""
    total = sum(len(v) * cfg.steps for v in noises.values()) * (2 if cfg.baseline else 1)
    bar = progress_bar(total, "slow-divergence false alarms", disable=not progress)
    rows, slow = [], {}
    for name, series in noises.items():
        alarms, old, us = 0, 0, []
        for noise in series:
            a, t = alarm_steps(stabljax.control.SlowDivergenceDetector(), LEVEL + noise, bar)
            alarms += len(a)
            us.append(t)
            if cfg.baseline:
                old += len(alarm_steps(OldSlow(), LEVEL + noise, bar)[0])
        n = len(series) * cfg.steps
        slow[name] = {
            "alarms": alarms,
            "steps": n,
            "per_1e5": 1e5 * alarms / n,
            "baseline_per_1e5": 1e5 * old / n if cfg.baseline else None,
            "us_per_update": statistics.median(us),
        }
        rows.append(
            {
                "test": f"slow divergence, flat {name}",
                "new": slow[name]["per_1e5"],
                "baseline": slow[name]["baseline_per_1e5"],
                "unit": "alarms / 1e5 steps",
                "us / update": slow[name]["us_per_update"],
            }
        )
    bar.close()

    return rows, slow


def slow_delays(cfg: Config, rng: np.random.Generator) -> tuple[list[dict], dict]:
    """Delay from the start of a ``rise`` over ``rise_steps`` (after ``warm_steps`` flat
    steps) to the first slow-divergence alarm, per noise; table rows and results."""
    rows = []
    delays: dict[str, dict] = {}
    horizon = cfg.rise_steps + cfg.warm_steps
    n = cfg.warm_steps + horizon
    t = np.arange(n)
    level = LEVEL * (1 + cfg.rise * np.clip((t - cfg.warm_steps) / cfg.rise_steps, 0, 1))
    for phi in cfg.phis:
        name = "iid" if phi == 0 else f"phi{phi:g}"
        found, early, old_found, old_early = [], 0, [], 0
        for _ in range(cfg.delay_seeds):
            x = level + ar1(n, phi, STD, rng)
            a, _ = alarm_steps(stabljax.control.SlowDivergenceDetector(), x)
            early += sum(s < cfg.warm_steps for s in a)
            after = [s - cfg.warm_steps for s in a if s >= cfg.warm_steps]
            found.append(after[0] if after else None)
            if cfg.baseline:
                b, _ = alarm_steps(OldSlow(), x)
                old_early += sum(s < cfg.warm_steps for s in b)
                after = [s - cfg.warm_steps for s in b if s >= cfg.warm_steps]
                old_found.append(after[0] if after else None)
        hit = [d for d in found if d is not None]
        old_hit = [d for d in old_found if d is not None]
        delays[name] = {
            "delays": found,
            "missed": len(found) - len(hit),
            "alarms_before_rise": early,
            "median": float(statistics.median(hit)) if hit else float(horizon),
            "max": float(max(hit)) if len(hit) == len(found) else float(horizon),
            "baseline_delays": old_found if cfg.baseline else None,
            "baseline_median": float(statistics.median(old_hit)) if old_hit else None,
            "baseline_alarms_before_rise": old_early if cfg.baseline else None,
        }
        rows.append(
            {
                "test": f"slow divergence, delay on a {100 * cfg.rise:g} % rise over "
                f"{cfg.rise_steps} steps, {name} (median; max; missed of {cfg.delay_seeds})",
                "new": f"{delays[name]['median']:.0f}; {delays[name]['max']:.0f}; "
                f"{delays[name]['missed']}",
                "baseline": (
                    f"{delays[name]['baseline_median']}; missed {sum(d is None for d in old_found)}"
                    if cfg.baseline
                    else None
                ),
                "unit": "steps",
            }
        )

    return rows, delays


def spike_false_rollbacks(
    cfg: Config, rng: np.random.Generator, real_noise: np.ndarray
) -> tuple[list[dict], dict]:
    """False rollbacks of :class:`SpikeDetector` (and :class:`OldSpike`) on healthy streams,
    and the 5x one-step spikes injected into them that it catches; table rows and results."""
    rows = []
    # A rate of 1 per 10^5 cannot be told from 2 on one series of 10^5 steps (Poisson): the
    # synthetic streams are pooled over `false_series` independent series (10: 10^6 steps,
    # a standard error of about 0.3 per 10^5 at that rate).
    series = {
        "student_t3": lambda: LEVEL * (1 + STD * rng.standard_t(3, size=cfg.steps)),
        "lognormal": lambda: LEVEL * np.exp(0.3 * rng.standard_normal(cfg.steps)),
        "gaussian": lambda: LEVEL * (1 + STD * rng.standard_normal(cfg.steps)),
        "real": None,
        "phi0.99": lambda: LEVEL + ar1(cfg.steps, 0.99, STD, rng),
        "phi0.999": lambda: LEVEL + ar1(cfg.steps, 0.999, STD, rng),
    }
    spikes = {}
    for name, make in series.items():
        xs = [LEVEL + real_noise] if make is None else [make() for _ in range(cfg.false_series)]
        spikes[name] = pooled_spike_runs(stabljax.control.SpikeDetector, xs, cfg.spike_every)
        if cfg.baseline:
            spikes[name]["baseline"] = pooled_spike_runs(OldSpike, xs, cfg.spike_every)
        base = spikes[name].get("baseline", {})
        rows.append(
            {
                "test": f"spike, healthy {name}: false rollbacks",
                "new": spikes[name]["false_per_1000"],
                "baseline": base.get("false_per_1000"),
                "unit": "/ 1000 steps",
                "us / update": spikes[name]["us_per_update"],
            }
        )
        rows.append(
            {
                "test": f"spike, {name}: 5x one-step spikes caught",
                "new": f"{spikes[name]['caught']} / {spikes[name]['spikes']}",
                "baseline": f"{base['caught']} / {base['spikes']}" if base else None,
                "unit": "",
            }
        )

    return rows, spikes


def run(cfg: Config, *, progress: bool = True) -> tuple[list[dict], dict]:
    rng = np.random.default_rng(cfg.seed)
    ratios_real, used = real_ratios(cfg.trend_width, cfg.skip_frac)
    real_noise = LEVEL * (block_bootstrap(ratios_real, cfg.steps, cfg.bootstrap_block, rng) - 1)
    noises: dict[str, list[np.ndarray]] = {}
    for phi in cfg.phis:
        name = "iid" if phi == 0 else f"phi{phi:g}"
        noises[name] = [ar1(cfg.steps, phi, STD, rng) for _ in range(cfg.seeds)]
    noises["real"] = [real_noise]
    rows, slow = slow_false_alarms(cfg, noises, progress)
    delay_rows, delays = slow_delays(cfg, rng)
    spike_rows, spikes = spike_false_rollbacks(cfg, rng, real_noise)
    power_rows, power = spike_power(cfg.power_trials, cfg.power_warm, rng)
    slingshot_rows, slingshot = model_spikes()
    rows += delay_rows + spike_rows + power_rows + slingshot_rows

    results = {
        "spike_power": power,
        "spike_power_slingshot": slingshot,
        "slow_false_alarms": slow,
        "slow_delay": delays,
        "spike": spikes,
        "real_curves": used,
        "real_ratio_std": float(np.std(ratios_real)),
        "real_ratio_lag1": float(np.corrcoef(ratios_real[:-1], ratios_real[1:])[0, 1]),
        "real_steps_pooled": len(ratios_real),
        "detectors": {
            "slow": repr(stabljax.control.SlowDivergenceDetector()),
            "spike": repr(stabljax.control.SpikeDetector()),
        },
        "ratios": {
            **{f"slow_alarms_per_1e5_{k}": v["per_1e5"] for k, v in slow.items()},
            **{f"slow_delay_median_steps_{k}": v["median"] for k, v in delays.items()},
            **{f"slow_delay_max_steps_{k}": v["max"] for k, v in delays.items()},
            **{f"spike_false_per_1000_{k}": v["false_per_1000"] for k, v in spikes.items()},
            **{f"spike_false_per_1e5_{k}": 100 * v["false_per_1000"] for k, v in spikes.items()},
            **{f"spike_5x_caught_{k}": v["caught_fraction"] for k, v in spikes.items()},
        },
        "targets": TARGETS,
    }
    return rows, results


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.detectors")
    cfg = ex.cfg
    rows, results = run(cfg, progress=not ex.args.no_progress)
    title = (
        f"Detectors: false alarms and delay ({cfg.steps} steps x {cfg.seeds} seeds a "
        f"noise; level {LEVEL}, std {STD})"
    )
    return ex.report(rows, results, targets=TARGETS, title=title)


if __name__ == "__main__":
    main()
