"""The objective group: each objective's loss term, as the iteration wires it, against a hand computation of the
released formula on the policy's own velocities; the weight copies (old / EMA) and their schedules; the rollout under
the behaviour policy; resume with the copies; and the settings each objective refuses."""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.testing.harness import compose_config, last_train_metrics, one_line_error

BASE = ["experiment=smoke", "reward=pickscore_tiny"]


def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    return build_module(compose_config("train", [*BASE, *overrides]), tmp_path)


def _batch(module, it=0):
    """A rollout of iteration ``it`` under the objective's behaviour policy, its trained steps and random advantages."""
    from stepflow.core.rollout import rollout

    lr = module.learner
    plan = lr.plan.plan(it)
    grid = lr.policy.time_grid(lr.loop.num_steps)
    steps = lr.objective.trained_steps(lr.train, lr.sampler, grid, None)
    with lr.objective.behaviour():
        traj = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    adv = torch.randn(traj.batch_size, lr.loop.num_steps, generator=torch.Generator().manual_seed(5)) * 3
    return plan, traj, steps, adv


def _point(obj, traj, term):
    """Term ``term``'s grid index k (B,), time t (B, 1, 1, 1), X_T, noise and x_t = (1 − t)·X_T + t·ε, written out."""
    k = obj.index[:, term]
    t = traj.times[k].view(-1, 1, 1, 1)
    x0, eps = traj.latents[:, -1], obj.noise[:, term]
    return k, t, x0, eps, (1 - t) * x0 + t * eps


def _perturb(copy, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    for s in copy.shadow:
        s.add_(torch.randn(s.shape, generator=g) * scale)


@pytest.mark.parametrize("name,cls", [("grpo", "Grpo"), ("distill", "Distill"), ("nft", "Nft"), ("awm", "Awm"),
                                      ("advantageflow", "AdvantageFlow")])
def test_the_objective_group_builds_each_objective(tmp_path, name, cls):
    m = _module(tmp_path, f"objective={name}")
    assert type(m.learner.objective).__name__ == cls and m.learner.objective.cfg.name == name


def test_nft_term_is_the_released_formula_on_the_policys_velocities(tmp_path):
    """One NFT term: x_t from the rollout's X_T and the row's own noise at the row's own grid time, v_old from the old
    copy, the loss of NVlabs/DiffusionNFT train_nft_sd3.py L910-970 written out here, β_kl·KL to the LoRA-disabled
    reference."""
    from stepflow.core.algorithm import step_loss

    m = _module(tmp_path, "objective=nft", "objective.beta=0.3", "train.beta_kl=0.01", "sampler=dpm2",
                "loop.same_latent=false", "train.timestep_fraction=0.75")
    lr, obj = m.learner, m.learner.objective
    _perturb(obj.old)  # the old copy differs from the current weights
    plan, traj, steps, adv = _batch(m)
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps)
    assert obj.index.shape == (traj.batch_size, 3)  # int(4 · 0.75) random grid times per row
    assert all(len(set(r.tolist())) == 3 for r in obj.index)  # a permutation's first K: no time twice
    rows = torch.arange(traj.batch_size)
    got = step_loss(lr, traj, adv, 1, rows, traj.times)
    k, t, x0, eps, x_t = _point(obj, traj, 1)
    cond, pol = traj.cond, lr.policy
    with torch.no_grad():
        v = pol.velocity(x_t, t.flatten(), cond, 1.0)
        with obj.old.applied():
            v_old = pol.velocity(x_t, t.flatten(), cond, 1.0)
        with pol.reference():
            v_ref = pol.velocity(x_t, t.flatten(), cond, 1.0)
    a = adv[rows, k]
    r = (a.clamp(-5, 5) / 5 / 2 + 0.5).clamp(0, 1)
    beta = 0.3
    pos, neg = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v
    lp, ln = x_t - t * pos, x_t - t * neg
    w_p = (lp - x0).abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
    w_n = (ln - x0).abs().mean(dim=(1, 2, 3)).clamp(min=1e-5)
    l_p = ((lp - x0) ** 2).mean(dim=(1, 2, 3)) / w_p
    l_n = ((ln - x0) ** 2).mean(dim=(1, 2, 3)) / w_n
    want = (5 * (r * l_p / beta + (1 - r) * l_n / beta)).mean() + 0.01 * ((v - v_ref) ** 2).mean()
    assert float(got["loss"].detach()) == pytest.approx(float(want), rel=1e-5)


