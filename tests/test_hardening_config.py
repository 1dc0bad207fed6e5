"""Settings a hostile user gives, checked before anything is built: non-finite numbers in any field of any entry
point, combinations of window × train_steps × sampler × num_steps that would train nothing, duplicate steps, bad
seeds; a run dir locked before Hydra writes into it; a non-finite gradient that stops the run before it reaches the
weights; a multirun whose failed jobs are reported and do not stop the others."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from stepflow.cli import check_finite, first_non_finite
from stepflow.errors import StepflowError
from stepflow.testing.harness import compose_config, run_in_process


def _settings(*overrides: str):
    from stepflow.train import settings

    return settings(compose_config("train", ["experiment=smoke", *overrides]))


# ------------------------------------------------------------------------------------------------ non-finite
def test_first_non_finite_names_the_key_and_the_list_index():
    assert first_non_finite({"a": {"b": 1.0, "c": [0.5, float("inf")]}}) == ("a.c[1]", float("inf"))
    key, v = first_non_finite({"x": [{"y": float("nan")}]})
    assert key == "x[0].y" and math.isnan(v)
    assert first_non_finite({"a": 1, "b": "inf", "c": [1e300, -1e-300], "d": None}) is None


@pytest.mark.parametrize("override,field", [
    ("train.lr=inf", "train.lr"), ("train.beta_kl=inf", "train.beta_kl"), ("lora.alpha=inf", "lora.alpha"),
    ("eval.guidance=inf", "eval.guidance"), ("loop.guidance=nan", "loop.guidance"),
    ("train.max_grad_norm=-inf", "train.max_grad_norm"), ("train.betas=[0.9,inf]", "train.betas[1]"),
    ("sampler.eta=nan", "sampler.eta"), ("loop.max_nonfinite_frac=nan", "loop.max_nonfinite_frac"),
    ("+model.eval_guidance=inf", "model.eval_guidance"), ("+reward.scale=inf", "reward.scale"),
])
def test_a_non_finite_value_of_any_training_field_is_refused(override, field):
    with pytest.raises(StepflowError, match="^" + re.escape(field) + ": must be a finite"):
        _settings(override)


@pytest.mark.parametrize("config,overrides,field", [
    ("evaluate", ["sampler.guidance=inf"], "sampler.guidance"),
    ("pretrain", ["optim.lr=nan"], "optim.lr"),
    ("serve_reward", ["reward=shapes_geneval", "max_body_mb=inf"], "max_body_mb"),
])
def test_every_entry_point_refuses_non_finite_values(config, overrides, field):
    with pytest.raises(StepflowError, match=rf"^{field}: must be a finite number"):
        check_finite(compose_config(config, overrides))


def test_the_entry_point_checks_finiteness_before_its_task_runs(tmp_path):
    """The shared Hydra task wrapper refuses inf before the entry point's function is called."""
    from stepflow.cli import entry_point

    called = []
    task = entry_point("train")(lambda cfg: called.append(cfg)).task
    with pytest.raises(SystemExit) as e:
        task(compose_config("train", ["experiment=smoke", "train.lr=inf"]))
    assert e.value.code == 2 and not called


# ------------------------------------------------------------------------------------------------ nothing trained
@pytest.mark.parametrize("overrides,field", [
    (["window=fixed", "window.start=2", "window.size=2", "train.train_steps=[1]"], "window"),
    (["window=fixed", "window.start=3", "window.size=1"], "window"),  # only the noise-free last step
    (["window=fixed", "window.start=3", "window.size=1", "train.weighting=auto"], "window"),
    (["window=sliding", "window.start=3", "window.size=1"], "window"),
    (["window=random", "window.start=3", "window.size=1"], "window"),
    (["window=fixed", "window.start=3", "window.size=2"], "window.size"),  # does not fit the 4-step grid
    (["train.train_steps=[1,1,1]"], "train.train_steps"),
    (["train.train_steps=[2,1,2]"], "train.train_steps"),
    (["sampler.eta=0"], "sampler.eta"),
    (["sampler=flow_sde", "sampler.a=0"], "sampler.a"),
    (["train.timestep_fraction=0.1"], "train.timestep_fraction"),
    (["seed=-1", "window=random", "window.size=2"], "seed"),
    (["loop.seed=-3"], "loop.seed"),
])
def test_settings_that_would_train_nothing_are_refused(overrides, field):
    with pytest.raises(StepflowError, match=rf"^{field}:"):
        _settings(*overrides)


