"""The experiment claims the docs make, derived from every results.json.

A comparison is a **stress test**, never counted as met, when it lies more than
``STRESS_MULTIPLE`` (10) times above its base arm's best LR, or when its failure was set by
hand. Every claim names its LR multiple and size. Beside the matched-LR claims, each
experiment reports every arm's best loss at its own best LR (:func:`best_block`, from the
per-LR, per-seed rows already stored), and from the two the verdict a practitioner wants:
does a remedy lower the best reachable loss, or only widen the stable LR range.
:mod:`experiments.summary_table` writes the result into experiments/README.md and
docs/experiments.md; ``tests/test_claims.py`` checks their sentences against the files.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Sequence
from typing import Any

from experiments import stats
from experiments.common import RESULTS, jsonable
from experiments.holm_family import one_family, seeds_note

ORDER = (
    "spike_recovery",
    "lr_robust",
    "adam_eps",
    "lr_sensitivity",
    "warmup",
    "clipping",
    "precision",
    "init_schemes",
)
#: Above this multiple of the base's best LR a comparison is a stress test (issue 39).
STRESS_MULTIPLE = 10.0
#: Per experiment: the rows' arm field, the base arm, the loss field, a group field (one
#: best-loss comparison per value) and a row filter: for :func:`best_block`.
ARMS: dict[str, dict[str, Any]] = {
    "adam_eps": {
        "arm": "arm",
        "base": "adamw_eps1e-8",
        "key": "final_loss",
        "match": {"condition": "x1"},
    },
    "precision": {"arm": "arm", "base": "fp16-noscale", "key": "final_loss"},
    "warmup": {
        "arm": "warmup",
        "base": 0.0,
        "key": "final_loss",
        "label": lambda w: "no warmup" if float(w) == 0 else f"warmup {float(w):g}",
    },
    "clipping": {"arm": "arm", "base": "none", "key": "final_loss"},
    "init_schemes": {"arm": "arm", "base": "fixed:0.02", "key": "final_loss"},
    "qk_clip": {"arm": "arm", "base": "none", "key": "final_loss", "group": "optimizer"},
    "lr_sensitivity": {"arm": "arm", "base": "base", "key": "final_loss", "group": "size"},
}


# --------------------------------------------------------------------------- the best loss
# per arm at its own best LR (issue 39): what a practitioner who tunes the LR gets.


def best_per_arm(
    rows: Sequence[dict[str, Any]],
    *,
    arm: str,
    base: Any,
    seeds: Sequence[int],
    key: str = "final_loss",
    **match: Any,
) -> dict[str, dict[str, Any]]:
    """Each arm's best LR (lowest seed mean of ``key``, a non-finite value counted as the
    row's ``init_loss``) over the LRs it was run at, its loss there per seed with a 95 %
    t-interval, and, for every arm but ``base``, the paired difference of the two best
    losses (arm at its best LR − ``base`` at its own), per seed.

    The rows with ``row[arm]`` equal to each arm value (and fields equal to ``match``).
    Descriptive, not a claim: the best LR is chosen on the same seeds, which biases both
    best losses down alike; read an interval below 0 as "lowers the best reachable loss",
    one that includes 0 as "does not (at this size)".

    Example:
      >>> rows = [
      ...     {"arm": a, "lr": lr, "seed": s, "final_loss": v + s, "init_loss": 9.0}
      ...     for a, vals in {"b": (3.0, 2.0), "r": (2.5, 2.1)}.items()
      ...     for lr, v in zip((0.1, 1.0), vals)
      ...     for s in (0, 1, 2)
      ... ]
      >>> out = best_per_arm(rows, arm="arm", base="b", seeds=(0, 1, 2))
      >>> out["b"]["best_lr"], out["r"]["best_lr"], round(out["r"]["vs_base"]["effect_mean"], 3)
      (1.0, 1.0, 0.1)
    """
    sub = [r for r in rows if all(r[k] == v for k, v in match.items())]
    arms = list(dict.fromkeys(r[arm] for r in sub))
    if base not in arms:
        raise ValueError(f"base arm {base!r} has no rows; arms: {arms}")
    out: dict[str, dict[str, Any]] = {}
    for a in arms:
        grid = stats.grid_of(sub, key, **{arm: a})
        best = grid["best_lr"]
        values = stats.final_per_seed(sub, seeds, key, **{arm: a, "lr": best})
        out[str(a)] = {
            "best_lr": best,
            "lrs": grid["lrs"],
            "best_loss": stats.interval(values),
            "per_seed": values,
        }
    base_seeds = out[str(base)]["per_seed"]
    for a, entry in out.items():
        if a != str(base):
            entry["vs_base"] = stats.paired_effect(
                entry["per_seed"], base_seeds, f"best {key} − base's"
            )
    return out


def num(x) -> str:
    return f"{float(x):+.3g}" if isinstance(x, int | float) else str(x)


def p_text(x) -> str:
    if x is None:
        return "—"
    x = float(x)
    return "nan" if x != x else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def summaries(results: pathlib.Path) -> list[tuple[str, dict | None]]:
    names = [n for n in ORDER if (results / n / "results.json").exists()]
    names += sorted(
        p.parent.name
        for p in results.glob("*/results.json")
        if p.parent.name not in ORDER and p.parent.name != "bench"
    )
    return [
        (n, json.loads((results / n / "results.json").read_text()).get("summary")) for n in names
    ]


def payloads(results: pathlib.Path) -> list[tuple[str, dict]]:
    return [
        (n, json.loads((results / n / "results.json").read_text()))
        for n, s in summaries(results)
        if s is not None
    ]


def best_block(name: str, payload: dict) -> dict | None:
    """``{group: stats.best_per_arm(...)}`` of one experiment from its stored per-LR,
    per-seed rows (``ARMS[name]`` says which field is the arm, which arm the base); None
    for an experiment without a spec or rows. Group ``""`` when the experiment has one."""
    spec = ARMS.get(name)
    rows = payload.get("results", {}).get("rows")
    if spec is None or not rows:
        return None
    numeric = (spec["key"], "init_loss")  # JSON stores a non-finite float as "nan"/"inf"
    rows = [r | {k: float(r[k]) for k in numeric if isinstance(r[k], str)} for r in rows]
    seeds = payload["summary"].get("seed_ids") or sorted({r["seed"] for r in rows})
    group = spec.get("group")
    out = {}
    for g in dict.fromkeys(r[group] for r in rows) if group else [""]:
        match = dict(spec.get("match", {}), **({group: g} if group else {}))
        per_arm = best_per_arm(
            rows, arm=spec["arm"], base=spec["base"], seeds=seeds, key=spec["key"], **match
        )
        label = spec.get("label", str)
        out[str(g)] = {label(a): v for a, v in per_arm.items()}
    fails = [
        r
        for r in rows
        if r[spec["arm"]] == spec["base"]
        and "failed" in r
        and all(r[k] == v for k, v in spec.get("match", {}).items())
    ]
    if fails:
        for g, arms in out.items():
            b = arms[spec.get("label", str)(spec["base"])]
            near = [
                r
                for r in fails
                if (not group or str(r[group]) == g)
                and b["best_lr"] * (1 - 1e-9)
                <= r["lr"]
                <= STRESS_MULTIPLE * b["best_lr"] * (1 + 1e-9)
            ]
            b["failed_runs_1_to_10x_best"] = [sum(bool(r["failed"]) for r in near), len(near)]
    return out


def rederive(results: pathlib.Path = RESULTS) -> list[tuple[str, pathlib.Path]]:
    """Adds ``summary["best_per_arm"]`` (:func:`best_block`) to every results.json with a
    spec in ``ARMS``, from the rows already stored there, and applies Holm over the claims
    and the best-loss comparisons together (:func:`~experiments.holm_family.one_family`);
    the rest of the file is unchanged (same writer format as
    :func:`experiments.common.write_results`)."""
    done = []
    for name, payload in payloads(results):
        block = best_block(name, payload)
        one_family(payload["summary"], block)
        if block is not None:
            payload["summary"]["best_per_arm"] = jsonable(block)
        path = results / name / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
        done.append((name, path))
    return done


def lr_of(comparison: str) -> float | None:
    """The LR a comparison's name states (``"... @ lr 0.3 ..."``), or None (a grid-wide one)."""
    m = re.search(r"@ lr ([0-9.]+(?:e-?[0-9]+)?)", comparison)
    return float(m.group(1)) if m else None


