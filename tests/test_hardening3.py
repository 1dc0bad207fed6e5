"""Hardening, round 3 (issue #43), one test (or a few) per kind of fault: options that would be inert, non-finite
training that passed as success, nonsense that was accepted, the experiments scripts' arguments and the league's
ledger, messages that named the wrong thing, and what was left from earlier rounds. Each fault is one line naming
its field (or argument) and the fix, a non-zero exit, no traceback, no lost work; in-process where the command line
does not matter."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stepflow.errors import ModelLoadError, NonFiniteUpdate, StepflowError
from stepflow.testing.harness import compose_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))


def load_experiment(name: str):
    """``experiments/<name>.py`` as the module the scripts import each other as (their dataclasses need it)."""
    import importlib

    return importlib.import_module(name)


def _settings(*overrides: str):
    from stepflow.train import settings

    return settings(compose_config("train", list(overrides)))


def _refused(needle: str, *overrides: str) -> str:
    with pytest.raises(StepflowError) as info:
        _settings(*overrides)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------------------------------ inert options
def test_an_option_that_would_be_inert_is_warned_about_in_one_line(caplog):
    caplog.set_level(logging.WARNING, "stepflow.train")
    _settings("experiment=smoke", "eval.at_fractions=[0.5]")  # no loop.budget: the fractions are of nothing
    _settings("experiment=smoke", "objective=nft", "sampler=dpm2")  # shared noise, no noise: identical groups
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("eval.at_fractions=[0.5]: ") and "loop.budget" in m for m in lines), lines
    assert any(m.startswith("loop.same_latent=true: ") and "sampler=dpm2" in m and "loop.same_latent=false" in m
               for m in lines), lines
    caplog.clear()
    _settings("experiment=smoke", "loop.budget=1000", "eval.at_fractions=[0.5]")
    _settings("experiment=smoke", "objective=nft", "sampler=dpm2", "loop.same_latent=false")
    _settings("experiment=smoke", "objective=nft")  # the default sampler adds noise
    assert not [r for r in caplog.records if "at_fractions" in r.getMessage() or "same_latent" in r.getMessage()]


def _resumed(tmp_path: Path, saved_loop: dict, iteration: int, spent: float, **loop):
    """A GRPOModule-shaped namespace resumed at ``iteration`` with ``spent`` NFEs, its run's config.yaml holding
    ``saved_loop``, the resume's loop settings ``loop``."""
    from stepflow.core.budget import parse_budget

    (tmp_path / "config.yaml").write_text(json.dumps({"loop": saved_loop}))
    budget = parse_budget(loop.get("budget"))
    ns = SimpleNamespace(iteration=iteration, eval_pending=False, run_dir=tmp_path, budget=budget,
                         spent={"nfe": spent, "seconds": 1.0},
                         loop=SimpleNamespace(iterations=loop.get("iterations", 5000), budget=loop.get("budget")))
    ns._budget_spent = lambda: budget is not None and budget.spent_all(ns.spent)
    return ns


def test_a_resume_that_would_train_nothing_is_refused(tmp_path):
    from stepflow.shell.run_state import check_resume_trains as check
    with pytest.raises(StepflowError, match=r"^loop\.budget: this resume's budget \(300 forward-equivalent NFEs\) "
                                            r"is below what the run already spent \(640 .*give loop\.budget above"):
        check(_resumed(tmp_path, {"iterations": 5000, "budget": 3000}, 2, 640.0, budget=300))
    with pytest.raises(StepflowError, match=r"^loop\.iterations: .*loop\.iterations=2 is not above .* \(4\)"):
        check(_resumed(tmp_path, {"iterations": 10}, 4, 640.0, iterations=2))
    # a finished run resumed with its own settings (a requeue), and a resume that goes on: no refusal
    check(_resumed(tmp_path, {"iterations": 5000, "budget": 600}, 2, 640.0, budget=600))
    check(_resumed(tmp_path, {"iterations": 4}, 4, 640.0, iterations=4))
    check(_resumed(tmp_path, {"iterations": 5000, "budget": 3000}, 2, 640.0, budget=1000))