@pytest.mark.parametrize("overrides", [
    ["window=fixed", "window.start=1", "window.size=2"],
    ["window=fixed", "window.start=2", "window.size=2", "train.train_steps=[2]"],
    ["window=sliding", "window.start=0", "window.size=2"],
    ["window=random", "window.start=1", "window.size=2", "train.weighting=auto"],
    ["train.train_steps=[2,1]"],
    ["objective=distill"],  # distillation trains the ODE's steps: noise-free steps included
    ["objective=nft", "sampler=ode"],  # the forward-process objectives need no density
    ["objective=awm", "window=fixed", "window.start=0", "window.size=2"],
])
def test_settings_that_train_something_pass(overrides):
    _settings(*overrides)


def test_the_ode_sampler_trains_nothing_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="stepflow.train"):
        _settings("sampler=ode")
    assert "trains nothing" in caplog.text


def test_a_bad_setting_stops_the_run_before_the_run_dir_is_touched(tmp_path):
    from stepflow.train import run

    run_dir = tmp_path / "never"
    with pytest.raises(StepflowError, match="^window"):
        run(compose_config("train", ["experiment=smoke", "window=fixed", "window.start=3", "window.size=1"]), run_dir)
    assert not run_dir.exists()


# ------------------------------------------------------------------------------------------------ run directory
def _callback_config(run_dir: Path):
    return OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}, "sweep": {"dir": str(run_dir / "sweep")}}})


def test_the_run_dir_is_locked_before_hydra_writes_into_it(tmp_path, capsys):
    from stepflow.rundir import LOCK_NAME, RunDirCallback, release

    run_dir = tmp_path / "a" / "b"
    RunDirCallback().on_run_start(_callback_config(run_dir))
    assert run_dir.is_dir() and json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
    RunDirCallback().on_run_start(_callback_config(run_dir))  # this process's own lock: taken again (a resume)
    release(run_dir)
    assert not (run_dir / LOCK_NAME).exists()
    # a live process of another run holds it: refused, one line, nothing written
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / LOCK_NAME).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "since": "t"}))
        with pytest.raises(SystemExit) as e:
            RunDirCallback().on_run_start(_callback_config(run_dir))
        assert e.value.code == 2
        assert f"hydra.run.dir: {run_dir} is in use by another run (pid {other.pid}" in capsys.readouterr().err
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_a_run_dir_that_cannot_be_created_is_one_line(tmp_path, capsys, key):
    from stepflow.rundir import RunDirCallback

    (tmp_path / "afile").write_text("x")
    cfg = _callback_config(tmp_path / "afile" / "run")
    with pytest.raises(SystemExit) as e:
        (RunDirCallback().on_run_start if key == "hydra.run.dir" else RunDirCallback().on_multirun_start)(cfg)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"stepflow: error: {key}: cannot create"), err


def test_every_entry_point_creates_its_run_dir_through_the_callback():
    for name, lock in [("train", True), ("pretrain", True), ("evaluate", False), ("serve_reward", False)]:
        cb = OmegaConf.load(Path(__file__).parent.parent / "stepflow" / "conf" / f"{name}.yaml").hydra.callbacks.run_dir
        assert cb._target_ == "stepflow.rundir.RunDirCallback" and cb.lock is lock, name


