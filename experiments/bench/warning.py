"""Fault-injection benchmark of the divergence warning: does it fire before the loss does?

Healthy runs and runs driven to instability on the reference LM (d32, 2 layers, byte-level
corpus; AdamW (0.9, 0.95), clip 1.0, cosine; best LR 1e-2 from
experiments/results/lr_sensitivity), every run vmapped in one program per precision
(``make_train_step(signals=Signals(b2=0.95))``, so the leading indicators are recorded):

* ``healthy``: the best LR, 5 % warmup;
* ``lr_<k>x``: k times the best LR, no warmup (10, 30, 100 by default; the issue's 3-10x
  gave no divergence on this model: BUILD.md, "Divergence warning");
* ``lr_bump``: the best LR, 5 % warmup, the LR multiplied by ``bump`` from mid-run;
* ``fp16``: float16 compute without loss scaling, ``fp16_lr`` times the best LR, no warmup;
* ``logit_growth``: no qk-norm (the reference model has none), ``logit_lr`` times the best
  LR with warmup.

An *event* is the first step whose loss is non-finite or more than 0.5 nats above the
median of the 20 losses before it. For each detector, offline on the recorded metrics, in
step order: recall (events with a detection at or before them, after the fault began),
lead time (event step minus detection step) and false warnings per 10^4 healthy steps
(detections in the held-out healthy runs). Detectors: ours
(:class:`~stabljax.control.detect.warning.WarningDetector`, threshold calibrated on separate
healthy seeds: the smallest with no warning there, times ``margin``), ``SpikeDetector``
(defaults), OLMo-core's 6 sigma over 128 and LLM Foundry's 2x the mean for 4 steps.

Run from the repository root::

    python -m experiments.bench.warning            # minutes on 2 CPU cores
    python -m experiments.bench.warning --quick    # seconds, smoke test
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import stabljax
from experiments import cli, common, proxy, trainer
from stabljax.control.detect.detectors import SpikeDetector
from stabljax.control.detect.warning import WarningDetector
from stabljax.telemetry import Signals

KEEP = ("loss", "grad_norm", "update_rms_ratio", "adam_rms", "max_attn_logit", "log_z")
FAULTS = ("lr_10x", "lr_30x", "lr_100x", "lr_bump", "fp16", "logit_growth")
RISE, BASE, HOLD = 0.5, 20, 5  # an event: RISE nats above the median of BASE, for HOLD


@dataclasses.dataclass(frozen=True)
class Config(proxy.ModelSize):
    """Model, steps, seeds, fault strengths and the warning's calibration; ``cache``: an
    ``.npz`` of the recorded metrics, written on the first run and read (no training) on
    the next, to re-score."""

    steps: int = 300
    best_lr: float = 1e-2
    bump: float = 30.0
    fp16_lr: float = 30.0
    logit_lr: float = 30.0
    seeds: tuple[int, ...] = tuple(range(8))
    healthy_seeds: tuple[int, ...] = tuple(range(12))
    calib_seeds: tuple[int, ...] = tuple(range(100, 108))
    margin: float = 1.25
    faults: tuple[str, ...] = FAULTS
    cache: str = ""

    @classmethod
    def quick(cls) -> Config:
        return cls(
            **proxy.QUICK_SIZE, steps=60, seeds=(0, 1), healthy_seeds=(0, 1), calib_seeds=(9,)
        )


def arm_runs(cfg: Config, arm: str, seeds) -> list[dict]:
    """The runs of ``arm``: seed, peak LR, warmup steps, bump step and bump factor."""
    lr, warm, bump_at, bump = cfg.best_lr, round(0.05 * cfg.steps), cfg.steps, 1.0
    if arm.startswith("lr_") and arm.endswith("x"):
        lr, warm = cfg.best_lr * float(arm[3:-1]), 0
    elif arm == "lr_bump":
        bump_at, bump = cfg.steps // 2, cfg.bump
    elif arm == "fp16":
        lr, warm = cfg.fp16_lr * cfg.best_lr, 0
    elif arm == "logit_growth":
        lr = cfg.logit_lr * cfg.best_lr
    elif arm != "healthy":
        raise ValueError(f"unknown arm {arm!r}; known: healthy, {', '.join(FAULTS)}")
    hp = {"learning_rate": lr, "warmup": warm, "bump_at": bump_at, "bump": bump}
    return [
        {"seed": s, "arm": arm, "start": 0 if bump_at >= cfg.steps else bump_at, **hp}
        for s in seeds
    ]


def factory(steps: int):
    """``factory(learning_rate, warmup, bump_at, bump)``: the proxy's AdamW, every
    hyperparameter injected (traced, one value per run)."""

    def make(learning_rate, warmup, bump_at, bump):
        def schedule(c):
            c = jnp.asarray(c, jnp.float32)
            ramp = jnp.minimum(1.0, (c + 1.0) / jnp.maximum(warmup, 1.0))
            cos = 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(c / steps, 1.0)))
            return learning_rate * ramp * cos * jnp.where(c >= bump_at, bump, 1.0)

        adamw = optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=1e-4)
        return optax.chain(optax.clip_by_global_norm(1.0), adamw)

    return make


def train(cfg: Config, runs: list[dict], precision: str, bar) -> dict[str, np.ndarray]:
    """Trains ``runs`` side by side; returns each kept metric as ``[runs, steps]``."""
    s = cfg.setup(steps=cfg.steps, precision=precision, corpus_bytes=400_000)
    model, _ = proxy.initial_model(s)
    aux_apply, _ = stabljax.nnx_apply(model, return_aux=True)

    def loss_fn(params, batch):
        logits, a = aux_apply(params, batch["inputs"])
        loss, aux = stabljax.cross_entropy_with_z_loss(logits, batch["targets"])
        out = {"log_z": aux["log_z"], "max_attn_logit": a["max_attn_logit"]}
        return loss, out | {"max_attn_logits": a["max_attn_logits"]}

    names = ("learning_rate", "warmup", "bump_at", "bump")
    tx = optax.inject_hyperparams(factory(cfg.steps))
    prec = proxy.precision_of(precision)
    step = stabljax.make_train_step(
        loss_fn, tx(**{k: runs[0][k] for k in names}), precision=prec,
        signals=Signals(b2=0.95), donate=False,
    )  # fmt: skip

    def one(state, window):
        state, m = step(state, {"inputs": window[..., :-1], "targets": window[..., 1:]})
        return state, {k: m[k] for k in KEEP}

    init = jax.jit(jax.vmap(lambda p, hp: stabljax.TrainState.create(p, tx(**hp), prec)))
    chunk = jax.jit(lambda st, w: jax.lax.scan(jax.vmap(one), st, w), donate_argnums=(0,),
                    compiler_options=trainer.FAST_COMPILE)  # fmt: skip
    setups = [dataclasses.replace(s, seed=r["seed"]) for r in runs]
    params = trainer._stack([proxy.initial_model(si)[1] for si in setups])
    hp = {k: jnp.asarray([float(r[k]) for r in runs], jnp.float32) for k in names}
    state, fns, out = init(params, hp), [proxy.corpus_batches(si) for si in setups], []
    k = 50 if cfg.steps % 50 == 0 else cfg.steps
    for start in range(0, cfg.steps, k):
        idx = range(start, start + k)
        windows = np.stack([trainer._batches(fn, idx) for fn in fns], axis=1)
        state, ms = chunk(state, jnp.asarray(windows))
        out.append(jax.device_get(ms))
        bar.update(k * len(runs))
    return {key: np.concatenate([o[key] for o in out], axis=0).T for key in KEEP}


def event_step(loss: np.ndarray, start: int) -> int | None:
    """The first step >= ``start`` (and >= 10) whose loss is non-finite, or more than RISE
    above the median of the BASE losses before it while the median of it and the next
    HOLD - 1 losses is too: a rise that lasts (one batch's outlier is not a divergence; the
    byte-level corpus has many, the same in every arm of a seed)."""
    for t in range(max(start, 10), loss.size):
        if not math.isfinite(loss[t]):
            return t
        if t + HOLD > loss.size:  # too near the end to tell a rise from one outlier
            continue
        base = loss[max(0, t - BASE) : t]
        base = np.median(base[np.isfinite(base)]) if np.isfinite(base).sum() >= 10 else None
        ahead = loss[t : t + HOLD]
        ahead = np.median(np.where(np.isfinite(ahead), ahead, np.inf))
        if base is not None and loss[t] - base > RISE and ahead - base > RISE:
            return t
    return None


class MeanSigma:
    """OLMo-core's rule: a loss above mean + 6 sigma of the last 128 (after 128)."""

    name = "6sigma/128"

    def __init__(self, n_sigma=6.0, window=128):
        self.n_sigma, self.window, self.hist = n_sigma, window, []

    def update(self, step, m):
        x, h = float(m["loss"]), self.hist[-self.window :]
        fire = not math.isfinite(x) or (
            len(h) >= self.window and x > np.mean(h) + self.n_sigma * np.std(h)
        )
        if math.isfinite(x) and not fire:
            self.hist.append(x)
        return step if fire else None