def test_forward_draws_depend_on_the_row_alone(tmp_path):
    """A row's times and noise come from its own seed: the same on one rank or another, in any batch order."""
    m = _module(tmp_path, "objective=nft", "sampler=dpm2")
    lr, obj = m.learner, m.learner.objective
    plan, traj, steps, _ = _batch(m)
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps)
    idx, noise = obj.index.clone(), obj.noise.clone()
    perm = torch.randperm(traj.batch_size, generator=torch.Generator().manual_seed(1))
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds[perm], steps)
    assert torch.equal(obj.index, idx[perm]) and torch.equal(obj.noise, noise[perm])
    assert len({tuple(r.tolist()) for r in idx}) > 1  # rows draw different times


def test_the_rollout_runs_under_the_old_copy(tmp_path):
    """DiffusionNFT samples with the old adapter: the behaviour context swaps the old weights in and back."""
    from stepflow.core.rollout import rollout

    m = _module(tmp_path, "objective=nft", "sampler=dpm2")
    lr, obj = m.learner, m.learner.objective
    _perturb(obj.old, 0.2)
    plan = lr.plan.plan(0)
    live = [p.detach().clone() for p in lr.policy.trainable_parameters()]
    with obj.behaviour():
        a = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    assert all(torch.equal(p, q) for p, q in zip(lr.policy.trainable_parameters(), live))  # restored
    with torch.no_grad():
        for p, s in zip(lr.policy.trainable_parameters(), obj.old.shadow):
            p.copy_(s)
    b = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    assert torch.equal(a.latents, b.latents)
    with torch.no_grad():
        for p, q in zip(lr.policy.trainable_parameters(), live):
            p.copy_(q)
    c = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    assert not torch.equal(a.latents, c.latents)


@pytest.mark.parametrize("decay_type,step,d", [(1, 3, 0.003), (1, 900, 0.5), (0, 50, 0.0), (2, 74, 0.0),
                                               (2, 100, 0.1875)])
def test_the_old_copy_follows_the_released_schedule(tmp_path, decay_type, step, d):
    """θ_old ← d·θ_old + (1 − d)·θ after every iteration, d from return_decay (train_nft_sd3.py L169-189), worked out
    by hand: type 1 min(0.001·step, 0.5); type 2 0 before step 75, then min(0.0075·(step − 75), 0.999)."""
    m = _module(tmp_path, "objective=nft", f"objective.decay_type={decay_type}")
    lr, obj = m.learner, m.learner.objective
    _perturb(obj.old)
    before = [s.clone() for s in obj.old.shadow]
    lr.opt_steps = step
    obj.end_iteration(lr)
    for s, b, p in zip(obj.old.shadow, before, lr.policy.trainable_parameters()):
        torch.testing.assert_close(s, d * b + (1 - d) * p.detach(), rtol=0, atol=1e-7)