def regime(name: str, comparison: str, summary: dict, best: dict | None) -> dict:
    """Where a comparison sits: its LR, the base's best LR and their ratio, and whether it
    is a stress test (> 10x the best LR, or a failure set by hand: never counted as met)."""
    lr = lr_of(comparison)
    by_hand = "set by hand" in comparison or summary.get("failure_made_by_model") is False
    base_lr = None
    if best:
        group = next((g for g in best if g and comparison.startswith(g + " ")), "")
        arms = best.get(group) or next(iter(best.values()))
        base_lr = arms[ARMS[name].get("label", str)(ARMS[name]["base"])]["best_lr"]
    elif isinstance(summary.get("lr_grid"), dict) and "best_lr" in summary["lr_grid"]:
        base_lr = summary["lr_grid"]["best_lr"]
    named = re.search(r"\(([0-9.]+)x best\)", comparison)
    mult = None
    if lr is not None and named:
        mult = float(named.group(1))
    elif lr is not None and base_lr:
        mult = lr / base_lr
    stress = by_hand or (mult is not None and mult > STRESS_MULTIPLE * (1 + 1e-6))
    return {"lr": lr, "base_best_lr": base_lr, "multiple": mult, "stress": stress}


def effect_text(r: dict) -> str:
    return f"{num(r['effect_mean'])} [{num(r['ci95'][0])}, {num(r['ci95'][1])}]"


