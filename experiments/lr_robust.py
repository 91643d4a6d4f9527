"""LR-robust training (issue 51, item 5): the controller at 1-10x the best fixed LR.

At 1-10x the best fixed LR, no warmup, does the controller keep every run from diverging
and within 1 % of the best-LR run, at equal compute?

The task is the main job's (:mod:`experiments.spike_recovery`, :mod:`experiments.lm_spikes`):
the reference byte-level Transformer on the embedded corpus, Adam at a constant LR, no
warmup, no clipping. The best fixed LR comes from the main job's scan (``scan_lrs`` x
``scan_seeds``, seeds not measured: :func:`experiments.spike_recovery.lr_scan`); the grid is
``multiples`` of it (1 must be one of them). At every LR of the grid, on every measured seed,
three arms, each exactly ``steps`` train-step calls (a rollback's replay is paid out of
them, :func:`experiments.equal_compute.run_controlled`):

* ``unguarded``: no controller;
* ``reactive``: :class:`stabljax.RollbackController` with its default detectors and
  ``remedy=lower_lr(remedy_factor)`` (the main job's ``remedy`` arm);
* ``predictive``: the same, plus :class:`~stabljax.control.detect.warning.WarningDetector`
  (its defaults unless ``warning_*`` say otherwise; action ``"record"``: an event, no Python
  warning) among the detectors and ``warning_response=WarningResponse(warning_factor)``: the
  LR is lowered while a warning is in force and restored after.

Every arm trains with one compiled step (the main job's Adam, returning the leading
indicators the warning reads: ``make_train_step(signals=Signals(b2))``, log Z and the max
attention logit), one call at a time, so a controlled run equals the unguarded one bit for
bit until its controller acts. (The main job's vmapped arms drift from its controlled ones
by float rounding; here they do not.)

Primary metric (:data:`PRIMARY`, declared before the run): per seed, the final held-out loss
over the unguarded run's at the best LR, minus 1 (:func:`gaps`). The moonshot target, per
arm: 0 diverged runs and the gap shown below 1 % at every LR of the grid. The family
(:func:`comparisons`), paired per seed, paired t-intervals and p-values, Holm over all of
it: each arm at each LR above 1x against the 1 % margin, and reactive and predictive
against unguarded, predictive against reactive, at each LR. At 1x the arms meet the
reference run itself (``arm − unguarded @ 1x``), not the margin: a controller that never
acts there *is* the reference run, and a margin test on it would be a zero-variance test
"showing" what holds by construction.

    python -m experiments.lr_robust [--quick] [--multiples 1 2 4 10] [--seeds 100 101] ...

Results go to ``runs/lr_robust/`` (git-ignored); ``--commit-results`` writes the committed
``experiments/results/lr_robust/`` that docs/experiments.md's claims are read from.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import time

import jax
import numpy as np

import stabljax
from experiments import cli, common, equal_compute, lm_spikes, plots, spike_recovery, stats
from experiments.equal_compute import UNIFORM, run_controlled
from experiments.spike_recovery import lr_scan, primary
from stabljax.control.decide.remedies import WarningResponse
from stabljax.control.detect.warning import WarningDetector
from stabljax.telemetry import Signals

ARMS = ("unguarded", "reactive", "predictive")
#: The moonshot's tolerance: a final held-out loss within this fraction of the best-LR run's.
MARGIN = 0.01
#: The primary metric, declared before the run: lower is better.
PRIMARY = (
    "final held-out loss / the same seed's unguarded one at the best LR − 1 "
    "(a non-finite loss counts as ln 256)"
)
#: Where a run writes unless told ``--commit-results`` (git-ignored).
RUN_FOLDER = "runs/lr_robust"
#: The optimizer and step every arm uses (:class:`Programs`).
KIND = "signals"
_WARNING = inspect.signature(WarningDetector).parameters


@dataclasses.dataclass(frozen=True)
class Config(spike_recovery.Config):
    lr: float = dataclasses.field(
        default=lm_spikes.FAILURE_LR,
        metadata={"help": "not used: every run's LR is one of `multiples` of the scan's best"},
    )
    seeds: tuple[int, ...] = tuple(range(100, 110))  # 10, as every committed sweep
    multiples: tuple[float, ...] = dataclasses.field(
        default=(1.0, 2.0, 4.0, 10.0),
        metadata={"help": "the grid, as multiples of the scan's best LR (1 must be one)"},
    )
    warning_threshold: float = dataclasses.field(
        default=_WARNING["threshold"].default,
        metadata={"help": "the predictive arm's WarningDetector threshold (its default)"},
    )
    warning_warmup: int = dataclasses.field(
        default=_WARNING["warmup"].default,
        metadata={"help": "the predictive arm's WarningDetector warmup (its default)"},
    )
    warning_factor: float = dataclasses.field(
        default=0.5, metadata={"help": "the predictive arm's LR multiplier while warned"}
    )

    @classmethod
    def quick(cls) -> Config:
        return dataclasses.replace(
            super().quick(), multiples=(1.0, 10.0), warning_warmup=10, warning_threshold=3.0
        )


class Programs(equal_compute.Programs):
    """The main job's programs, plus :data:`KIND`: its Adam in a step that also returns the
    leading indicators (update/param RMS ratio, Adam RMS, log Z, the max attention logit)."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        apply_aux, _ = self.task.model(0, return_aux=True)
        self.optimizers[KIND] = self.optimizers["plain"]
        self.steps[KIND] = stabljax.make_train_step(
            signals_loss(apply_aux), self.optimizers[KIND], signals=Signals(b2=cfg.b2),
            donate=False,
        )  # fmt: skip


