"""Faults a run meets on a shared cluster: crafted checkpoints, preemption signals, bad values, missing weights,
non-finite rewards, two runs in one directory, a resume with other settings, a full disk. Each ends in one line
and a non-zero exit, never a traceback, and never loses a finished iteration."""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.payloads import evil_checkpoint

from stepflow.errors import StepflowError
from stepflow.testing.harness import ROOT, compose_config, one_line_error, run_cli


def _train_rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as fh:
        return [r for r in csv.DictReader(fh) if r.get("train/reward_final")]


def _ckpt_iteration(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["stepflow"]["iteration"])


# ------------------------------------------------------------------------------------------------ crafted files
CRAFTED = {"stepflow.evaluate": ["max_prompts=4"], "stepflow.pretrain": [], "stepflow.train": ["experiment=smoke"]}


@pytest.mark.parametrize("module,arg", [("stepflow.evaluate", "ckpt_path"), ("stepflow.pretrain", "resume"),
                                        ("stepflow.train", "ckpt_path")])
def test_a_crafted_checkpoint_never_runs_code(tmp_path, module, arg):
    evil, marker = evil_checkpoint(tmp_path)
    r = run_cli(module, *CRAFTED[module], f"{arg}={evil}", f"hydra.run.dir={tmp_path / 'run'}", timeout=300)
    one_line_error(r, "evil.ckpt")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ checkpoints
def test_last_ckpt_after_every_iteration_even_without_an_optimizer_step(tmp_path):
    """With the ODE sampler no step has a density, so no iteration takes an optimizer step; last.ckpt still holds
    every finished iteration (Lightning's ModelCheckpoint skipped them: iteration 1 of 3)."""
    from stepflow.train import run

    module = run(compose_config("train", ["experiment=smoke", "sampler=ode", "loop.iterations=3"]), tmp_path)
    assert module.learner.opt_steps == 0
    assert _ckpt_iteration(tmp_path / "checkpoints" / "last.ckpt") == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]  # one file per iteration


def test_keep_every_keeps_periodic_checkpoints(tmp_path):
    from stepflow.train import run

    run(compose_config("train", ["experiment=smoke", "loop.iterations=2", "callbacks.checkpoint.keep_every=1"]),
        tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["iter_0001.ckpt", "iter_0002.ckpt", "last.ckpt"]
    assert _ckpt_iteration(tmp_path / "checkpoints" / "iter_0001.ckpt") == 1


# ------------------------------------------------------------------------------------------------ signals
def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    return subprocess.Popen([sys.executable, "-m", "stepflow.train", "experiment=smoke", *args,
                             f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.monotonic()
    while not path.is_file():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.2)


def test_training_runs_under_stepflows_signal_handler_only(tmp_path, monkeypatch):
    """While the iterations run, SIGTERM / SIGINT reach stepflow's handler alone. Lightning's own SIGTERM handler
    (installed when fitting starts, chained before ours) runs a broadcast inside the handler on the signalled rank
    alone, which paired with an unrelated collective of the other rank and hung a 2-process FSDP2 run."""
    from stepflow.core import stop
    from stepflow.grpo import GRPOModule
    from stepflow.train import run

    seen: list = []
    iterate = GRPOModule.iterate

    def recording(self, *a, **k):
        seen.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), stop._active[:1]))
        return iterate(self, *a, **k)

    monkeypatch.setattr(GRPOModule, "iterate", recording)
    run(compose_config("train", ["experiment=smoke", "loop.iterations=2"]), tmp_path)
    assert len(seen) == 2
    for term, intr, active in seen:
        assert active and term is active[0] and intr is active[0]
    assert signal.getsignal(signal.SIGTERM) is not seen[0][0]  # restored after the run