def where_text(comparison: str, reg: dict, sizes: list) -> str:
    """The comparison's name, with its LR multiple and size added where it lacks them."""
    text = comparison
    if reg["multiple"] is not None and "x best" not in text:
        text += f" ({reg['multiple']:.3g}x best)"
    if sizes and not any(str(z) in text for z in sizes):
        text += f", {', '.join(map(str, sizes))}"
    return text


def verdicts(name: str, summary: dict, best: dict | None) -> dict[str, str]:
    """Per remedy arm: ``"lowers the best loss"`` (its best loss at its own best LR below
    the base's, paired interval below 0), ``"widens the stable LR range only"`` (a
    comparison met at <= 10x the best LR, best loss not lower), or ``"neither shown"``."""
    if not best:
        return {}
    out = {}
    for group, arms in best.items():
        for arm, entry in arms.items():
            if "vs_base" not in entry:
                continue
            key = f"{group} {arm}".strip()
            met = [
                k
                for k, r in summary["remedies"].items()
                if r.get("claim_met")
                and not regime(name, k, summary, best)["stress"]
                and arm_in(k, arm)
                and (not group or k.startswith(group + " ") or group in k)
            ]
            vs = entry["vs_base"]
            if stats.below_zero(vs) and vs.get("p_holm", 1.0) < stats.ALPHA:
                out[key] = "lowers the best loss"
            elif met:
                out[key] = "widens the stable LR range only"
            else:
                out[key] = "neither shown"
    return out


def arm_in(comparison: str, arm: str) -> bool:
    return re.search(rf"(^|\s){re.escape(arm)}(\s|$)", comparison.split(" @ ")[0]) is not None