@pytest.mark.slow
def test_a_refused_second_run_leaves_the_running_runs_record_untouched(tmp_path):
    """The hostile case end to end: a run holds the dir, a second run with other settings is refused, and the first
    run's .hydra/*.yaml and train.log are byte for byte what they were."""
    import time

    run_dir = tmp_path / "busy"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "stepflow.train", "experiment=smoke", "loop.iterations=100000",
                              f"hydra.run.dir={run_dir}"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (run_dir / "metrics.csv").exists() and time.time() < deadline:
            time.sleep(0.5)
        record = {p.name: p.read_bytes() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "config.yaml"]}
        r = run_in_process("stepflow.train", "experiment=smoke", "train.lr=0.01", f"hydra.run.dir={run_dir}")
        assert r.returncode == 2 and "is in use by another run" in r.stderr
        assert {p.name: p.read_bytes() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "config.yaml"]} == record
        assert b"train.lr=0.01" not in (run_dir / "train.log").read_bytes()
    finally:
        first.kill()
        first.wait()


# ------------------------------------------------------------------------------------------------ non-finite update
def test_a_non_finite_gradient_is_never_stepped_into_the_weights():
    from stepflow.core.update import clip_and_step
    from stepflow.errors import NonFiniteUpdate

    w = torch.nn.Parameter(torch.ones(3))
    lr = SimpleNamespace(dist=SimpleNamespace(engine=None), optimizer=torch.optim.SGD([w], lr=0.1), opt_steps=4)
    for max_norm in (1.0, 0.0):  # with and without clipping
        w.grad = torch.tensor([1.0, float("nan"), 0.0])
        with pytest.raises(NonFiniteUpdate, match="optimizer step 5 is not finite"):
            clip_and_step(lr, [w], max_norm)
        assert torch.equal(w.detach(), torch.ones(3))
    w.grad = torch.tensor([3.0, 4.0, 0.0])
    assert float(clip_and_step(lr, [w], 1.0)) == pytest.approx(5.0)
    assert torch.allclose(w.detach(), torch.tensor([1 - 0.06, 1 - 0.08, 1.0]))


def test_a_run_whose_loss_turns_non_finite_stops_before_saving_it(tmp_path, monkeypatch):
    """From the second optimizer step on the loss is NaN (as an fp16 overflow makes it): the run stops with one line
    naming the term and what feeds it (before the gradient is even looked at), last.ckpt holds the last finished
    iteration with finite weights, and no adapter is written."""
    import stepflow.core.update as core_update  # the update's own module: its step_loss is the one it calls
    from stepflow.errors import NonFiniteUpdate
    from stepflow.train import run

    real = core_update.step_loss

    def poisoned(lr, *args, **kwargs):
        out = real(lr, *args, **kwargs)
        if lr.opt_steps >= 1:
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(core_update, "step_loss", poisoned)
    with pytest.raises(NonFiniteUpdate, match=r"^train: the loss of optimizer step 2 is not finite \(train/loss = nan "
                                              r"in term \d+ of objective=grpo\), so the run stopped before the step.*"
                                              r"loss is fed by train\.lr, train\.clip_eps, train\.beta_kl"):
        run(compose_config("train", ["experiment=smoke", "loop.iterations=6", "eval.max_prompts=2",
                                     "train.drop_zero_adv=false"]), tmp_path)  # a step every iteration
    ck = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 1 <= ck["stepflow"]["iteration"] < 6
    assert all(bool(torch.isfinite(v).all()) for v in ck["state_dict"].values() if v.is_floating_point())
    assert not (tmp_path / "lora").exists()


