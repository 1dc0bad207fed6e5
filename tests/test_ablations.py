"""The ablation suite: experiment files compose, the report's numbers (mean ± t-CI) and plots, the skip logic and the
planned command lines (nothing is trained here, except in the `slow` end-to-end test on the smoke config)."""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from stepflow.cli import CONF_DIR
from stepflow.testing.harness import compose_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
import ablations  # noqa: E402
import report  # noqa: E402

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def _compose(overrides, hydra_cfg=False):
    return compose_config("train", overrides, return_hydra_config=hydra_cfg)


# ---------------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_file_composes(name):
    c = ablations.planned_config(name, [])  # Hydra compose of train.yaml with experiment=<name>, resolved
    assert c["loop"]["iterations"] >= 1 and c["loop"]["group_size"] >= 2
    if name.startswith("paper_"):  # the paper's settings (method.md §7.1)
        assert c["experiment_name"] == name
        assert c["model"]["name"] == "sd35_medium" and c["trainer"]["devices"] == 8 and c["trainer"]["strategy"] == "ddp"
        assert c["loop"]["num_steps"] == 10 and c["loop"]["substeps"] == 5
        assert c["train"]["lr"] == 3e-4 and c["train"]["clip_eps"] == 1e-4 and c["train"]["timestep_fraction"] == 0.99
        assert (c["lora"]["rank"], c["lora"]["alpha"]) == (32, 64)
        assert c["eval"]["num_steps"] == 40 and c["eval"]["guidance"] == 4.5
        assert c["sampler"].get("a", 0.7) == 0.7 and c["sampler"].get("eta", 0.9) == 0.9
        batch = c["loop"]["prompts_per_iter"] * c["loop"]["group_size"]
        assert batch % c["trainer"]["devices"] == 0
        if name != "paper_fig2_diagnostics":
            assert c["loop"]["group_size"] == 16
            per_gpu = batch // 8
            assert (c["loop"]["guidance"], per_gpu) in ((1.0, 16), (4.5, 8))
        geneval_like = c["reward"].get("name") == "geneval" or name == "paper_fig11_ocr"
        assert c["train"]["beta_kl"] == (0.04 if geneval_like else 0.01)
    elif name.startswith("mini_"):
        assert c["experiment_name"] == name
        assert c["model"]["_target_"].startswith("stepflow.policies.shapes") and c["trainer"]["accelerator"] == "cpu"
        assert c["loop"]["num_steps"] == 10


def test_the_paper_experiments_have_files_and_twins():
    figs = ["fig4_pickscore_geneval", "fig4_imagereward_geneval", "fig4_unifiedreward_geneval",
            "fig4_pickscore_pickscore", "fig6_sde", "fig10_substeps", "fig9_norm", "fig7_credit", "table1_cfg45",
            "fig12_geneval_long", "fig13_unifiedreward_long", "fig11_ocr", "fig2_diagnostics"]
    for f in figs:
        assert f"paper_{f}" in EXPERIMENTS
        twin = re.search(r"Miniature twin: (mini_\w+)", (CONF_DIR / "experiment" / f"paper_{f}.yaml").read_text())
        assert twin and twin.group(1) in EXPERIMENTS, f


@pytest.mark.parametrize("data", ["geneval", "pickscore", "ocr"])
def test_real_prompt_data_configs(data):
    c = _compose([f"data={data}"])
    assert c.data.name == data and c.data.train_file.startswith("data/") and c.data.eval_file.startswith("data/")


def test_mini_ocr_twin_builds_its_multi_reward():
    from stepflow.train import build_reward

    r = build_reward(_compose(["experiment=mini_fig11_ocr"]))
    assert r.name == "multi" and r.weights == {"strict": 0.8, "partial": 0.2}
    assert {k: v.mode for k, v in r.rewards.items()} == {"strict": "strict", "partial": "partial"}


def test_slurm_launcher_config():
    cfg = _compose(["experiment=paper_fig6_sde", "hydra/launcher=slurm"], hydra_cfg=True)
    lc = cfg.hydra.launcher
    assert lc._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (lc.gpus_per_node, lc.tasks_per_node, lc.nodes) == (8, 8, 1) and lc.timeout_min > 0
    assert "partition" in lc
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher  # noqa: F401