def test_awm_term_is_the_released_formula_with_shared_stratified_times(tmp_path):
    """AWM: every row trains at the same stratified grid indices of [1, int(0.9·T)) (discrete_wo_init); the term is
    −A·∇(−ghuber(ℓ)·t) on-policy + β·KL to the reference + ema_beta·KL to the fast EMA copy
    (train_sd3_awm.py L210-252, L1290-1352, written out here)."""
    from stepflow.core.algorithm import step_loss

    m = _module(tmp_path, "objective=awm", "loop.num_steps=10", "train.beta_kl=0.003", "objective.ema_beta=0.5")
    lr, obj = m.learner, m.learner.objective
    _perturb(obj.ema)
    plan, traj, steps, adv = _batch(m)
    obj.begin_update(lr, traj, 3, plan.step_noise_seeds, steps)
    assert obj.index.shape == (traj.batch_size, 6)
    assert all(torch.equal(r, obj.index[0]) for r in obj.index)  # shared by the whole batch
    strata = [(1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 9)]  # floor(linspace(1, 9, 7))
    assert all(lo <= int(k) < hi for k, (lo, hi) in zip(obj.index[0], strata))
    rows = torch.arange(traj.batch_size)
    got = step_loss(lr, traj, adv, 2, rows, traj.times)
    k, t, x0, eps, x_t = _point(obj, traj, 2)
    pol, cond = lr.policy, traj.cond
    with torch.no_grad():
        v = pol.velocity(x_t, t.flatten(), cond, 1.0)
        with pol.reference():
            v_ref = pol.velocity(x_t, t.flatten(), cond, 1.0)
        with obj.ema.applied():
            v_ema = pol.velocity(x_t, t.flatten(), cond, 1.0)
    a = adv[rows, k].clamp(-5, 5) / 5
    ell = ((v.double() - (eps.double() - x0.double())) ** 2).mean(dim=(1, 2, 3))
    logp = -((ell + 1e-10) ** 0.25 - 1e-10 ** 0.25) * t.flatten().double() / 0.25
    pl = (-a.double() * torch.exp(logp - logp)).mean()  # ρ = 1 on-policy
    want = pl + 0.003 * ((v - v_ref) ** 2).mean() + 0.5 * ((v - v_ema) ** 2).mean()
    assert float(got["loss"].detach()) == pytest.approx(float(want), rel=1e-5)
    assert float(got["ratio_mean"]) == 1.0


def test_awm_gradient_is_the_advantage_weighted_flow_matching_gradient(tmp_path):
    """On-policy AWM's policy-loss gradient equals that of mean_i A_i·w(ℓ_i, t) (the reshaped flow-matching loss)."""
    from stepflow.core.algorithm import step_loss

    m = _module(tmp_path, "objective=awm", "loop.num_steps=10", "objective.ema_beta=0")
    lr, obj = m.learner, m.learner.objective
    plan, traj, steps, adv = _batch(m)
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps)
    rows = torch.arange(traj.batch_size)
    params = [p for p in lr.policy.trainable_parameters()]
    g1 = torch.autograd.grad(step_loss(lr, traj, adv, 0, rows, traj.times)["loss"], params, allow_unused=True)
    k, t, x0, eps, x_t = _point(obj, traj, 0)
    t = t.flatten()
    v = lr.policy.velocity(x_t, t, traj.cond, 1.0)
    ell = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    w = ((ell + 1e-10) ** 0.25 - 1e-10 ** 0.25) * t / 0.25
    g2 = torch.autograd.grad((adv[rows, k].clamp(-5, 5) / 5 * w).mean(), params, allow_unused=True)
    for a, b in zip(g1, g2):
        if a is not None or b is not None:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-9)


def test_advantageflow_term(tmp_path):
    """AdvantageFlow: A/5·‖f − x0‖² + γ‖f − f_old‖² + λ‖f − f_ref‖² (means over dims) with f = x_t − t·v."""
    from stepflow.core.algorithm import step_loss

    m = _module(tmp_path, "objective=advantageflow", "objective.gamma=1.2", "objective.lam=0.4")
    lr, obj = m.learner, m.learner.objective
    _perturb(obj.old)
    plan, traj, steps, adv = _batch(m)
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps)
    rows = torch.arange(traj.batch_size)
    got = step_loss(lr, traj, adv, 0, rows, traj.times)
    k, t, x0, eps, x_t = _point(obj, traj, 0)
    pol, cond = lr.policy, traj.cond
    with torch.no_grad():
        f = x_t - t * pol.velocity(x_t, t.flatten(), cond, 1.0)
        with obj.old.applied():
            f_old = x_t - t * pol.velocity(x_t, t.flatten(), cond, 1.0)
        with pol.reference():
            f_ref = x_t - t * pol.velocity(x_t, t.flatten(), cond, 1.0)
    a = (adv[rows, k] / 5).clamp(-1, 1)
    per = (a * ((f - x0) ** 2).mean(dim=(1, 2, 3)) + 1.2 * ((f - f_old) ** 2).mean(dim=(1, 2, 3))
           + 0.4 * ((f - f_ref) ** 2).mean(dim=(1, 2, 3)))
    assert float(got["loss"].detach()) == pytest.approx(float(per.mean()), rel=1e-5)


