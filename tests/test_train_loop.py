"""Integration tests of the GRPO loop on a tiny random shapes policy (CPU, seconds each)."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import pytest
import torch

from stepflow.testing.harness import compose_config, run_cli, run_in_process, smoke_config

make_cfg = smoke_config  # this module's name for the smoke config with overrides


def fit(tmp_path: Path, *overrides: str):
    from stepflow.train import run

    cfg = make_cfg(*overrides)
    return run(cfg, tmp_path), cfg


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as fh:
        return list(csv.DictReader(fh))


def test_first_update_is_on_policy(tmp_path):
    """On the first (only) update of an iteration π_θ = π_old, so every ratio is 1 (to 1e-5)."""
    from stepflow.train import build_module

    cfg = make_cfg("train.updates_per_iter=1", "loop.iterations=1")
    module = build_module(cfg, tmp_path)  # standalone: no Trainer, the module owns its optimizer
    m = module.iterate()
    assert m["train/steps_trained"] > 0
    assert abs(m["train/ratio_min"] - 1) < 1e-5 and abs(m["train/ratio_max"] - 1) < 1e-5
    assert m["train/clip_frac"] == 0.0


ADVANTAGES = ["uniform", "gain", "gain_per_step", "gain_ema", "gae"]
OBJECTIVES = ["grpo", "distill", "nft", "awm", "advantageflow"]
SAMPLERS = ["flow_sde", "ddim_sde", "cps", "ode"]


def covering(parts: list[str]) -> list:
    """Every (sampler, part) pair; CI (``slow``) runs a covering subset, each part and each sampler at least once
    (part i with sampler i mod 4), the other pairs are ``extended`` (make test-extended)."""
    return [pytest.param(s, x, id=f"{s}-{x}", marks=() if j == i % len(SAMPLERS) else pytest.mark.extended)
            for j, s in enumerate(SAMPLERS) for i, x in enumerate(parts)]


@pytest.mark.slow
@pytest.mark.parametrize("sampler, advantage", covering(ADVANTAGES))
def test_two_iterations_every_combination(tmp_path, advantage, sampler):
    module, _ = fit(tmp_path, f"advantage={advantage}", f"sampler={sampler}", "eval.max_prompts=6")
    rows = read_metrics(tmp_path)
    train = [r for r in rows if r.get("train/reward_final")]
    assert len(train) == 2
    assert module.iteration == 2
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (tmp_path / "reward_curve.png").is_file()
    trained = float(train[-1]["train/steps_trained"])
    if sampler == "ode":
        assert trained == 0  # the ODE has no density: GRPO trains nothing
    else:
        assert trained > 0
    nfe = float(train[-1]["cost/nfe"])
    assert nfe > 0
    if advantage == "uniform":
        assert float(train[-1]["cost/reward_images"]) == 8  # only R_T: B images
    else:
        assert float(train[-1]["cost/reward_images"]) == 8 * 5  # B * (T + 1)


@pytest.mark.slow
@pytest.mark.parametrize("sampler, objective", covering(OBJECTIVES[1:]))
def test_two_iterations_every_objective(tmp_path, objective, sampler):
    """Each objective trains with every rollout sampler (distill: its own ODE rollout), with finite metrics and
    moved weights."""
    import math

    from safetensors.torch import load_file

    from stepflow.train import build_module

    ref = build_module(make_cfg(), tmp_path / "ref").state_dict()  # the trained weights before training
    module, _ = fit(tmp_path, f"objective={objective}", f"sampler={sampler}", "eval.max_prompts=6")
    train = [r for r in read_metrics(tmp_path) if r.get("cost/nfe")]
    assert len(train) == 2 and float(train[-1]["train/steps_trained"]) > 0
    assert all(math.isfinite(float(v)) for r in train for k, v in r.items() if k.startswith("train/") and v)
    saved = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    assert saved and all(bool(v.isfinite().all()) for v in saved.values())
    now = module.state_dict()
    assert set(now) == set(ref)
    assert max(float((now[k] - ref[k]).abs().max()) for k in ref) > 0, "no weight moved"


def test_outputs_of_a_run(tmp_path):
    module, _ = fit(tmp_path)
    rows = read_metrics(tmp_path)
    evals = [r for r in rows if r.get("eval/geneval")]
    assert len(evals) == 2  # start and end
    keys = set(rows[0])
    for k in ["train/reward_mean", "train/reward_final", "train/kl", "train/clip_frac", "train/ratio_mean",
              "train/adv_abs_mean_step0", "eval/shapes_geneval", "eval/geneval", "time/rollout_s", "time/estimate_s",
              "time/reward_s", "time/update_s", "cost/nfe", "cost/reward_calls"]:
        assert k in keys, k
    assert len(list((tmp_path / "eval_grids").glob("*.png"))) == 2
    assert (tmp_path / "config.yaml").is_file()
    # the adapter loads with diffusers' loader conventions (transformer.* keys, peft format)
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"))
    assert sd and all(k.startswith("transformer.") for k in sd)
    assert any("add_q_proj" in k for k in sd) and any("to_out.0" in k for k in sd)
    # the end-of-run line names the held-out metric first -> last, as in metrics.csv
    from stepflow.train import summary_line

    line = summary_line(module.history, tmp_path)
    a, b = float(evals[0]["eval/geneval"]), float(evals[-1]["eval/geneval"])
    assert line.startswith("stepflow: 2 iterations,") and f"eval/geneval {a:.3f} -> {b:.3f} ({b - a:+.3f})" in line
    assert "eval/geneval_" not in line and str(tmp_path) in line
    # the model's forward calls, and what a budget counts (a backward as two forwards), both from metrics.csv
    last = [r for r in rows if r.get("cost/nfe_total")][-1]
    nfe, equiv = (int(float(last[k])) for k in ("cost/nfe_total", "cost/nfe_fwd_equiv_total"))
    assert f" {nfe:,} NFEs ({equiv:,} forward-equivalent);" in line and equiv > nfe


def test_kill_and_resume_matches_uninterrupted(tmp_path):
    """A run stopped after iteration 2 and resumed from last.ckpt gives the same iteration-3 metrics."""
    common = ["advantage=gain_ema", "train.updates_per_iter=2", "eval.max_prompts=4"]
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    fit(full_dir, "loop.iterations=3", *common)
    fit(part_dir, "loop.iterations=2", *common)
    ckpt = part_dir / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    fit(part_dir, "loop.iterations=3", f"ckpt_path={ckpt}", *common)
    a = [r for r in read_metrics(full_dir) if r.get("train/reward_final")]
    b = [r for r in read_metrics(part_dir) if r.get("train/reward_final")]
    assert len(a) == len(b) == 3
    for key in ["train/reward_final", "train/reward_mean", "train/ratio_mean", "train/policy_loss", "train/adv_abs_mean_step1"]:
        assert float(a[2][key]) == pytest.approx(float(b[2][key]), rel=1e-5, abs=1e-7), key


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return run_cli("stepflow.train", *args, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["advantage=nope"], "advantage=nope"),
    (["sampler=sdee"], "sampler=sdee"),
    (["sampler.eta=-1"], "sampler.eta"),
    (["advantage.std_scope=batch"], "std_scope"),
    (["train.lr=0"], "train.lr"),
    (["loop.frobnicate=1"], "frobnicate"),
    (["data.train_file=/nonexistent/prompts.jsonl"], "data.train_file"),
    (["ckpt_path=/nonexistent/last.ckpt"], "ckpt_path"),
    (["data.balance_by=nokey"], "data.balance_by"),
    (["sampler=ddim_sde", "sampler.schedule=bogus"], "sampler.schedule"),
    (["train.train_steps=[12]"], "train.train_steps: step 12 is outside 0..3"),
    (["train.train_steps=[]"], "train.train_steps: empty list"),
    (["sampler=ddim_sde", "sampler.schedule=eta_s_sqrt1mt", "train.train_steps=[0]"], "carry no noise"),
])
def test_bad_overrides_give_one_line_errors(tmp_path, cli, args, needle):
    r = cli("stepflow.train", "experiment=smoke", f"hydra.run.dir={tmp_path}", *args)  # in-process
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith("stepflow: error:") and needle in err[0], err[0]


#: the newer methods' 2-process cases (each about a minute on 2 cores: make test-extended, outside CI's 30 minutes)
EXTENDED_DDP = [
    ("pref_grpo", ["advantage=pref_grpo", "sampler=flow_sde", "reward=pickscore_tiny", "loop.prompts_per_iter=1",
                   "loop.group_size=8"]),
    ("e_grpo", ["advantage=e_grpo", "sampler=flow_sde", "reward=pickscore_tiny", "loop.same_latent=true",
                "train.update_per_step=true", "train.drop_zero_adv=false", "train.train_steps=[0,1]",
                "advantage.merge=[2,1]", "loop.time_grid=fastvideo"]),
    ("branchgrpo", ["advantage=branchgrpo", "advantage.split_points=[0,1,2]", "sampler=dance_sde",
                    "reward=pickscore_tiny", "train.train_steps=null", "loop.prompts_per_iter=1", "loop.group_size=8"]),
    ("dgpo", ["objective=dgpo", "sampler=ode", "advantage=uniform", "reward=pickscore_tiny", "loop.same_latent=false",
              "objective.trunc_steps=2", "objective.num_times=2", "train.beta_kl=0.02", "loop.prompts_per_iter=1",
              "loop.group_size=8", "loop.iterations=2"]),
    # gardo: the features, the auxiliary component and the gate over every rank's rows (std_norm: the released
    # unnormalised advantages of the tiny rewards move lora_B under the 1e-5 floor)
    ("gardo", ["advantage=gardo", "objective=gardo", "sampler=flow_sde", "train.beta_kl=0.07", "loop.same_latent=false",
               "reward=multi", "reward@reward.rewards.ocr=pickscore_tiny", "reward@reward.rewards.pickscore=pickscore_tiny",
               "reward.rewards.ocr.seed=1", "advantage.aux_components=[ocr]", "advantage.std_norm=true",
               "loop.prompts_per_iter=4"]),
    # online_dpo: the pair of a group's max / min advantage found over both ranks (uniform credit: every row has
    # one, so pairs found per rank would be two)
    ("online_dpo", ["objective=online_dpo", "advantage=uniform", "sampler=flow_sde", "reward=pickscore_tiny",
                    "loop.same_latent=false", "loop.prompts_per_iter=1", "loop.group_size=8", "loop.iterations=2"]),
]


@pytest.mark.slow
@pytest.mark.xdist_group("multiprocess2")  # 2 processes, one at a time on one worker (test_sharded's on the other)
@pytest.mark.parametrize("extra", [[],  # CI runs plain and tempflow; the others are extended (make test-extended)
                                   pytest.param(["train.weighting=auto", "train.auto_warmup=0", "reward=pickscore_tiny",
                                                 "sampler=flow_sde"], marks=pytest.mark.extended),
                                   pytest.param(["objective=nft", "sampler=dpm2", "reward=pickscore_tiny",
                                                 "loop.same_latent=false", "advantage=uniform", "advantage.std_scope=global"],
                                                marks=pytest.mark.extended),
                                   ["advantage=tempflow", "advantage.branches=2", "sampler=flow_sde", "reward=pickscore_tiny",
                                    "loop.same_latent=false", "train.weighting=noise", "loop.prompts_per_iter=1",
                                    "loop.group_size=8"],  # one group over both ranks
                                   pytest.param(["advantage=g2rpo", "sampler=flow_sde", "reward=pickscore_tiny",
                                                 "train.update_per_step=true", "train.train_steps=[0,1]"],
                                                marks=pytest.mark.extended),
                                   *[pytest.param(x, id=i, marks=pytest.mark.extended) for i, x in EXTENDED_DDP]],
                         ids=["plain", "auto", "nft", "tempflow", "g2rpo", *[i for i, _ in EXTENDED_DDP]])
def test_ddp_two_processes_matches_one(tmp_path, extra):
    """2-process DDP on the CPU (gloo) gives the same rewards and advantages as 1 process for the same seeds, and
    the same optimizer step (auto: the per-step gradients are RMS-normalised by their global norms; nft: each row's
    training times and noise follow it to its rank; tempflow / g2rpo: each rank branches its own rows' anchors, the
    advantages are normalised over every rank's branches, g2rpo takes one optimizer step per trained step; the newer
    methods (``extended``: make test-extended): pref_grpo's win rates over a group on both ranks; e_grpo's merged steps,
    whose branch rows carry their spans to each rank's update; branchgrpo: both ranks grow the shared prefix of the
    tree their leaves split, each trains the edges it owns; dgpo: one group over both ranks, its weight's sum added
    over them; online_dpo: a group's winner and loser paired across ranks (both for 2 iterations, so that the
    second's margins to the reference are not 0))."""
    one, two = tmp_path / "one", tmp_path / "two"
    # adam_eps=1, lr=1: the first Adam step is ~ the gradient itself (not its sign), so weights compare gradients
    common = ["experiment=smoke", "loop.iterations=1", "loop.dump_trajectories=true", "eval.max_prompts=2",
              "train.adam_eps=1.0", "train.lr=1.0", "train.max_grad_norm=0", *extra]
    r1 = run_in_process("stepflow.train", *common, f"hydra.run.dir={one}")  # one process: no fresh interpreter
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = _cli(*common, "trainer=ddp_cpu", f"hydra.run.dir={two}", timeout=400)
    assert r2.returncode == 0, r2.stderr[-3000:]
    a = torch.load(one / "trajectories" / "iter_0000.pt")
    b = torch.load(two / "trajectories" / "iter_0000.pt")
    assert a["prompts"] == b["prompts"]
    torch.testing.assert_close(a["rewards"], b["rewards"], atol=1e-5, rtol=0, equal_nan=True)  # NaN: not scored
    torch.testing.assert_close(a["advantages"], b["advantages"], atol=1e-4, rtol=0)
    # the gradients are averaged over ranks, so both runs take the same optimizer step
    from safetensors.torch import load_file

    wa = load_file(str(one / "lora" / "pytorch_lora_weights.safetensors"))
    wb = load_file(str(two / "lora" / "pytorch_lora_weights.safetensors"))
    assert wa.keys() == wb.keys()
    moved = max(float(wa[k].abs().max()) for k in wa if "lora_B" in k)
    for k in wa:  # tolerances relative to the step (auto's step is ~2e-5: an absolute 1e-6 would hide a 10 % error)
        torch.testing.assert_close(wa[k], wb[k], atol=1e-3 * moved, rtol=1e-3)
    assert moved > 1e-5  # lora_B starts at zero: the step moved it


def test_reward_service_failure_stops_cleanly_and_resumes(tmp_path):
    """A remote reward that keeps failing stops the run with a one-line error and a usable last.ckpt."""
    import threading

    from stepflow.errors import StepflowError
    from stepflow.rewards.shapes_geneval import ShapesGenEvalReward
    from stepflow.serve_reward import make_server

    class Flaky(ShapesGenEvalReward):
        calls, fail_after = 0, 2  # eval at start, iteration 1; then the service breaks

        def score(self, images, prompts, meta):
            Flaky.calls += 1
            if Flaky.calls > Flaky.fail_after:
                raise RuntimeError("model crashed")
            return super().score(images, prompts, meta)

    server = make_server(Flaky(), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    args = ["reward=remote", f"reward.url={url}", "reward.max_retries=1", "reward.backoff_s=0.01",
            "loop.iterations=3", "eval.max_prompts=4"]
    try:
        with pytest.raises(StepflowError, match="reward service failed at iteration 1"):
            fit(tmp_path, *args)
        rows = [r for r in read_metrics(tmp_path) if r.get("train/reward_final")]
        assert len(rows) == 1
        ckpt = tmp_path / "checkpoints" / "last.ckpt"
        assert ckpt.is_file()
        Flaky.fail_after = 10**6  # the service is back
        module, _ = fit(tmp_path, *args, f"ckpt_path={ckpt}")
        assert module.iteration == 3
        assert len([r for r in read_metrics(tmp_path) if r.get("train/reward_final")]) == 3
    finally:
        server.shutdown()


def test_ddim_schedule_default_follows_the_recipe():
    """recipe/shapes.yaml (composed for model=shapes) picks the eta_s DDIM schedule; other models keep the paper's,
    the miniature suite pins its own, and an explicit sampler.schedule override always wins."""
    assert compose_config("train").sampler.schedule == "eta_s"
    assert compose_config("train", ["model=sd3_tiny"]).sampler.schedule == "eta_s_sqrt1mt"
    assert compose_config("train", ["sampler.schedule=eta_t_sqrt1mt"]).sampler.schedule == "eta_t_sqrt1mt"
    assert compose_config("train", ["experiment=mini_fig6_sde", "sampler=ddim_sde"]).sampler.schedule == "eta_s_sqrt1mt"


def test_train_steps_default_follows_the_recipe():
    """recipe/shapes.yaml trains step 0; other models and the miniature suite train every stochastic step; an
    explicit override wins."""
    assert list(compose_config("train").train.train_steps) == [0]
    assert compose_config("train", ["model=sd3_tiny"]).train.train_steps is None
    assert compose_config("train", ["model=shapes_tiny"]).train.train_steps is None
    assert compose_config("train", ["experiment=mini_fig7_credit"]).train.train_steps is None
    assert list(compose_config("train", ["train.train_steps=[1,2]"]).train.train_steps) == [1, 2]


def test_explicit_train_steps_train_only_those_steps(tmp_path):
    """train.train_steps=[1]: one step trained, and its log carries only that step's clip fraction."""
    module, _ = fit(tmp_path, "train.train_steps=[1]", "loop.iterations=1")
    train = [r for r in read_metrics(tmp_path) if r.get("train/reward_final")]
    assert float(train[0]["train/steps_trained"]) == 1
    assert train[0].get("train/clip_frac_step1") not in (None, "")
    assert train[0].get("train/clip_frac_step0") in (None, "")


def test_gain_trained_does_only_the_work_its_credit_uses(tmp_path, monkeypatch):
    """advantage=gain_trained with step 1 trained: the rollout stops after X_2, only X_1 and X_2 are estimated and
    scored, and the advantages, loss and gradient equal those of gain_per_step on the full rollout (at one trained
    step both normalise that step's gains per group)."""
    from stepflow.core.algorithm import iteration, iteration_metrics
    from stepflow.train import build_module

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))  # reward=pickscore_tiny: scores with variance
    # T' fixed (loop.adaptive_substeps=false) so that the estimate's NFEs below are the plain T' = 2 count
    common = ["train.train_steps=[1]", "sampler=flow_sde", "loop.final_reward_every=0", "reward=pickscore_tiny",
              "loop.adaptive_substeps=false"]
    cut = build_module(make_cfg("advantage=gain_trained", *common), tmp_path / "cut")
    full = build_module(make_cfg("advantage=gain_per_step", *common), tmp_path / "full")
    for m in (cut, full):
        m.learner.optimizer = m._own_optimizer()
    a, b = iteration(cut.learner, 0), iteration(full.learner, 0)
    torch.testing.assert_close(a.advantages.advantages[:, 1], b.advantages.advantages[:, 1])
    assert float(a.advantages.advantages[:, [0, 2, 3]].abs().max()) == 0.0
    for k in ("train/policy_loss", "train/grad_norm", "train/samples_trained"):
        assert a.update[k] == pytest.approx(b.update[k], rel=1e-6), k
    ma, mb = iteration_metrics(a, 1), iteration_metrics(b, 1)
    bsz = 8  # smoke: 2 prompts x 4
    assert ma["cost/nfe_rollout"] == bsz * 2 and mb["cost/nfe_rollout"] == bsz * 4  # X_0 -> X_2 only
    assert ma["cost/reward_images"] == bsz * 2 and mb["cost/reward_images"] == bsz * 5  # R_1, R_2 only
    # T' = 2: X_1 reuses the rollout's velocity (1 more NFE), X_2 needs its own first one (2)
    assert ma["cost/nfe_estimate"] == bsz * 3
    assert "train/reward_final" not in ma and "train/reward_step1" in ma and "train/reward_step0" not in ma
    # every loop.final_reward_every iterations the rollout goes on to score the final image for the log
    cut.learner.loop.final_reward_every = 2
    m2 = iteration_metrics(iteration(cut.learner, 2), 1)
    assert m2["cost/nfe_rollout"] == bsz * 4 and "train/reward_final" in m2


