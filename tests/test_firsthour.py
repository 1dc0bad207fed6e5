"""What a newcomer meets: a quiet run (each line once, no library adverts or deprecations), one checkpoint file, the
summary in train.log, a resume that writes into the resumed run's directory, a progress bar whose total is what the
run will do, a failed start that leaves only its explanation, `make help`, and training grids that show GenEval's
verdict on category-balanced prompts."""

from __future__ import annotations

import csv
import re
import subprocess
from types import SimpleNamespace

import pytest
import torch

from stepflow.testing.harness import ROOT, run_cli

NOISE = re.compile(r"💡|tip:|deprecat|LeafSpec|module\(s\) in eval mode|litlogger|litmodels", re.I)
PREFIX = re.compile(r"^\[[^]]*\]\[[^]]*\]\[[A-Z]+\] - |^[A-Z]+: ")


def _lines(r) -> list[str]:
    text = (r.stdout + "\n" + r.stderr).replace("\r", "\n")
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("GRPO:")]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("first")
    r = run_cli("stepflow.train", "experiment=smoke", "loop.iterations=2", f"hydra.run.dir={d / 'run'}", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return d, r


def test_a_run_prints_each_line_once_and_no_library_adverts(first_run):
    _, r = first_run
    lines = _lines(r)
    assert not [ln for ln in lines if NOISE.search(ln)], [ln for ln in lines if NOISE.search(ln)]
    bare = [PREFIX.sub("", ln) for ln in lines]
    assert len(bare) == len(set(bare)), sorted({b for b in bare if bare.count(b) > 1})
    assert any("GPU available" in b for b in bare)  # Lightning's own lines still appear (once)


def test_one_checkpoint_file_and_the_summary_in_train_log(first_run):
    d, r = first_run
    assert sorted(p.relative_to(d / "run").as_posix() for p in (d / "run").rglob("*.ckpt")) == ["checkpoints/last.ckpt"]
    summary = r.stdout.strip().splitlines()[-1]
    assert summary.startswith("stepflow: 2 iterations,") and summary in (d / "run" / "train.log").read_text()


def test_a_resume_started_elsewhere_continues_in_the_run_directory(first_run):
    d, _ = first_run
    run = d / "run"
    before = (run / ".hydra" / "overrides.yaml").read_text()
    elsewhere = d / "elsewhere"
    elsewhere.mkdir()
    r = run_cli("stepflow.train", "experiment=smoke", "loop.iterations=3",
                f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", cwd=elsewhere, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not list(elsewhere.iterdir())  # no outputs/ of its own
    assert (run / ".hydra" / "overrides.yaml").read_text() == before  # the original record is kept
    assert [p.name for p in (run / ".hydra").glob("resume_*")], "the resume's own Hydra record"
    its = {int(float(x["iteration"])) for x in csv.DictReader((run / "metrics.csv").open()) if x.get("cost/nfe")}
    assert its == {1, 2, 3}
    assert "stepflow: 3 iterations," in (run / "train.log").read_text()
    assert len(list(run.rglob("*.ckpt"))) == 1
    # a refused resume (another lr) leaves the run as it was, but for its error line in train.log
    records = sorted(p.name for p in (run / ".hydra").glob("resume_*"))
    r = run_cli("stepflow.train", "experiment=smoke", "loop.iterations=4", "train.lr=0.5",
                f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", cwd=elsewhere, timeout=900)
    assert r.returncode != 0 and "train.lr" in r.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in (run / ".hydra").glob("resume_*")) == records and not list(elsewhere.iterdir())
    assert r.stderr.strip().splitlines()[-1] in (run / "train.log").read_text()


def test_a_run_that_fails_before_its_first_iteration_leaves_only_its_explanation(tmp_path):
    run = tmp_path / "run"
    r = run_cli("stepflow.train", "model=sd35_medium", "loop.iterations=1", f"hydra.run.dir={run}", timeout=600)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()[-1]
    assert "hf download stabilityai/stable-diffusion-3.5-medium" in err and "hf auth login" in err
    assert "huggingface-cli" not in err
    left = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    assert left == [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "train.log"], left
    assert err in (run / "train.log").read_text()


def _module(iterations, budget=None, iteration=0, spent=0.0):
    from stepflow.core.budget import parse_budget

    return SimpleNamespace(loop=SimpleNamespace(iterations=iterations), budget=parse_budget(budget),
                           iteration=iteration, spent={"nfe": spent, "seconds": 0.0})


def test_the_progress_bars_total_is_what_the_run_will_do():
    from stepflow.shell.progress import Progress

    p = Progress.__new__(Progress)
    p.module = _module(60)
    assert p.total() == 60 and p.total(done=True) == 0
    p.module = _module(5000, budget=30000)
    assert p.total() is None  # unknown before the first iteration: no percentage rather than a false one
    p.module = _module(5000, budget=30000, iteration=2, spent=5000.0)  # 2,500 per iteration: 12 in all
    assert p.total() == 12
    p.module = _module(8, budget=30000, iteration=2, spent=5000.0)  # loop.iterations caps it
    assert p.total() == 8
    p.module = _module(5000, budget=30000, iteration=13, spent=30500.0)
    assert p.total(done=True) == 13 and p.total() == 13


def test_a_budget_run_ends_its_bar_at_100_percent(tmp_path):
    r = run_cli("stepflow.train", "experiment=smoke", "loop.iterations=200", "loop.budget=300", "eval.at_start=false",
                f"hydra.run.dir={tmp_path / 'run'}", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    bars = [ln for ln in r.stderr.replace("\r", "\n").splitlines() if ln.startswith("GRPO:")]
    assert bars and "100%" in bars[-1] and "/200" not in bars[-1], bars[-1]


def test_make_help_lists_every_target_with_a_line():
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    targets = re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M)
    shown = {ln.split()[0] for ln in out.stdout.splitlines()[1:] if ln.strip()}
    assert set(targets) - {"install"} <= shown | {"install"} and {"train", "test", "league"} <= shown


def test_training_grids_take_the_categories_in_turn_and_frame_the_verdict(tmp_path, monkeypatch):
    from stepflow.core import heldout
    from stepflow.shell import outputs

    cats = ["single"] * 5 + ["two"] * 5 + ["count"] * 5
    recs = [{"prompt": f"{c} {i}", "category": c} for i, c in enumerate(cats)]
    assert heldout.balanced_indices(recs, 4) == [0, 5, 10, 1]
    got = {}
    monkeypatch.setattr(heldout, "save_grid", lambda images, prompts, path, **kw: got.update(prompts=prompts, **kw))
    module = SimpleNamespace(eval_cfg=SimpleNamespace(grid_prompts=6), reward=SimpleNamespace(name="shapes_geneval"),
                             iteration=12, run_dir=tmp_path)
    strict = [i % 2 == 0 for i in range(15)]
    outputs.save_eval_grid(module, torch.zeros(15, 3, 4, 4), [r["prompt"] for r in recs],
                           {"records": recs, "strict": strict, "scores": [0.0] * 15}, {"eval/geneval": 0.5})
    assert got["prompts"] == ["single 0", "two 5", "count 10", "single 1", "two 6", "count 11"]
    assert got["passed"] == [True, False, True, False, True, False] and got["scores"] is None
    assert "after iteration 12" in got["title"] and "GenEval 0.500" in got["title"] and "3/6" in got["title"]
    assert "accept objects beyond the asked ones" in got["title"].replace("\n", " ")
