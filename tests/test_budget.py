"""loop.budget (stepflow.core.budget): a run stops after the iteration that reaches its compute budget, evaluates at
eval.at_fractions of it, and a resumed run stops where the uninterrupted one does."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from stepflow.core.budget import Budget, crossed, parse_budget
from stepflow.testing.harness import smoke_config


def rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as fh:
        return list(csv.DictReader(fh))


def train_rows(run_dir: Path) -> list[dict[str, str]]:
    return [r for r in rows(run_dir) if r.get("time/iteration_s")]


def eval_iterations(run_dir: Path) -> list[int]:
    return [int(float(r["iteration"])) for r in rows(run_dir) if r.get("eval/shapes_geneval")]


def fit(run_dir: Path, *overrides: str):
    from stepflow.train import run

    return run(smoke_config("eval.every=0", "eval.max_prompts=4", *overrides), run_dir)


@pytest.mark.parametrize("value,expected", [
    (None, None), (2e5, Budget("nfe", 2e5)), (1500, Budget("nfe", 1500.0)), ("2e5", Budget("nfe", 2e5)),
    ("420s", Budget("seconds", 420.0)), (" 0.5s", Budget("seconds", 0.5)),
])
def test_parse_budget(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", [0, -3, "0s", "abc", "s", "10m", True, float("inf"), float("nan"), [1]])
def test_bad_budgets_name_the_field_and_the_forms(value):
    with pytest.raises(ValueError, match=r"^budget: must be a number of forward-equivalent NFEs"):
        parse_budget(value)


def test_each_fraction_is_reached_by_one_iteration():
    spent = [0, 30, 60, 90, 120, 150]  # iterations of 30 against a budget of 100
    hits = [crossed(a, b, 100, [0.25, 0.5, 1.0]) for a, b in zip(spent, spent[1:])]
    assert hits == [[0.25], [0.5], [], [1.0], []]
    assert crossed(0, 25, 100, [0.25]) == [0.25] and crossed(25, 50, 100, [0.25]) == []  # reached exactly: once


def test_a_budget_in_nfes_stops_the_run_and_evaluates_at_its_fractions(tmp_path):
    """A budget halfway between what iterations 2 and 3 of the smoke recipe spend in total (measured by a run without
    a budget: the iterations differ, the first rolls out to the end for train/reward_final) ends the run after
    iteration 3 of a cap of 50, its spent NFEs the unbudgeted run's, with evaluations at the start, after the first
    iteration reaching each eval.at_fractions of the budget, and at its end."""
    fit(tmp_path / "free", "loop.iterations=5")
    cost = [float(r["cost/nfe_fwd_equiv"]) for r in train_rows(tmp_path / "free")]
    cum = [sum(cost[:i + 1]) for i in range(len(cost))]  # spent after iteration i + 1
    assert all(c > 0 for c in cost)
    budget, fractions = (cum[1] + cum[2]) / 2, [0.2, 0.4, 0.9, 1.0]
    fit(tmp_path / "b", "loop.iterations=50", f"loop.budget={budget}", f"eval.at_fractions={fractions}")
    tr = train_rows(tmp_path / "b")
    assert [float(r["cost/nfe_fwd_equiv_total"]) for r in tr] == cum[:3]
    assert float(tr[-1]["budget/fraction"]) == pytest.approx(cum[2] / budget)
    first = {f: next(i + 1 for i, c in enumerate(cum) if c >= f * budget) for f in fractions}
    assert eval_iterations(tmp_path / "b") == sorted({0, 3, *(i for i in first.values() if i <= 3)})
    assert (tmp_path / "b" / "lora").is_dir()  # a run ended by its budget saves its outputs as a finished one


def test_eval_at_start_false_skips_the_base_evaluation_only(tmp_path):
    """eval.at_start=false (a suite evaluates its one base once): no evaluation before iteration 1, the others as
    with it (every 2 iterations and the end); the summary line names the first evaluation's iteration."""
    from stepflow.train import summary_line

    m = fit(tmp_path / "r", "loop.iterations=3", "eval.every=2", "eval.at_start=false")
    assert eval_iterations(tmp_path / "r") == [2, 3]
    assert "(from iteration 2)" in summary_line(m.history, tmp_path / "r")
    m = fit(tmp_path / "s", "loop.iterations=1")
    assert eval_iterations(tmp_path / "s") == [0, 1] and "from iteration" not in summary_line(m.history, tmp_path)