def test_pretrain_options_that_would_be_inert_are_refused():
    from stepflow.config import PretrainConfig, to_config

    with pytest.raises(StepflowError, match=r"^export: .*select\.enabled=false picks none; set select\.enabled=true"):
        to_config(compose_config("pretrain", ["export=true", "select.enabled=false"]), PretrainConfig)
    with pytest.raises(StepflowError, match=r"^finalize_only: .*resume would be ignored"):
        to_config(compose_config("pretrain", ["finalize_only=/x", "resume=/y"]), PretrainConfig)


# ------------------------------------------------------------------------------------------------ non-finite loss
def _learner(objective, world_bad: bool = False):
    return SimpleNamespace(objective=objective, opt_steps=4,
                           dist=SimpleNamespace(any=lambda flag: bool(flag) or world_bad))


def test_a_non_finite_loss_stops_naming_the_term_and_the_settings_that_feed_it():
    from stepflow.config import ObjectiveConfig
    from stepflow.core.update import check_finite_loss

    finite = {"loss": torch.tensor(0.5), "policy_loss": torch.tensor(0.5)}
    check_finite_loss(_learner(ObjectiveConfig("nft")), [(0, finite)])
    inf = {"loss": torch.tensor(float("inf"), dtype=torch.float64), "policy_loss": torch.tensor(float("inf")),
           "old_deviate": torch.tensor(float("inf"))}
    with pytest.raises(NonFiniteUpdate) as info:
        check_finite_loss(_learner(ObjectiveConfig("nft")), [(0, finite), (1, inf)])
    msg = str(info.value)
    assert msg.startswith("train: the loss of optimizer step 5 is not finite (train/policy_loss = inf in term 1 of "
                          "objective=nft)") and "policy_loss is fed by objective.beta, objective.adv_clip_max" in msg
    nan = {"loss": torch.tensor(float("nan")), "policy_loss": torch.tensor(float("nan"))}
    with pytest.raises(NonFiniteUpdate, match=r"train/policy_loss = nan .*objective=awm.*fed by objective\.p, "):
        check_finite_loss(_learner(ObjectiveConfig("awm")), [(0, nan)])
    with pytest.raises(NonFiniteUpdate, match=r"\(on another rank, objective=grpo\).*loss is fed by train\.lr"):
        check_finite_loss(_learner(ObjectiveConfig("grpo"), world_bad=True), [(0, finite)])


def test_a_non_finite_gradient_names_the_objectives_settings_too():
    from stepflow.config import ObjectiveConfig
    from stepflow.core.update import clip_and_step

    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.tensor([float("nan"), 0.0])
    lr = SimpleNamespace(dist=SimpleNamespace(engine=None), optimizer=torch.optim.SGD([w], lr=0.1), opt_steps=0,
                         objective=ObjectiveConfig("awm"))
    with pytest.raises(NonFiniteUpdate, match=r"the objective's settings \(objective\.p, .*objective=awm\)"):
        clip_and_step(lr, [w], 1.0)


@pytest.mark.slow
def test_an_overflowing_objective_stops_the_run(tmp_path, cli):
    """objective=nft objective.beta=1e30: policy_loss overflows from iteration 2 (logged as inf with grad_norm 0 and
    exit 0 before): one line naming objective.beta, a non-zero exit."""
    r = cli("stepflow.train", "experiment=smoke", "loop.iterations=3", "objective=nft", "objective.beta=1e30",
            f"hydra.run.dir={tmp_path}")
    from stepflow.testing.harness import one_line_error

    line = one_line_error(r, "objective.beta")  # on a line of its own: the progress bar ended its line first
    assert "train/policy_loss = inf" in line, line