def signals_loss(apply_aux):
    """The main job's loss (mean next-byte cross-entropy, no z-loss) with log Z and the max
    attention logit in ``aux``."""

    def fn(params, batch):
        logits, a = apply_aux(params, batch["inputs"])
        loss, aux = stabljax.cross_entropy_with_z_loss(logits, batch["targets"], z_loss_weight=0.0)
        return loss, {"log_z": aux["log_z"], "max_attn_logit": a["max_attn_logit"]}

    return fn


def run_plain(cfg: Config, progs: Programs, seed: int, lr: float) -> dict:
    """One unguarded seed, ``cfg.steps`` calls of the controlled arms' own step."""
    state, step, fn = progs.state(KIND, seed, lr), progs.steps[KIND], progs.task.batches(seed)
    t0, losses = time.perf_counter(), []
    for i in range(cfg.steps):
        state, m = step(state, fn(i))
        losses.append(m["loss"])
    x = np.asarray(jax.device_get(losses), float)
    return equal_compute.record(
        x, progs.evaluate(state.params), seed=seed, lr=lr, final_lr=lr, event_counts={},
        wall_s=round(time.perf_counter() - t0, 1),
    )  # fmt: skip


def predictive_kw(cfg: Config) -> dict:
    """The predictive arm's extra controller arguments: the warning detector beside the
    default ones, and the response that lowers the LR while it is engaged."""
    warn = WarningDetector(
        threshold=cfg.warning_threshold, warmup=cfg.warning_warmup, action="record"
    )
    return {
        "detectors": [*stabljax.control.default_detectors(), warn],
        "warning_response": WarningResponse(factor=cfg.warning_factor),
    }


def sweep(cfg: Config, progs: Programs, lrs: list[float], workdir, bar) -> list[dict]:
    """Every arm at every LR of the grid on every measured seed; one row per run."""
    runs = []
    for m, lr in zip(cfg.multiples, lrs, strict=True):
        for arm in ARMS:
            for sd in cfg.seeds:
                if arm == "unguarded":
                    r = run_plain(cfg, progs, sd, lr)
                else:
                    kw = predictive_kw(cfg) if arm == "predictive" else {}
                    ckpt = workdir / f"{arm}-{m:g}x-{sd}"
                    r = run_controlled(cfg, progs, sd, lr, ckpt, remedy=True, kind=KIND, **kw)
                ev = r["event_counts"]
                extra = {"warnings": ev.get("warning", 0)}
                extra["warning_responses"] = ev.get("warning_response", 0)
                runs.append({"arm": arm, "multiple": m, **extra, **r})
                bar.update(cfg.steps)
    return runs