def test_overlapped_reward_calls_give_the_sequential_iteration(tmp_path, monkeypatch):
    """loop.overlap_reward: chunks rolled out, estimated and decoded in turn, their reward calls in a thread; the
    trajectories, rewards, advantages and update are the sequential iteration's, and a slow reward's time hides
    behind the next chunk's rollout."""
    import time as _time

    from stepflow.core.algorithm import iteration, iteration_metrics
    from stepflow.train import build_module

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    mods = {o: build_module(make_cfg("reward=pickscore_tiny", f"loop.overlap_reward={o}", "loop.overlap_chunks=2",
                                     "sampler=flow_sde", "train.train_steps=null"), tmp_path / str(o))
            for o in (False, True)}
    slow = {"n": 0}
    for m in mods.values():
        m.learner.optimizer = m._own_optimizer()
        inner = m.learner.reward

        class Slow:  # the remote reward's latency
            name = inner.name

            def __call__(self, images, prompts, meta=None, inner=inner):
                _time.sleep(0.3)
                slow["n"] += 1
                return inner(images, prompts, meta)

        m.learner.reward = Slow()
    seq, ovl = iteration(mods[False].learner, 0), iteration(mods[True].learner, 0)
    torch.testing.assert_close(ovl.rewards, seq.rewards, equal_nan=True)
    torch.testing.assert_close(ovl.advantages.advantages, seq.advantages.advantages)
    assert ovl.update["train/policy_loss"] == pytest.approx(seq.update["train/policy_loss"], rel=1e-6)
    ms, mo = iteration_metrics(seq, 1), iteration_metrics(ovl, 1)
    assert mo["cost/nfe"] == ms["cost/nfe"] and mo["cost/reward_images"] == ms["cost/reward_images"]
    assert slow["n"] == 3  # one call in sequence, two chunks overlapped