# ------------------------------------------------------------------------------------------------ nonsense accepted
@pytest.mark.parametrize("overrides,needle", [
    (["window=mixgrpo", "window.post_solver=dpmpp2m", "advantage=uniform", "window.post_compress_ratio=100"],
     "window.post_compress_ratio: must be a float > 0 and at most 1"),
    (["advantage=g2rpo", "advantage.granularities=[50,60]"], "advantage.granularities: stride 60 completes every "
     "trained step [1, 2] of the 4-step grid as stride 50 does"),
    (["advantage=g2rpo", "advantage.granularities=[1,2]", "advantage.jump_last=false"], "only the strides [1] differ: "
     "choose among them (e.g. advantage.granularities=[1])"),  # step 0 is noise-free here: on steps 1, 2 of 4 every
    # stride is one jump when the suffix's last time is visited first (with the released jump_last, stride 2 at step 1
    # jumps from τ_2 to 0 where stride 1 visits τ_3: test_granularities_that_complete_differently_pass)
    (["advantage=g2rpo", "sampler=flow_sde", "advantage.granularities=[1,3,9]"], "advantage.granularities: stride 9 "
     "completes every trained step [0, 1, 2] of the 4-step grid as stride 3 does"),
])
def test_nonsense_that_was_accepted_is_refused(overrides, needle):
    _refused(needle, "experiment=smoke", *overrides)


def test_granularities_that_complete_differently_pass():
    _settings("experiment=smoke", "advantage=g2rpo", "sampler=flow_sde", "advantage.granularities=[1,2]")
    _settings("experiment=smoke", "advantage=g2rpo", "advantage.granularities=[1]")  # what the refusal suggests
    _settings("experiment=smoke", "advantage=g2rpo", "advantage.granularities=[1,2]")  # jump_last: τ_2 -> 0 at step 1
    _settings("experiment=league/g2rpo")


def test_a_server_that_would_refuse_every_image_it_takes_is_refused():
    from stepflow.config import Limits

    with pytest.raises(StepflowError, match=r"^max_request_pixels: must be >= max_image_pixels=4194304 .*got 1000"):
        Limits(max_request_pixels=1000)
    Limits(max_image_pixels=32 * 32, max_request_pixels=32 * 32)


# ------------------------------------------------------------------------------------------------ experiments' args
@pytest.mark.parametrize("script,argv,needle", [
    ("league", ["--quick", "--seeds", "a", "--dry-run"], "--seeds: must be comma-separated integers >= 0"),
    ("league", ["--quick", "--seeds", "0,0", "--dry-run"], "--seeds: 0 is given twice"),
    ("league", ["--quick", "--methods", "default,default", "--dry-run"], "--methods: default is given twice"),
    ("league", ["--quick", "--methods", ",", "--dry-run"], "--methods: names no method"),
    ("league", ["--quick", "--prefix", "srun 'a", "--dry-run"], "--prefix: cannot split"),
    ("league", ["--quick", "--budget", "inf", "--dry-run"], "--budget: must be a finite number"),
    ("league", ["--quick", "--jobs", "0"], "--jobs: must be an integer >= 1"),
    ("league", ["--quick", "--dry-run", "--out", "{file}/x"], "--out: "),
    ("league", ["--quick", "--dry-run", "--docs", "{file}/x"], "--docs: "),
    ("ablations", ["--suite", "quick", "--seeds", "a", "--dry-run"], "--seeds: must be comma-separated integers"),
    ("ablations", ["--suite", "quick", "--only", ",", "--dry-run"], "--only: names no ablation"),
    ("ablations", ["--suite", "quick", "--jobs", "0", "--dry-run"], "--jobs: must be an integer >= 1"),
    ("ablations", ["--suite", "quick", "--threads", "-1", "--dry-run"], "--threads: must be an integer >= 0"),
    ("ablations", ["--suite", "quick", "--sweep-dir", "{file}/s", "--dry-run"], "--sweep-dir: "),
    ("bench_iteration", ["--threads", "0"], "--threads: must be an integer >= 1"),
    ("bench_iteration", ["--iters", "0"], "--iters: must be an integer >= 1"),
    ("bench_iteration", ["--warmup", "-1"], "--warmup: must be an integer >= 0"),
    ("bench_iteration", ["--compare", "loop.substeps"], "--compare: must be KEY=V1,V2"),
    ("bench_iteration", ["--compare", "loop.substeps="], "--compare: must be KEY=V1,V2"),
    ("bench_iteration", ["--settings", "bogus"], "--settings: unknown setting 'bogus'"),
    ("bench_iteration", ["--settings", ","], "--settings: names no setting"),
    ("bench_iteration", ["--scheme", "bogus"], "--scheme: unknown advantage scheme 'bogus'"),
    ("bench_iteration", ["--run-dir", "{file}/r"], "--run-dir: "),
])
def test_every_experiments_argument_is_one_line(tmp_path, capsys, script, argv, needle):
    (tmp_path / "afile").write_text("x")
    argv = [a.replace("{file}", str(tmp_path / "afile")) for a in argv]
    if script == "league" and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as info:
        load_experiment(script).main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err and needle in err[-1], err[-1:]
    if needle.endswith(": "):
        assert "afile is a file" in err[-1], err[-1]