def claims(results: pathlib.Path = RESULTS) -> str:
    """The claims of docs/experiments.md, one line per experiment, from the results.json files.

    Each line names the size, the seeds and where the failure comes from, then: the
    comparisons met at <= 10x the base's best LR (effect, interval, Holm p, LR multiple);
    the stress tests, met but not counted (> 10x the best LR, or a failure set by hand);
    each arm's best loss at its own best LR against the base's (paired per seed,
    descriptive); and which remedies lower the best loss and which only widen the
    stable LR range.
    """
    out = []
    for name, payload in payloads(results):
        s = payload["summary"]
        best = best_block(name, payload) or s.get("best_per_arm")
        one_family(s, best)  # in memory: one Holm family over claims and verdicts
        where = f"{', '.join(map(str, s['sizes']))}, {s['seeds']} seeds"
        made = s.get("failure_made_by_model")
        kind = {True: "failure made by the model", False: "failure set by hand"}.get(
            made, "failure source not recorded"
        )
        note = seeds_note(s)
        head = f"- **{name}** ({where}; {kind}{note})"
        met, stress, grid_wide = [], [], []
        for k, r in s["remedies"].items():
            if not r.get("claim_met"):
                continue
            reg = regime(name, k, s, best)
            text = f"{where_text(k, reg, s['sizes'])}: {effect_text(r)}"
            if r.get("p_holm") is not None:
                text += f", Holm p {p_text(r['p_holm'])}"
            if reg["stress"]:
                stress.append(text)
            else:
                (met if reg["lr"] is not None else grid_wide).append(text)
        metric = next(iter(s["remedies"].values()))["metric"] if s["remedies"] else ""
        if met:
            line = f"{head}, {metric}. Met at <= 10x the best LR: " + "; ".join(met) + "."
        elif grid_wide:
            line = f"{head}, {metric}."
        else:
            why = s.get("not_shown") or s.get("note") or "no comparison met its claim"
            line = f"{head}: nothing met at <= 10x the best LR. {why.rstrip('.')}."
        if grid_wide:
            lrs = sorted(
                {lr for arms in (best or {}).values() for e in arms.values() for lr in e["lrs"]}
            )
            span = f" (LRs {lrs[0]:g}..{lrs[-1]:g})" if lrs else ""
            line += f" Met over the whole LR grid{span}: " + "; ".join(grid_wide) + "."
        if stress:
            line += " Stress tests (not counted): " + "; ".join(stress) + "."
        if best:
            line += " " + best_text(best, ARMS[name]["base"], ARMS[name].get("label", str))
            v = verdicts(name, s, best)
            if v:
                kinds = {}
                for arm, verdict in v.items():
                    kinds.setdefault(verdict, []).append(arm)
                line += (
                    " Verdict: " + "; ".join(f"{', '.join(a)}: {k}" for k, a in kinds.items()) + "."
                )
        out.append(line)
    return "\n".join(out) + "\n"


def best_text(best: dict, base: Any, label) -> str:
    parts, fails = [], []
    for group, arms in best.items():
        b = arms[label(base)]
        one = [f"{label(base)} {b['best_loss']['mean']:.3f} @ lr {b['best_lr']:g}"]
        for arm, e in arms.items():
            if "vs_base" in e:
                one.append(
                    f"{arm} {effect_text(e['vs_base'])} @ lr {e['best_lr']:g}"
                    f" (Holm p {p_text(e['vs_base'].get('p_holm'))})"
                )
        parts.append((f"{group}: " if group else "") + ", ".join(one))
        if "failed_runs_1_to_10x_best" in b:
            k, n = b["failed_runs_1_to_10x_best"]
            fails.append(f"{group + ' ' if group else ''}{label(base)} {k}/{n}")
    text = (
        "Best loss at each arm's own best LR (remedy − base, paired per seed; Holm over one "
        "family with the claims): " + "; ".join(parts) + "."
    )
    if fails:
        text += " Base runs failed at 1-10x its best LR: " + ", ".join(fails) + "."
    return text