def test_a_resumed_budget_run_stops_where_the_uninterrupted_one_does(tmp_path):
    """Interrupted by its cap after iteration 2 and resumed with the cap raised, a budget run stopping after
    iteration 4 (a budget between what iterations 3 and 4 spend) stops there with the uninterrupted run's metrics and
    spent counters (a continuous reward, so every iteration trains)."""
    cont = ["reward=pickscore_tiny"]
    fit(tmp_path / "free", "loop.iterations=4", *cont)
    cum = float(train_rows(tmp_path / "free")[2]["cost/nfe_fwd_equiv_total"]), \
        float(train_rows(tmp_path / "free")[3]["cost/nfe_fwd_equiv_total"])
    budget = f"loop.budget={(cum[0] + cum[1]) / 2}"
    fit(tmp_path / "full", "loop.iterations=50", budget, *cont)
    fit(tmp_path / "part", "loop.iterations=2", budget, *cont)
    ckpt = tmp_path / "part" / "checkpoints" / "last.ckpt"
    fit(tmp_path / "part", "loop.iterations=50", budget, f"ckpt_path={ckpt}", *cont)
    a, b = train_rows(tmp_path / "full"), train_rows(tmp_path / "part")
    assert len(a) == len(b) == 4
    for key in ("cost/nfe_fwd_equiv_total", "budget/fraction", "train/reward_mean", "train/policy_loss", "train/grad_norm"):
        assert a[-1][key] != "" and float(a[-1][key]) == pytest.approx(float(b[-1][key]), rel=1e-6, abs=1e-9), key
    # run again once finished: nothing more is spent
    fit(tmp_path / "part", "loop.iterations=50", budget, f"ckpt_path={ckpt}", *cont)
    assert len(train_rows(tmp_path / "part")) == 4