def test_run_pool_with_no_jobs_still_runs(tmp_path):
    """--jobs 0 used to start nothing and wait for ever: the pool runs at least one at a time."""
    league = load_experiment("league")
    run = league.Run("table", league.method("default"), "0.001", 0, tmp_path / "table" / "default" / "seed=0")
    run.command = lambda python=None, prefix=(): [sys.executable, "-c", "pass"]

    def hung(signum, frame):  # noqa: ARG001
        raise TimeoutError("run_pool with jobs=0 started nothing and waited")

    import signal

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        assert league.run_pool([run], 0, dict(os.environ)) == [0]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------------ the ledger
GOOD_CFG = "seed: 0\nloop:\n  iterations: 5000\n  budget: 300\ntrain:\n  lr: 0.001\neval:\n  at_fractions: [1.0]\n"
GOOD_METRICS = b"iteration,cost/nfe_fwd_equiv,cost/nfe_fwd_equiv_total,eval/geneval\n1,320.0,320.0,\n1,,,0.41\n"


def _run_dir(root: Path, name: str = "seed=0", config: str = GOOD_CFG, metrics: bytes = GOOD_METRICS) -> Path:
    d = root / "table" / "default" / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(config)
    (d / "metrics.csv").write_bytes(metrics)
    return d


def test_the_ledger_reads_what_it_can_and_names_file_and_line(tmp_path, capsys):
    league = load_experiment("league")
    f = tmp_path / "runs.jsonl"
    f.write_bytes(b'{"phase": "table", "method": "default", "run": "seed=0", "rc": 0, "wall_s": 7.0}\n'
                  b'\xff\xfe garbage\n{"phase": "table", "method": "default", "run": "se')
    assert [r["wall_s"] for r in league.read_records(f)] == [7.0]
    err = capsys.readouterr().err
    assert f"{f}: line 2 is not text" in err and f"{f}:3: not a complete record" in err, err
    csv_file = tmp_path / "results.csv"
    csv_file.write_bytes(b"phase,method\ntable,\x00x\n\xff\ntable,nft\n")
    assert league.read_csv_rows(csv_file) == [{"phase": "table", "method": "nft"}]
    assert f"{csv_file}: lines 2, 3 are not text" in capsys.readouterr().err