@pytest.mark.parametrize("suite", ["full", "paper"])  # (quick: composed by its dry run below)
def test_every_planned_arm_composes(suite, tmp_path):
    s = ablations.build_suites()[suite]
    jobs = ablations.plan(s, tmp_path, check_config=True)  # composes every arm
    assert len(jobs) == sum(len(a.arms()) for a in s.ablations) * len(s.seeds)
    assert {j.status for j in jobs} == {"missing", "shared"}  # shared: the common baseline arm (see below)
    assert sum(j.status == "shared" for j in jobs) == 3 * len(s.seeds)
    assert len(s.seeds) >= 3


def test_step0_suite_plans_the_default_recipe(tmp_path):
    """--suite step0: method x SDE x 3 seeds on mini_step0, which is the no-argument default recipe (step 0 trained),
    and the cost ablation, whose default gain and uniform arms are method_sampler's runs (linked, not rerun)."""
    s = ablations.build_suites()["step0"]
    jobs = ablations.plan(s, tmp_path, check_config=True)
    assert len(jobs) == (4 + 5) * 3
    assert sorted(j.status for j in jobs) == ["missing"] * 21 + ["shared"] * 6
    assert [ablations.arm_label(x) for x in s.ablations[1].arms()][1] == "advantage.over=all,advantage=gain,sampler=ddim_sde"
    assert [ablations.arm_label(x) for x in s.ablations[0].arms()] == [
        "advantage=uniform,sampler=flow_sde", "advantage=uniform,sampler=ddim_sde",
        "advantage=gain,sampler=flow_sde", "advantage=gain,sampler=ddim_sde"]
    default = ablations.planned_config("mini_step0", ["advantage=gain", "sampler=ddim_sde", "seed=0"])
    assert default["train"]["train_steps"] == [0] and default["loop"]["prompts_per_iter"] == 4
    assert default["sampler"]["schedule"] == "eta_s" and default["loop"]["iterations"] == 60
    plain = OmegaConf.to_container(compose_config("train"), resolve=True)  # python -m stepflow.train, no arguments
    default.pop("experiment_name"), plain.pop("experiment_name")  # set by experiment files only
    default.pop("experiment", None), plain.pop("experiment", None)
    assert default == plain


def test_full_suite_axes():
    s = ablations.build_suites()["full"]
    arms = {a.name: [ablations.arm_label(x) for x in a.arms()] for a in s.ablations}
    assert arms["method_sampler"] == ["advantage=uniform,sampler=flow_sde", "advantage=uniform,sampler=ddim_sde",
                                      "advantage=gain,sampler=flow_sde", "advantage=gain,sampler=ddim_sde"]
    assert arms["substeps"] == ["loop.substeps=1", "loop.substeps=2", "loop.substeps=5", "loop.substeps=8",
                                "loop.adaptive_substeps=true"]
    assert arms["normalization"] == ["advantage=gain", "advantage=gain_per_step"]
    assert arms["credit"] == ["advantage=gain", "advantage=gain_ema", "advantage=gae", "objective=distill"]
    assert s.seeds == [0, 1, 2] and s.launcher is None
    assert ablations.build_suites()["paper"].launcher == "slurm"


# ---------------------------------------------------------------------------------------------------- naming
def test_run_name_is_hydras_override_dirname():
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    arm = {"sampler": "ddim_sde", "advantage": "gain", "loop.substeps": "5"}
    lines = ["loop.iterations=12", *(f"{k}={v}" for k, v in arm.items()), "seed=2", "experiment=mini_fig6_sde"]
    parsed = OverridesParser.create().parse_overrides(lines)
    expect = get_overrides_dirname(parsed, ["experiment", "ckpt_path", "loop.iterations"], ",", "=")
    assert ablations.run_name(arm, 2) == expect == "advantage=gain,loop.substeps=5,sampler=ddim_sde,seed=2"
    # a boolean override is written as Hydra parses it (True), else finished runs would be planned again
    assert ablations.run_name({"loop.adaptive_substeps": "true"}, 0) == "loop.adaptive_substeps=True,seed=0"