def key(arm: str, multiple: float) -> str:
    return f"{arm} @ {multiple:g}x"


def per_arm(cfg: Config, runs: list[dict]) -> dict[str, dict[str, list]]:
    """``equal_compute``: ``"<arm> @ <m>x"`` -> field -> one value per seed (``cfg.seeds``
    order)."""
    keys = ("final_heldout", "steps_executed", "rollbacks", "rollbacks_below_criterion")
    keys += ("diverged", "gave_up", "mean_train", "spikes", "final_lr", "lr")
    keys += ("warnings", "warning_responses")
    out = {}
    for m in cfg.multiples:
        for arm in ARMS:
            rr = [r for r in runs if r["arm"] == arm and r["multiple"] == m]
            rr.sort(key=lambda r: cfg.seeds.index(r["seed"]))
            out[key(arm, m)] = {k: [r[k] for r in rr] for k in keys}
    return out


def gaps(values, reference) -> list[float]:
    """Per seed, ``value / reference − 1``, a non-finite loss on either side counted as
    ln 256 (:data:`~experiments.equal_compute.UNIFORM`): the primary metric."""
    fin = lambda v: float(v) if np.isfinite(float(v)) else UNIFORM  # noqa: E731
    return [fin(v) / fin(r) - 1.0 for v, r in zip(values, reference, strict=True)]


def comparisons(cfg: Config, ec: dict, lrs: list[float]) -> dict[str, dict[str, list]]:
    """The family, fixed before the run, on :func:`gaps` to the unguarded best-LR run: per
    LR, each arm against the 1 % margin (above 1x only: at 1x the pairs below compare the
    arms with the reference run itself), reactive and predictive against unguarded,
    predictive against reactive."""
    ref = ec[key("unguarded", 1.0)]["final_heldout"]
    gap = {k: gaps(v["final_heldout"], ref) for k, v in ec.items()}
    size, n = f"d{cfg.d_model}x{cfg.n_layers}", len(cfg.seeds)
    out = {}
    for m, lr in zip(cfg.multiples, lrs, strict=True):
        at = f"@ lr {lr:.3g} ({m:g}x best), {size}"
        for arm in ARMS:
            if m != 1.0:
                out[f"{arm} − 1 % margin {at}"] = {"remedy": gap[key(arm, m)], "base": [MARGIN] * n}
        for arm, base in (("reactive", "unguarded"), ("predictive", "unguarded"),
                          ("predictive", "reactive")):  # fmt: skip
            out[f"{arm} − {base} {at}"] = {"remedy": gap[key(arm, m)], "base": gap[key(base, m)]}
    return out


def moonshot(cfg: Config, ec: dict, family: dict, lrs: list[float]) -> dict:
    """Per arm and LR: diverged runs, the mean gap, whether within 1 % is shown (above 1x:
    the margin comparison met; at 1x, where the reference run is within by definition: a
    mean gap of at most 1 % and the arm not shown worse than unguarded there); ``met``: 0
    diverged and within 1 % shown at every LR of the grid."""
    ref = ec[key("unguarded", 1.0)]["final_heldout"]
    size, out = f"d{cfg.d_model}x{cfg.n_layers}", {}
    for arm in ARMS:
        per = {}
        for m, lr in zip(cfg.multiples, lrs, strict=True):
            a = ec[key(arm, m)]
            mean_gap = float(np.mean(gaps(a["final_heldout"], ref)))
            if m != 1.0:
                within = family[f"{arm} − 1 % margin @ lr {lr:.3g} ({m:g}x best), {size}"]
                within = bool(within["claim_met"])
            else:
                pair = family.get(f"{arm} − unguarded @ lr {lr:.3g} (1x best), {size}")
                worse = pair is not None and pair["ci95"][0] > 0 and pair["p_holm"] < 0.05
                within = mean_gap <= MARGIN and not worse
            per[f"{m:g}x"] = {
                "lr": lr,
                "diverged": int(sum(a["diverged"])),
                "mean_gap": mean_gap,
                "within_1pct_shown": within,
            }
        met = all(p["diverged"] == 0 and p["within_1pct_shown"] for p in per.values())
        out[arm] = {"met": met, "per_multiple": per}
    return out