@pytest.mark.parametrize("kind,why", [
    ("config", "config.yaml is not YAML (line "),
    ("groups", "config.yaml is not a training config"),
    ("metrics_bytes", "metrics.csv is not text (line 1)"),
    ("metrics_nul", "metrics.csv holds NUL bytes (line 2)"),
    ("empty_ckpt", "checkpoints/last.ckpt is empty"),
    ("torn_ckpt", "checkpoints/last.ckpt is no checkpoint"),
])
def test_a_broken_run_dir_is_moved_aside_with_a_line(tmp_path, capsys, kind, why):
    league = load_experiment("league")
    s = league.Settings(out=tmp_path / "out", ledger=tmp_path / "docs")
    good = _run_dir(tmp_path / "docs" / "runs", "seed=1")
    root = tmp_path / ("out" if kind.endswith("ckpt") else "docs/runs")
    d = _run_dir(root, config={"config": "loop: [\n  budget: 3\n", "groups": "- 1\n"}.get(kind, GOOD_CFG),
                 metrics={"metrics_bytes": b"iteration,\xff\n", "metrics_nul": b"iteration,a\n1,\x00\n"}.get(
                     kind, GOOD_METRICS))
    if kind.endswith("ckpt"):
        (d / "checkpoints").mkdir()
        (d / "checkpoints" / "last.ckpt").write_bytes(b"" if kind == "empty_ckpt" else b"PK\x03\x04 torn")
    assert league.quarantine(s, dry_run=True) == 1 and d.is_dir()  # a dry run only names it
    assert league.quarantine(s) == 1
    err = capsys.readouterr().err
    assert not d.exists() and good.is_dir() and list((d.parent / ".stale").iterdir())
    assert f"moved {d} aside to {d.parent / '.stale'}" in err and why in err, err
    assert league.quarantine(s) == 0  # the next invocation goes on


def test_league_report_over_a_damaged_ledger_writes_the_report(tmp_path, capsys):
    """A half-written runs.jsonl line and an archived run with a corrupt config.yaml (what a crash or a disk fault
    leaves): the report is written, each named (lc1, lc3 of the acceptance sample together)."""
    league = load_experiment("league")
    docs = tmp_path / "docs"
    bad = _run_dir(docs / "runs", config="loop: [\n  budget: 3\n")
    (docs / "runs.jsonl").write_text('{"phase": "table", "method": "default", "run": "seed=0", "rc": 0, '
                                     '"wall_s": 7.0, "end": "x"}\n{"phase": "table", "method": "default", "run": "se')
    rc = league.main(["--report", "--methods", "default", "--no-grid", "--no-claims", "--out", str(tmp_path / "out"),
                      "--docs", str(docs)])
    err = capsys.readouterr().err
    assert rc == 0 and (docs / "report.md").is_file()
    assert f"{docs / 'runs.jsonl'}:2: not a complete record" in err and f"moved {bad} aside" in err, err


# ------------------------------------------------------------------------------------------------ the right thing
def test_turning_point_on_a_noise_free_step_0_names_the_sampler():
    msg = _refused("sampler=ddim_sde (schedule eta_s_sqrt1mt): advantage=turning_point trains an SDE window that "
                   "starts at step 0", "experiment=smoke", "advantage=turning_point")
    assert "window.start=0" not in msg and "sampler=flow_sde" in msg
    _settings("experiment=smoke", "advantage=turning_point", "sampler=flow_sde")  # the fix it gives works


@pytest.mark.parametrize("overrides,needle", [
    (["trainer=fsdp_cpu", "trainer.devices=0"], "trainer.devices: must be a count >= 1"),
    (["trainer=ddp_cpu", "trainer.num_nodes=0"], "trainer.num_nodes: must be an integer >= 1, got 0"),
    (["trainer=fsdp_cpu", "trainer.devices=3"], "trainer.devices: the 8 rows of an iteration "
     "(loop.prompts_per_iter=2 x loop.group_size=4) do not split over trainer.devices x trainer.num_nodes = 3"),
    (["trainer=ddp_cpu", "trainer.devices=[0,1,2]"], "= 3 processes"),
])
def test_a_process_count_is_checked_before_any_process_starts(overrides, needle):
    _refused(needle, "experiment=smoke", *overrides)


