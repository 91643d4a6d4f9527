"""Smoke runs of every experiment in --quick mode, and the statistics behind the claims.

Each quick run must write its JSON (with the issue-17 ``summary``, the command, the wall
time and the versions), its table and its figures; the numbers asserted are the ones the
experiment's claims are built from.
"""

import json
import math
import pathlib

import numpy as np
import pytest

from experiments import plots, stats, summary_table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_per_seed_sums_the_matching_rows_in_seed_order():
    rows = [
        {"arm": "a", "lr": 1, "seed": 1, "bursts": 2},
        {"arm": "a", "lr": 2, "seed": 1, "bursts": 3},
        {"arm": "a", "lr": 1, "seed": 0, "bursts": 7},
        {"arm": "b", "lr": 1, "seed": 0, "bursts": 100},
    ]
    assert stats.per_seed(rows, "bursts", [1, 0], arm="a") == [5.0, 7.0]
    assert stats.per_seed(rows, "bursts", [0, 1], arm="a", lr=1) == [7.0, 2.0]
    assert stats.per_seed(rows, "bursts", [0, 2], arm="b") == [100.0, 0.0]  # no rows: 0


def test_paired_effect_and_grid_of_rows():
    e = stats.paired_effect([1.0, 2.0, 3.0], [2.0, 3.0, 4.5], "loss")
    assert e["per_seed"] == [-1.0, -1.0, -1.5] and e["effect_mean"] == pytest.approx(-7 / 6)
    assert stats.below_zero(e)
    with pytest.raises(ValueError, match="one length"):
        stats.paired_effect([1.0], [1.0, 2.0], "loss")
    rows = [
        {"arm": "a", "lr": lr, "seed": sd, "final_loss": v, "init_loss": 5.5}
        for lr, vs in ((1e-4, (3.0, 3.2)), (1e-2, (2.0, 2.2)), (1.0, (float("nan"), 4.5)))
        for sd, v in enumerate(vs)
    ] + [{"arm": "b", "lr": 1e-2, "seed": 0, "final_loss": 9.0, "init_loss": 5.5}]
    g = stats.grid_of(rows, arm="a")
    assert g["lrs"] == [1e-4, 1e-2, 1.0] and g["score"] == pytest.approx([3.1, 2.1, 5.0])
    assert g["best_lr"] == 1e-2 and g["best_strictly_inside"] and g["spans_1e-4_to_1"]


def test_burst_count_and_failure():
    # Running minima 4, 2, 2, 2, 1.5: bursts where the loss is above 1.5x that.
    assert stats.burst_count([4.0, 2.0, 3.5, 2.9, 1.5]) == 1
    assert stats.burst_count([3.0, 2.0, float("nan"), 1.0]) == 2  # NaN: every step from it
    assert stats.burst_count([]) == 0
    with pytest.raises(ValueError, match="factor"):
        stats.burst_count([1.0], factor=1.0)
    assert stats.failed(5.6, 5.5) and stats.failed(float("nan"), 5.5)
    assert not stats.failed(3.0, 5.5)


def test_lr_sensitivity_formula():
    # mean(min(loss, init)) - best: [2, 3, nan->5, 7->5] with init 5 -> mean 3.75 - 2.
    assert stats.lr_sensitivity([2.0, 3.0, float("nan"), 7.0], 5.0) == pytest.approx(1.75)


def test_steps_lost():
    losses = [3.0, 2.9, 2.8, 6.0, 4.0, 2.9, 2.7, 2.6]
    assert stats.steps_lost(losses, [3]) == 3  # back to <= 2.8 at step 6
    assert stats.steps_lost(losses, []) == 0
    assert stats.steps_lost([2.0, 5.0, 4.0], [1]) == 2  # never recovers: to the end


