"""The main job: the rollback controller on a language model's own loss spikes, at equal
compute, against the best fixed LR and a cosine decay.

The task (:mod:`experiments.lm_spikes`): the reference byte-level Transformer
(:mod:`stabljax.reference.nn`, d32x2) on the embedded corpus (the standard library's
``.py`` files; the last 10 % held out), Adam b2 0.999 at a constant LR, no warmup, no
clipping. At :data:`experiments.lm_spikes.FAILURE_LR` (fixed by the pilot) the loss
spikes by itself; nothing is injected.

Arms, every one the same number of train-step calls (``steps``; a rollback's replay is paid
out of it): ``unguarded``; ``guards`` (``skip_nonfinite(skip_spikes(adam))``);
``cosine`` (the same LR decayed to 0 over the calls: what LR-halving rollbacks amount to);
``rollback`` (:class:`stabljax.RollbackController`, default detectors) and ``remedy``
(the same with ``remedy=lower_lr(remedy_factor)``), all at the failure LR; and at the best
fixed LR of a scan (``scan_lrs`` x ``scan_seeds``, seeds not measured): ``best_fixed_lr``,
``cosine_best_lr`` and ``best_lr_rollback`` (the controller on a healthy run: its
rollbacks per 1,000 calls are false alarms).

Primary metric (:data:`PRIMARY`, declared before the run): the final held-out loss.
Comparisons (:data:`COMPARISONS`), paired per seed: t-intervals, paired t-test p-values
(with 8 seeds the exact sign-flip floor is 2/256; times 12 comparisons it is above 0.05),
Holm over all of them together.

    python -m experiments.spike_recovery [--quick] [--steps 500] [--seeds 100 101] ...

Results go to ``runs/spike_recovery/`` (git-ignored); ``--commit-results`` writes the
committed ``experiments/results/spike_recovery/`` that docs/experiments.md's claims are
read from.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from experiments import cli, common, lm_spikes, plots, stats
from experiments.equal_compute import UNIFORM, Programs, run_controlled, run_scanned

FAILURE_ARMS = ("unguarded", "guards", "cosine", "rollback", "remedy")
BEST_ARMS = ("best_fixed_lr", "cosine_best_lr", "best_lr_rollback")
ARMS = FAILURE_ARMS + BEST_ARMS
CONTROLLED = ("rollback", "remedy", "best_lr_rollback")
#: The family, fixed before the run: (arm, base) pairs, each ``arm − base`` per seed.
COMPARISONS = (
    *((a, "unguarded") for a in ("guards", "cosine", "rollback", "remedy", "best_fixed_lr")),
    ("cosine_best_lr", "unguarded"),
    *((a, "best_fixed_lr") for a in ("rollback", "remedy", "cosine", "cosine_best_lr")),
    ("rollback", "cosine"),
    ("remedy", "cosine"),
)
#: The primary metric, declared before the run: lower is better.
PRIMARY = "final held-out loss (nats/byte; a non-finite one counts as ln 256)"
#: Where a run writes unless told ``--commit-results`` (git-ignored).
RUN_FOLDER = "runs/spike_recovery"


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 16
    lr: float = lm_spikes.FAILURE_LR
    b2: float = 0.999
    steps: int = 400
    seeds: tuple[int, ...] = tuple(range(100, 108))
    scan_lrs: tuple[float, ...] = (1e-4, 1e-3, 3e-3, 1e-2, 0.1, 1.0)
    scan_seeds: tuple[int, ...] = (0, 1, 2)
    save_every: int = 25
    margin: int = 25
    max_rollbacks: int = 10
    remedy_factor: float = 0.5
    spike_warmup: int = 50
    corpus_bytes: int = 1_000_000
    eval_batches: int = 16
    workdir: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "checkpoint folder of the controller arms, which must not exist yet "
            "(default: <out>/ckpt, emptied first and kept after the run)"
        },
    )

    @classmethod
    def quick(cls) -> Config:
        return cls(
            d_model=16, n_layers=1, n_heads=2, seq_len=16, batch_size=4, steps=40,
            seeds=(0, 1), scan_lrs=(1e-3, 1e-2, 1.0), save_every=5, margin=5, spike_warmup=5,
            corpus_bytes=200_000, eval_batches=2,
        )  # fmt: skip

    def task(self) -> lm_spikes.Task:
        names = ("d_model", "n_layers", "n_heads", "seq_len", "batch_size", "lr", "b2")
        names += ("corpus_bytes", "eval_batches")
        return lm_spikes.Task(**{k: getattr(self, k) for k in names})


def lr_scan(cfg: Config, progs: Programs) -> tuple[dict, list[dict]]:
    """Constant-LR runs at every ``scan_lrs`` x ``scan_seeds``; the LR grid of their seed-mean
    final held-out loss (a non-finite one counted as ln 256)."""
    pairs = [(lr, sd) for lr in cfg.scan_lrs for sd in cfg.scan_seeds]
    runs = run_scanned(progs, "plain", [sd for _, sd in pairs], [lr for lr, _ in pairs], cfg.steps)
    score = {lr: float(np.mean([primary(r) for r in runs if r["lr"] == lr])) for lr in cfg.scan_lrs}
    grid = stats.lr_grid(score)
    grid["seeds"] = len(cfg.scan_seeds)
    grid["arm"] = (
        f"unguarded constant LR, {len(cfg.scan_seeds)} seeds ({', '.join(map(str, cfg.scan_seeds))}"
        f", not the measured ones), {cfg.steps} steps, final held-out loss"
    )
    return grid, [{k: r[k] for k in ("lr", "seed", "final_heldout", "spikes")} for r in runs]


def primary(run: dict) -> float:
    v = run["final_heldout"]
    return float(v) if np.isfinite(v) else UNIFORM


def sweep(cfg: Config, progs: Programs, best_lr: float, workdir, bar) -> list[dict]:
    """Every arm on every measured seed; returns one row per run."""
    n, seeds = len(cfg.seeds), list(cfg.seeds)
    plan = {
        ("plain", cfg.lr): "unguarded",
        ("plain", best_lr): "best_fixed_lr",
        ("cosine", cfg.lr): "cosine",
        ("cosine", best_lr): "cosine_best_lr",
        ("guarded", cfg.lr): "guards",
    }
    runs = []
    for kind in ("plain", "cosine", "guarded"):
        pairs = [(lr, arm) for (k, lr), arm in plan.items() if k == kind]
        lrs = [lr for lr, _ in pairs for _ in seeds]
        got = run_scanned(progs, kind, seeds * len(pairs), lrs, cfg.steps)
        for j, r in enumerate(got):
            runs.append({"arm": pairs[j // n][1], "guard_skips": 0, **r})
        bar.update(len(got) * cfg.steps)
    for arm, lr in (("rollback", cfg.lr), ("remedy", cfg.lr), ("best_lr_rollback", best_lr)):
        for sd in seeds:
            ckpt = workdir / f"{arm}-{sd}"
            r = run_controlled(cfg, progs, sd, lr, ckpt, remedy=arm == "remedy")
            runs.append({"arm": arm, "guard_skips": 0, **r})
            bar.update(cfg.steps)
    return runs


def per_arm(cfg: Config, runs: list[dict]) -> dict[str, dict[str, list]]:
    """``equal_compute``: arm -> field -> one value per seed (seed order of ``cfg.seeds``)."""
    keys = ("final_heldout", "steps_executed", "rollbacks", "rollbacks_below_criterion")
    keys += ("diverged", "gave_up", "mean_train", "spikes", "rollback_rises", "final_lr")
    keys += ("guard_skips",)
    out = {}
    for arm in ARMS:
        rr = sorted((r for r in runs if r["arm"] == arm), key=lambda r: cfg.seeds.index(r["seed"]))
        out[arm] = {k: [r[k] for r in rr] for k in keys}
    return out


def summarize(cfg: Config, ec: dict, grid: dict, best_lr: float) -> dict:
    """The summary block: the family, the healthy rollback rate, the equal-compute record."""
    size = f"d{cfg.d_model}x{cfg.n_layers}"
    lr_of = {a: (best_lr if a in BEST_ARMS else cfg.lr) for a in ARMS}
    col = {
        a: [float(v) if np.isfinite(v) else UNIFORM for v in ec[a]["final_heldout"]] for a in ARMS
    }
    family = stats.family(
        PRIMARY,
        {
            f"{a} − {b} @ lr {lr_of[a]:g}, {size}": {"remedy": col[a], "base": col[b]}
            for a, b in COMPARISONS
        },
        test="paired_t",
    )
    healthy = ec["best_lr_rollback"]
    per_1000 = 1000 * sum(healthy["rollbacks"]) / max(1, sum(healthy["steps_executed"]))
    steps = [s for a in ARMS for s in ec[a]["steps_executed"]]
    spiked = sum(n > 0 for n in ec["unguarded"]["spikes"])
    mult = cfg.lr / best_lr
    task = (
        f"reference byte-level Transformer {size} (stabljax.reference.nn) on the embedded "
        f"corpus (stdlib .py bytes, last 10 % held out), Adam b2 {cfg.b2:g}, constant LR "
        f"{cfg.lr:g} ({mult:.3g}x the best fixed LR {best_lr:g}), no warmup, no clipping"
    )
    met = [k for k, r in family.items() if r["claim_met"]]
    return stats.summary(
        cfg,
        instability_reproduced=spiked * 2 >= len(cfg.seeds),
        failure_metric=(
            f"seeds whose unguarded training loss rises > {lm_spikes.SPIKE_NATS} nats above "
            f"the median of its previous {lm_spikes.SPIKE_WINDOW} steps, at least half"
        ),
        remedies=family,
        sizes=[size],
        note=f"{task}; {cfg.steps} train-step calls per arm; unguarded spiked on "
        f"{spiked}/{len(cfg.seeds)} seeds",
        primary_metric=PRIMARY,
        lr_grid=grid,
        failure_made_by_model=True,
        not_shown="" if met else "no comparison met its claim (interval below 0, Holm p < 0.05)",
    ) | {
        "task": task,
        "equal_compute": ec,
        "healthy_rollbacks_per_1000": per_1000,
        "steps_executed_spread": (max(steps) - min(steps)) / max(steps),
        "spike_criterion_nats": lm_spikes.SPIKE_NATS,
        "p_floor_sign_flip": stats.sign_flip_floor(len(cfg.seeds)),
        "lr_multiple_of_best": mult,
    }


def table(cfg: Config, s: dict) -> str:
    ec = s["equal_compute"]

    def mean(a, k):
        v = np.asarray(ec[a][k], float)
        return f"{np.mean(np.where(np.isfinite(v), v, UNIFORM)):.3f}"

    rows = [
        {
            "arm": a,
            "final held-out [95% t-CI]": common.fmt_interval(
                stats.interval([v if np.isfinite(v) else UNIFORM for v in ec[a]["final_heldout"]])
            ),
            "mean train (every call)": mean(a, "mean_train"),
            "calls": " ".join(sorted({str(n) for n in ec[a]["steps_executed"]})),
            "spikes per run": mean(a, "spikes"),
            "rollbacks per seed": " ".join(map(str, ec[a]["rollbacks"])),
            "below criterion": sum(ec[a]["rollbacks_below_criterion"]),
            "diverged": sum(ec[a]["diverged"]),
            "final LR (mean)": f"{np.mean(ec[a]['final_lr']):.3g}",
        }
        for a in ARMS
    ]
    return (
        reading(s)
        + "\n"
        + common.equal_compute_tables(cfg, s, rows, "Δ final held-out [95% t-CI]", PRIMARY)
    )


def reading(s: dict) -> str:
    """What the controller buys against each baseline, in words, from the summary's numbers
    (so a re-run rewrites it with its own)."""
    fam, ec, best = s["remedies"], s["equal_compute"], s["lr_grid"]["best_lr"]

    def eff(arm, base):
        (k,) = [k for k in fam if k.startswith(f"{arm} − {base} @ ")]
        r = fam[k]
        lo, hi = r["ci95"]
        word = "no different"
        if lo > 0 or hi < 0:
            side = "higher" if lo > 0 else "lower"
            word = side if r["p_holm"] < 0.05 else f"{side} before Holm, not after"
        return f"{arm} {common.fmt_ci(r)} (Holm p {r['p_holm']:.2g}: {word})"

    rb = [n for a in ("rollback", "remedy") for n in ec[a]["rollbacks"]]
    below = sum(n for a in ("rollback", "remedy") for n in ec[a]["rollbacks_below_criterion"])
    lines = [
        "**What the controller buys, at equal compute** (final held-out loss, arm − base):",
        f"- against `unguarded`: {eff('rollback', 'unguarded')}; {eff('remedy', 'unguarded')}.",
        f"- against `best_fixed_lr` (lr {best:g}, from the scan): "
        f"{eff('rollback', 'best_fixed_lr')}; {eff('remedy', 'best_fixed_lr')}.",
        f"- against `cosine` (the same LR decayed to 0): {eff('rollback', 'cosine')}; "
        f"{eff('remedy', 'cosine')}.",
        f"- rollbacks at the failure LR: {sum(rb)} over {len(rb)} runs, {below} of them below the "
        f"{s['spike_criterion_nats']:g}-nat spike criterion; on the healthy best-LR run "
        f"{s['healthy_rollbacks_per_1000']:.3g} per 1,000 calls.",
        "",
        "A fixed LR is not known in advance; where a scan finds one, compare with it first. "
        "The controller is for the runs where it is not found (a spike becomes a restart from "
        "a checkpoint, with a lower LR under `remedy`, instead of a lost run) and for bad data "
        "(a window of batches it skips); neither is a fixed LR's job, and neither makes a "
        "too-high LR as good as the right one.",
    ]
    return "\n".join(lines) + "\n"


def output_argv(argv, folder: str = RUN_FOLDER) -> list[str]:
    """``argv`` with the results folder made explicit: ``--out`` if given, else the committed
    folder with ``--commit-results``, else ``folder`` (:data:`RUN_FOLDER`, git-ignored)."""
    argv = list(argv)
    commit = "--commit-results" in argv
    argv = [a for a in argv if a != "--commit-results"]
    if not commit and not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv = [*argv, "--out", folder]
    return argv


def main(argv=None) -> dict:
    argv = output_argv(sys.argv[1:] if argv is None else argv)
    doc = __doc__ + "\n--commit-results: write experiments/results/spike_recovery/ instead."
    ex = cli.start(Config, argv, doc, name="spike_recovery")
    cfg, out = ex.cfg, ex.out
    workdir = cli.fresh_workdir(cfg.workdir, out, name="spike_recovery")
    progs = Programs(cfg)
    grid, scan_rows = lr_scan(cfg, progs)
    best_lr = grid["best_lr"]
    runs = ex.sweep(len(ARMS) * len(cfg.seeds) * cfg.steps,
                    lambda bar: sweep(cfg, progs, best_lr, workdir, bar))  # fmt: skip
    ec = per_arm(cfg, runs)
    summary = summarize(cfg, ec, grid, best_lr)
    res = {"equal_compute": ec, "scan": scan_rows, "runs": runs}
    res["healthy_rollbacks_per_1000"] = summary["healthy_rollbacks_per_1000"]
    top = {k: summary[k] for k in ("equal_compute", "healthy_rollbacks_per_1000", "task")}
    ex.write(
        res, table=table(cfg, summary), title="Spike recovery (main job)", summary=summary, top=top
    )
    pad = lambda x: np.pad(np.asarray(x, float), (0, cfg.steps - len(x)), constant_values=np.nan)  # noqa: E731
    curves = {a: np.array([pad(r["losses"]) for r in runs if r["arm"] == a]) for a in ARMS}
    plots.curves(
        {"every executed call": curves},
        path=out / "loss.png",
        xlabel="train-step call",
        ylabel="training loss (nats/byte)",
        logy=True,
    )
    plots.effects(
        summary["remedies"],
        path=out / "effects.png",
        title=f"arm − base, {len(cfg.seeds)} seeds (paired t 95% CI, Holm)",
    )
    print(f"checkpoints of the controller arms: {workdir}")
    print(f"wall {ex.elapsed():.0f}s -> {out}")
    return res


if __name__ == "__main__":
    main()