def test_compiled_transformer_gives_the_eager_velocity_and_trains(tmp_path):
    """loop.compile=<backend>: the transformer's forward through torch.compile (aot_eager here: Dynamo's graph
    capture of the peft-adapted transformer without a C++ build) equals eager and a run goes through."""
    from stepflow.train import build_module

    eager = build_module(make_cfg(), tmp_path / "e")
    comp = build_module(make_cfg("loop.compile=aot_eager"), tmp_path / "c")
    x = torch.randn(4, *eager.policy.latent_shape, generator=torch.Generator().manual_seed(0))
    c = eager.policy.encode(["a photo of a circle"] * 4)
    with torch.no_grad():
        torch.testing.assert_close(comp.policy.velocity(x, 0.5, c), eager.policy.velocity(x, 0.5, c), atol=1e-6, rtol=0)
    m = comp.iterate()
    assert m["cost/nfe"] > 0 and sorted(comp.state_dict()) == sorted(eager.state_dict())


def test_estimate_chunks_give_the_same_estimates(tmp_path):
    """loop.estimate_chunk only bounds the states per model call: the estimates agree to float rounding (the
    batched kernels' summation order; on the shipped shapes model chunks of 16, 64 and 160 were bit-identical)."""
    from stepflow.core.rollout import estimate_states, rollout
    from stepflow.train import build_module

    m = build_module(make_cfg(), tmp_path)
    lr = m.learner
    traj = rollout(lr.policy, lr.plan.plan(0), lr.sampler, 4, 1.0)
    full = estimate_states(lr.policy, traj, 2, 1.0)
    for chunk in (3, 7):
        torch.testing.assert_close(estimate_states(lr.policy, traj, 2, 1.0, chunk_size=chunk), full, atol=1e-5, rtol=0)