class TwiceMean:
    """LLM Foundry's KillLossSpike: loss >= 2x the running mean for more than 4 steps."""

    name = "2x mean, patience 4"

    def __init__(self, factor=2.0, patience=4, window=100):
        self.factor, self.patience, self.window, self.hist, self.run = (
            factor,
            patience,
            window,
            [],
            0,
        )

    def update(self, step, m):
        x = float(m["loss"])
        high = not math.isfinite(x) or (
            len(self.hist) >= 10 and x >= self.factor * np.mean(self.hist[-self.window :])
        )
        self.run = self.run + 1 if high else 0
        if not high:
            self.hist.append(x)
        return step if self.run == self.patience + 1 else None


class Library:
    """A stabljax detector as a function of (step, metrics): the step of each detection."""

    def __init__(self, det):
        self.det, self.name = det, det.name

    def update(self, step, m):
        d = self.det.update(step, m)
        return None if d is None else step


def detector_factories(threshold: float) -> dict[str, callable]:
    return {
        "ours (WarningDetector)": lambda: Library(WarningDetector(threshold=threshold)),
        "SpikeDetector": lambda: Library(SpikeDetector()),
        "6sigma/128 (OLMo-core)": MeanSigma,
        "2x mean, patience 4 (LLM Foundry)": TwiceMean,
    }