def test_trainer_vmapped_runs_match_single_runs():
    from experiments import proxy
    from experiments.trainer import Trainer

    s = proxy.SweepConfig.quick().setup()
    t = Trainer(s)
    both = t.run_many([{"seed": 0, "learning_rate": 1e-2}, {"seed": 1, "learning_rate": 0.1}])
    one = t.run_many([{"seed": 1, "learning_rate": 0.1}])
    np.testing.assert_allclose(both.eval_loss[1], one.eval_loss[0], rtol=1e-5)
    np.testing.assert_allclose(both.metrics["loss"][1], one.metrics["loss"][0], rtol=1e-5)
    assert both.metrics["loss"].shape == (2, s.steps)
    # The held-out loss at init against a float64 numpy cross-entropy of the same logits.
    import stabljax

    model, params = proxy.initial_model(proxy.dataclasses.replace(s, seed=0))
    apply_fn, _ = stabljax.nnx_apply(model)
    held = proxy.corpus_batches(proxy.dataclasses.replace(s, seed=0), seed_offset=1)
    ces = []
    for i in range(s.eval_batches):
        b = held(i)
        z = np.asarray(apply_fn(params, b["inputs"]), np.float64)
        logp = z - z.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        ces.append(-np.take_along_axis(logp, b["targets"][..., None], -1).mean())
    assert both.init_loss[0] == pytest.approx(np.mean(ces), rel=1e-5)
    with pytest.raises(ValueError, match="same hyperparameters"):
        t.run_many([{"seed": 0, "learning_rate": 1e-2}, {"seed": 1}])