def test_process_counts_lightning_decides_pass():
    _settings("experiment=smoke", "trainer=ddp_cpu")
    _settings("experiment=smoke", "trainer=ddp", "trainer.devices=auto")


def test_a_list_field_given_one_value_says_how_to_write_it(capsys):
    from stepflow.cli import check_keys

    with pytest.raises(SystemExit):
        check_keys(["eval.at_fractions=0.5"], "train")
    assert capsys.readouterr().err.strip() == ("stepflow: error: eval.at_fractions: must be a list, got '0.5' (float); "
                                               "give eval.at_fractions=[0.5] (in brackets)")


def test_an_output_dir_that_cannot_be_written_names_its_field(tmp_path):
    from stepflow.evaluate import evaluate
    from stepflow.rundir import writable_dir

    (tmp_path / "afile").write_text("x")
    with pytest.raises(StepflowError, match=r"^out_dir: cannot write into .*afile \(a file is in its way"):
        evaluate(compose_config("evaluate", ["model=shapes_tiny", "max_prompts=4"]), tmp_path / "afile")
    with pytest.raises(StepflowError, match=r"^export_dir: cannot write into .*afile/x \("):
        writable_dir(tmp_path / "afile" / "x", "export_dir")
    assert writable_dir(tmp_path / "new" / "dir", "out_dir").is_dir()


@pytest.mark.parametrize("text,needle", [
    ("", "evals.jsonl is empty"),
    ('{"step": 10, "geneval": 0.4, "pa', "holds no complete evaluation record"),
    ('{"foo": 1}\n', "holds no complete evaluation record"),
])
def test_pretrain_finalize_only_on_a_run_without_evaluations_is_one_line(tmp_path, text, needle):
    from stepflow.pretrain import read_history

    (tmp_path / "evals.jsonl").write_text(text)
    with pytest.raises(StepflowError, match=rf"^finalize_only: .*{needle}"):
        read_history(tmp_path)


def test_pretrain_reads_evaluations_as_far_as_they_go(tmp_path, caplog):
    from stepflow.pretrain import read_history

    row = {"step": 10, "geneval": 0.4, "path": "x", "train_time_s": 1.0}
    (tmp_path / "evals.jsonl").write_text(json.dumps(row) + '\n{"step": 20, "ge')
    assert read_history(tmp_path) == [row]
    assert "line 2 is no complete evaluation record" in caplog.text


def test_pretrain_resume_from_a_training_checkpoint_is_refused(tmp_path):
    from stepflow.pretrain import _check_resume

    torch.save({"state_dict": {}, "stepflow": {"iteration": 1}}, tmp_path / "grpo.ckpt")
    with pytest.raises(StepflowError, match=r"^resume: .*grpo\.ckpt is a stepflow\.train checkpoint"):
        _check_resume(str(tmp_path / "grpo.ckpt"), None)
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "other.ckpt")
    with pytest.raises(StepflowError, match=r"^resume: .*other\.ckpt holds a checkpoint of another model"):
        _check_resume(str(tmp_path / "other.ckpt"), torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------ left from before
def test_a_damaged_shapes_model_dir_names_model_path_and_the_file(tmp_path):
    import shutil

    from stepflow.policies.shapes import ShapesPolicy, default_asset_dir

    shutil.copytree(default_asset_dir(), tmp_path / "m", ignore=shutil.ignore_patterns("*.png", "README.md"))
    (tmp_path / "m" / "config.json").write_text('{"image_size": 32,')
    with pytest.raises(ModelLoadError, match=r"^model\.path: .*m/config\.json is not JSON \(.* at line 1\)"):
        ShapesPolicy.from_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("[1]")
    with pytest.raises(ModelLoadError, match=r"^model\.path: .*config\.json is not a ShapesPolicy config"):
        ShapesPolicy.from_pretrained(tmp_path / "m")
    shutil.copy2(default_asset_dir() / "config.json", tmp_path / "m" / "config.json")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match=r"^model\.path: .*model\.safetensors cannot be read as safetensors"):
        ShapesPolicy.from_pretrained(tmp_path / "m")


