"""One Holm family per experiment, and how many seeds a best LR rests on.

Issue 50: an experiment's claims (``summary["remedies"]``, matched-LR comparisons) and its
verdicts (``summary["best_per_arm"]``, each arm's best loss at its own best LR against the
base's) are tested together, so Holm's correction runs over all of them at once
(:func:`one_family`); a verdict that passed in a family of its own but not in the whole one
is not shown. Each comparison's p is its ``p_test`` where the experiment chose a test
(:func:`experiments.stats.family`), else its exact sign-flip p, whose floor with ``n``
seeds is ``2 / 2**n`` (:func:`experiments.stats.sign_flip_floor`).
"""

from __future__ import annotations

import re
from typing import Any

from experiments import stats

#: A best LR must come from at least this many seeds (issue 39).
MIN_BEST_LR_SEEDS = 3


def members(summary: dict, best: dict | None) -> list[tuple[str, dict]]:
    """``(name, comparison)`` of every claim and every best-loss comparison, in a fixed
    order: the claims as stored, then the best-loss comparisons by group and arm."""
    out = [(f"claim: {k}", r) for k, r in summary.get("remedies", {}).items()]
    for group, arms in (best or {}).items():
        for arm, e in arms.items():
            if "vs_base" in e:
                out.append((f"best loss: {group} {arm}".replace("  ", " "), e["vs_base"]))
    return out


def p_of(comparison: dict) -> float:
    """The p a comparison enters Holm with: its ``p_test``, else its sign-flip p."""
    return float(comparison.get("p_test", comparison["p_sign_flip"]))


def one_family(summary: dict, best: dict | None, *, alpha: float = stats.ALPHA) -> list[str]:
    """Holm over every claim and every best-loss comparison of one experiment, in place.

    Sets each comparison's ``p_holm``, each claim's ``claim_met`` (interval below 0, Holm
    p below ``alpha``, mechanism not contradicted: :func:`experiments.stats.family`'s
    rule), and the summary's ``family_size`` and ``holm_family`` (the members' names);
    returns the names. Idempotent: the input p-values are never the adjusted ones.

    Example:
      >>> s = {"remedies": {"a": {"p_sign_flip": 0.01, "ci95": [-2, -1]}}}
      >>> best = {"": {"b": {"vs_base": {"p_sign_flip": 0.02, "ci95": [-1, 1]}}}}
      >>> one_family(s, best), s["remedies"]["a"]["p_holm"], s["remedies"]["a"]["claim_met"]
      (['claim: a', 'best loss: b'], 0.02, True)
    """
    found = members(summary, best)
    for (_, c), p in zip(found, stats.holm([p_of(c) for _, c in found]), strict=True):
        c["p_holm"] = p
    for r in summary.get("remedies", {}).values():
        moved = r.get("mechanism_moved")
        r["claim_met"] = bool(stats.below_zero(r) and r["p_holm"] < alpha and moved is not False)
    summary["family_size"] = len(found)
    summary["holm_family"] = [n for n, _ in found]
    return summary["holm_family"]


def grid_seeds(grid: dict) -> int | None:
    """How many seeds one LR-grid record's best LR rests on: its ``seeds`` field, else
    what its ``arm`` text says (``"5 seeds"`` -> 5, ``"seed 100"`` -> 1, ``"seeds 0, 1, 2"``
    -> 3), else None (not recorded).

    Example:
      >>> [grid_seeds({"arm": a}) for a in ("x, 5 seeds", "x, seed 100, 9 steps", "seeds 0 1")]
      [5, 1, 2]
    """
    if isinstance(grid.get("seeds"), int):
        return int(grid["seeds"])
    text = str(grid.get("arm", ""))
    if m := re.search(r"(\d+)\s+seeds?\b", text):
        return int(m.group(1))
    # a list of seed ids: numbers after "seeds", up to one followed by a word ("600 steps")
    if m := re.search(r"\bseeds\s+(\d+(?:(?:,\s*|\s+)\d+(?![\d.]|\s+[A-Za-z]))*)", text):
        return len(re.findall(r"\d+", m.group(1)))
    if re.search(r"\bseed\s+\d+", text):
        return 1
    return None


def seeds_note(s: dict) -> str:
    """``"; best LR from n seed(s), below the 3 required"`` when any LR-grid record of the
    summary (nested ones too) rests on fewer than :data:`MIN_BEST_LR_SEEDS` seeds."""
    counts = [grid_seeds(g) for g in grid_records(s.get("lr_grid"))]
    low = [n for n in counts if n is not None and n < MIN_BEST_LR_SEEDS]
    if low:
        return f"; best LR from {min(low)} seed(s), below the {MIN_BEST_LR_SEEDS} required"
    return ""


def grid_records(g: Any) -> list[dict]:
    """The LR-grid records (dicts with ``best_lr``) in a summary's ``lr_grid``, nested too."""
    if isinstance(g, dict) and "best_lr" in g:
        return [g]
    if isinstance(g, dict):
        return [r for v in g.values() for r in grid_records(v)]
    return []