def test_a_stop_between_iterations_leaves_the_run_unfinished_and_resumable(tmp_path, monkeypatch):
    """A signal that arrives after an iteration's last phase (seen at the iteration boundary) stops the run with the
    resume line, and the run does not write its final outputs: the adapter marks a finished run for the ablation
    suites and the league, which would then never resume it (a league run stopped so kept 1 of its 8 iterations)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))
    import report

    from stepflow.core import stop
    from stepflow.errors import StepflowError
    from stepflow.grpo import GRPOModule
    from stepflow.train import run

    iterate = GRPOModule.iterate

    def then_signal(self, *a, **k):
        out = iterate(self, *a, **k)
        stop.request("SIGTERM")  # after the iteration's phases: only the boundary check can see it
        return out

    monkeypatch.setattr(GRPOModule, "iterate", then_signal)
    try:
        with pytest.raises(StepflowError, match="stopped by SIGTERM after iteration 1; resume: ") as e:
            run(compose_config("train", ["experiment=smoke", "loop.iterations=3"]), tmp_path)
    finally:
        stop.clear()
    assert e.value.exit_code == 143
    assert not (tmp_path / "lora").exists() and not report.run_finished(tmp_path)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


_AGREE = """
import sys
import torch.distributed as d
import torch.multiprocessing as mp
from stepflow.core import stop
from stepflow.core.dist import Dist

def work(rank, port, out, signalled):
    d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    dist = Dist(rank=rank, world=3)
    before = dist.stop_requested()  # nobody asked yet
    for r, name in signalled:
        if r == rank:
            stop.request(name)
    after = dist.stop_requested()
    with open(f"{out}/{rank}", "w") as fh:
        fh.write(f"{before} {after} {stop.reason()} {stop.EXIT_CODES.get(stop.reason(), 2)}")
    d.destroy_process_group()

if __name__ == "__main__":
    signalled = [(int(r), n) for r, n in (a.split(":") for a in sys.argv[3:])]
    mp.spawn(work, args=(int(sys.argv[1]), sys.argv[2], signalled), nprocs=3)