# ---------------------------------------------------------------------------------------------------- report
def _write_run(d: Path, cfg: dict, evals: dict[int, float], iterations: int, nfe: float = 100.0, t_iter: float = 2.0,
               lora: bool = False, ckpt: bool = False, geneval: dict[int, float] | None = None) -> Path:
    """A fake run dir: config.yaml + metrics.csv in stepflow's format (train rows 1..n, eval rows)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    last_train = max([i for i in evals] + [0])
    for it in range(0, iterations + 1):
        if 1 <= it <= last_train:
            rows.append({"iteration": it, "train/reward_final": 0.1 * it, "time/iteration_s": t_iter, "cost/nfe": nfe,
                         "cost/nfe_total": nfe * it, "cost/reward_calls": 1, "cost/reward_images_total": 64 * it})
        if it in evals:
            r = {"iteration": it, "eval/shapes_geneval": evals[it]}
            if geneval and it in geneval:
                r["eval/geneval"] = geneval[it]
            rows.append(r)
    cols = ["iteration"] + sorted({k for r in rows for k in r if k != "iteration"})
    with (d / "metrics.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    if lora:
        (d / "lora").mkdir()
        (d / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    if ckpt:
        (d / "checkpoints").mkdir()
        (d / "checkpoints" / "last.ckpt").write_bytes(b"x")
    return d


def _cfg(adv: str, seed: int, iterations: int = 4) -> dict:
    return {"seed": seed, "experiment_name": "mini_fig9_norm", "advantage": {"scheme": adv, "eps": 1e-4},
            "loop": {"iterations": iterations, "seed": seed, "substeps": 5}, "ckpt_path": None}


def test_mean_ci_is_the_t_interval():
    from scipy import stats

    m, h, n = report.mean_ci([0.5, 0.6, 0.7])
    # by hand: mean 0.6, sample std 0.1, t_{0.975, 2} = 4.302652729911275 -> 4.302652729911275 * 0.1 / sqrt(3)
    assert n == 3 and m == pytest.approx(0.6) and h == pytest.approx(0.24841377, abs=1e-8)
    lo, hi = stats.t.interval(0.95, 2, loc=0.6, scale=stats.sem([0.5, 0.6, 0.7]))
    assert (m - h, m + h) == pytest.approx((lo, hi))
    assert math.isnan(report.mean_ci([1.0])[1]) and report.mean_ci([])[2] == 0
    assert report.fmt_ci(*report.mean_ci([0.5, 0.6, 0.7])) == "0.600 ± 0.248"


def test_report_on_synthetic_runs(tmp_path):
    sweep = tmp_path / "sweep"
    abl = sweep / "normalization"
    # arm gain: finals 0.5, 0.6, 0.7 (seeds 0-2); arm gain_per_step: 0.3, 0.45 (+ one unfinished run)
    for seed, final in enumerate([0.5, 0.6, 0.7]):
        _write_run(abl / f"advantage=gain,seed={seed}", _cfg("gain", seed), {0: 0.2, 2: final - 0.05, 4: final},
                   4, nfe=100.0, t_iter=2.0 + seed, geneval={0: 0.1, 4: 0.3 + 0.1 * seed})
    for seed, final in enumerate([0.3, 0.45]):
        _write_run(abl / f"advantage=gain_per_step,seed={seed}", _cfg("gain_per_step", seed), {0: 0.2, 2: 0.25, 4: final},
                   4, nfe=50.0)
    _write_run(abl / "advantage=gain_per_step,seed=2", _cfg("gain_per_step", 2), {0: 0.2, 2: 0.9}, 4, ckpt=True)
    (abl / ".hydra").mkdir()
    md = report.build_report(sweep)
    text = md.read_text()
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in text.splitlines()
            if ln.startswith("| `")}
    gain, per_step = rows["`advantage=gain`"], rows["`advantage=gain_per_step`"]
    assert gain[0] == "3" and per_step[0] == "2 (+1 unfinished)"
    assert gain[1] == "0.600 ± 0.248"  # t_{0.975,2} * 0.1 / sqrt(3)
    # two seeds: mean 0.375, s = 0.1060660, t_{0.975,1} = 12.706204736 -> 12.706204736 * 0.1060660 / sqrt(2) = 0.9530
    assert per_step[1] == "0.375 ± 0.953"
    assert gain[2] == "0.400 ± 0.248"  # final strict GenEval 0.3, 0.4, 0.5
    assert per_step[2] == "—"
    # target = base 0.2 + 0.5 * (0.6 - 0.2) = 0.4: gain reaches it at iteration 2 (0.45, 0.55, 0.65) in every seed;
    # gain_per_step: 0.25 at 2, then 0.3 / 0.45 at 4 -> only seed 1, at 4
    assert "≥ 0.4" in text
    assert gain[3] == "2.0"  # identical in every seed: no ± 0
    assert per_step[3] == "4.0 (1/2 reached)"
    assert gain[4] == "12.0 ± 9.9"  # wall: 4 iterations x (2, 3, 4) s = 8, 12, 16 -> 12 ± 4.303 * 4 / sqrt(3)
    assert gain[5] == "400" and per_step[5] == "200"  # NFEs: nfe_total at iteration 4
    assert gain[6] == "4" and gain[7] == "256"  # reward calls, rewarded images
    for suffix in ("iteration", "nfe", "wallclock"):
        png = md.parent / f"normalization_{suffix}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png.name})" in text
    summary = json.loads((md.parent / "summary.json").read_text())
    g = summary["ablations"]["normalization"]["arms"]["advantage=gain"]
    assert g["final held-out reward"]["mean"] == pytest.approx(0.6) and g["final held-out reward"]["n"] == 3
    assert g["final held-out reward"]["ci95"] == pytest.approx(0.24841377, abs=1e-8)
    # an absolute target and the CLI
    md2 = report.main([str(sweep), "--out", str(tmp_path / "r2"), "--target", "0.62"])
    rows2 = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in md2.read_text().splitlines()
             if ln.startswith("| `")}
    assert rows2["`advantage=gain`"][3] == "2.0 (1/3 reached)"  # only seed 2 (0.65 at 2); seeds 0, 1 top at 0.5, 0.6
    assert "≥ 0.62 (given)" in md2.read_text()


def test_report_labels_arms_by_config_without_dir_names(tmp_path):
    sweep = tmp_path / "multirun"  # Hydra's default layout: job numbers, no seed in the names
    for i, (adv, seed) in enumerate([("uniform", 0), ("gain", 0), ("uniform", 1), ("gain", 1)]):
        _write_run(sweep / str(i), _cfg(adv, seed, 2), {0: 0.1, 2: 0.2 + 0.1 * (adv == "gain")}, 2, lora=True)
    md = report.build_report(sweep)
    text = md.read_text()
    assert "| `advantage.scheme=gain` | 2 |" in text and "| `advantage.scheme=uniform` | 2 |" in text
    assert "## multirun" in text


# ---------------------------------------------------------------------------------------------------- skip logic
def test_finished_vs_unfinished_runs(tmp_path):
    done = _write_run(tmp_path / "done", _cfg("gain", 0, 4), {0: 0.1, 4: 0.3}, 4)
    assert report.run_finished(done)
    partial = _write_run(tmp_path / "partial", _cfg("gain", 0, 4), {0: 0.1, 2: 0.3}, 4, ckpt=True)
    assert not report.run_finished(partial)
    assert not report.run_finished(partial, iterations=4) and report.run_finished(partial, iterations=2)
    lora_only = _write_run(tmp_path / "lora", _cfg("gain", 0, 4), {0: 0.1}, 4, lora=True)
    assert report.run_finished(lora_only)
    # the same directory being run again from scratch: a checkpoint newer than the old adapter -> not finished
    rerun = _write_run(tmp_path / "rerun", _cfg("gain", 0, 4), {0: 0.1}, 4, lora=True, ckpt=True)
    ad = rerun / "lora" / "pytorch_lora_weights.safetensors"
    os.utime(ad, (ad.stat().st_mtime - 60, ad.stat().st_mtime - 60))
    assert not report.run_finished(rerun) and ablations.job_status(rerun)[0] == "resume"
    assert not report.run_finished(tmp_path / "nothing")
    assert ablations.job_status(done)[0] == "finished"
    assert ablations.job_status(partial)[0] == "resume"
    assert ablations.job_status(_write_run(tmp_path / "started", _cfg("gain", 0, 4), {0: 0.1}, 4))[0] == "missing"
    assert ablations.job_status(tmp_path / "nothing")[0] == "missing"
    # the stored config must agree with the plan (seed keys and keys only one side has are ignored)
    planned = _cfg("gain", 7, 4) | {"new_default": 1}
    assert ablations.job_status(done, planned)[0] == "finished"
    st, why = ablations.job_status(done, _cfg("gain_per_step", 0, 4))
    assert st == "stale" and "advantage.scheme" in why
    # a longer run was planned: the 4-iteration run is no longer finished; with a checkpoint it is extended
    assert ablations.job_status(done, _cfg("gain", 0, 8))[0] == "stale"
    (done / "checkpoints").mkdir()
    (done / "checkpoints" / "last.ckpt").write_bytes(b"x")
    assert ablations.job_status(done, _cfg("gain", 0, 8)) == ("resume", "extend from 4 to 8 iterations")
    assert ablations.job_status(done, _cfg("gain", 0, 2))[0] == "stale"  # shorter: rerun


def _suite(tmp_path):
    abl = ablations.Ablation("method", "smoke", {"advantage": ["uniform", "gain"], "sampler": ["flow_sde", "ddim_sde"]},
                             [{"loop.substeps": "1"}])
    return ablations.Suite("t", [abl], [0, 1, 2], common=["loop.iterations=2"], sweep_dir=str(tmp_path))


def _cmd_str(c):
    return " ".join(c)


def test_only_missing_runs_are_launched(tmp_path):
    suite = _suite(tmp_path)
    jobs = ablations.plan(suite, tmp_path, check_config=False)
    assert len(jobs) == 5 * 3
    cmds = ablations.plan_commands(suite, jobs, tmp_path, python="py")
    # nothing exists: one multirun over the axes + one for the extra arm
    assert len(cmds) == 2
    assert "advantage=uniform,gain sampler=flow_sde,ddim_sde seed=0,1,2" in _cmd_str(cmds[0])
    assert "loop.substeps=1 seed=0,1,2" in _cmd_str(cmds[1])
    # a sub-grid of the axes missing the same seeds is still one multirun
    for j in jobs:
        if not (j.arm.get("advantage") == "uniform" and j.seed == 0):
            j.status = "finished"
    grid_cmds = [_cmd_str(c) for c in ablations.plan_commands(suite, jobs, tmp_path, python="py")]
    assert len(grid_cmds) == 1 and "advantage=uniform sampler=flow_sde,ddim_sde seed=0 " in grid_cmds[0]
    # finish some runs, leave one resumable
    d = tmp_path / "method"
    cfg = _cfg("gain", 0, 2)
    for arm in ablations.Ablation.arms(suite.ablations[0]):
        _write_run(d / ablations.run_name(arm, 0), cfg, {0: 0.1, 2: 0.2}, 2)
    _write_run(d / ablations.run_name({"advantage": "gain", "sampler": "ddim_sde"}, 1), cfg, {0: 0.1, 2: 0.2}, 2)
    _write_run(d / ablations.run_name({"advantage": "uniform", "sampler": "flow_sde"}, 2), cfg, {0: 0.1}, 2, ckpt=True)
    jobs = ablations.plan(suite, tmp_path, check_config=False)
    st = {(ablations.arm_label(j.arm), j.seed): j.status for j in jobs}
    assert st[("advantage=gain,sampler=ddim_sde", 0)] == "finished"
    assert st[("advantage=uniform,sampler=flow_sde", 2)] == "resume"
    assert sum(s == "finished" for s in st.values()) == 6
    cmds = [_cmd_str(c) for c in ablations.plan_commands(suite, jobs, tmp_path, python="py")]
    launched = []
    for c in cmds:  # expand each multirun into its jobs
        axes = [t.split("=", 1) for t in c.split() if t.startswith(("advantage=", "sampler=", "loop.substeps="))]
        seeds = re.search(r" seed=([\d,]+)", c).group(1).split(",")
        for vals in itertools.product(*(v.split(",") for _, v in axes)):
            arm = " ".join(f"{k}={v}" for (k, _), v in zip(axes, vals))
            launched += [(arm, int(s), "ckpt_path=" in c) for s in seeds]
    expect_missing = {(f"advantage={a} sampler={s}", seed) for a in ("uniform", "gain") for s in ("flow_sde", "ddim_sde")
                      for seed in (1, 2)} - {("advantage=gain sampler=ddim_sde", 1), ("advantage=uniform sampler=flow_sde", 2)}
    expect_missing |= {("loop.substeps=1", 1), ("loop.substeps=1", 2)}
    assert {(a, s) for a, s, r in launched if not r} == expect_missing
    assert [(a, s) for a, s, r in launched if r] == [("advantage=uniform sampler=flow_sde", 2)]
    assert len(launched) == len(set(launched))  # nothing twice, nothing finished
    resume = next(c for c in cmds if "ckpt_path=" in c)
    assert "checkpoints/last.ckpt'" in resume  # quoted: the run dir name holds ',' and '='
    # all finished -> nothing to launch
    for j in jobs:
        if j.status != "finished":
            _write_run(j.run_dir, cfg, {0: 0.1, 2: 0.2}, 2, lora=True)
    jobs = ablations.plan(suite, tmp_path, check_config=False)
    assert all(j.status == "finished" for j in jobs) and ablations.plan_commands(suite, jobs, tmp_path) == []


def test_quick_suite_command_lines(tmp_path, capsys):
    rc = ablations.main(["--suite", "quick", "--dry-run", "--sweep-dir", str(tmp_path / "q")])
    assert rc == 0
    out = capsys.readouterr().out
    cmds = [ln for ln in out.splitlines() if "stepflow.train" in ln]
    assert "14 runs to run" not in out and "20 runs in 4 ablations" in out and "6 shared" in out
    assert len(cmds) == 4  # one multirun per ablation; the baseline arm (gain, flow_sde, T' = 5) runs once
    by_exp = {re.search(r"experiment=(\S+)", c).group(1): c for c in cmds}
    assert set(by_exp) == {"mini_fig6_sde", "mini_fig10_substeps", "mini_fig9_norm", "mini_fig7_credit"}
    assert "advantage=uniform,gain sampler=flow_sde,ddim_sde" in by_exp["mini_fig6_sde"]
    assert " loop.substeps=1 " in by_exp["mini_fig10_substeps"]
    assert " advantage=gain_per_step " in by_exp["mini_fig9_norm"]
    assert " advantage=gae " in by_exp["mini_fig7_credit"]
    for c in cmds:
        assert " --multirun " in c and " seed=0,1 " in c
        for o in ablations.QUICK_COMMON:
            assert f" {o} " in c
        assert f"hydra.sweep.dir={tmp_path / 'q'}/" in c
        assert "'hydra.sweep.subdir=${hydra.job.override_dirname}'" in c
        assert "exclude_keys=[experiment,ckpt_path,loop.iterations," in c
        assert "hydra/launcher" not in c
    assert not (tmp_path / "q").exists()  # a dry run writes nothing
    # the paper suite goes through the SLURM launcher
    ablations.main(["--suite", "paper", "--dry-run", "--only", "substeps", "--sweep-dir", str(tmp_path / "p")])
    out = capsys.readouterr().out
    cmds = [ln for ln in out.splitlines() if "stepflow.train" in ln]
    assert cmds and all("hydra/launcher=slurm" in c and "experiment=paper_fig10_substeps" in c for c in cmds)
    assert any("loop.substeps=1,2,5,8" in c for c in cmds) and any("loop.adaptive_substeps=true" in c for c in cmds)


# ---------------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_end_to_end_smoke_multirun_then_skip(tmp_path):
    """Two arms x one seed of the smoke config through real Hydra multiruns; the report reads their output and a
    second invocation launches nothing."""
    import os

    abl = ablations.Ablation("adv", "smoke", {"advantage": ["uniform", "gain"]})
    suite = ablations.Suite("e2e", [abl], [0], common=["loop.iterations=1", "eval.max_prompts=4"])
    jobs = ablations.plan(suite, tmp_path)
    cmds = ablations.plan_commands(suite, jobs, tmp_path)
    assert len(cmds) == 1
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    assert ablations.run_commands(cmds, env, concurrent=False) == [0]
    names = sorted(p.name for p in (tmp_path / "adv").iterdir() if p.is_dir() and not p.name.startswith("."))
    assert names == ["advantage=gain,seed=0", "advantage=uniform,seed=0"]
    jobs = ablations.plan(suite, tmp_path)
    assert [j.status for j in jobs] == ["finished", "finished"]
    assert ablations.plan_commands(suite, jobs, tmp_path) == []
    md = report.build_report(tmp_path)
    text = md.read_text()
    assert "| `advantage=gain` | 1 |" in text and "| `advantage=uniform` | 1 |" in text
    assert (md.parent / "adv_iteration.png").is_file() and (md.parent / "adv_nfe.png").is_file()
    # an interrupted run (no final row, no adapter, a checkpoint) is resumed through the quoted ckpt_path override
    run = tmp_path / "adv" / "advantage=gain,seed=0"
    shutil.rmtree(run / "lora")
    lines = (run / "metrics.csv").read_text().splitlines()
    (run / "metrics.csv").write_text("\n".join(lines[:2]) + "\n")  # header + the iteration-0 evaluation
    jobs = ablations.plan(suite, tmp_path)
    assert [j.status for j in jobs] == ["finished", "resume"]
    cmds = ablations.plan_commands(suite, jobs, tmp_path)
    assert len(cmds) == 1 and any(a.startswith("ckpt_path='") for a in cmds[0])
    assert ablations.run_commands(cmds, env, concurrent=False) == [0]
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "adv").iterdir() if p.is_dir() and not p.name.startswith(".")) == names


def test_identical_runs_of_different_ablations_are_shared(tmp_path):
    """The baseline arm (gain, Flow-GRPO SDE, T' = 5, joint normalisation) is the same run in all four ablations: it
    runs once (in the first ablation) and the others link to it; the report counts it in each ablation."""
    suite = ablations.build_suites()["quick"]
    jobs = ablations.plan(suite, tmp_path)
    shared = [j for j in jobs if j.status == "shared"]
    assert {(j.ablation.name, ablations.arm_label(j.arm)) for j in shared} == {
        ("substeps", "loop.substeps=5"), ("normalization", "advantage=gain"), ("credit", "advantage=gain")}
    assert all(j.same_as.ablation.name == "method_sampler" and j.same_as.arm == {"advantage": "gain",
               "sampler": "flow_sde"} and j.same_as.seed == j.seed for j in shared)
    cmds = [" ".join(c) for c in ablations.plan_commands(suite, jobs, tmp_path, python="py")]
    assert not any("loop.substeps=5" in c or "advantage=gain " in c for c in cmds)
    # link, write the canonical run, and read the report
    for j in shared:
        ablations.link_shared(j)
    canon = shared[0].same_as
    cfg = ablations.planned_config(canon.ablation.experiment, [*suite.common, "advantage=gain", "sampler=flow_sde",
                                                               f"seed={canon.seed}"])
    _write_run(canon.run_dir, cfg, {0: 0.1, 12: 0.3}, 12)
    assert (tmp_path / "credit" / ablations.run_name({"advantage": "gain"}, canon.seed)).is_symlink()
    jobs2 = ablations.plan(suite, tmp_path)
    assert {j.status for j in jobs2 if j.same_as is not None} == {"shared"}
    assert [j.status for j in jobs2 if j.run_dir == canon.run_dir] == ["finished"]
    runs = report.find_runs(tmp_path)
    assert sorted(r.ablation for r in runs) == ["credit", "method_sampler", "normalization", "substeps"]


def test_settings_that_only_change_speed_do_not_make_a_run_stale():
    """A run is the same run whatever its chunk sizes, reward overlap, compilation or CPU threads (the iteration's
    numbers do not depend on them: tests/test_train_loop.py)."""
    a = {"loop": {"estimate_chunk": None, "decode_chunk": None, "overlap_reward": False, "substeps": 2},
         "torch_threads": 1}
    b = {"loop": {"estimate_chunk": 64, "decode_chunk": 16, "overlap_reward": True, "substeps": 2}, "torch_threads": 4}
    assert ablations.config_mismatch(a, b) == []
    b["loop"]["substeps"] = 5
    assert ablations.config_mismatch(a, b) == ["loop.substeps"]


def test_a_target_named_through_another_path_is_the_same_part(capfd, caplog):
    """A stored ``_target_`` that names the same class through another module path (a re-export, a moved part) does
    not make a run stale; a different class does, and so does a path that no longer imports (quietly: the league
    checks every stored run and must not print an import error for each old one)."""
    import stepflow.rewards.base as rb

    cls = rb.Reward
    here = f"{cls.__module__}.{cls.__qualname__}"
    alias = next((f"{m}.{cls.__name__}" for m in ("stepflow.rewards", "stepflow") if
                  getattr(__import__(m, fromlist=["_"]), cls.__name__, None) is cls), None)
    assert alias is not None and alias != here, "no re-export of Reward to test with"
    assert ablations.config_mismatch({"reward": {"_target_": here}}, {"reward": {"_target_": alias}}) == []
    assert ablations.config_mismatch({"reward": {"_target_": "collections.OrderedDict"}},
                                     {"reward": {"_target_": here}}) == ["reward._target_"]
    assert ablations.config_mismatch({"reward": {"_target_": "stepflow.nowhere.Reward"}},
                                     {"reward": {"_target_": here}}) == ["reward._target_"]
    assert ablations.config_mismatch({"reward": {"_target_": "stepflow.rewards.base.Nowhere"}},
                                     {"reward": {"_target_": here}}) == ["reward._target_"]
    out, err = capfd.readouterr()
    assert "Error" not in out + err + caplog.text


def test_report_plots_the_per_step_weights_of_auto_runs(tmp_path):
    """Runs that log train/weight_step{k} get a stacked per-step weight plot, averaged over seeds."""
    abl = tmp_path / "sweep" / "auto"
    for seed, w0 in enumerate([0.2, 0.6]):
        d = _write_run(abl / f"advantage=gain,seed={seed}", _cfg("gain", seed), {0: 0.2, 4: 0.5}, 4)
        with (d / "metrics.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        for r in rows:
            if r.get("train/reward_final"):
                r["train/weight_step0"], r["train/weight_step2"] = w0 * int(r["iteration"]), 1 - w0 * int(r["iteration"])
        with (d / "metrics.csv").open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=[*rows[0].keys(), "train/weight_step0", "train/weight_step2"])
            w.writeheader()
            w.writerows(rows)
    runs = report.find_runs(tmp_path / "sweep")
    steps, its, ys = report.step_weight_curves(runs)
    assert steps == [0, 2] and its == [1, 2, 3, 4]
    assert ys[0] == pytest.approx([0.4 * i for i in its]) and ys[1] == pytest.approx([1 - 0.4 * i for i in its])
    md = report.build_report(tmp_path / "sweep")
    assert (md.parent / "auto_step_weights.png").read_bytes()[:4] == b"\x89PNG" and "(auto_step_weights.png)" in md.read_text()
    assert report.step_weight_curves([r for r in runs if False]) == ([], [], [])


@pytest.mark.parametrize("broken, what", [("config.yaml", b"seed: [1\n"), ("config.yaml", b"- a list\n"),
                                          ("metrics.csv", bytes(range(128, 256))), ("metrics.csv", b"iteration,eval/geneval\n1,0.5\n2,\xff\xfe\n")])
def test_the_report_skips_a_run_it_cannot_read_in_one_line(tmp_path, capsys, broken, what):
    """A corrupt config.yaml or metrics.csv (binary bytes, a NUL, a YAML that is not a mapping) leaves that run out
    with one line naming the run and the file; the other runs are reported."""
    abl = tmp_path / "sweep" / "credit"
    for seed in (0, 1):
        _write_run(abl / f"advantage=gain,seed={seed}", _cfg("gain", seed), {0: 0.2, 4: 0.5}, 4)
    (abl / "advantage=gain,seed=1" / broken).write_bytes(what)
    runs = report.find_runs(tmp_path / "sweep")
    assert [r.path.name for r in runs] == ["advantage=gain,seed=0"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seed=1" in err[0] and f"{broken} cannot be read" in err[0], err
    assert report.build_report(tmp_path / "sweep").is_file()