def test_help_lists_every_field(capsys):
    import dataclasses

    from experiments import warmup

    with pytest.raises(SystemExit):
        warmup.main(["--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(warmup.Config):
        assert "--" + f.name.replace("_", "-") in text


def test_readme_table_matches_results():
    text = summary_table.README.read_text()
    assert summary_table.render(text, summary_table.table()) == text, (
        "run python -m experiments.summary_table"
    )
    top = summary_table.CLAIMS_PAGE.read_text()
    assert summary_table.render(top, summary_table.claims(), summary_table.CLAIMS) == top, (
        "run python -m experiments.summary_table"
    )
    assert summary_table.main(["--check"]) == 0


def test_no_experiment_module_over_400_lines():
    for p in (ROOT / "experiments").glob("*.py"):
        assert len(p.read_text().splitlines()) <= 400, p


# --------------------------------------------------------------------------- issue 29's statistics


@pytest.mark.parametrize(
    "df, q975",  # Student's t table (e.g. NIST/SEMATECH e-Handbook, Table 1.3.6.7.2)
    [(1, 12.706205), (2, 4.302653), (4, 2.776445), (9, 2.262157), (29, 2.045230), (100, 1.983972)],
)
def test_t_quantile_matches_the_table(df, q975):
    assert stats.t_quantile(0.975, df) == pytest.approx(q975, abs=2e-6)
    assert stats.t_quantile(0.025, df) == pytest.approx(-q975, abs=2e-6)
    assert stats.t_cdf(stats.t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-10)


def test_t_interval_hand_computed():
    # mean 2, n 4, df 3: 2 ± 3.182446 · sd / 2
    lo, hi = stats.t_interval([1.0, 2.0, 2.0, 3.0])
    sd = np.std([1.0, 2.0, 2.0, 3.0], ddof=1)
    half = 3.182446 * sd / 2
    assert (lo, hi) == (pytest.approx(2 - half, abs=1e-5), pytest.approx(2 + half, abs=1e-5))
    assert all(math.isnan(v) for v in stats.t_interval([1.0]))
    assert all(math.isnan(v) for v in stats.t_interval([1.0, float("inf")]))


def test_sign_flip_p_is_exact():
    assert stats.sign_flip_p([1.0, 2.0, 3.0]) == 2 / 8  # only all-+ and all-− reach |6|
    assert stats.sign_flip_p([1.0, -1.0]) == 1.0
    assert stats.sign_flip_p([-0.5] * 10) == 2 / 1024  # the floor with ten seeds
    # [3, 1, 1]: |sums| are 5, 3, 3, 1, 1, 3, 3, 5 -> two of eight reach 5
    assert stats.sign_flip_p([3.0, 1.0, 1.0]) == 2 / 8
    assert stats.sign_flip_p([3.0, 1.0, -1.0]) == 6 / 8  # |sums| 3, 5, 1, 3 (twice): six >= 3
    assert math.isnan(stats.sign_flip_p([1.0, float("nan")]))
    with pytest.raises(ValueError):
        stats.sign_flip_p(np.ones(21))


def test_holm_hand_computed():
    assert stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert stats.holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    adj = stats.holm([0.02, float("nan"), 0.4])  # NaN counts in m
    assert adj[0] == pytest.approx(0.06) and math.isnan(adj[1]) and adj[2] == pytest.approx(0.8)


def test_paired_effect_with_a_t_interval():
    e = stats.paired_effect([1.0, 2.0, 3.0], [2.0, 3.0, 4.5], "loss")
    assert e["effect_mean"] == pytest.approx(-7 / 6) and e["interval"] == "paired t"
    assert e["p_sign_flip"] == 0.25 and e["ci95"][1] < 0


def test_family_applies_t_intervals_sign_flip_and_holm():
    # Hand-computed: differences [-1]*10 -> t-interval (-1, -1), sign-flip p = 2/1024;
    # differences [1, -1, ...] -> mean 0, p = 1. Holm over m=2: min(1, 2*p) first.
    ten = [0.0] * 10
    fam = stats.family(
        "loss",
        {
            "a": {"remedy": [-1.0] * 10, "base": ten},
            "b": {"remedy": [1.0, -1.0] * 5, "base": ten},
            "c": {
                "remedy": [-1.0] * 10,
                "base": ten,
                "mechanism": {"remedy": ten, "base": ten, "metric": "m", "direction": -1},
            },
        },
    )
    assert fam["a"]["p_sign_flip"] == pytest.approx(2 / 1024)
    assert fam["a"]["p_holm"] == pytest.approx(3 * 2 / 1024)
    assert fam["c"]["p_holm"] == pytest.approx(3 * 2 / 1024)  # ties: the running max
    assert fam["b"]["p_holm"] == pytest.approx(1.0)
    assert fam["a"]["claim_met"] and fam["a"]["mechanism_moved"] is None
    assert not fam["b"]["claim_met"]
    assert fam["c"]["mechanism_moved"] is False and not fam["c"]["claim_met"]
    # Five seeds can never pass: p >= 2/32 = 0.0625.
    five = stats.family("loss", {"x": {"remedy": [-1.0] * 5, "base": [0.0] * 5}})
    assert five["x"]["p_holm"] == pytest.approx(0.0625) and not five["x"]["claim_met"]
    with pytest.raises(ValueError, match="direction"):
        stats.family(
            "l",
            {
                "x": {
                    "remedy": [1.0, 2],
                    "base": [0, 0],
                    "mechanism": {"remedy": [1, 2], "base": [0, 0], "metric": "m", "direction": 0},
                }
            },
        )


def test_lr_grid_records_the_best_lr_and_the_span():
    g = stats.lr_grid({1e-4: 3.0, 1e-3: 2.0, 1e-2: 1.5, 1e-1: 2.5, 1.0: 5.5})
    assert g["best_lr"] == 1e-2 and g["best_strictly_inside"] and g["spans_1e-4_to_1"]
    edge = stats.lr_grid({1e-3: 3.0, 1e-2: 1.0})
    assert edge["best_lr"] == 1e-2 and not edge["best_strictly_inside"]
    assert not edge["spans_1e-4_to_1"]
    with pytest.raises(ValueError, match="finite"):
        stats.lr_grid({1e-3: float("nan")})
    assert stats.finite_or([1.0, float("nan")], [5.0, 5.5]) == [1.0, 5.5]


def test_summary_with_a_primary_metric_requires_holm_and_the_grid():
    class Cfg:
        seeds = list(range(10))
        d_model, n_layers = 32, 2

    fam = stats.family("loss", {"a": {"remedy": [-1.0] * 10, "base": [0.0] * 10}})
    grid = stats.lr_grid({1e-4: 2.0, 1e-2: 1.0, 1.0: 5.0})
    s = stats.summary(
        Cfg,
        instability_reproduced=True,
        failure_metric="f",
        remedies=fam,
        primary_metric="loss",
        lr_grid=grid,
        failure_made_by_model=True,
    )
    assert s["seed_ids"] == list(range(10)) and s["family_size"] == 1
    assert s["interval"].startswith("paired t") and "Holm" in s["p_values"]
    with pytest.raises(ValueError, match="Holm"):
        stats.summary(
            Cfg,
            instability_reproduced=True,
            failure_metric="f",
            remedies={"a": {"claim_met": True}},
            primary_metric="loss",
            lr_grid=grid,
            failure_made_by_model=True,
        )
    with pytest.raises(ValueError, match="lr_grid"):
        stats.summary(
            Cfg,
            instability_reproduced=True,
            failure_metric="f",
            remedies=fam,
            primary_metric="loss",
        )


def test_effects_and_metric_vs_lr_figures_are_written(tmp_path):
    fam = stats.family("loss", {"a @ lr 0.1": {"remedy": [-1.0, -2.0], "base": [0.0, 0.0]}})
    plots.effects(fam, path=tmp_path / "e.png", title="t")
    rows = [
        {"lr": lr, "seed": sd, "arm": a, "final_loss": v, "init_loss": 5.5}
        for lr in (1e-3, 1e-2)
        for sd in (0, 1)
        for a, v in (("x", 2.0 + sd), ("y", float("nan")))
    ]
    plots.metric_vs_lr(
        rows,
        y="final_loss",
        group="arm",
        path=tmp_path / "m.png",
        title="t",
        ylabel="loss",
        fallback="init_loss",
    )
    assert (tmp_path / "e.png").stat().st_size > 0 and (tmp_path / "m.png").stat().st_size > 0


def _grid_records(g):
    if isinstance(g, dict) and "best_lr" in g:
        yield g
    elif isinstance(g, dict):
        for v in g.values():
            yield from _grid_records(v)


def test_committed_results_follow_issue_29():
    """Every committed results.json: >= 10 seeds (spike_recovery >= 5), a primary metric,
    t-intervals, Holm p re-derived here from the stored per-seed differences, LR grids over
    1e-4..1 with the best LR strictly inside; >= 4 experiments with a failure the model
    makes itself and a remedy met at Holm p < 0.05."""
    made_and_met = []
    for path in sorted((ROOT / "experiments" / "results").glob("*/results.json")):
        if path.parent.name == "bench":
            continue
        s = json.loads(path.read_text())["summary"]
        name = path.parent.name
        assert s["seeds"] >= (5 if name == "spike_recovery" else 10), name
        assert s["primary_metric"] and s["interval"].startswith("paired t"), name
        grids = list(_grid_records(s["lr_grid"]))
        assert grids and all(g["best_strictly_inside"] and g["spans_1e-4_to_1"] for g in grids)
        for g in grids:
            assert min(g["lrs"]) <= 1e-4 and max(g["lrs"]) >= 1 and g["lrs"][0] < g["best_lr"]
        rem = s["remedies"]
        # One Holm family (issue 50): every claim and every best-loss verdict together, each
        # with the test it declares (exact sign-flip unless "paired_t"), recomputed here.
        best = [
            e.get("vs_base") for arms in s.get("best_per_arm", {}).values() for e in arms.values()
        ]
        best = [e for e in best if e is not None]
        members = list(rem.values()) + best
        assert s["family_size"] == len(members) and len(rem) > 0, name

        def raw_p(r):
            if r.get("test") == "paired_t":
                return stats.paired_t_p(r["per_seed"])
            return stats.sign_flip_p(r["per_seed"])

        raw = [raw_p(r) for r in members]
        for r, p_adj in zip(members, stats.holm(raw), strict=True):
            assert r["p_holm"] == pytest.approx(p_adj), name
        for r, p in zip(rem.values(), raw[: len(rem)], strict=True):
            assert len(r["per_seed"]) == s["seeds"]
            assert r.get("p_test", r["p_sign_flip"]) == pytest.approx(p)
            p_adj = r["p_holm"]
            lo, hi = stats.t_interval(r["per_seed"])
            assert r["ci95"] == pytest.approx([lo, hi]) and r["effect_mean"] == pytest.approx(
                float(np.mean(r["per_seed"]))
            )
            assert r["claim_met"] == (hi < 0 and p_adj < 0.05 and r["mechanism_moved"] is not False)
        if not any(r["claim_met"] for r in rem.values()):
            assert s["not_shown"], f"{name}: no claim met and no not_shown line"
        elif s["failure_made_by_model"]:
            made_and_met.append(name)
    assert len(made_and_met) >= 4, made_and_met


def test_paired_t_p_matches_scipy_and_a_hand_computation():
    from scipy import stats as sps

    d = [-0.3, -0.1, -0.2, -0.25, 0.05]
    # hand: mean -0.16, sd 0.13874, t = 0.16 * sqrt(5) / 0.13874 = 2.5787, df 4
    sd = math.sqrt(sum((x + 0.16) ** 2 for x in d) / 4)
    assert 0.16 * math.sqrt(5) / sd == pytest.approx(2.5787, abs=1e-4)
    assert stats.paired_t_p(d) == pytest.approx(sps.ttest_1samp(d, 0.0).pvalue, rel=1e-10)
    assert stats.paired_t_p(d) == pytest.approx(0.06137, abs=1e-4)
    assert stats.paired_t_p([-1.0] * 4) == 0.0 and stats.paired_t_p([0.0] * 4) == 1.0
    assert math.isnan(stats.paired_t_p([1.0])) and math.isnan(stats.paired_t_p([1.0, math.nan]))


@pytest.mark.parametrize("n", [1, 5, 8, 10, 12])
def test_sign_flip_floor_is_the_smallest_p_the_exact_test_gives(n):
    floor = stats.sign_flip_floor(n)
    assert floor == 2 / 2**n
    assert stats.sign_flip_p([-0.5] * n) == pytest.approx(min(1.0, floor))
    rng = np.random.default_rng(n)
    assert all(stats.sign_flip_p(rng.normal(size=n)) >= floor for _ in range(20))


def test_family_with_the_paired_t_test_goes_below_the_sign_flip_floor():
    base = [0.0] * 8
    remedy = [-1.0, -1.1, -0.9, -1.05, -0.95, -1.2, -0.8, -1.0]
    fam = stats.family("loss", {"a": {"remedy": remedy, "base": base}} | {
        f"n{k}": {"remedy": [0.1, -0.1] * 4, "base": base} for k in range(9)
    }, test="paired_t")  # fmt: skip
    from scipy import stats as sps

    p = sps.ttest_1samp(remedy, 0.0).pvalue
    assert fam["a"]["test"] == "paired_t" and fam["a"]["p_test"] == pytest.approx(p)
    assert fam["a"]["p_holm"] == pytest.approx(10 * p) and fam["a"]["claim_met"]
    # the sign-flip test cannot pass here: its floor with 8 seeds, times 10, is 0.078
    flip = stats.family("loss", {"a": {"remedy": remedy, "base": base}} | {
        f"n{k}": {"remedy": [0.1, -0.1] * 4, "base": base} for k in range(9)
    })  # fmt: skip
    assert flip["a"]["p_holm"] == pytest.approx(10 * stats.sign_flip_floor(8))
    assert not flip["a"]["claim_met"]
    with pytest.raises(ValueError, match="test"):
        stats.family("loss", {"a": {"remedy": remedy, "base": base}}, test="wilcoxon")


def test_every_committed_result_ran_on_the_library_it_claims():
    """Staleness: a results.json records the commit it ran on; a file under stabljax/control/
    or stabljax/optim/ that changed since (committed or not) makes it stale, and so does a
    result with no record. Regenerate."""
    from experiments import regenerate

    stale = regenerate.stale()
    assert not stale, "\n".join(
        f"experiments/results/{n}/results.json is stale ({why}); regenerate it with "
        f"`{regenerate.command(n)}`, or all of them with `python -m experiments.regenerate`"
        for n, why in stale.items()
    )


def test_the_staleness_rule_on_a_real_commit(tmp_path, monkeypatch):
    """The rule itself, against git: the current commit with no library change is fresh;
    a recorded commit whose control/ differs from the tree is stale; no record is stale."""
    from experiments import common, regenerate

    head = common.git("rev-parse", "HEAD")
    assert head, "the tests run in a git clone"
    # The newest commit that changed stabljax/control: its parent differs from the tree.
    last = common.git("log", "-1", "--format=%H", "--", "stabljax/control")
    parent = common.git("rev-parse", f"{last}^")
    monkeypatch.setattr(regenerate, "RESULTS", tmp_path)
    cases = {
        "fresh": {"commit": head, "dirty": []},
        "old": {"commit": parent, "dirty": []},
        "dirty": {"commit": head, "dirty": ["stabljax/optim/adam.py"]},
        "none": None,
    }
    for name, lib in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"library": lib}))
    dirty_tree = common.git("status", "--porcelain", "--", *common.LIBRARY_PATHS)
    assert (regenerate.stale_reason("fresh") is None) == (not dirty_tree)
    assert "changed since" in regenerate.stale_reason("old")
    assert "stabljax/control/" in regenerate.stale_reason("old")
    assert "uncommitted" in regenerate.stale_reason("dirty")
    assert "no library commit" in regenerate.stale_reason("none")
    assert regenerate.stale_reason("missing") == "no results.json"


def test_results_record_the_library_commit(tmp_path):
    out = common_write(tmp_path)
    lib = json.loads((out / "results.json").read_text())["library"]
    from experiments import common

    assert lib["commit"] == common.git("rev-parse", "HEAD") and len(lib["commit"]) == 40
    assert lib["paths"] == ["stabljax/control", "stabljax/optim"]


def common_write(tmp_path):
    from experiments import common

    return common.write_results(tmp_path, config={"a": 1}, results={}, table="", title="t")