def test_a_finished_budget_run_extended_from_its_checkpoint_is_the_run_to_the_larger_budget(tmp_path):
    """A run that finished at budget B1 (its last iteration evaluated, its adapter written), resumed from its
    last.ckpt with budget B2 > B1 and evaluation points that hold B1, is the run made to B2 in one go: the same
    training rows, the same evaluations at the same iterations, the same final adapter (what the league does when
    it doubles a still-rising method's budget instead of running it again from the start)."""
    from safetensors.torch import load_file

    cont = ["reward=pickscore_tiny", "eval.at_start=false"]
    fit(tmp_path / "free", "loop.iterations=4", *cont)
    cum = [float(r["cost/nfe_fwd_equiv_total"]) for r in train_rows(tmp_path / "free")]
    b1, b2 = (cum[0] + cum[1]) / 2, (cum[2] + cum[3]) / 2  # B1 ends after iteration 2, B2 after iteration 4
    two = [f"loop.budget={b2}", f"eval.at_fractions=[{b1 / b2},1.0]"]
    fit(tmp_path / "full", "loop.iterations=50", *two, *cont)
    fit(tmp_path / "part", "loop.iterations=50", f"loop.budget={b1}", "eval.at_fractions=[1.0]", *cont)
    def evals(d):  # the held-out score of this reward, per evaluated iteration
        return [(int(float(r["iteration"])), float(r["eval/pickscore"])) for r in rows(tmp_path / d)
                if r.get("eval/pickscore")]

    assert [i for i, _ in evals("part")] == [2] and (tmp_path / "part" / "lora").is_dir()
    ckpt = tmp_path / "part" / "checkpoints" / "last.ckpt"
    fit(tmp_path / "part", "loop.iterations=50", *two, f"ckpt_path={ckpt}", *cont)
    a, b = train_rows(tmp_path / "full"), train_rows(tmp_path / "part")
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        for key in ("cost/nfe_fwd_equiv_total", "train/reward_mean", "train/policy_loss", "train/grad_norm"):
            assert ra[key] != "" and float(ra[key]) == pytest.approx(float(rb[key]), rel=1e-6, abs=1e-9), key
    assert [i for i, _ in evals("part")] == [i for i, _ in evals("full")] == [2, 4]
    assert [v for _, v in evals("part")] == pytest.approx([v for _, v in evals("full")], abs=1e-9)
    wa, wb = (load_file(tmp_path / d / "lora" / "pytorch_lora_weights.safetensors") for d in ("full", "part"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_budget_in_seconds_counts_the_iterations_own_seconds(tmp_path):
    """loop.budget='<N>s': the iterations' time/iteration_s summed (evaluation not counted); a budget smaller
    than one iteration ends the run after it."""
    fit(tmp_path, "loop.iterations=5", "loop.budget=0.001s")
    tr = train_rows(tmp_path)
    assert len(tr) == 1
    assert float(tr[0]["cost/train_seconds_total"]) == pytest.approx(float(tr[0]["time/iteration_s"]))
    assert float(tr[0]["budget/fraction"]) == pytest.approx(float(tr[0]["time/iteration_s"]) / 0.001)


def test_a_bad_budget_is_one_line(tmp_path, cli):
    r = cli("stepflow.train", "experiment=smoke", f"hydra.run.dir={tmp_path}", "loop.budget=10m")
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith("stepflow: error:") and "loop.budget" in err[0] and "'420s'" in err[0], err[0]
    r = cli("stepflow.train", "experiment=smoke", f"hydra.run.dir={tmp_path}", "eval.at_fractions=[0,2]")
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and "eval.at_fractions" in err[0], r.stderr[-2000:]


def test_an_evaluation_a_stop_interrupts_runs_when_the_run_resumes(tmp_path, monkeypatch):
    """A stop during the evaluation after a budget run's last iteration (SIGTERM while the held-out prompts are
    sampled) leaves last.ckpt at that iteration; resumed, the run is finished but its evaluation was never made:
    it runs first, the same numbers as the uninterrupted run's, and the outputs are written."""
    from stepflow.core import stop
    from stepflow.errors import StepflowError
    from stepflow.grpo import GRPOModule

    budget = ["loop.iterations=50", "loop.budget=1", "eval.at_start=false"]  # the first iteration spends it
    fit(tmp_path / "full", *budget)
    original = GRPOModule.run_evaluation

    def interrupted(self):
        stop.request("SIGTERM")  # arrives while the first batch of held-out prompts is due
        return original(self)

    monkeypatch.setattr(GRPOModule, "run_evaluation", interrupted)
    try:
        with pytest.raises(StepflowError):
            fit(tmp_path / "part", *budget)
    finally:
        stop.clear()
    monkeypatch.setattr(GRPOModule, "run_evaluation", original)
    assert eval_iterations(tmp_path / "part") == [] and not (tmp_path / "part" / "lora").exists()
    ckpt = tmp_path / "part" / "checkpoints" / "last.ckpt"
    fit(tmp_path / "part", *budget, f"ckpt_path={ckpt}")
    assert eval_iterations(tmp_path / "part") == eval_iterations(tmp_path / "full") == [1]
    a, b = (next(r for r in rows(tmp_path / d) if r.get("eval/shapes_geneval")) for d in ("full", "part"))
    assert float(a["eval/shapes_geneval"]) == pytest.approx(float(b["eval/shapes_geneval"]), abs=1e-9)
    assert len(train_rows(tmp_path / "part")) == 1 and (tmp_path / "part" / "lora").is_dir()
    fit(tmp_path / "part", *budget, f"ckpt_path={ckpt}")  # once more: nothing is evaluated twice
    assert eval_iterations(tmp_path / "part") == [1]