"""


@pytest.mark.slow
@pytest.mark.parametrize("signalled,want", [
    (["1:SIGTERM"], ["SIGTERM 143"] * 3),                       # the signal reached one process: all say it
    (["2:SIGINT"], ["SIGINT 130"] * 3),
    (["0:SIGINT", "2:SIGTERM"], ["SIGINT 130", "SIGTERM 143", "SIGTERM 143"]),  # a signalled rank keeps its own
])
def test_every_rank_stops_with_the_signal_one_rank_received(tmp_path, signalled, want):
    """The ranks agree to stop at a phase boundary (one collective); a rank the signal did not reach takes its name,
    so each rank's reason and exit status name the signal (before: "stopped by stop requested", exit 2)."""
    script = tmp_path / "agree.py"
    script.write_text(_AGREE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script), str(port), str(tmp_path), *signalled], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [(tmp_path / str(rank)).read_text() for rank in range(3)]
    assert got == [f"False True {w}" for w in want], got


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_checkpoints_prints_the_resume_command_and_exits_non_zero(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "loop.iterations=500")
    _wait_for(run_dir / "checkpoints" / "last.ckpt", proc)
    time.sleep(1.0)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = one_line_error(subprocess.CompletedProcess([], proc.returncode, out, err), f"stopped by {sig.name}")
    assert "resume: python -m stepflow.train experiment=smoke loop.iterations=500 ckpt_path=" in line
    done = _ckpt_iteration(run_dir / "checkpoints" / "last.ckpt")
    assert done == len(_train_rows(run_dir)) >= 1  # the checkpoint holds every logged iteration: none is lost
    assert not (run_dir / ".stepflow.lock").exists()
    if sig != signal.SIGTERM:
        return  # the resume from a signal's checkpoint is the same for both signals: SIGTERM's case runs it
    # the printed command resumes the run and goes on from there
    r = run_cli("stepflow.train", "experiment=smoke", f"loop.iterations={done + 1}",
                f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(_train_rows(run_dir)) == done + 1


@pytest.mark.slow
def test_sigterm_interrupts_a_hanging_reward_call(tmp_path, http_server):
    """A reward call that hangs (timeout 600 s) does not hold the run: SIGTERM ends it within seconds."""
    server = http_server(None)  # a reward service that accepts requests and never answers
    try:
        run_dir = tmp_path / "run"
        proc = _start(run_dir, "reward=remote", f"reward.url={server.url}",
                      "reward.timeout_s=600", "reward.max_retries=0", "reward.progress_every_s=1")
        deadline = time.monotonic() + 300
        while not server.calls and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert server.calls, "the run never called the reward service"
        # the run is now waiting on the first (evaluation) reward call: its progress line comes every second (a fixed
        # 8 s from config.yaml was not always enough on a loaded machine: the call had not been made yet)
        time.sleep(5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
        assert proc.returncode == 143, err[-3000:]
        one_line_error(subprocess.CompletedProcess([], proc.returncode, out, err), "stopped by SIGTERM")
        assert "waiting" in out + err  # progress of the slow call was visible before the signal (logged)
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------ one-line errors
@pytest.mark.parametrize("args,needle", [
    (["loop.iterations=abc"], "loop.iterations"),
    (["loop.iterations=-1"], "loop.iterations"),
    (["ema.update_every=0"], "ema.update_every"),
    (["ema.decay=1.5"], "ema.decay"),
    (["eval.every=-1"], "eval.every"),
    (["loop.group_size=1"], "loop.group_size"),
    (["lora.rank=0"], "lora.rank"),
    (["callbacks.checkpoint.keep_every=-1"], "keep_every"),
])
def test_bad_values_are_one_line(tmp_path, args, needle, cli):
    one_line_error(cli("stepflow.train", "experiment=smoke", f"hydra.run.dir={tmp_path}", *args), needle)


def test_the_readme_pickscore_command_without_weights_is_one_line(tmp_path, cli):
    """`python -m stepflow.train reward=pickscore advantage=gain sampler=ddim_sde` offline, no weights."""
    r = cli("stepflow.train", "reward=pickscore", "advantage=gain", "sampler=ddim_sde",
                f"hydra.run.dir={tmp_path}", env={"HF_HOME": str(tmp_path / "hf")})
    one_line_error(r, "PickScore")


def test_a_reward_failure_in_the_first_evaluation_stops_cleanly(tmp_path):
    """The iteration-0 evaluation's reward call fails: the documented clean stop, not a traceback."""
    from stepflow.train import run

    cfg = compose_config("train", ["experiment=smoke", "reward=remote", "reward.url=http://127.0.0.1:9",
                                   "reward.max_retries=0", "reward.timeout_s=2"])
    with pytest.raises(StepflowError, match="reward service failed at iteration 0"):
        run(cfg, tmp_path)


def test_an_unexpected_error_is_one_line_naming_the_traceback_switch(capsys):
    from stepflow.cli import report

    with pytest.raises(SystemExit) as e:
        report(RuntimeError("boom\n  in some library"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0] == "stepflow: error: RuntimeError: boom in some library (set HYDRA_FULL_ERROR=1 for the traceback)"


def test_hydra_full_error_shows_the_traceback(tmp_path, cli):
    r = cli("stepflow.train", "experiment=smoke", "ema.update_every=0", f"hydra.run.dir={tmp_path}",
                env={"HYDRA_FULL_ERROR": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr and "ema.update_every" in r.stderr


# ------------------------------------------------------------------------------------------------ non-finite rewards
class _NaNReward:
    """Wraps a reward: every ``every``-th image scores NaN (inf for the one after)."""

    def __init__(self, inner, every: int):
        self.inner, self.every, self.name = inner, every, inner.name

    def __call__(self, images, prompts, meta=None):
        out = self.inner(images, prompts, meta)
        s = out.scores.clone()
        s[:: self.every] = float("nan")
        s[1:: self.every] = float("inf")
        return type(out)(s, out.components)


def test_non_finite_rewards_are_dropped_counted_and_never_logged(tmp_path):
    from stepflow.train import build_module

    module = build_module(compose_config("train", ["experiment=smoke", "loop.iterations=1",
                                                   "loop.max_nonfinite_frac=0.5"]), tmp_path)
    module.learner.reward = _NaNReward(module.reward, every=40)  # 2 of the 40 images (8 samples x 5 states)
    m = module.iterate()
    assert m["train/nonfinite_rewards"] > 0
    assert m["train/samples_trained"] <= 8 - m["train/nonfinite_rewards"]
    bad = {k: v for k, v in m.items() if not math.isfinite(float(v))}
    assert not bad, bad


def test_too_many_non_finite_rewards_stop_the_run(tmp_path):
    from stepflow.train import run

    cfg = compose_config("train", ["experiment=smoke", "loop.iterations=2", "loop.max_nonfinite_frac=0.1",
                                   "eval.max_prompts=2"])
    import stepflow.train as train_mod

    real = train_mod.build_reward
    try:
        train_mod.build_reward = lambda c: _NaNReward(real(c), every=2)
        with pytest.raises(StepflowError, match="NaN / inf reward"):
            run(cfg, tmp_path)
    finally:
        train_mod.build_reward = real


# ------------------------------------------------------------------------------------------------ run directories
def test_one_run_per_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".stepflow.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                        "since": "today"}))
    r = run_cli("stepflow.train", "experiment=smoke", f"hydra.run.dir={run_dir}")
    one_line_error(r, f"in use by another run (pid {os.getpid()}")
    assert not (run_dir / "metrics.csv").exists()
    # a lock whose process is gone is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / ".stepflow.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    r = run_cli("stepflow.train", "experiment=smoke", "loop.iterations=1", f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (run_dir / ".stepflow.lock").exists()


def test_a_resume_with_other_settings_keeps_the_original_config(tmp_path, monkeypatch):
    """A resume never rewrites config.yaml; it records its own settings in config.resume.yaml (what experiments/
    compares a planned run with), and one that fails before it trains puts back the record it found."""
    import stepflow.train
    from stepflow.train import run

    run(compose_config("train", ["experiment=smoke", "loop.iterations=1"]), tmp_path)
    original = (tmp_path / "config.yaml").read_text()
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(StepflowError, match=r"changes train\.lr"):
        run(compose_config("train", ["experiment=smoke", "loop.iterations=2", "train.lr=0.5", f"ckpt_path={ckpt}"]),
            tmp_path)
    assert (tmp_path / "config.yaml").read_text() == original
    module = run(compose_config("train", ["experiment=smoke", "loop.iterations=2", f"ckpt_path={ckpt}"]), tmp_path)
    assert module.iteration == 2 and (tmp_path / "config.yaml").read_text() == original
    assert "iterations: 2" in (tmp_path / "config.resume.yaml").read_text()

    def broken(*a, **k):
        raise StepflowError("model.path: cannot load (a failure after the resume's settings were checked)")

    monkeypatch.setattr(stepflow.train, "build_module", broken)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(StepflowError, match="cannot load"):
        run(compose_config("train", ["experiment=smoke", "loop.iterations=3", f"ckpt_path={ckpt}"]), tmp_path)
    assert "iterations: 2" in (tmp_path / "config.resume.yaml").read_text()  # not the failed resume's 3


def test_a_run_written_before_a_field_existed_resumes(tmp_path):
    """A run whose config.yaml predates fields added since (a part's field: sampler.first_step_guard,
    objective.same_latent; loop.time_grid) resumes: settings compare as their typed groups and their parts resolve
    them (a missing field is its default). A setting that really changed is still refused."""
    import yaml

    from stepflow.train import run

    run(compose_config("train", ["experiment=smoke", "loop.iterations=1"]), tmp_path)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    saved["objective"].pop("same_latent")
    saved["sampler"].pop("first_step_guard")
    saved["loop"].pop("time_grid")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(StepflowError, match=r"changes sampler\.eta"):
        run(compose_config("train", ["experiment=smoke", "loop.iterations=2", "sampler.eta=0.5", f"ckpt_path={ckpt}"]),
            tmp_path)
    with pytest.raises(StepflowError, match=r"changes objective\._target_"):
        run(compose_config("train", ["experiment=smoke", "loop.iterations=2", "objective=nft", f"ckpt_path={ckpt}"]),
            tmp_path)
    module = run(compose_config("train", ["experiment=smoke", "loop.iterations=2", f"ckpt_path={ckpt}"]), tmp_path)
    assert module.iteration == 2


def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path):
    from stepflow.shell.checkpoint import atomic_write
    from stepflow.shell.loggers import MetricsCSVLogger

    def full(fh):
        fh.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (tmp_path / "last.ckpt").write_bytes(b"previous")
    with pytest.raises(StepflowError, match="disk full writing .*last.ckpt"):
        atomic_write(tmp_path / "last.ckpt", full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert (tmp_path / "last.ckpt").read_bytes() == b"previous"
    # two writers of one file never share a temporary name
    names = set()
    for _ in range(2):
        atomic_write(tmp_path / "a.bin", lambda fh: names.add(fh.name) or fh.write(b"1"))
    assert len(names) == 2
    # metrics.csv rewrites go through the same path
    lg = MetricsCSVLogger(tmp_path / "logs")
    lg.log_metrics({"a": 1.0}, step=1)
    lg.log_metrics({"b": 2.0}, step=2)  # a new column: a rewrite
    assert (tmp_path / "logs" / "metrics.csv").read_text().splitlines()[0] == "iteration,a,b"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["metrics.csv"]


def test_ckpt_path_auto_resumes_a_requeued_run_and_starts_a_fresh_one(tmp_path):
    from stepflow.train import run

    module = run(compose_config("train", ["experiment=smoke", "loop.iterations=1", "ckpt_path=auto"]), tmp_path)
    assert module.iteration == 1  # nothing to resume: a fresh start
    module = run(compose_config("train", ["experiment=smoke", "loop.iterations=2", "ckpt_path=auto"]), tmp_path)
    assert module.iteration == 2 and len(_train_rows(tmp_path)) == 2  # resumed from its own last.ckpt


@pytest.mark.parametrize("args,needle", [
    (["hydra.run.dir=/tmp/a=b,c=d"], "hydra.run.dir"),  # Hydra's grammar: '=' in a value needs quotes
    (["train.lr=[1"], "train.lr"),
    (["--multirun", "--cfg", "job"], "Only one of"),  # Hydra's own argument check, outside the task
])
def test_overrides_hydra_cannot_read_are_one_line(tmp_path, args, needle, cli):
    one_line_error(cli("stepflow.train", "experiment=smoke", *args), needle)


def test_a_quoted_run_dir_with_equals_signs_is_read(tmp_path, cli):
    d = tmp_path / "seed=1,train.weighting=guard"
    r = cli("stepflow.train", "experiment=smoke", f"hydra.run.dir='{d}'", "--cfg", "job")
    assert r.returncode == 0, r.stderr


def test_non_finite_held_out_scores_are_counted_and_never_logged(tmp_path):
    """Evaluation: NaN / inf scores are left out of eval/<reward> and counted as eval/nonfinite_rewards."""
    from stepflow.core.heldout import evaluate_reward
    from stepflow.train import build_module

    module = build_module(compose_config("train", ["experiment=smoke"]), tmp_path)
    recs = module.eval_records[:6]
    clean, _, _ = evaluate_reward(module.policy, module.reward, recs, num_steps=2)
    res, _, _ = evaluate_reward(module.policy, _NaNReward(module.reward, every=3), recs, num_steps=2)
    name = f"eval/{module.reward.name}"
    assert res["eval/nonfinite_rewards"] == 4  # samples 0, 1, 3, 4 of 6
    scores = module.reward(*_images_and_prompts(module, recs)).scores
    assert res[name] == pytest.approx(float(scores[[2, 5]].mean()))
    assert all(math.isfinite(v) for v in res.values()) and "eval/nonfinite_rewards" not in clean


def _images_and_prompts(module, recs):
    from stepflow.core.heldout import sample_ode

    prompts = [r["prompt"] for r in recs]
    return sample_ode(module.policy, prompts, num_steps=2), prompts, recs