def summarize(cfg: Config, ec: dict, grid: dict, lrs: list[float]) -> dict:
    """The summary block: the family, the moonshot per arm, the equal-compute record."""
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    family = stats.family(PRIMARY, comparisons(cfg, ec, lrs), test="paired_t")
    goal = moonshot(cfg, ec, family, lrs)
    steps = [s for a in ec.values() for s in a["steps_executed"]]
    mults = ", ".join(f"{m:g}" for m in cfg.multiples)
    task = (
        f"reference byte-level Transformer {size} (stabljax.reference.nn) on the embedded "
        f"corpus (stdlib .py bytes, last 10 % held out), Adam b2 {cfg.b2:g}, constant LR "
        f"{mults}x the best fixed LR {grid['best_lr']:g}, no warmup, no clipping"
    )
    verdict = "; ".join(
        f"{a}: {'met' if g['met'] else 'not met'}" for a, g in goal.items()
    )  # fmt: skip
    met = [k for k, r in family.items() if r["claim_met"]]
    none_met = (
        f"no arm shown within {MARGIN * 100:g} % of the best-LR run at any LR above 1x "
        f"({', '.join(f'{m:g}' for m in cfg.multiples if m > 1)}x the best), nor better than "
        "another (interval below 0, Holm p < 0.05); at 1x every arm is the reference run"
    )
    return stats.summary(
        cfg,
        instability_reproduced=not goal["unguarded"]["met"],
        failure_metric=(
            "unguarded misses the target somewhere on the grid: a diverged run, or its final "
            f"held-out loss not shown within {MARGIN * 100:g} % of the best-LR run"
        ),
        remedies=family,
        sizes=[size],
        note=f"{task}; {cfg.steps} train-step calls per run; moonshot (0 diverged, within "
        f"{MARGIN * 100:g} % at every LR): {verdict}",
        primary_metric=PRIMARY,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown="" if met else none_met,
    ) | {
        "task": task,
        "equal_compute": ec,
        "moonshot": goal,
        "margin": MARGIN,
        "lr_multiples": list(cfg.multiples),
        "grid_lrs": lrs,
        "steps_executed_spread": (max(steps) - min(steps)) / max(steps),
    }


def table(cfg: Config, s: dict) -> str:
    ec, ref = s["equal_compute"], s["equal_compute"][key("unguarded", 1.0)]["final_heldout"]
    rows = []
    for k, a in ec.items():
        held = [primary({"final_heldout": v}) for v in a["final_heldout"]]
        rows.append({
            "arm @ LR": k,
            "lr": f"{a['lr'][0]:.3g}",
            "final held-out [95% t-CI]": common.fmt_interval(stats.interval(held)),
            "gap to best-LR run": f"{np.mean(gaps(a['final_heldout'], ref)):+.2%}",
            "diverged": sum(a["diverged"]),
            "rollbacks": sum(a["rollbacks"]),
            "warnings": sum(a["warnings"]),
            "LR lowered/restored": sum(a["warning_responses"]),
            "final LR (mean)": f"{np.mean(a['final_lr']):.3g}",
            "calls": " ".join(sorted({str(n) for n in a["steps_executed"]})),
        })  # fmt: skip
    return (
        reading(s) + "\n" + common.equal_compute_tables(cfg, s, rows, "Δ gap [95% t-CI]", PRIMARY)
    )


