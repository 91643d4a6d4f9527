"""Spike power: how often and how fast :class:`stabljax.control.SpikeDetector` catches spikes.

Spikes of :data:`SPIKE_SIZES` nats lasting :data:`SPIKE_LENGTHS` steps added to a falling
loss, and the model-made Slingshot spikes of the committed main job. Used by
:mod:`experiments.bench.detectors`.
"""

from __future__ import annotations

import json

import numpy as np

import stabljax
from experiments.bench.detector_streams import falling_loss
from experiments.common import RESULTS

#: Spike sizes (nats) and lengths (steps) of the power table, added to a falling loss.
SPIKE_SIZES = (0.3, 0.5, 1.0, 2.0)
SPIKE_LENGTHS = (1, 5, 20, 50)


def first_rollback(det, x: np.ndarray, start: int) -> tuple[int | None, int]:
    """The first step >= ``start`` where ``det`` rolls back on ``x`` (None: never), and
    the rollbacks before ``start`` (false ones)."""
    early = 0
    for s, v in enumerate(x.tolist()):
        d = det.update(s, {"loss": v})
        if d is not None and d.rolls_back:
            if s >= start:
                return s, early
            early += 1
    return None, early


def spike_power(trials: int, warm: int, rng: np.random.Generator) -> tuple[list[dict], dict]:
    """Detection rate and delay of :class:`SpikeDetector` (defaults) on spikes of
    :data:`SPIKE_SIZES` nats lasting :data:`SPIKE_LENGTHS` steps, added at a random step
    after ``warm`` steps to a falling loss (``trials`` each); caught when a rollback comes
    before the spike has ended plus 20 steps (delay: from its first step)."""
    rows, out = [], {}
    for noise in ("student_t3", "phi0.99"):
        for size in SPIKE_SIZES:
            for length in SPIKE_LENGTHS:
                delays, early = [], 0
                for _ in range(trials):
                    start = warm + int(rng.integers(0, 100))
                    x = falling_loss(start + length + 20, noise, rng)
                    x[start : start + length] += size
                    at, e = first_rollback(stabljax.control.SpikeDetector(), x, start)
                    early += e
                    delays.append(None if at is None else at - start)
                hit = [d for d in delays if d is not None]
                key = f"{noise} +{size:g} nats x {length}"
                out[key] = {
                    "caught": len(hit) / len(delays),
                    "delay_median": float(np.median(hit)) if hit else None,
                    "delay_max": float(max(hit)) if hit else None,
                    "false_before": early,
                }
                rows.append(
                    {
                        "test": f"spike power, falling {noise}: +{size:g} nats for {length} steps",
                        "new": f"{100 * len(hit) / len(delays):.0f} %",
                        "baseline": None,
                        "unit": "caught; delay median/max steps: "
                        + (f"{np.median(hit):.0f}/{max(hit)}" if hit else "-"),
                    }
                )
    return rows, out


def model_spikes() -> tuple[list[dict], dict]:
    """The detector on the main job's model-made spikes: every unguarded run's kept losses
    of the committed ``spike_recovery`` results, fed in order; each spike onset (> 0.5 nats
    above the running minimum, :func:`experiments.slingshot.spikes`) is caught when a
    rollback comes within 20 steps of it (delay from the onset; negative: before the loss
    was 0.5 nats up). Rollback episodes (runs of consecutive rolling-back detections; the
    controller would roll back at the first) more than 20 steps from any onset are counted
    apart: blips above the 10^-3 floor at a median of 0 that stay under 0.5 nats."""
    from experiments.slingshot import spikes

    f = RESULTS / "spike_recovery" / "results.json"
    if not f.exists():
        return [], {}
    runs = json.loads(f.read_text())["results"].get("runs", [])
    runs = [r for r in runs if r.get("arm") == "unguarded" and "kept_losses" in r]
    delays, other, onsets_n, steps = [], 0, 0, 0
    for r in runs:
        x = np.asarray([np.nan if v is None else v for v in r["kept_losses"]], float)
        onsets = spikes(x)
        onsets_n += len(onsets)
        steps += len(x)
        det, fired, inside = stabljax.control.SpikeDetector(), [], False
        for s, v in enumerate(x.tolist()):
            d = det.update(s, {"loss": v})
            rolls = d is not None and d.rolls_back
            if rolls and not inside:  # the first step of an episode: where it rolls back
                fired.append(s)
            inside = rolls
        for o in onsets:
            near = [s - o for s in fired if -20 <= s - o <= 20]
            delays.append(near[0] if near else None)
        other += sum(all(abs(s - o) > 20 for o in onsets) for s in fired)
    hit = [d for d in delays if d is not None]
    res = {
        "runs": len(runs),
        "onsets": onsets_n,
        "caught": len(hit) / max(1, len(delays)),
        "delay_median": float(np.median(hit)) if hit else None,
        "rollbacks_away_from_onsets": other,
        "steps": steps,
    }
    row = {
        "test": f"spike power, Slingshot (main job, unguarded, {len(runs)} runs, "
        f"{onsets_n} spikes)",
        "new": f"{100 * res['caught']:.0f} %",
        "baseline": None,
        "unit": f"caught; delay median {res['delay_median']} steps; "
        f"{other} rollback episodes > 20 steps from a spike",
    }
    return [row], res