def detections(make, metrics: dict[str, np.ndarray], i: int) -> list[int]:
    det, out = make(), []
    n = metrics["loss"].shape[1]
    for t in range(n):
        m = {k: v[i, t] for k, v in metrics.items()}
        if not math.isfinite(m["loss"]):  # a NaN run stops: the event has happened
            out += [t] if det.update(t, m) is not None else []
            break
        if det.update(t, m) is not None:
            out.append(t)
    return out


def cusum_maxima(metrics: dict[str, np.ndarray], i: int) -> np.ndarray:
    """Run ``i``'s largest CUSUM statistic after each step (an untriggerable detector)."""
    det, out = WarningDetector(threshold=1e300), []
    for t in range(metrics["loss"].shape[1]):
        det.update(t, {k: v[i, t] for k, v in metrics.items()})
        out.append(max(det.statistics.values()))
    return np.asarray(out)


def score(runs, metrics, factories) -> tuple[list[dict], dict]:
    """Per detector and arm: events, recall, lead times, false warnings."""
    per: dict[tuple[str, str], dict] = {}
    for i, r in enumerate(runs):
        event = event_step(metrics["loss"][i], r["start"])
        for name, make in factories.items():
            got = detections(make, metrics, i)
            p = per.setdefault(
                (name, r["arm"]),
                {"runs": 0, "steps": 0, "false": 0, "events": 0, "leads": [], "warned": 0},
            )
            p["runs"] += 1
            if r["arm"] == "healthy":
                p["steps"] += metrics["loss"].shape[1]
                p["false"] += len(got)
                p["events"] += event is not None
                continue
            p["false"] += sum(d < r["start"] for d in got)
            p["warned"] += any(d >= r["start"] for d in got)
            if event is not None:
                p["events"] += 1
                warned = [d for d in got if r["start"] <= d <= event]
                p["leads"].append(event - warned[0] if warned else None)
    rows, summary = [], {}
    for (name, arm), p in per.items():
        leads = [x for x in p["leads"] if x is not None]
        row = {"detector": name, "arm": arm, "runs": p["runs"], "events": p["events"]}
        row |= {"false warnings": p["false"], "runs warned": p["warned"]}
        row |= {"recall": "", "median lead": "", "leads": ""}
        if arm != "healthy" and p["events"]:
            row["recall"] = len(leads) / p["events"]
            row["median lead"] = float(np.median(leads)) if leads else float("nan")
            row["leads"] = " ".join("-" if x is None else str(x) for x in sorted(
                p["leads"], key=lambda x: (x is None, x)))  # fmt: skip
        rows.append(row)
    for name in factories:
        leads = [x for (n, a), p in per.items() if n == name and a != "healthy" for x in p["leads"]]
        ok = [x for x in leads if x is not None]
        h = per.get((name, "healthy"), {"false": 0, "steps": 0})
        summary[name] = {
            "events": len(leads),
            "recall": len(ok) / len(leads) if leads else float("nan"),
            "median_lead": float(np.median(ok)) if ok else float("nan"),
            "false_per_1e4_healthy": 1e4 * h["false"] / max(h["steps"], 1),
            "healthy_steps": h["steps"],
        }
    return rows, summary


