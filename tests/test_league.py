"""experiments/league.py and league_report.py: the statistics against scipy and a simulation, the budget points of
a run, the lr choice, the plan's skip / stale logic, and one real league run end to end."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
import league  # noqa: E402
import league_report as lr  # noqa: E402


# ------------------------------------------------------------------------------------------------ statistics
def test_paired_test_equals_scipys_ttest_rel():
    from scipy.stats import ttest_rel

    rng = np.random.default_rng(0)
    a = rng.normal(0.45, 0.03, 5)
    b = a - 0.02 + rng.normal(0, 0.01, 5)
    got = lr.paired_test(dict(enumerate(a)), dict(enumerate(b)))
    ref = ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    assert got["t"] == pytest.approx(ref.statistic, rel=1e-10) and got["p"] == pytest.approx(ref.pvalue, rel=1e-10)
    assert got["diff"] - got["half"] == pytest.approx(ci.low) and got["diff"] + got["half"] == pytest.approx(ci.high)
    # only the seeds both have are paired
    one = lr.paired_test({0: 1.0, 1: 2.0, 7: 5.0}, {0: 0.5, 1: 1.0, 9: 0.0})
    assert one["n"] == 2 and one["diff"] == pytest.approx(0.75)
    assert math.isnan(lr.paired_test({0: 1.0}, {0: 0.0})["p"])


def test_holm_adjusts_as_the_step_down_procedure():
    # sorted: 0.005·4 = 0.02, 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 -> monotone 0.06
    assert lr.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    out = lr.holm([0.2, math.nan, 0.6])
    assert out[0] == pytest.approx(0.4) and math.isnan(out[1]) and out[2] == pytest.approx(0.6)
    assert lr.holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # 2·0.8 capped at 1, and kept monotone


def test_detectable_difference_has_the_stated_power_in_a_simulation():
    """A true mean difference of the computed δ is found by scipy's paired t-test at α = 0.05 in 80 % of simulated
    5-seed experiments (100,000 draws: sd of the rate 0.0013)."""
    from scipy.stats import ttest_1samp

    sd, n = 0.02, 5
    delta = lr.detectable_difference(sd, n)
    rng = np.random.default_rng(1)
    d = rng.normal(delta, sd, size=(100_000, n))
    rate = float((ttest_1samp(d, 0.0, axis=1).pvalue < 0.05).mean())
    assert rate == pytest.approx(0.80, abs=0.006)
    # the normal-theory shortcut (t_{.975} + t_{.80}) sd / sqrt(n) is close, and it shrinks with more seeds
    from scipy.stats import t

    assert delta == pytest.approx((t.ppf(0.975, n - 1) + t.ppf(0.8, n - 1)) * sd / math.sqrt(n), rel=0.08)
    assert lr.detectable_difference(sd, 10) < delta and math.isnan(lr.detectable_difference(sd, 1))


def test_detectable_difference_at_two_seeds_has_the_stated_power():
    """make league-quick's 2 seeds: one degree of freedom, where scipy's noncentral t returns NaN at the large
    noncentralities the root search passes through; the integral over χ² that replaces it gives the same power
    where scipy's is finite, and δ scales with sd and has 80 % power in a simulation."""
    from scipy.stats import nct, t, ttest_1samp

    for df, nc in ((1, 1.0), (1, 5.0), (1, 20.0), (4, 3.0)):
        c = float(t.ppf(0.975, df))
        assert lr._power_by_integral(c, df, nc) == pytest.approx(nct.sf(c, df, nc) + nct.cdf(-c, df, nc), abs=1e-9)
    deltas = [lr.detectable_difference(sd, 2) for sd in (1e-4, 1e-3, 0.03)]
    assert all(math.isfinite(d) for d in deltas)
    assert deltas[0] * 10 == pytest.approx(deltas[1], rel=1e-6) and deltas[1] * 30 == pytest.approx(deltas[2], rel=1e-6)
    d = np.random.default_rng(2).normal(deltas[2], 0.03, size=(100_000, 2))
    assert float((ttest_1samp(d, 0.0, axis=1).pvalue < 0.05).mean()) == pytest.approx(0.80, abs=0.006)


@pytest.mark.parametrize("diff,half,p,kind,verdict", [
    (0.03, 0.01, 0.001, "better", "reproduced"),
    (-0.03, 0.01, 0.001, "better", "refuted (the opposite holds)"),
    (0.01, 0.02, 0.3, "better", "not decidable at this power"),
    (0.002, 0.01, 0.7, "alike", "reproduced (alike within the detectable difference)"),
    (0.02, 0.03, 0.2, "alike", "not decidable at this power"),
    (0.05, 0.01, 0.001, "alike", "refuted (they differ)"),
    # "X does not beat plain gains" (diff = gains - X): X collapsing is a reproduction, X winning a refutation
    (0.40, 0.05, 0.001, "no_better", "reproduced (plain gains significantly better)"),
    (-0.01, 0.015, 0.3, "no_better", "reproduced (it does not beat plain gains by the detectable difference)"),
    (-0.01, 0.025, 0.4, "no_better", "not decidable at this power"),  # X may be better by up to 0.035 > 0.03
    (-0.05, 0.01, 0.001, "no_better", "refuted (it beats plain gains)"),
])
def test_claim_verdicts(diff, half, p, kind, verdict):
    assert lr.claim_verdict({"diff": diff, "half": half, "n": 5, "p": p}, p, kind, mdd=0.03) == verdict