# ------------------------------------------------------------------------------------------------ multirun
def test_a_multirun_reports_failed_jobs_and_runs_the_others(tmp_path, cli):
    r = cli("stepflow.train", "--multirun", "experiment=smoke", "loop.iterations=1", "eval.max_prompts=2",
                "train.lr=-1,0.001", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert "stepflow: error: train.lr: must be > 0, got -1.0 (multirun job #0:" in r.stderr
    assert (tmp_path / "1" / "metrics.csv").is_file()  # the valid job after the bad one ran
    assert r.stderr.strip().splitlines()[-1].startswith(
        "stepflow: multirun: 2 jobs: 1 ran, 1 failed, 0 skipped; failed: #0 (")


def test_a_sweep_value_of_the_wrong_type_is_one_line_naming_the_job(tmp_path, cli):
    r = cli("stepflow.train", "--multirun", "experiment=smoke", "loop.iterations=1,abc",
                f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stepflow: error: loop.iterations: 'abc' is not a valid integer")
    assert "sweep job #1" in lines[0]
    assert not any(tmp_path.iterdir())  # no job started


def test_the_multirun_summary_counts_skipped_jobs():
    from stepflow import cli

    cli.JOBS[:] = [{"num": 0, "overrides": "a=1", "error": None}, {"num": 1, "overrides": "a=2", "error": "x"}]
    try:
        assert cli.multirun_summary(4) == ("stepflow: multirun: 4 jobs: 1 ran, 1 failed, 2 skipped; failed: #1 (a=2)", 1)
        cli.JOBS[:] = cli.JOBS[:1]
        assert cli.multirun_summary(1) == ("stepflow: multirun: 1 jobs: 1 ran, 0 failed, 0 skipped", 0)
    finally:
        cli.JOBS.clear()


def test_sweep_jobs_expand_as_hydra_does():
    from stepflow.cli import sweep_jobs

    jobs = sweep_jobs(["--multirun", "a=1,2", "b=x,y", "c=3"])
    assert sorted(" ".join(j) for j in jobs) == ["a=1 b=x c=3", "a=1 b=y c=3", "a=2 b=x c=3", "a=2 b=y c=3"]


# ------------------------------------------------------------------------------------------------ messages
def test_an_unknown_key_suggests_adding_it_with_plus(capsys):
    from stepflow.cli import check_keys

    with pytest.raises(SystemExit):
        check_keys(["model=shapes_tiny", "model.not_a_field=1"], "train")
    err = capsys.readouterr().err
    assert "model.not_a_field: unknown key" in err and "+model.not_a_field=<value>" in err


@pytest.mark.parametrize("override,field", [
    ("sampler.guidance=-1", "sampler.guidance"), ("sampler.num_steps=0", "sampler.num_steps"),
    ("seed=-1", "seed"), ("batch_size=0", "batch_size"), ("max_prompts=0", "max_prompts"),
    ("grid.ncol=0", "grid.ncol"),
])
def test_evaluate_settings_are_checked_before_the_model_loads(override, field, tmp_path, monkeypatch):
    import stepflow.evaluate as ev

    monkeypatch.setattr(ev, "load_policy", lambda cfg: pytest.fail("the model was loaded"))
    with pytest.raises(StepflowError, match=rf"^{field}:"):
        ev.evaluate(compose_config("evaluate", [override]), tmp_path)


def test_a_reward_constructor_error_is_one_line_naming_the_reward():
    from stepflow.rewards.registry import build_reward

    with pytest.raises(StepflowError, match=r"^reward.*protocol.*bogus"):
        build_reward(OmegaConf.to_container(compose_config("train", ["reward=remote", "reward.protocol=bogus"]).reward))


def test_a_checkpoint_of_another_model_is_refused_before_lightning_loads_it(tmp_path):
    """Resumed outside its run dir (so no config.yaml to compare), another LoRA rank's checkpoint is one line naming
    ckpt_path and the first differing weight, not a shape error in Lightning's optimizer code."""
    from stepflow.train import run

    run(compose_config("train", ["experiment=smoke", "loop.iterations=1", "eval.max_prompts=2", "lora.rank=2"]),
        tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    with pytest.raises(StepflowError, match=r"^ckpt_path: .*last.ckpt holds a checkpoint of another model \(.*lora"):
        run(compose_config("train", ["experiment=smoke", "loop.iterations=2", "eval.max_prompts=2", "lora.rank=4",
                                     f"ckpt_path={ckpt}"]), tmp_path / "b")