@pytest.mark.parametrize("overrides,field", [
    (["objective=nft", "train.weighting=noise"], "train.weighting"),
    (["objective=awm", "train.weighting=guard"], "train.weighting"),
    (["objective=awm", "train.train_steps=[1]"], "train.train_steps"),
    (["objective=awm", "objective.times_frac=0.3"], "objective.times_frac"),
    (["objective=advantageflow", "objective.gamma=0.5", "objective.lam=0.2"], "objective.gamma"),
    (["objective=distill", "advantage=uniform"], "objective=distill"),
    (["objective=nft", "objective.adv_mode=bogus"], "objective.adv_mode"),
    (["objective=nft", "objective.decay_type=3"], "objective.decay_type"),
    (["objective=bogus"], "objective=bogus"),
    (["train.train_steps=auto"], "train.train_steps"),
])
def test_settings_an_objective_cannot_use_are_one_line(cli, overrides, field):
    r = cli("stepflow.train", *BASE, *overrides)
    assert one_line_error(r, field).startswith(f"stepflow: error: {field}")


@pytest.mark.parametrize("objective", ["nft", "awm", "dgpo"])
def test_resume_is_exact_with_the_weight_copies(tmp_path, objective):
    """3 iterations in one go and 2 + a resume to 3 end with the same weights, the same old / EMA copy and the same
    metrics: the copies are checkpointed."""
    from stepflow.train import run

    args = [*BASE, f"objective={objective}", "eval.every=0", "eval.max_prompts=2", "loop.same_latent=false"]
    if objective == "nft":
        args.append("sampler=dpm2")
    if objective == "dgpo":  # its old copy also rolls out after switch_ema_ref steps (here from iteration 2)
        args += ["sampler=ode", "objective.trunc_steps=2", "objective.num_times=2", "objective.switch_ema_ref=1",
                 "objective.ema_ref_rate=0.2"]
    a = run(compose_config("train", [*args, "loop.iterations=3"]), tmp_path / "a")
    run(compose_config("train", [*args, "loop.iterations=2"]), tmp_path / "b")
    b = run(compose_config("train", [*args, "loop.iterations=3",
                                     f"ckpt_path={tmp_path / 'b' / 'checkpoints' / 'last.ckpt'}"]), tmp_path / "b")
    for p, q in zip(a.policy.trainable_parameters(), b.policy.trainable_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    ca, cb = a.objective.state_dict(), b.objective.state_dict()
    key = "ema" if objective == "awm" else "old"
    assert ca[key]["num_updates"] == cb[key]["num_updates"] == 3
    for s, u in zip(ca[key]["shadow"], cb[key]["shadow"]):
        torch.testing.assert_close(s, u, rtol=0, atol=1e-7)
    last = [last_train_metrics(a), last_train_metrics(b)]
    assert last[0].keys() == last[1].keys()
    assert all(math.isclose(last[0][k], last[1][k], rel_tol=1e-5, abs_tol=1e-7) for k in last[0])


@pytest.mark.parametrize("model", ["shapes_tiny", "sd3_tiny", "sd35_large_tiny", "flux_tiny", "flux_schnell_tiny",
                                   "qwen_image_tiny"])
def test_every_forward_objective_trains_every_model_family(tmp_path, model):
    """nft, awm and advantageflow on each family's policy: a finite loss whose gradient reaches the trained weights
    (the per-sample training times go through each family's velocity)."""
    from stepflow.config import ObjectiveConfig
    from stepflow.core.algorithm import step_loss
    from stepflow.objectives import build_objective

    m = _module(tmp_path, f"model={model}", "objective=nft")
    lr = m.learner
    params = list(lr.policy.trainable_parameters())
    for name in ("nft", "awm", "advantageflow"):
        obj = build_objective(ObjectiveConfig(name=name), lr.train)
        obj.attach(params)
        lr.objective = obj
        plan, traj, steps, adv = _batch(m)
        obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps)
        out = step_loss(lr, traj, adv, 0, torch.arange(traj.batch_size), traj.times)
        assert math.isfinite(float(out["loss"].detach())), name
        grads = torch.autograd.grad(out["loss"], params, allow_unused=True)
        assert any(g is not None and float(g.abs().max()) > 0 for g in grads), name