# ------------------------------------------------------------------------------------------------ runs on disk
def fake_run(d: Path, lr_value: float, points: list[tuple[int, float, float]], budget: float, fractions, seed=0):
    """A finished run directory: (iteration, spent NFEs, geneval) evaluations, training rows for every iteration."""
    d.mkdir(parents=True)
    (d / "lora").mkdir()
    (d / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (d / "config.yaml").write_text(f"seed: {seed}\nloop:\n  iterations: 5000\n  budget: {budget}\ntrain:\n  lr: {lr_value}\n"
                                   f"eval:\n  at_fractions: {list(fractions)}\n")
    cols = ["iteration", "cost/nfe_fwd_equiv_total", "cost/train_seconds_total", "time/iteration_s", "eval/geneval",
            *(f"eval/geneval_{c}" for c in league.CATEGORIES)]
    with (d / "metrics.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for it, nfe, g in points:
            w.writerow({"iteration": it, "cost/nfe_fwd_equiv_total": nfe, "cost/train_seconds_total": it * 2.0,
                        "time/iteration_s": 2.0})
            w.writerow({"iteration": it, "eval/geneval": g, **{f"eval/geneval_{c}": g for c in league.CATEGORIES}})


def test_each_evaluation_is_labelled_with_the_fraction_its_iteration_reached(tmp_path):
    # budget 1000 at fractions .25/.5/1: iteration 3 spent 270 (first past 250), 6 spent 540, 11 spent 1010
    fake_run(tmp_path / "r", 1e-3, [(3, 270, 0.40), (6, 540, 0.42), (11, 1010, 0.45)], 1000, [0.25, 0.5, 1.0])
    rows = league.eval_rows(tmp_path / "r", 1000, [0.25, 0.5, 1.0])
    assert [(r["budget"], r["iteration"], r["nfe"], r["geneval"]) for r in rows] == \
        [(250, 3, 270, 0.40), (500, 6, 540, 0.42), (1000, 11, 1010, 0.45)]
    assert rows[0]["seconds"] == 6.0 and rows[0]["counting"] == 0.40


def test_the_lr_is_the_grids_best_peak_of_the_mean_over_its_seeds(tmp_path):
    """The grid scores an lr by its peak: the largest mean over the grid seeds at one budget point (the criterion the
    table reports), not the mean over the evaluations (which favours early speed)."""
    s = league.Settings(budget=1000, fractions=(0.5, 1.0), methods=("default",), out=tmp_path, grid_seeds=(100, 101))
    from stepflow.config import composer

    scores = {"0.00033": (0.40, 0.41), "0.001": (0.44, 0.46), "0.003": (0.47, 0.35)}  # point means .405 .45 .41
    for lrv, (g100, g101) in scores.items():
        for seed, g in ((100, g100), (101, g101)):
            fake_run(tmp_path / "grid" / "default" / f"lr={lrv},seed={seed}", float(lrv),
                     [(3, 510, g - 0.01), (6, 1010, g + 0.01)], 1000, [0.5, 1.0], seed)
    with composer() as compose:  # peaks: .405 + .01, .45 + .01, .41 + .01
        chosen = league.chosen_lrs(s, compose)
    assert chosen["default"][0] == "0.001" and "grid: 0.00033 0.415, 0.001 0.460, 0.003 0.420" in chosen["default"][1]
    # an lr that is fast early and then flat loses to one that ends higher: the mean of the two points would choose
    # 0.003 (0.47 vs 0.46), the peak chooses 0.001 (0.52 vs 0.47)
    import shutil

    for seed in (100, 101):
        for lrv, (g1, g2) in (("0.001", (0.40, 0.52)), ("0.003", (0.47, 0.47))):
            d = tmp_path / "grid" / "default" / f"lr={lrv},seed={seed}"
            shutil.rmtree(d)
            fake_run(d, float(lrv), [(3, 510, g1), (6, 1010, g2)], 1000, [0.5, 1.0], seed)
    assert league.grid_scores(s, league.method("default"), ["0.001", "0.003"]) == \
        {"0.001": pytest.approx(0.52), "0.003": pytest.approx(0.47)}
    with composer() as compose:
        assert league.chosen_lrs(s, compose)["default"][0] == "0.001"
    assert league.grid_list(s, league.method("default"), 1e-3) == ["0.00033", "0.001", "0.003"]  # best inside
    # an unfinished grid run: the config's lr, said so
    (tmp_path / "grid" / "default" / "lr=0.003,seed=101" / "lora" / "pytorch_lora_weights.safetensors").unlink()
    (tmp_path / "grid" / "default" / "lr=0.003,seed=101" / "metrics.csv").unlink()
    with composer() as compose:
        assert league.chosen_lrs(s, compose)["default"] == ("0.001", "the config's lr (grid unfinished)")


def test_a_best_lr_at_the_grids_edge_extends_the_grid(tmp_path):
    s = league.Settings(budget=500, fractions=(0.5, 1.0), methods=("default",), out=tmp_path, grid_seeds=(100,))
    from stepflow.config import composer

    def put(lrv, g):
        fake_run(tmp_path / "grid" / "default" / f"lr={lrv},seed=100", float(lrv), [(3, 260, g), (6, 510, g)], 500,
                 [0.5, 1.0], 100)

    for lrv, g in (("0.00033", 0.40), ("0.001", 0.42), ("0.003", 0.44)):
        put(lrv, g)
    m = league.method("default")
    assert league.grid_list(s, m, 1e-3) == ["0.00033", "0.001", "0.003", "0.009"]
    with composer() as compose:
        assert league.chosen_lrs(s, compose)["default"][1] == "the config's lr (grid unfinished)"
        assert [r.run_dir.name for r in league.plan(s, ["grid"], check_config=False) if r.status != "finished"] == \
            ["lr=0.009,seed=100"]
    put("0.009", 0.43)  # past the peak: the grid stops; 0.003 is chosen
    assert league.grid_list(s, m, 1e-3) == ["0.00033", "0.001", "0.003", "0.009"]
    with composer() as compose:
        assert league.chosen_lrs(s, compose)["default"][0] == "0.003"
    s.grid_extend = 0
    assert league.grid_list(s, m, 1e-3) == ["0.00033", "0.001", "0.003"]


def test_plan_skips_finished_runs_and_finds_stale_ones(tmp_path):
    s = league.Settings(budget=1000, seeds=(0, 1), methods=("default",), grid=False, claims=False, out=tmp_path)
    runs = league.plan(s, ["table"])
    assert [(r.phase, r.method.name, r.run_dir.name, r.status) for r in runs] == \
        [("table", "default", "seed=0", "missing"), ("table", "default", "seed=1", "missing")]
    cmd = runs[0].command("python")
    assert "loop.budget=1000" in cmd and "eval.at_start=false" in cmd and "train.lr=0.001" in cmd and "seed=0" in cmd
    assert "eval.at_fractions=[0.0625,0.125,0.25,0.5,0.75,1]" in cmd  # 7.5k .. 120k of 120k, scaled
    assert "loop.final_reward_every=0" in cmd and "eval.grid_prompts=0" in cmd  # no logging rollouts, no grids
    # a finished run with the planned config is skipped; one with another lr is stale
    from omegaconf import OmegaConf

    from stepflow.config import compose

    for seed, lrv in ((0, "0.001"), (1, "0.003")):
        cfg = compose("train", [*league.run_overrides(league.method("default"), lrv, 1000, s.fractions, s), f"seed={seed}"])
        d = tmp_path / "table" / "default" / f"seed={seed}"
        fake_run(d, float(lrv), [(3, 1100, 0.4)], 1000, [1.0], seed)
        (d / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    st = {r.run_dir.name: (r.status, r.reason) for r in league.plan(s, ["table"])}
    assert st["seed=0"] == ("finished", "") and st["seed=1"][0] == "stale" and "train.lr" in st["seed=1"][1]
    # an adapter written by a run stopped before its budget (a signal seen between iterations, before that was fixed)
    m = (tmp_path / "table" / "default" / "seed=0" / "metrics.csv")
    m.write_text(m.read_text().replace("1100", "400"))
    st = {r.run_dir.name: (r.status, r.reason) for r in league.plan(s, ["table"])}
    assert st["seed=0"][0] == "stale" and "stopped before its budget" in st["seed=0"][1]


def test_every_method_and_claim_arm_composes_and_claims_name_known_arms():
    from stepflow.config import composer

    names = {m.name for m in (*league.METHODS, *league.CLAIM_ARMS)}
    assert len(league.METHODS) >= 15 and len(names) == len(league.METHODS) + len(league.CLAIM_ARMS)
    assert all(c.better in names and c.worse in names for c in league.CLAIMS)
    assert all(m.parent in {x.name for x in league.METHODS} for m in league.CLAIM_ARMS)
    with composer() as compose:
        for m in (*league.METHODS, *league.CLAIM_ARMS):
            cfg = compose("train", league.run_overrides(m, "0.001", 1000, (0.5, 1.0), league.Settings()))
            assert float(cfg.train.lr) == 0.001 and cfg.eval.at_start is False, m.name


def test_a_league_recipe_joins_the_league_by_its_file_alone(tmp_path):
    (tmp_path / "nft.yaml").write_text("# DiffusionNFT (objective=nft)\n")
    (tmp_path / "mine.yaml").write_text("# @package _global_\n# My-GRPO (advantage=mine; a method of my own)\nloop: {}\n")
    (tmp_path / "bare.yaml").write_text("loop: {}\n")
    got = league.recipe_methods({"nft"}, tmp_path)
    assert [(m.name, m.experiment, m.title) for m in got] == [("bare", "league/bare", "bare"),
                                                               ("mine", "league/mine", "My-GRPO")]
    listed = {m.experiment for m in league.METHODS}  # every shipped recipe is in the league
    assert {f"league/{p.stem}" for p in (ROOT / "stepflow/conf/experiment/league").glob("*.yaml")} <= listed


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        league.main(["--methods", "bogus", "--dry-run"])
    assert e.value.code == 2 and "--methods: unknown ['bogus']" in capsys.readouterr().err


def test_paper_scale_plans_sd35_runs_through_the_prefix(capsys):
    assert league.main(["--scale", "paper", "--phase", "table", "--methods", "nft", "--seeds", "0", "--no-grid",
                        "--prefix", "srun -N1 --gpus-per-node 8", "--dry-run"]) == 0
    out = capsys.readouterr().out
    cmd = next(line for line in out.splitlines() if line.startswith("srun"))
    for part in ("srun -N1 --gpus-per-node 8 ", "experiment=league/nft", "model=sd35_medium", "trainer=ddp",
                 "reward=geneval_server", "loop.budget=5000000", "league_paper/table/nft/seed=0"):
        assert part in cmd, part


@pytest.mark.slow
def test_a_tiny_league_runs_resumes_nothing_and_reports(tmp_path):
    """Two methods, one seed, a budget of a few iterations: real runs through the pool, results.csv with a row per
    method, seed and budget point, a second invocation finds both finished, and the report states CIs."""
    out = tmp_path / "lq"
    argv = ["--quick", "--methods", "default,flow_grpo_fast", "--seeds", "0", "--budget", "900", "--out", str(out),
            "--jobs", "2", "--", "eval.max_prompts=12"]
    assert league.main(argv) == 0
    rows = list(csv.DictReader((out / "report" / "results.csv").open()))
    assert {(r["method"], r["seed"], r["budget"]) for r in rows} == {("default", "0", "900"), ("flow_grpo_fast", "0", "900")}
    assert all(int(r["nfe"]) >= 900 for r in rows)
    assert (out / "report" / "runs" / "table" / "default" / "seed=0" / "archived.json").is_file()  # the ledger
    runs = league.plan(league.Settings(budget=900, fractions=(1.0,), seeds=(0,), methods=("default", "flow_grpo_fast"),
                                       grid=False, claims=False, out=out, extra=("eval.max_prompts=12",)), ["table"])
    assert [r.status for r in runs] == ["finished", "finished"]
    md = (out / "report" / "report.md").read_text()
    assert "95 % confidence interval" in md and "| default (" in md


def test_the_league_cost_sums_every_attempt_of_a_finished_run(tmp_path):
    import json

    s = league.Settings(out=tmp_path)
    recs = [("grid", "nft", "lr=0.001,seed=100", 143, 100.0), ("grid", "nft", "lr=0.001,seed=100", 0, 260.0),
            ("grid", "nft", "lr=0.003,seed=100", 0, 360.0), ("table", "default", "seed=0", 1, 50.0)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps({"phase": p, "method": m, "run": r, "rc": rc, "wall_s": w})
                                                 + "\n" for p, m, r, rc, w in recs))
    cost = lr.league_cost(s)
    assert cost == {"grid": {"runs": 2, "hours": pytest.approx((100 + 260 + 360) / 3600), "estimated": 0}}  # rc 1: out


def test_the_league_cost_estimates_the_runs_finished_before_runs_jsonl(tmp_path):
    """Runs measured before runs.jsonl existed (only their csv rows) count at their training seconds times the
    median wall / training ratio of the recorded runs."""
    import json

    s = league.Settings(out=tmp_path)
    recs = [("table", "default", "seed=0", 300.0), ("table", "default", "seed=1", 200.0),
            ("table", "awm", "seed=0", 160.0)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps({"phase": p, "method": m, "run": r, "rc": 0, "wall_s": w})
                                                 + "\n" for p, m, r, w in recs))
    rows = [{"phase": p, "method": m, "seed": sd, "lr": "0.001", "seconds": sec} for p, m, sd, sec in (
        ("table", "default", 0, 50.0), ("table", "default", 0, 100.0),  # ratio 3 (its largest seconds count)
        ("table", "default", 1, 100.0),  # ratio 2
        ("table", "awm", 0, 40.0), ("table", "awm", 0, 80.0),  # ratio 2: the median of 3, 2, 2 is 2
        ("grid", "nft", 100, 30.0), ("grid", "nft", 100, 60.0), ("grid", "nft", 101, 45.0))]  # not recorded
    cost = lr.league_cost(s, rows)
    assert list(cost) == ["grid", "table"]
    assert cost["table"] == {"runs": 3, "hours": pytest.approx(660 / 3600), "estimated": 0}
    assert cost["grid"] == {"runs": 2, "hours": pytest.approx((60 + 45) * 2 / 3600), "estimated": 2}


# ------------------------------------------------------------------------------------------------ the ledger
def _table_run(s, tmp_path, seed, lrv="0.001", nfe=1100, g=0.4):
    from omegaconf import OmegaConf

    from stepflow.config import compose

    cfg = compose("train", [*league.run_overrides(league.method("default"), lrv, 1000, s.fractions, s), f"seed={seed}"])
    d = s.out / "table" / "default" / f"seed={seed}"
    fake_run(d, float(lrv), [(3, 300, g - 0.02), (6, 600, g - 0.01), (11, nfe, g)], 1000, s.fractions, seed)
    (d / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return d


def test_finished_runs_go_to_the_ledger_and_a_fresh_clone_gets_them_back(tmp_path):
    import shutil

    s = league.Settings(budget=1000, seeds=(0, 1, 2), methods=("default",), grid=False, claims=False,
                        out=tmp_path / "out", ledger=tmp_path / "docs")
    _table_run(s, tmp_path, 0, g=0.41)
    _table_run(s, tmp_path, 1, g=0.43)
    unfinished = _table_run(s, tmp_path, 2)
    (unfinished / "lora" / "pytorch_lora_weights.safetensors").unlink()
    (unfinished / "checkpoints").mkdir()
    (unfinished / "checkpoints" / "last.ckpt").write_bytes(b"x")
    before = sorted(league.collect(s), key=lambda r: (r["seed"], r["fraction"]))
    assert league.sync_archive(s) == 2 and league.sync_archive(s) == 0  # the finished two; a second sync copies nothing
    arch = s.ledger / "runs" / "table" / "default"
    assert sorted(p.name for p in arch.iterdir()) == ["seed=0", "seed=1"]
    assert (arch / "seed=0" / "lora" / "pytorch_lora_weights.safetensors").is_file()  # seed 0 keeps its adapter
    assert not (arch / "seed=1" / "lora").exists() and not (arch / "seed=1" / "checkpoints").exists()
    shutil.rmtree(s.out)  # a fresh clone: outputs/ is gone
    runs = {r.run_dir.name: r.status for r in league.plan(s, ["table"])}
    assert runs == {"seed=0": "finished", "seed=1": "finished", "seed=2": "missing"}
    assert sorted(league.collect(s), key=lambda r: (r["seed"], r["fraction"])) == before
    # a restored run whose config no longer matches the plan is stale (it is rerun, and its new copy replaces it)
    s.extra = ("loop.group_size=4",)
    assert {r.run_dir.name: r.status for r in league.plan(s, ["table"])}["seed=1"] == "stale"


def test_a_doubled_budget_extends_each_finished_run_from_its_checkpoint(tmp_path):
    """A method whose budget doubles (still rising) does not run its seeds again from the start: a finished run that
    kept its last.ckpt is resumed to the new budget (its evaluations are the new plan's first ones; a run extended
    this way equals one run to the larger budget: tests/test_budget.py), one without a checkpoint is stale. While
    the extension runs (its config.resume.yaml newer than the old adapter) it is unfinished; once it wrote its
    adapter it is finished, and its ledger copy (with config.resume.yaml) is finished in a fresh clone."""
    import os
    import shutil
    import zipfile

    from omegaconf import OmegaConf

    from stepflow.config import compose

    s = league.Settings(budget=1000, fractions=(0.5, 1.0), seeds=(0, 1), methods=("default",), grid=False,
                        claims=False, out=tmp_path / "out", ledger=tmp_path / "docs")
    m = league.method("default")

    def planned(budget, seed):
        ovr = league.run_overrides(m, "0.001", budget, league.method_fractions(s, budget), s)
        return OmegaConf.to_yaml(compose("train", [*ovr, f"seed={seed}"]), resolve=True)

    for seed in (0, 1):
        d = s.out / "table" / "default" / f"seed={seed}"
        fake_run(d, 1e-3, [(3, 510, 0.40), (6, 1010, 0.45)], 1000, [0.5, 1.0], seed)
        (d / "config.yaml").write_text(planned(1000, seed))
    d0 = s.out / "table" / "default" / "seed=0"
    (d0 / "checkpoints").mkdir()
    with zipfile.ZipFile(d0 / "checkpoints" / "last.ckpt", "w") as z:  # the finished run's last checkpoint
        z.writestr("data.pkl", b"")
    adapter = d0 / "lora" / "pytorch_lora_weights.safetensors"
    t = adapter.stat().st_mtime
    os.utime(d0 / "checkpoints" / "last.ckpt", (t - 5, t - 5))
    assert {r.run_dir.name: r.status for r in league.plan(s, ["table"])} == {"seed=0": "finished", "seed=1": "finished"}

    s.budget_for = {"default": 2000.0}  # doubled: points 500, 1000 (the old ones), 1500, 2000
    runs = {r.run_dir.name: r for r in league.plan(s, ["table"])}
    assert (runs["seed=0"].status, runs["seed=0"].reason) == ("resume", "extend from 1,000 to 2,000 NFEs")
    assert any(a.startswith("ckpt_path=") for a in runs["seed=0"].command("python"))
    assert "loop.budget=2000" in runs["seed=0"].command("python")
    assert runs["seed=0"].cost == pytest.approx(runs["seed=1"].cost / 2)  # only its second half is to run
    assert runs["seed=1"].status == "stale"  # no checkpoint: run again
    # an extension that drops an evaluation the stored run made, or one the stored run passed, is a rerun
    s.budget_for, s.fractions = {"default": 2000.0}, (1.0,)
    assert {r.run_dir.name: r.status for r in league.plan(s, ["table"])}["seed=0"] == "stale"
    s.fractions = (0.25, 0.5, 1.0)
    assert {r.run_dir.name: r.status for r in league.plan(s, ["table"])}["seed=0"] == "stale"
    s.fractions = (0.5, 1.0)

    # the extension has started (its resume's settings written, a checkpoint after the old adapter): unfinished
    (d0 / "config.resume.yaml").write_text(planned(2000, 0))
    os.utime(d0 / "config.resume.yaml", (t + 5, t + 5))
    os.utime(d0 / "checkpoints" / "last.ckpt", (t + 10, t + 10))
    assert {r.run_dir.name: (r.status, r.reason) for r in league.plan(s, ["table"])}["seed=0"] == \
        ("resume", "unfinished, has checkpoints/last.ckpt")
    # stopped before its first checkpoint: still unfinished (the old adapter does not mark the extended run)
    os.utime(d0 / "checkpoints" / "last.ckpt", (t - 5, t - 5))
    assert {r.run_dir.name: r.status for r in league.plan(s, ["table"])}["seed=0"] == "resume"
    # finished: its metrics reach 2000 and it wrote its adapter again
    shutil.rmtree(d0)
    fake_run(d0, 1e-3, [(3, 510, 0.40), (6, 1010, 0.45), (9, 1510, 0.47), (12, 2010, 0.48)], 2000,
             [0.25, 0.5, 0.75, 1.0], 0)
    (d0 / "config.yaml").write_text(planned(1000, 0))
    (d0 / "config.resume.yaml").write_text(planned(2000, 0))
    (d0 / "checkpoints").mkdir()
    with zipfile.ZipFile(d0 / "checkpoints" / "last.ckpt", "w") as z:
        z.writestr("data.pkl", b"")
    t = adapter.stat().st_mtime
    for f in (d0 / "config.resume.yaml", d0 / "checkpoints" / "last.ckpt"):
        os.utime(f, (t - 5, t - 5))
    assert {r.run_dir.name: r.status for r in league.plan(s, ["table"])}["seed=0"] == "finished"
    assert [r["geneval"] for r in league.eval_rows(d0, 2000, league.method_fractions(s, 2000))] == [0.40, 0.45, 0.47, 0.48]
    # the ledger keeps the settings it finished with: a fresh clone finds it finished, not stale
    assert league.sync_archive(s) == 2  # (seed 1 too: finished at its old budget)
    assert (s.ledger / "runs" / "table" / "default" / "seed=0" / "config.resume.yaml").is_file()
    shutil.rmtree(s.out)
    assert {r.run_dir.name: r.status for r in league.plan(s, ["table"])}["seed=0"] == "finished"


def test_the_ledgers_csv_rows_count_as_finished_runs_until_a_run_on_disk_replaces_them(tmp_path):
    s = league.Settings(budget=1000, fractions=(0.25, 0.5, 1.0), seeds=(0, 1), methods=("default",), grid=False, claims=False,
                        out=tmp_path / "out", ledger=tmp_path / "docs")
    rows = [{"phase": "table", "method": "default", "seed": sd, "lr": lrv, "budget": int(f * 1000), "fraction": f,
             "iteration": i, "nfe": int(f * 1000) + 10, "seconds": 2.0 * i, "reward_images": 64 * i, "geneval": g,
             **{c: g for c in league.CATEGORIES}}
            for sd, lrv in ((0, "0.001"), (1, "0.003")) for f, i, g in ((0.25, 3, 0.38), (0.5, 6, 0.39), (1.0, 11, 0.40))]
    league.write_csv(rows, s.ledger / "results.csv")
    s.seeds = (0, 1, 2)
    rows += [{**r, "seed": 2} for r in rows[:3]]
    league.write_csv(rows, s.ledger / "results.csv")
    runs = {r.run_dir.name: (r.status, r.reason) for r in league.plan(s, ["table"])}
    assert runs["seed=2"][0] == "finished" and "ledger" in runs["seed=2"][1]
    assert runs["seed=1"] == ("missing", "no run yet")  # measured at another lr than the plan's
    assert runs["seed=0"] == ("missing", "no run yet")  # seed 0 runs again: the image grids need its adapter
    got = league.collect(s)
    assert len(got) == 9 and {(r["seed"], r["lr"], r["fraction"], r["geneval"]) for r in got} >= \
        {(0, "0.001", 1.0, 0.40), (1, "0.003", 0.25, 0.38)}
    _table_run(s, tmp_path, 0, g=0.45)  # rerun on disk: its rows replace the csv's
    got = [r for r in league.collect(s) if r["seed"] == 0]
    assert len(got) == 3 and max(r["geneval"] for r in got) == 0.45
    # the grid's csv rows choose the lr as its runs would
    grid = [{**r, "phase": "grid", "seed": 100, "lr": lrv, "budget": int(f * 1000), "fraction": f, "geneval": g}
            for lrv, base in (("0.00033", 0.40), ("0.001", 0.45), ("0.003", 0.41)) for r in rows[:1]
            for f, g in ((0.25, base), (0.5, base), (1.0, base))]
    league.write_csv(grid, s.ledger / "lr_grid.csv")
    s.grid, s.grid_seeds = True, (100,)
    assert league.grid_scores(s, league.method("default"), ["0.00033", "0.001", "0.003"]) == \
        {"0.00033": 0.40, "0.001": 0.45, "0.003": 0.41}
    from stepflow.config import composer

    with composer() as compose:
        assert league.chosen_lrs(s, compose)["default"][0] == "0.001"


def test_make_train_runs_the_leagues_best_within_seven_minutes():
    """``make train`` (the Makefile's TRAIN, experiment=league_best) is the table's best mean held-out GenEval among
    the (method, budget) points whose runs all trained within 7 minutes, as the league ran it (its lr, its budget),
    plus the evaluation before training; the committed results decide, so a league that finds another best fails
    this until the default follows it."""
    from omegaconf import OmegaConf

    from stepflow.config import composer

    rows = [r for r in csv.DictReader((ROOT / "docs/league/results.csv").open()) if r["phase"] == "table"]
    points: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        points.setdefault((r["method"], float(r["budget"])), []).append(r)
    fits = {k: v for k, v in points.items() if len(v) >= 5 and max(float(r["seconds"]) for r in v) <= 420}
    (name, budget), best = max(fits.items(), key=lambda kv: np.mean([float(r["geneval"]) for r in kv[1]]))
    lrs = {r["lr"] for r in best}
    assert len(lrs) == 1, lrs
    makefile = (ROOT / "Makefile").read_text()
    assert "TRAIN ?= experiment=league_best\n" in makefile and "stepflow.train $(TRAIN) $(ARGS)" in makefile
    s = league.Settings()
    ovr = [x if x != "eval.at_start=false" else "eval.at_start=true"
           for x in league.run_overrides(league.method(name), lrs.pop(), budget, s.fractions, s)]
    with composer() as compose:
        got = OmegaConf.to_container(compose("train", ["experiment=league_best"]), resolve=True)
        want = OmegaConf.to_container(compose("train", ovr), resolve=True)
    assert got.pop("experiment_name") == "league_best"
    want.pop("experiment_name")
    # the same training; make train keeps its own evaluation points and logs (the league's LEAGUE_OVERRIDES and
    # budget points are league-side settings)
    for cfg in (got, want):
        cfg["eval"].pop("at_fractions"), cfg["eval"].pop("grid_prompts"), cfg["eval"].pop("batch_size"), cfg["loop"].pop("final_reward_every")
    assert got == want, (name, budget)


def test_the_readmes_first_table_is_the_leagues():
    """The README's results table is what the report writes from the committed docs/league/results.csv (a number
    changed in either alone fails this)."""
    rows = list(csv.DictReader((ROOT / "docs/league/results.csv").open()))
    names = [m.name for m in league.METHODS]
    s = league.Settings(ledger=ROOT / "docs" / "league")
    table = lr.readme_table(rows, {m.name: m.title for m in league.METHODS}, names, lambda m: league.method_budget(s, m))
    text = (ROOT / "README.md").read_text()
    assert text.index(lr.README_BEGIN) < text.index("|")  # the first table of the README
    block = text.split(lr.README_BEGIN, 1)[1].split(lr.README_END, 1)[0]
    assert block.strip() == table
    ran = {r["method"] for r in rows if r["phase"] == "table"}
    assert table.split("\n\n")[0].count("\n") == len([n for n in names if n in ran]) + 1  # a row per method run
    assert "peak GenEval" in table and "end GenEval" in table  # the README's first table is "peak and end"
    assert all(f"(`{n}`)" in table for n in names)  # and the others named as not run yet


def test_update_readme_rewrites_only_between_its_markers(tmp_path):
    p = tmp_path / "README.md"
    p.write_text(f"a\n{lr.README_BEGIN}\nold\n{lr.README_END}\nb\n")
    assert lr.update_readme(p, "| new |") and p.read_text() == f"a\n{lr.README_BEGIN}\n| new |\n{lr.README_END}\nb\n"
    q = tmp_path / "other.md"
    q.write_text("no markers\n")
    assert not lr.update_readme(q, "| new |") and q.read_text() == "no markers\n"


# ------------------------------------------------------------------------------------------------ where methods end
def test_an_iteration_past_two_points_is_the_evaluation_of_both(tmp_path):
    """Each budget point takes the first evaluation at or past it, with the NFEs that evaluation had spent: one
    iteration that passes two points (a method with large iterations) serves both, never a later evaluation."""
    fake_run(tmp_path / "r", 1e-3, [(2, 300, 0.40), (3, 780, 0.42), (5, 1010, 0.45)], 1000, [0.25, 0.5, 0.75, 1.0])
    rows = league.eval_rows(tmp_path / "r", 1000, [0.25, 0.5, 0.75, 1.0])
    assert [(r["budget"], r["iteration"], r["nfe"], r["geneval"], r["run_budget"]) for r in rows] == \
        [(250, 2, 300, 0.40, 1000), (500, 3, 780, 0.42, 1000), (750, 3, 780, 0.42, 1000), (1000, 5, 1010, 0.45, 1000)]
    assert math.isnan(rows[0]["exact_scene"])  # an evaluation without the scene counts: NaN, not 0


def test_the_protocol_has_six_points_to_120k_and_league_runs_spend_nothing_on_logging():
    s = league.Settings()
    assert [round(f * s.budget) for f in s.fractions] == [7500, 15000, 30000, 60000, 90000, 120000]
    assert s.grid_budget == s.budget and s.grid_fractions == s.fractions  # the grid sees the table's points
    ovr = league.run_overrides(league.method("default"), "0.001", s.budget, s.fractions, s)
    assert "loop.final_reward_every=0" in ovr and "eval.grid_prompts=0" in ovr and "eval.batch_size=64" in ovr
    # a doubled budget keeps the six points and adds 1.5x and 2x the old budget
    assert [round(f * 240_000) for f in league.method_fractions(s, 240_000)] == \
        [7500, 15000, 30000, 60000, 90000, 120000, 180000, 240000]
    assert [round(f * 480_000) for f in league.method_fractions(s, 480_000)][-4:] == [180000, 240000, 360000, 480000]


@pytest.mark.parametrize("curve,rising", [
    ([(1, 0.40), (2, 0.45), (3, 0.50)], True),    # peak at the end, +0.05 in the last interval
    ([(1, 0.40), (2, 0.45), (3, 0.455)], False),  # peak at the end but flat: +0.005 < 0.01
    ([(1, 0.40), (2, 0.50), (3, 0.48)], False),   # peaked and fell
    ([(1, 0.40), (3, 0.52), (2, 0.50)], True),    # order of the points does not matter
    ([(1, 0.40)], False),
])
def test_still_rising_is_a_peak_at_the_end_that_still_gains(curve, rising):
    assert league.still_rising(curve, 0.01) is rising


def test_a_still_rising_method_gets_twice_its_budget_kept_in_the_ledger(tmp_path):
    s = league.Settings(budget=1000, fractions=(0.5, 1.0), seeds=(0, 1), methods=("default",), grid=False,
                        claims=False, out=tmp_path / "out", ledger=tmp_path / "docs", max_extend=1)
    for seed, (g1, g2) in ((0, (0.40, 0.46)), (1, (0.42, 0.47))):
        fake_run(s.out / "table" / "default" / f"seed={seed}", 1e-3, [(3, 510, g1), (6, 1010, g2)], 1000, [0.5, 1.0],
                 seed)
    assert league.decide_extensions(s, ["default"]) == {"default": 2000}
    assert json.loads((s.ledger / "budgets.json").read_text()) == {"default": 2000}
    assert league.method_budget(s, "default") == 2000
    run = league.plan(s, ["table"], check_config=False)[0]
    assert "loop.budget=2000" in run.overrides and "eval.at_fractions=[0.25,0.5,0.75,1]" in run.overrides
    assert league.decide_extensions(s, ["default"]) == {}  # its runs at 2000 are not finished; and max_extend is 1
    s.budget_for = {"default": 3000.0}  # by hand: it wins over the file
    assert league.method_budget(s, "default") == 3000


def test_a_flat_or_falling_method_is_not_extended(tmp_path):
    s = league.Settings(budget=1000, fractions=(0.5, 1.0), seeds=(0, 1), methods=("default",), grid=False,
                        claims=False, out=tmp_path / "out", ledger=tmp_path / "docs")
    for seed, (g1, g2) in ((0, (0.46, 0.44)), (1, (0.47, 0.47))):
        fake_run(s.out / "table" / "default" / f"seed={seed}", 1e-3, [(3, 510, g1), (6, 1010, g2)], 1000, [0.5, 1.0],
                 seed)
    assert league.decide_extensions(s, ["default"]) == {} and not (s.ledger / "budgets.json").exists()
    # a rising method with a seed unfinished: no decision until every seed has its end
    import shutil

    for seed, (g1, g2) in ((0, (0.40, 0.46)), (1, (0.42, 0.47))):
        shutil.rmtree(s.out / "table" / "default" / f"seed={seed}")
        fake_run(s.out / "table" / "default" / f"seed={seed}", 1e-3, [(3, 510, g1), (6, 1010, g2)], 1000, [0.5, 1.0],
                 seed)
    (s.out / "table" / "default" / "seed=1" / "lora" / "pytorch_lora_weights.safetensors").unlink()
    (s.out / "table" / "default" / "seed=1" / "metrics.csv").write_text("iteration\n")
    assert league.decide_extensions(s, ["default"]) == {}


@pytest.mark.parametrize("text", ["[1, 2]", "{bad", '{"default": "many"}'])
def test_an_unreadable_ledger_decision_is_noted_and_every_method_keeps_its_setting(tmp_path, capsys, text):
    s = league.Settings(budget=1000, seeds=(0, 1), methods=("default",), grid=False, claims=False,
                        out=tmp_path / "out", ledger=tmp_path / "docs", budget_for={"paper": 3000.0})
    s.ledger.mkdir()
    for f in ("budgets.json", "seeds.json"):
        (s.ledger / f).write_text(text)
    assert league.extended_budgets(s) == {"paper": 3000.0} and league.method_budget(s, "default") == 1000
    assert league.power_seeds(s) == {} and league.method_seeds(s, "default") == (0, 1)
    err = capsys.readouterr().err.splitlines()
    for f, what in (("budgets.json", "--budget"), ("seeds.json", "--seeds")):
        assert any(str(s.ledger / f) in line and line.endswith(f"every method at {what}") for line in err), err
    (s.ledger / "budgets.json").write_text('{"default": 2000, "paper": 1500, "nft": 0}')
    (s.ledger / "seeds.json").write_text('{"default": 3}')
    assert league.extended_budgets(s) == {"default": 2000.0, "paper": 3000.0}  # by hand wins; 0 is no decision
    assert league.method_seeds(s, "default") == (0, 1, 2)


def test_the_central_claims_arms_get_the_seeds_its_power_needs(tmp_path):
    """Item 4 of the protocol: a comparison of ``CENTRAL`` whose arms have finished gets, for both arms, the seeds at
    which the detectable difference at the measured paired sd (each arm at its own peak) is <= 0.04; they are kept in
    the ledger, planned after the table's seeds (skipping grid seeds), capped, and re-decided only when they ran."""
    import statistics

    assert ("allsteps", "uniform_guard") in {(a, b) for a, b, _ in lr.CENTRAL}
    s = league.Settings(budget=1000, fractions=(0.5, 1.0), seeds=(0, 1, 2), grid_seeds=(4,),
                        methods=("allsteps", "uniform_guard"), grid=False, claims=False, out=tmp_path / "out",
                        ledger=tmp_path / "docs")
    curves = {"allsteps": [(0.40, 0.46), (0.41, 0.44), (0.42, 0.49)],        # peak at 1000
              "uniform_guard": [(0.43, 0.41), (0.44, 0.43), (0.45, 0.42)]}  # peak at 500
    for m, per_seed in curves.items():
        for seed, (g1, g2) in enumerate(per_seed):
            fake_run(s.out / "table" / m / f"seed={seed}", 1e-3, [(3, 510, g1), (6, 1010, g2)], 1000, [0.5, 1.0],
                     seed)
    diffs = [a[1] - b[0] for a, b in zip(curves["allsteps"], curves["uniform_guard"])]  # each at its own peak
    need = lr.seeds_for(statistics.stdev(diffs), 0.04)
    assert need == 5 and lr.seeds_for(statistics.stdev([a[1] - b[1] for a, b in zip(*curves.values())]), 0.04) != 5
    assert league.decide_power(s) == {"allsteps": 5, "uniform_guard": 5}
    assert json.loads((s.ledger / "seeds.json").read_text()) == {"allsteps": 5, "uniform_guard": 5}
    assert league.method_seeds(s, "allsteps") == (0, 1, 2, 3, 5) and league.method_seeds(s, "default") == (0, 1, 2)
    runs = league.plan(s, ["table"], check_config=False)
    assert sorted((r.method.name, r.seed, r.status) for r in runs if r.status != "finished") == \
        [(m, seed, "missing") for m in ("allsteps", "uniform_guard") for seed in (3, 5)]
    assert league.decide_power(s) == {}  # the new seeds have not run: no new decision
    s.max_seeds = 4
    (s.ledger / "seeds.json").unlink()
    assert league.decide_power(s) == {"allsteps": 4, "uniform_guard": 4}  # capped
    s.power_target = 0.0  # off (make league-quick)
    assert league.decide_power(s) == {} and league.method_seeds(s, "allsteps") == (0, 1, 2)


def test_the_league_runs_the_seeds_its_power_asks_for_and_stops(tmp_path, monkeypatch):
    """The run loop: after the table, the central comparison's arms get more seeds, the table is planned again and
    runs them, and the loop ends once the re-measured sd asks for no more (here a stand-in for stepflow.train writes
    each run's evaluations: gains ahead of uniform credit by 0.06 on even seeds, 0.00 on odd ones)."""
    ran: list[tuple[str, int]] = []

    def fake_pool(runs, jobs, env, prefix=(), s=None):  # noqa: ARG001
        for r in runs:
            fr = league.planned_fractions(r.overrides)
            gap = 0.06 if r.seed % 2 == 0 else 0.0
            top = 0.40 + 0.01 * r.seed + (gap if r.method.name == "allsteps" else 0.0)
            fake_run(r.run_dir, 1e-3, [(i + 1, 1001 * f, top - 0.1 * abs(f - 0.5)) for i, f in enumerate(fr)], 1000, fr,
                     r.seed)  # peaked at half the budget: not extended
            ran.append((r.method.name, r.seed))
        return [0] * len(runs)

    monkeypatch.setattr(league, "run_pool", fake_pool)
    monkeypatch.setattr(league, "restore_archive", lambda s: None)
    monkeypatch.setattr(league, "sync_archive", lambda s: None)
    monkeypatch.setattr(lr, "write_report", lambda s, docs, readme=None: docs / "report.md")
    docs = tmp_path / "docs"
    assert league.main(["--phase", "table", "--methods", "allsteps,uniform_guard", "--no-grid", "--no-claims",
                        "--seeds", "0,1,2", "--max-seeds", "20", "--budget", "1000", "--out", str(tmp_path / "out"),
                        "--docs", str(docs)]) == 0
    n = json.loads((docs / "seeds.json").read_text())
    assert n["allsteps"] == n["uniform_guard"] > 3
    assert sorted(ran) == sorted((m, seed) for m in ("allsteps", "uniform_guard") for seed in range(n["allsteps"]))
    diffs = [0.06 if seed % 2 == 0 else 0.0 for seed in range(n["allsteps"])]
    import statistics

    assert lr.seeds_for(statistics.stdev(diffs), 0.04) <= n["allsteps"]  # it stopped where the power was reached
    assert lr.seeds_for(statistics.stdev(diffs[:3]), 0.04) <= n["allsteps"]


def test_make_trains_recipe_is_the_best_point_that_fits_in_seven_minutes():
    """Item 6: per method the best mean held-out GenEval among the points whose league training seconds plus make
    train's start-up and four evaluations (13 + 4 x 17 = 81 s) fit in 420 s; of equal means the cheaper; the drop is
    paired against the method's end."""
    pts = {"a": [(1000, 100.0, (0.40, 0.42)), (2000, 300.0, (0.50, 0.52)), (3000, 400.0, (0.60, 0.60))],
           "b": [(1000, 50.0, (0.45, 0.47)), (2000, 200.0, (0.45, 0.47))]}
    rows = [{"method": m, "seed": seed, "budget": b, "geneval": g[seed], "seconds": sec + seed}
            for m, p in pts.items() for b, sec, g in p for seed in (0, 1)]
    got = lr.train_recipes(rows, ["a", "b"])
    assert [(c["method"], c["budget"]) for c in got] == [("a", 2000), ("b", 1000)]  # a at 3000: 400.5 + 81 > 420
    a, b = got
    assert a["geneval"][0] == pytest.approx(0.51) and a["seconds"] == 300.5 and a["wall"] == pytest.approx(381.5)
    assert a["end_budget"] == 3000 and a["drop"]["diff"] == pytest.approx(0.51 - 0.60) and a["drop"]["n"] == 2
    assert b["end_budget"] == 2000 and b["drop"]["diff"] == pytest.approx(0.0)
    assert lr.train_recipes(rows, ["a", "b"], limit_s=130) == [] and len(lr.train_recipes(rows, ["a", "b"], most=1)) == 1


def test_one_panel_per_method_shows_geneval_beside_exact_scenes_and_extras(tmp_path):
    s = league.Settings(out=tmp_path / "out")
    rows = [{"method": m, "seed": seed, "fraction": f, "nfe": 1000 * f, "seconds": 10 * f, "iteration": 4 * f,
             "geneval": 0.4 + 0.1 * f, "exact_scene": 0.3 - 0.1 * f, "extra_objects": 0.5 + 2 * f}
            for m in ("default", "awm", "default_uniform") for seed in (0, 1) for f in (0.5, 1.0)]
    assert lr.plot_methods(s, ["default", "awm", "default_uniform"], tmp_path / "m.png", rows)
    from PIL import Image

    w, h = Image.open(tmp_path / "m.png").size
    assert w > 1000 and h > 150  # five columns, one row
    assert not lr.plot_methods(s, ["nft"], tmp_path / "none.png", rows) and not (tmp_path / "none.png").exists()


def test_named_seeds_or_max_seeds_0_add_no_seeds_and_a_bad_count_is_one_line(capsys, monkeypatch):
    got = []
    monkeypatch.setattr(league, "quarantine", lambda s, dry_run=False: got.append((s.power_target, s.max_seeds)))
    monkeypatch.setattr(league, "plan", lambda s, phases, check_config=True: [])
    monkeypatch.setattr(lr, "write_report", lambda s, docs, readme=None: docs / "report.md")
    for argv, want in ((["--seeds", "0,1"], (0.0, 20)), (["--max-seeds", "0"], (0.0, 0)),
                       (["--max-seeds", "12"], (0.04, 12)), ([], (0.04, 20)),
                       (["--seeds", "0,1", "--max-seeds", "12"], (0.04, 12)), (["--seeds", "0,1", "--max-seeds", "2"], (0.0, 2))):
        league.main(["--phase", "base", "--dry-run", *argv])
        assert got.pop() == want, argv
    with pytest.raises(SystemExit) as e:
        league.main(["--max-seeds", "-1", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-seeds: must be an integer >= 0" in err and "Traceback" not in err


def test_budget_for_refuses_unknown_methods_and_small_budgets(capsys):
    for bad in ("bogus=240000", "flow_grpo=1000", "flow_grpo"):
        with pytest.raises(SystemExit) as e:
            league.main(["--budget-for", bad, "--dry-run", "--phase", "base"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--budget-for:" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ peaks and power
def test_peak_and_end_against_a_hand_computation():
    from scipy.stats import t

    data = {100: {0: 0.40, 1: 0.42, 2: 0.38}, 200: {0: 0.50, 1: 0.46, 2: 0.48}, 300: {0: 0.44, 1: 0.45, 2: 0.40}}
    pe = lr.peak_and_end(data)
    assert pe["peak_budget"] == 200 and pe["end_budget"] == 300
    assert pe["peak"][0] == pytest.approx(0.48) and pe["end"][0] == pytest.approx(0.43)
    assert pe["peak"][1] == pytest.approx(t.ppf(0.975, 2) * 0.02 / math.sqrt(3))  # sd of .50 .46 .48 is 0.02
    d = [0.06, 0.01, 0.08]  # peak - end per seed
    sd = float(np.std(d, ddof=1))
    assert pe["drop"]["diff"] == pytest.approx(0.05) and pe["drop"]["half"] == pytest.approx(t.ppf(0.975, 2) * sd / math.sqrt(3))
    # equal means: the earliest point is the peak; a peak at the end has no drop
    assert lr.peak_budget({1: {0: 0.5}, 2: {0: 0.5}}) == 1
    assert lr.peak_and_end({1: {0: 0.4, 1: 0.5}, 2: {0: 0.6, 1: 0.6}})["drop"]["diff"] == 0.0


def test_seeds_for_is_the_fewest_whose_detectable_difference_is_small_enough():
    for sd in (0.02, 0.04, 0.07):
        n = lr.seeds_for(sd, 0.04)
        assert lr.detectable_difference(sd, n) <= 0.04 < (lr.detectable_difference(sd, n - 1) if n > 2 else 1)
    # large n: the normal approximation (z_0.975 + z_0.8) sd / sqrt(n) <= 0.04
    n = lr.seeds_for(0.07, 0.04)
    assert n == pytest.approx(((1.959964 + 0.841621) * 0.07 / 0.04) ** 2, abs=3)
    assert lr.seeds_for(0.0, 0.04) is None


@pytest.mark.parametrize("gg,gx,ge,extras", [
    (0.10, 0.02, 0.3, True),    # GenEval +0.10, exact scenes +0.02 (< half), more extras
    (0.10, 0.06, 0.3, False),   # exact scenes gained more than half of it
    (0.10, 0.02, -0.1, False),  # fewer extras: the gain is not theirs
    (-0.05, -0.1, 0.3, False),  # no gain
    (0.10, math.nan, 0.3, False),
])
def test_gains_from_extras(gg, gx, ge, extras):
    assert lr.gains_from_extras(gg, gx, ge) is extras


def test_comparisons_at_peak_pair_each_method_at_its_own_peak():
    data = {"a": {1: {0: 0.50, 1: 0.52, 2: 0.51}, 2: {0: 0.40, 1: 0.41, 2: 0.42}},
            "b": {1: {0: 0.40, 1: 0.41, 2: 0.40}, 2: {0: 0.47, 1: 0.49, 2: 0.46}}}
    (r,) = lr.comparisons_at_peak(data, ["a", "b"])
    assert r["leader"] == "a" and r["method"] == "b"
    assert r["diff"] == pytest.approx(np.mean([0.50 - 0.47, 0.52 - 0.49, 0.51 - 0.46]))


def test_the_current_protocol_replaces_an_earlier_ones_rows_per_method():
    rows = [{"method": "a", "budget": 30000, "fraction": 1.0, "seed": 0},  # an earlier run (no run_budget column)
            {"method": "a", "budget": 30000, "fraction": 0.25, "run_budget": 120000, "seed": 0},
            {"method": "b", "budget": 15000, "fraction": 0.5, "seed": 0}]
    got, legacy = lr.select_protocol(rows, lambda m: 120000)
    assert [(r["method"], r["fraction"]) for r in got] == [("a", 0.25), ("b", 0.5)] and legacy == {"b"}


def test_the_report_names_every_difference_of_the_papers_recipe_and_every_pairing_exception():
    from stepflow.config import composer

    with composer() as compose:
        diff = {k for k, _, _ in league.config_differences(compose, league.method("default"), league.method("paper"))}
        exc = league.pairing_exceptions(compose, ["default", "paper", "flow_grpo", "allsteps", "pref_grpo"])
        arms = {c.arm: compose("train", league.method(c.arm).base_overrides()) for c in league.DECOMPOSITION}
    assert {"train.beta_kl", "data.balance_by", "loop.substeps", "sampler.schedule", "train.train_steps",
            "advantage.over", "train.timestep_fraction"} <= diff
    assert set(exc) == {"paper", "flow_grpo", "pref_grpo"} and "balanced" in exc["paper"][0]
    assert "same_latent" in exc["flow_grpo"][0] and "8 prompts x 8" in exc["pref_grpo"][0]
    # each one-change arm differs from its parent exactly where it says
    assert arms["default_kl04"].train.beta_kl == 0.04 and arms["paper_no_kl"].train.beta_kl == 0.0
    assert arms["default_balanced"].data.balance_by == "category" and arms["paper_unbalanced"].data.balance_by is None
    assert arms["default_t5"].loop.substeps == 5 and arms["paper_t2"].loop.substeps == 2
    assert arms["paper_noisy_step0"].sampler.schedule == "eta_s" and arms["default_every_step"].train.train_steps is None
    assert {c.arm for c in league.DECOMPOSITION} <= {m.name for m in league.CLAIM_ARMS}


# ------------------------------------------------------------------------------------------------ the progress bar
def test_time_left_schedules_the_runs_as_the_pool_starts_them():
    """Closed forms of list scheduling, longest first, on the first worker to free."""
    assert league.time_left([10, 10, 10, 10], [], 2) == 20
    assert league.time_left([10], [5, 0], 2) == 10  # the idle worker takes it at once
    assert league.time_left([3, 3, 3], [], 2) == 6
    assert league.time_left([3, 5, 3, 4, 3], [], 2) == 10  # 5 | 4, then 3 -> the 4's worker, 3 -> 5's, 3 -> 7
    assert league.time_left([2, 2], [], 0) == 4  # --jobs 0 runs one at a time
    assert league.time_left([], [-3.0, 7.0], 2) == 7  # a live run past its expected time is "about to end"
    assert league.time_left([], [], 2) == 0


def test_the_league_bar_estimates_from_expected_seconds_scaled_by_the_finished_runs(tmp_path, capsys):
    """Two runs expected at two hours each, one at a time: the bar starts at 4 h, and once the first has taken a
    second or so the second is expected to take as long (tqdm's own estimate, or the unscaled costs, say otherwise)."""
    import re

    runs = []
    for seed in (0, 1):
        r = league.Run("table", league.method("default"), "0.001", seed, tmp_path / "table" / "default" / f"seed={seed}",
                       cost=7200.0)
        r.command = lambda python=None, prefix=(): [sys.executable, "-c", "pass"]
        runs.append(r)
    assert league.run_pool(runs, 1, {"PATH": "/usr/bin:/bin"}) == [0, 0]
    err = capsys.readouterr().err
    frames = [f for f in err.replace("\r", "\n").splitlines() if "|" in f]
    shown = [re.search(r"\| \d+/2 \[[\d:]+, about ([\d.]+) (h|min|s) left\]$", f.strip()) for f in frames]
    assert frames and all(shown), frames  # every drawing of the bar: "[elapsed, about ... left]"
    shown = [m.groups() for m in shown]
    secs = [float(v) * {"h": 3600, "min": 60, "s": 1}[u] for v, u in shown]
    assert secs and secs[0] == 4 * 3600, shown
    after_first = [x for x in secs if x != 4 * 3600]
    assert after_first and after_first[0] < 60, shown  # the second run is expected to take what the first took