def run(cfg: Config, bar) -> dict:
    groups = {"fp32": [], "fp16-noscale": []}
    calib = [dict(r, arm="calib") for r in arm_runs(cfg, "healthy", cfg.calib_seeds)]
    groups["fp32"] += calib + arm_runs(cfg, "healthy", cfg.healthy_seeds)
    for arm in cfg.faults:
        groups["fp16-noscale" if arm == "fp16" else "fp32"] += arm_runs(cfg, arm, cfg.seeds)
    runs, metrics = [], {}
    cached = pathlib.Path(cfg.cache) if cfg.cache else None
    for precision, rs in groups.items():
        if rs:
            runs += rs
            if cached is None or not cached.exists():
                m = train(cfg, rs, precision, bar)
                metrics = {k: np.concatenate([metrics[k], m[k]]) if metrics else m[k] for k in KEEP}
    if cached is not None and cached.exists():  # the metrics of an earlier run of this config
        with np.load(cached, allow_pickle=False) as z:
            metrics = {k: z[k] for k in KEEP}
    elif cached is not None:
        np.savez_compressed(cached, **metrics)
    cal = [i for i, r in enumerate(runs) if r["arm"] == "calib"]
    peak = max(float(cusum_maxima(metrics, i).max()) for i in cal)
    # No statistic rose (runs shorter than the warmup): the detector's own default.
    threshold = float(f"{cfg.margin * peak:.3g}") if peak > 0 else WarningDetector().threshold
    keep = [i for i, r in enumerate(runs) if r["arm"] != "calib"]
    sub = {k: v[keep] for k, v in metrics.items()}
    rows, summary = score([runs[i] for i in keep], sub, detector_factories(threshold))
    events = {r["arm"]: 0 for r in runs}
    for i, r in enumerate(runs):
        events[r["arm"]] += event_step(metrics["loss"][i], r["start"]) is not None
    return {"rows": rows, "summary": summary, "threshold": threshold, "calib_peak": peak,
            "events_per_arm": events, "runs": runs}  # fmt: skip


def main(argv=None) -> dict:
    ex = cli.start(Config, argv, __doc__, name="bench.warning", folder="bench/warning")
    cfg = ex.cfg
    total = cfg.steps * (
        len(cfg.calib_seeds) + len(cfg.healthy_seeds) + len(cfg.seeds) * len(cfg.faults)
    )
    res = ex.sweep(total, lambda bar: run(cfg, bar))
    goal = {"median_lead": ">= 5", "false_per_1e4_healthy": "<= 1", "recall": ">= 0.9"}
    srows = [{"detector": k, **v} for k, v in res["summary"].items()]
    table = common.markdown_table(srows) + "\n\n" + common.markdown_table(res["rows"])
    title = f"Divergence warning: fault injection (threshold {res['threshold']:g})"
    ex.write(res | {"goal": goal}, table=table, title=title, stem="results")
    return res


if __name__ == "__main__":
    main()