def test_lockstep_padding_micro_batches_train_nothing(tmp_path, monkeypatch):
    """Under FSDP2 / DeepSpeed a rank with fewer micro-batches than another (or none of a chunk's rows) runs extra
    ones at loss weight 0, so every rank makes the same forward / backward passes. Here one process stands in for a
    rank whose peer holds 3 micro-batches more per chunk: it runs exactly those extra passes, and its gradient,
    weights and logged statistics are those of the run without them."""
    from stepflow.core import dist as dist_mod
    from stepflow.train import build_module

    class Peer(dist_mod.Dist):  # a rank whose peer has 3 more micro-batches in every chunk
        def all_max(self, x: float) -> float:
            return float(x) + 3

    def run(lockstep: bool):
        torch.manual_seed(0)
        # a continuous reward: every row (the padding row too) has an advantage, so a padding row given any weight
        # would move the weights
        module = build_module(make_cfg("model=sd3_tiny", "reward=pickscore_tiny", "loop.iterations=1",
                                       "train.micro_batch_size=2", "train.beta_kl=0.04"), tmp_path / str(lockstep))
        monkeypatch.setattr(dist_mod.Dist, "from_module", classmethod(
            lambda cls, m: Peer(device=m.device, lockstep=True) if lockstep else dist_mod.Dist(device=m.device)))
        m = module.iterate()
        return m, [p.detach().clone() for p in module.policy.trainable_parameters()]

    plain, w_plain = run(False)
    padded, w_padded = run(True)
    assert plain["train/steps_trained"] > 0 and plain["train/samples_trained"] > 0
    for a, b in zip(w_plain, w_padded):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for k in ("train/policy_loss", "train/kl", "train/grad_norm", "train/clip_frac", "train/samples_trained"):
        assert padded[k] == plain[k], k
    # the extra passes ran: 3 zero-weight micro-batches (of one row) per trained step, each a forward with grad
    # and (beta > 0) one without for the reference
    steps = int(plain["train/steps_trained"])
    assert padded["cost/nfe_backward"] - plain["cost/nfe_backward"] == 3 * steps
    assert padded["cost/nfe"] - plain["cost/nfe"] == 3 * steps * 2