def test_weights_of_another_family_name_both(tmp_path):
    from stepflow.policies.pipeline import check_family

    flux_pipeline, flux_transformer = type("FluxPipeline", (), {}), type("FluxTransformer2DModel", (), {})
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(ModelLoadError, match=r"^model\.path: .* holds SD3 weights \(StableDiffusion3Pipeline in "
                                             r"model_index\.json\), not FLUX \(FluxPipeline\)"):
        check_family(tmp_path / "model_index.json", flux_pipeline, "model.path", "FLUX")
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with pytest.raises(ModelLoadError, match=r"^model\.transformer_path: .* holds SD3 weights"):
        check_family(tmp_path / "config.json", flux_transformer, "model.transformer_path", "FLUX")
    check_family(tmp_path / "config.json", type("SD3Transformer2DModel", (), {}), "model.transformer_path", "SD3")


def test_too_many_nan_rewards_name_the_service(tmp_path):
    from stepflow.rewards.remote import RemoteReward
    from stepflow.rollouts.trajectory import _describe

    r = RemoteReward(url="http://127.0.0.1:9/score")
    assert _describe(r) == "reward=remote served at http://127.0.0.1:9/score"
    assert _describe(lambda *a: None) == "reward function"


def test_a_run_dir_hydra_cannot_log_into_is_one_line(tmp_path, capsys, monkeypatch):
    """A run dir that exists but cannot be written (a read-only directory or file system; root writes into a
    read-only directory, so the write is refused here by hand): one line naming hydra.run.dir before Hydra's log
    file handler opens it (a traceback before)."""
    import errno
    import tempfile

    from stepflow.rundir import RunDirCallback

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ro"))

    (tmp_path / "ro").mkdir()
    cfg = compose_config("train", [f"hydra.run.dir={tmp_path / 'ro'}"], return_hydra_config=True)
    monkeypatch.setattr(tempfile, "TemporaryFile", refused)
    with pytest.raises(SystemExit):
        RunDirCallback(lock=False).on_run_start(cfg)
    assert capsys.readouterr().err.strip() == (f"stepflow: error: hydra.run.dir: cannot write into {tmp_path / 'ro'} "
                                               f"(Read-only file system: {tmp_path / 'ro'}); give a directory that can "
                                               "be written, hydra.run.dir=<dir>")


@pytest.mark.parametrize("override, refused", [
    ("trainer.max_steps=10", "trainer.max_steps"), ("optim.lr=1e-3", "optim.lr"), ("+data.foo=1", "data.foo"),
    ("arch.width=8", "arch.width"), ("select.enabled=true", None), ("eval.max_prompts=4", None), ("export=true", None),
    ("hydra.run.dir=/x", None), ("seed=3", None),
])
def test_pretrain_finalize_only_refuses_training_settings_it_would_ignore(override, refused):
    from stepflow.pretrain import inert_under_finalize

    if refused is None:
        inert_under_finalize([override])
        return
    with pytest.raises(StepflowError, match=rf"^{refused}: finalize_only .* so {refused} would be ignored; drop it"):
        inert_under_finalize([override])


def test_pretrain_finalize_only_with_a_training_setting_is_one_line_from_the_command_line(cli, tmp_path):
    """Before anything loads: the run dir given need not even exist."""
    from stepflow.testing.harness import one_line_error

    r = cli("stepflow.pretrain", f"finalize_only={tmp_path / 'nowhere'}", "trainer.max_steps=5",
            f"hydra.run.dir={tmp_path / 'out'}")
    one_line_error(r, "trainer.max_steps: finalize_only")