def reading(s: dict) -> str:
    """The moonshot's verdict per arm, in words, from the summary's numbers."""
    pct = f"{s['margin'] * 100:g} %"
    lines = [f"**Moonshot** (0 diverged runs, final held-out loss within {pct} of the best-LR "
             f"run, at every LR of the grid; shown = the paired interval of gap − {pct} below 0, "
             "Holm p < 0.05):"]  # fmt: skip
    for arm, g in s["moonshot"].items():
        per = g["per_multiple"]
        ok = [m for m, p in per.items() if p["diverged"] == 0 and p["within_1pct_shown"]]
        bad = [f"{m} ({p['diverged']} diverged, gap {p['mean_gap']:+.2%})"
               for m, p in per.items() if m not in ok]  # fmt: skip
        word = "**met**" if g["met"] else "not met"
        lines.append(
            f"- `{arm}`: {word}; shown at {', '.join(ok) or 'no LR'}"
            + (f"; not at {', '.join(bad)}" if bad else "")
            + "."
        )
    return "\n".join(lines) + "\n"


def figures(cfg: Config, out, runs: list[dict], summary: dict) -> None:
    rows = [r | {"final_heldout": primary(r)} for r in runs]
    plots.metric_vs_lr(rows, y="final_heldout", group="arm", path=out / "heldout_vs_lr.png",
                       title=f"final held-out loss, {len(cfg.seeds)} seeds",
                       ylabel="final held-out loss (nats/byte)")  # fmt: skip
    pad = lambda x: np.pad(np.asarray(x, float), (0, cfg.steps - len(x)), constant_values=np.nan)  # noqa: E731
    curves = {
        f"{m:g}x best": {a: np.array([pad(r["losses"]) for r in runs
                                      if r["arm"] == a and r["multiple"] == m]) for a in ARMS}
        for m in cfg.multiples
    }  # fmt: skip
    plots.curves(curves, path=out / "loss.png", xlabel="train-step call",
                 ylabel="training loss (nats/byte)", logy=True)  # fmt: skip
    title = f"gap − margin or arm − base, {len(cfg.seeds)} seeds (paired t 95% CI, Holm)"
    plots.effects(summary["remedies"], path=out / "effects.png", title=title)


def main(argv=None) -> dict:
    argv = spike_recovery.output_argv(sys.argv[1:] if argv is None else argv, RUN_FOLDER)
    doc = __doc__ + "\n--commit-results: write experiments/results/lr_robust/ instead."
    ex = cli.start(Config, argv, doc, name="lr_robust")
    cfg, out = ex.cfg, ex.out
    if 1.0 not in cfg.multiples:
        raise ValueError(f"--multiples must include 1 (the reference run), got {cfg.multiples}")
    workdir = cli.fresh_workdir(cfg.workdir, out, name="lr_robust")
    progs = Programs(cfg)
    grid, scan_rows = lr_scan(cfg, progs)
    lrs = [m * grid["best_lr"] for m in cfg.multiples]
    total = len(ARMS) * len(cfg.multiples) * len(cfg.seeds) * cfg.steps
    runs = ex.sweep(total, lambda bar: sweep(cfg, progs, lrs, workdir, bar))
    ec = per_arm(cfg, runs)
    summary = summarize(cfg, ec, grid, lrs)
    res = {"equal_compute": ec, "moonshot": summary["moonshot"], "scan": scan_rows, "runs": runs}
    top = {k: summary[k] for k in ("equal_compute", "moonshot", "task")}
    ex.write(res, table=table(cfg, summary), title="LR-robust training", summary=summary, top=top)
    figures(cfg, out, runs, summary)
    print(f"checkpoints of the controller arms: {workdir}")
    print(f"wall {ex.elapsed():.0f}s -> {out}")
    return res


if __name__ == "__main__":
    main()
