"""Online Diffusion-DPO (objective=online_dpo, advantage=best_worst): each formula against a plain-torch transcription of
the released lines of yifan123/flow_grpo@ac4c86e8cae021841f1fde853d340e0db67690dd (scripts/train_sd3_dpo.py, "dpo:L";
flow_grpo/stat_tracking.py, "stat:L"), with diffusers' own FlowMatchEulerDiscreteScheduler and
compute_density_for_timestep_sampling for the training times; the whole update's gradient as the iteration wires it
(LoRA and full fine-tuning); the pairs' shared noise and times; the reference copy (rollouts, refresh); the NFEs; the
refusals; the recipe (a 2-iteration run)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepflow.credits.best_worst import best_worst
from stepflow.objectives.online_dpo import dpo_loss, dpo_times, pair_signs
from stepflow.testing.harness import compose_config, one_line_error

BASE = ["experiment=smoke", "reward=pickscore_tiny", "objective=online_dpo", "advantage=best_worst", "sampler=flow_sde",
        "loop.same_latent=false", "train.timestep_fraction=0.75"]


# ---------------------------------------------------------------- the released lines, transcribed (plain torch)
def released_tracker(prompts, rewards):
    """stat:L38-51, ``PerPromptStatTracker.update(type='dpo')`` for each prompt:

        prompt_advantages = torch.tensor(prompt_rewards)
        max_idx = torch.argmax(prompt_advantages)
        min_idx = torch.argmin(prompt_advantages)
        if max_idx == min_idx:
            min_idx = 0
            max_idx = 1
        result = torch.zeros_like(prompt_advantages).float()
        result[max_idx] = 1.0
        result[min_idx] = -1.0
        advantages[prompts == prompt] = result.numpy()
    """
    import numpy as np

    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_advantages = torch.tensor(rewards[prompts == prompt])
        max_idx = torch.argmax(prompt_advantages)
        min_idx = torch.argmin(prompt_advantages)
        if max_idx == min_idx:
            min_idx = 0
            max_idx = 1
        result = torch.zeros_like(prompt_advantages).float()
        result[max_idx] = 1.0
        result[min_idx] = -1.0
        advantages[prompts == prompt] = result.numpy()
    return torch.as_tensor(advantages, dtype=torch.float32)


def released_loss(model_pred, model_pred_ref, target, bsz, beta):
    """dpo:L926-939 (rows 0..bsz-1 the winners, bsz..2bsz-1 their losers):

        theta_mse = ((model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
        ref_mse = ((model_pred_ref.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
        model_w_err = theta_mse[:bsz]; model_l_err = theta_mse[bsz:]
        ref_w_err = ref_mse[:bsz]; ref_l_err = ref_mse[bsz:]
        w_diff = model_w_err - ref_w_err; l_diff = model_l_err - ref_l_err
        w_l_diff = w_diff - l_diff
        inside_term = -0.5 * config.train.beta * w_l_diff
        loss = -F.logsigmoid(inside_term)
        loss = torch.mean(loss)
    """
    theta_mse = ((model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    ref_mse = ((model_pred_ref.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    w_diff = theta_mse[:bsz] - ref_mse[:bsz]
    l_diff = theta_mse[bsz:] - ref_mse[bsz:]
    inside_term = -0.5 * beta * (w_diff - l_diff)
    return torch.mean(-F.logsigmoid(inside_term))


# ---------------------------------------------------------------- the formulas on small hand-made inputs
def test_best_worst_is_the_released_tracker():
    """+1 / −1 at the first max / min reward of each prompt; an all-tied prompt pairs its rows 0 (loser) and 1."""
    prompts = ["a"] * 4 + ["b"] * 4 + ["c"] * 3
    rewards = [0.2, 0.9, 0.9, 0.1, 0.5, 0.5, 0.5, 0.5, 0.3, 0.3, 0.7]
    groups = torch.tensor([0] * 4 + [1] * 4 + [2] * 3)
    want = released_tracker(prompts, rewards)
    got = best_worst(torch.tensor(rewards), groups)
    assert got.tolist() == want.tolist() == [0, 1, 0, -1, -1, 1, 0, 0, -1, 0, 1]
    assert best_worst(torch.tensor(rewards), groups, tie_pair=False)[4:8].tolist() == [0, 0, 0, 0]


def test_pairs_are_each_groups_first_max_and_min():
    score = torch.tensor([0.0, 1.0, 1.0, -1.0, 0.0, 0.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    assert pair_signs(score, groups).tolist() == [0, 1, 0, -1, 0, 0, 0, 0]  # a tied group: no pair


def test_training_times_are_the_released_scheduler_draws():
    """dpo:L890-903 with diffusers' own pieces: u = compute_density_for_timestep_sampling('logit_normal', 0, 1),
    indices = (u * 1000).long(), timesteps = noise_scheduler.timesteps[indices], σ = get_sigmas(...) (dpo:L179-189)
    of SD3.5's FlowMatchEulerDiscreteScheduler (shift 3); dpo_times gets the same standard normal draws."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    for shift in (3.0, 1.0):
        noise_scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        u = compute_density_for_timestep_sampling(weighting_scheme="logit_normal", batch_size=512, logit_mean=0,
                                                  logit_std=1, mode_scale=1.29, generator=torch.Generator().manual_seed(3))
        indices = (u * noise_scheduler.config.num_train_timesteps).long()
        timesteps = noise_scheduler.timesteps[indices]
        schedule_timesteps = noise_scheduler.timesteps
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        want = noise_scheduler.sigmas[step_indices].flatten()
        z = torch.normal(mean=0.0, std=1.0, size=(512,), generator=torch.Generator().manual_seed(3))
        got = dpo_times(z, 0.0, 1.0, shift, 1000)
        torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)
        assert float(got.min()) > 0 and float(got.max()) <= 1


def test_loss_and_gradient_match_the_released_lines():
    """dpo_loss is dpo:L926-939, and the detached coefficient β·σ(β/2·m)·(±1)·n/(2P) on each row's error gives the
    released gradient as a mean over the n trained rows (what OnlineDpo.loss computes)."""
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(6, 2, 3, 3, generator=g).requires_grad_(True)
    ref, target = torch.randn(6, 2, 3, 3, generator=g), torch.randn(6, 2, 3, 3, generator=g)
    beta = 5.0
    want = released_loss(pred, ref, target, 3, beta)
    g_want, = torch.autograd.grad(want, pred)
    err = ((pred - target) ** 2).reshape(6, -1).mean(1)
    ref_err = ((ref - target) ** 2).reshape(6, -1).mean(1)
    assert float(dpo_loss(err[:3], err[3:], ref_err[:3], ref_err[3:], beta).mean()) == pytest.approx(float(want), rel=1e-6)
    m = (err - ref_err).detach()
    m = (m[:3] - m[3:]).repeat(2)
    sign = torch.tensor([1.0, 1, 1, -1, -1, -1])
    coef = sign * beta * torch.sigmoid(0.5 * beta * m) * 6 / (2 * 3)
    g_got, = torch.autograd.grad((coef * err).mean(), pred)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- the update as the iteration wires it
def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    return build_module(compose_config("train", [*BASE, *overrides]), tmp_path)


def _batch(m, it=0, seed=5):
    from stepflow.core.rollout import rollout

    lr = m.learner
    plan = lr.plan.plan(it)
    with lr.objective.behaviour():
        traj = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    rewards = torch.rand(traj.batch_size, generator=torch.Generator().manual_seed(seed))
    adv = best_worst(rewards, plan.group_ids).view(-1, 1).expand(-1, lr.loop.num_steps).contiguous()
    steps = lr.objective.trained_steps(lr.train, lr.sampler, traj.times, None)
    return plan, traj, steps, adv


def _perturb(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("finetune,drop", [("lora", True), ("full", True), ("lora", False)])
def test_the_update_gradient_is_the_released_one(tmp_path, finetune, drop):
    """The mean over the training times of OnlineDpo.loss over the pairs' rows (the update's one optimizer step) has
    the gradient of the released loss averaged over its training times (gradient accumulation over
    num_train_timesteps), written out with the winners first and the losers after (dpo:L866-939), the reference the
    copy of the initial weights (the release's "ref" adapter); train/policy_loss is the released loss. With
    train.drop_zero_adv=false the update's mean runs over every row, the others' coefficients 0: the same gradient."""
    from stepflow.core.algorithm import step_loss

    full = ["model=sd3_tiny", "model.finetune=full"] if finetune == "full" else []
    m = _module(tmp_path, *full, "objective.beta=20", f"train.drop_zero_adv={str(drop).lower()}")
    lr, obj, pol = m.learner, m.learner.objective, m.learner.policy
    params = list(pol.trainable_parameters())
    _perturb(params, 0.3 if finetune == "lora" else 0.01, 1)  # θ ≠ the reference: the margins are not 0
    plan, traj, steps, adv = _batch(m)
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps, adv=adv, groups=plan.group_ids)
    k = obj.num_terms(steps)
    assert k == int(lr.loop.num_steps * 0.75)
    rows = torch.nonzero((adv.abs().sum(1) > 0) | (not drop)).flatten()  # the rows the update trains
    outs = [step_loss(lr, traj, adv, j, rows, traj.times) for j in range(k)]
    got = sum(o["loss"] for o in outs) / k
    g_got = torch.autograd.grad(got, params, allow_unused=True)
    win = torch.nonzero(adv[:, 0] > 0).flatten()
    lose = torch.stack([torch.nonzero((adv[:, 0] < 0) & (plan.group_ids == plan.group_ids[w])).flatten()[0] for w in win])
    order = torch.cat([win, lose])
    bsz = len(win)
    x0 = traj.latents[order, -1]
    points, refs = [], []
    for j in range(k):  # the reference first (its copy is swapped into the weights in place)
        t, noise = obj.t[order, j], obj.noise[order, j]
        xt = (1.0 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        cond = traj.cond.index(order)
        with torch.no_grad(), obj.ref.applied():
            refs.append(pol.velocity(xt, t, cond, 1.0).detach())
        points.append((t, xt, noise - x0, cond))
    want, value = 0.0, 0.0
    for (t, xt, target, cond), ref in zip(points, refs):
        loss = released_loss(pol.velocity(xt, t, cond, 1.0), ref, target, bsz, 20.0)
        want = want + loss / k
        value += float(loss) / k
    g_want = torch.autograd.grad(want, params, allow_unused=True)
    for a, b in zip(g_got, g_want):
        if b is None:
            assert a is None or float(a.abs().max()) == 0
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)
    assert any(b is not None and float(b.abs().max()) > 0 for b in g_want)
    assert sum(float(o["policy_loss"]) for o in outs) / k == pytest.approx(value, rel=1e-5)


def test_a_pair_shares_its_noise_and_times(tmp_path):
    """dpo:L884-899: one noise and one time per pair (``noise = torch.cat([noise[:bsz], noise[:bsz]])``, the timesteps
    likewise), fresh at every training time; drawn per prompt group from the run seed, so any rank draws the same."""
    m = _module(tmp_path)
    lr, obj = m.learner, m.learner.objective
    plan, traj, steps, adv = _batch(m)
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps, adv=adv, groups=plan.group_ids)
    g = plan.group_ids
    for a in range(len(g)):
        for b in range(len(g)):
            same = bool(g[a] == g[b])
            assert torch.equal(obj.noise[a], obj.noise[b]) == same and torch.equal(obj.t[a], obj.t[b]) == same
    assert len(set(obj.t[0].tolist())) == obj.t.shape[1]  # fresh per training time
    t, noise = obj.t.clone(), obj.noise.clone()
    half = slice(traj.batch_size // 2, traj.batch_size)
    import dataclasses

    sub = dataclasses.replace(traj, latents=traj.latents[half], cond=traj.cond.index(torch.arange(traj.batch_size)[half]))
    lr.dist.gather_rows = lambda x: torch.cat([torch.zeros_like(x), x]) if x.dtype.is_floating_point else torch.cat([x - 100, x])
    lr.dist.local_rows = lambda x: x[len(x) // 2:]  # "rank 1 of 2": its half of every gathered row
    obj.begin_update(lr, sub, 0, plan.step_noise_seeds[half], steps, adv=adv[half], groups=g[half])
    assert torch.equal(obj.t, t[half]) and torch.equal(obj.noise, noise[half])


def test_the_rollouts_run_under_the_reference_copy_and_it_refreshes(tmp_path):
    """The release samples with the "ref" adapter (dpo:L617-618), copied from the learner every ref_update_step steps
    (dpo:L614-615; released 10^7: never); rollout_from=current samples with the trained weights (Flow-Factory)."""
    m = _module(tmp_path, "objective.ref_update_every=2")
    lr, obj = m.learner, m.learner.objective
    params = list(lr.policy.trainable_parameters())
    init = [p.detach().clone() for p in params]
    _perturb(params, 0.1, 4)
    live = [p.detach().clone() for p in params]
    with obj.behaviour():
        assert all(torch.equal(p, q) for p, q in zip(params, init))
    assert all(torch.equal(p, q) for p, q in zip(params, live))
    lr.opt_steps = 1
    obj.end_iteration(lr)
    assert all(torch.equal(s, q) for s, q in zip(obj.ref.shadow, init))
    lr.opt_steps = 2
    obj.end_iteration(lr)
    assert all(torch.equal(s, q) for s, q in zip(obj.ref.shadow, live))
    obj.rollout_from = "current"
    _perturb(params, 0.1, 5)
    with obj.behaviour():
        assert not any(torch.equal(p, s) for p, s in zip(params, obj.ref.shadow))


@pytest.mark.parametrize("overrides,field", [
    (["train.beta_kl=0.04"], "train.beta_kl"),
    (["train.train_steps=[0]"], "train.train_steps"),
    (["objective.rollout_from=old"], "objective.rollout_from"),
    (["objective.beta=0"], "objective.beta"),
    (["objective.ref_update_every=0"], "objective.ref_update_every"),
    (["advantage.tie_pair=maybe"], "advantage.tie_pair"),
])
def test_settings_online_dpo_cannot_use_are_one_line(cli, overrides, field):
    r = cli("stepflow.train", *BASE, *overrides)
    assert one_line_error(r, field).startswith(f"stepflow: error: {field}")


def test_the_recipe_composes():
    from stepflow.train import settings

    s = settings(compose_config("train", ["experiment=league/online_dpo"]))
    o = s.objective
    assert type(o).__name__ == "OnlineDpo" and o.couples_rows and o.forward_process and o.drops_zero_advantage
    assert (o.beta, o.num_times, o.time_shift, o.rollout_from, o.ref_update_every) == (100.0, None, None, "reference", None)
    assert s.advantage.name == "best_worst" and s.advantage.tie_pair and s.sampler.name == "flow_sde"
    assert s.train.beta_kl == 0 and s.train.timestep_fraction == 0.99 and s.loop.guidance == 1.0
