"""DGPO (objective=dgpo, stepflow/objectives/dgpo.py): each formula against a plain-torch transcription of the released
lines of Luo-Yihong/DGPO@01ceb4b83c0bbc55d96246fe1b6d9a3d4749ebd6 scripts/train_sd3_dgpo.py (quoted where used, "dgpo:L"
= that file's line), the whole term as the iteration wires it (LoRA and full fine-tuning), the shared times and group
noise, the old copy's schedule and the rollout switch, the NFEs, the refusals, and the recipe (a 2-iteration run)."""

from __future__ import annotations

import pytest
import torch

from stepflow.objectives.dgpo import (
    dgpo_ema_ref_decay,
    dgpo_group_weights,
    dgpo_should_clip,
    dsm_loss,
    group_sums,
)
from stepflow.testing.harness import compose_config, one_line_error

BASE = ["experiment=smoke", "reward=pickscore_tiny", "objective=dgpo", "sampler=ode", "advantage=uniform",
        "objective.trunc_steps=2", "objective.num_times=2", "loop.same_latent=false"]


# ---------------------------------------------------------------- the released lines, transcribed (plain torch)
def released_group_loss(model_v, ref_old_v, target_v, advantages, local_group_indices, num_groups, beta_dpo,
                        group_size, dsm_loss=None):
    """dgpo:L162-193 ``compute_group_dgpo_loss_allreduce`` on one process (its all_reduce is the identity):

        if dsm_loss is None:
            dsm_loss = (target_v - model_v).square().reshape(batch_size, -1).mean(dim=1)
        with torch.no_grad():
            ref_dsm_loss = (target_v - ref_old_v).square().reshape(batch_size, -1).mean(dim=1)
        delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
        per_sample_term = advantages * beta_dpo * delta_diff / group_size
        local_group_sums = torch.zeros(num_groups, device=device, dtype=per_sample_term.dtype)
        local_group_sums.scatter_add_(0, local_group_indices, per_sample_term)
        global_group_sums = local_group_sums.clone().detach()
        dist.all_reduce(global_group_sums, op=dist.ReduceOp.SUM)
        group_weights = torch.sigmoid(global_group_sums)
        local_weights = group_weights[local_group_indices]
        loss = (local_weights.detach() * advantages * dsm_loss).mean()
    """
    batch_size = model_v.shape[0]
    if dsm_loss is None:
        dsm_loss = (target_v - model_v).square().reshape(batch_size, -1).mean(dim=1)
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_old_v).square().reshape(batch_size, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    local_group_sums = torch.zeros(num_groups, dtype=per_sample_term.dtype)
    local_group_sums.scatter_add_(0, local_group_indices, per_sample_term)
    group_weights = torch.sigmoid(local_group_sums.clone().detach())
    local_weights = group_weights[local_group_indices]
    return (local_weights.detach() * advantages * dsm_loss).mean()


def released_term(model_v, ref_old_v, old_v, target_v, adv_raw, group_idx, num_groups, beta_dpo, group_size,
                  clip_range, beta, clip_dsm=True, clip_kl=False, adv_clip_max=5.0):
    """dgpo:L1127-1158, one training time of one batch:

        advantages = torch.clamp(sample["advantages"][:, j], -config.train.adv_clip_max, config.train.adv_clip_max)
        dsm_loss = 1 * (target_v - model_v).square().reshape(x0.shape[0],-1).mean(dim=1)
        if use_old:
            old_dsm_loss = 1 * (target_v - old_v).square().reshape(x0.shape[0],-1).mean(dim=1)
            ratio = torch.exp(-dsm_loss + old_dsm_loss)
            should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
            if config.clip_dsm:
                dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
        dgpo_loss = compute_group_dgpo_loss_allreduce(model_v, ref_dgpo_v, target_v, advantages, ..., dsm_loss = dsm_loss)
        if config.train.beta > 0:
            kl_loss = 1 * (model_v - ref_old_v).square().reshape(x0.shape[0],-1).mean(dim=1)
            if config.clip_kl:
                kl_loss = torch.where(should_clip, kl_loss.detach(), kl_loss)
            kl_loss = torch.mean(kl_loss)
            loss = dgpo_loss + config.train.beta * kl_loss
    """
    b = model_v.shape[0]
    advantages = torch.clamp(adv_raw, -adv_clip_max, adv_clip_max)
    dsm = 1 * (target_v - model_v).square().reshape(b, -1).mean(dim=1)
    old_dsm = 1 * (target_v - old_v).square().reshape(b, -1).mean(dim=1)
    ratio = torch.exp(-dsm + old_dsm)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    if clip_dsm:
        dsm = torch.where(should_clip, dsm.detach(), dsm)
    dgpo = released_group_loss(model_v, ref_old_v, target_v, advantages, group_idx, num_groups, beta_dpo, group_size,
                               dsm_loss=dsm)
    loss = dgpo
    if beta > 0:
        kl = 1 * (model_v - ref_old_v).square().reshape(b, -1).mean(dim=1)
        if clip_kl:
            kl = torch.where(should_clip, kl.detach(), kl)
        loss = dgpo + beta * torch.mean(kl)
    return loss, dgpo, should_clip


# ---------------------------------------------------------------- the formulas on small hand-made inputs
def _inputs(seed=0, b=6, groups=(0, 0, 0, 1, 1, 1)):
    g = torch.Generator().manual_seed(seed)
    shape = (b, 2, 3, 3)
    model_v = torch.randn(shape, generator=g).requires_grad_(True)
    ref_v, old_v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    target = torch.randn(shape, generator=g)
    adv = torch.tensor([1.5, -0.5, -1.0, 6.0, -2.0, -4.0])  # 6.0 is clipped to 5
    return model_v, ref_v, old_v, target, adv, torch.tensor(groups)


def test_group_weights_and_loss_match_the_released_lines():
    """``sg σ(Σ_g A·β·(ℓ − ℓ_ref)/G)·A·ℓ`` (dgpo_group_weights, dsm_loss): the value and the gradient of dgpo:L162-193."""
    model_v, ref_v, _, target, adv, groups = _inputs()
    want = released_group_loss(model_v, ref_v, target, adv, groups, 2, 3.0, 3)
    g_want, = torch.autograd.grad(want, model_v)
    dsm = dsm_loss(model_v, target)
    w = dgpo_group_weights(adv, dsm, dsm_loss(ref_v, target), groups, 3.0, 3)
    got = (w * adv * dsm).mean()
    g_got, = torch.autograd.grad(got, model_v)
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-9)
    assert not w.requires_grad and len(set(w.tolist())) == 2  # one weight per group, no gradient through it


def test_group_sums_by_hand_and_over_ranks():
    """Each row's group sum; under several ranks each rank adds its part of every group and the parts are summed."""
    v, g = torch.tensor([1.0, 2.0, 4.0, 8.0]), torch.tensor([1, 0, 1, 3])
    assert group_sums(v, g).tolist() == [5.0, 2.0, 5.0, 8.0]

    class TwoRanks:  # rank 0 holds rows 0-1 and rank 1 rows 2-3 of one batch: what all_reduce adds is the other's part
        world = 2

        def __init__(self, other):
            self.other = other

        def all_max(self, x):
            return max(x, int(self.other[1].max()) + 1)

        def all_sum_tensor(self, x):
            return x + torch.zeros_like(x).index_add_(0, self.other[1], self.other[0])

    left = group_sums(v[:2], g[:2], TwoRanks((v[2:], g[2:])))
    right = group_sums(v[2:], g[2:], TwoRanks((v[:2], g[:2])))
    assert torch.cat([left, right]).tolist() == [5.0, 2.0, 5.0, 8.0]


def test_should_clip_matches_the_released_lines():
    """dgpo:L1136-1141: ``ρ = exp(−ℓ + ℓ_old)``, clipped where A > 0 and ρ > 1 + c, or A <= 0 and ρ < 1 − c."""
    dsm = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    old = torch.tensor([1.02, 0.98, 1.02, 0.98, 0.98])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0])
    ratio = torch.exp(-dsm + old)
    want = torch.where(adv > 0, ratio > 1.0 + 0.01, ratio < 1.0 - 0.01)
    got = dgpo_should_clip(adv, dsm, old, 0.01)
    assert got.tolist() == want.tolist() == [True, False, False, True, True]


def test_whole_term_matches_the_released_lines_on_hand_made_inputs():
    """clip + group weights + KL together (dgpo:L1127-1158), written with our functions as Dgpo.loss composes them."""
    model_v, ref_v, old_v, target, adv_raw, groups = _inputs(1)
    old_v = model_v.detach() + 0.3 * old_v * torch.tensor([0, 0, 0, 1, 1, 1.0]).view(-1, 1, 1, 1)  # rows 0-2: ρ = 1
    want, _, clip = released_term(model_v, ref_v, old_v, target, adv_raw, groups, 2, 100.0, 3, 0.01, 0.02)
    g_want, = torch.autograd.grad(want, model_v)
    a = adv_raw.clamp(-5, 5)
    dsm = dsm_loss(model_v, target)
    w = dgpo_group_weights(a, dsm, dsm_loss(ref_v, target), groups, 100.0, 3)
    mine = dgpo_should_clip(a, dsm, dsm_loss(old_v, target), 0.01)
    dsm = torch.where(mine, dsm.detach(), dsm)
    got = (w * a * dsm).mean() + 0.02 * (model_v - ref_v).square().reshape(6, -1).mean(1).mean()
    g_got, = torch.autograd.grad(got, model_v)
    assert 0 < int(clip.sum()) < 6 and torch.equal(mine, clip)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-9)


def test_ema_ref_decay_as_released():
    """dgpo:L1176 ``ema_ref_decay = min(0.3, 0.001 * global_step)``."""
    assert [dgpo_ema_ref_decay(s) for s in (0, 1, 150, 300, 301, 5000)] == [0.0, 0.001, 0.15, 0.3, 0.3, 0.3]


# ---------------------------------------------------------------- the term as the iteration wires it
def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    return build_module(compose_config("train", [*BASE, *overrides]), tmp_path)


def _batch(m, it=0):
    from stepflow.core.rollout import rollout

    lr = m.learner
    plan = lr.plan.plan(it)
    with lr.objective.behaviour():
        traj = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    adv = torch.randn(traj.batch_size, lr.loop.num_steps, generator=torch.Generator().manual_seed(5)) * 3
    steps = lr.objective.trained_steps(lr.train, lr.sampler, traj.times, None)
    return plan, traj, steps, adv


def _perturb(params, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_the_update_gradient_is_the_released_one(tmp_path, finetune):
    """The mean over the terms of Dgpo.loss over every row (the update's one optimizer step) has the gradient of the
    released loss averaged over the training times (gradient accumulation over ``num_train_timesteps``), written out
    on the policy's own velocities: model_v with grad, old_v under the old copy, ref_old_v under π_ref (LoRA off, or
    the frozen initial transformer under model.finetune=full, on the tiny SD3 pipeline)."""
    from stepflow.core.algorithm import step_loss

    full = ["model=sd3_tiny", "model.finetune=full"] if finetune == "full" else []
    m = _module(tmp_path, *full, "train.beta_kl=0.02", "objective.beta_dpo=50",
                "objective.clip_range=0.001")
    lr, obj, pol = m.learner, m.learner.objective, m.learner.policy
    params = [p for p in pol.trainable_parameters()]
    scale = 0.3 if finetune == "lora" else 0.01  # (the tiny LoRA of rank 4 moves v little)
    _perturb(params, scale, 1)  # θ ≠ π_ref: the margins and the KL are not 0
    _perturb(obj.old.shadow, 5 * scale, 2)  # the old copy differs: some rows clip
    plan, traj, steps, adv = _batch(m)
    groups = plan.group_ids
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps, adv=adv, groups=groups)
    rows = torch.arange(traj.batch_size)
    k = obj.num_terms(steps)
    got = sum(step_loss(lr, traj, adv, j, rows, traj.times)["loss"] for j in range(k)) / k
    g_got = torch.autograd.grad(got, params, allow_unused=True)
    points, frozen = [], []
    for j in range(k):  # the no-grad velocities first (the old copy is swapped into the weights in place)
        idx = obj.index[:, j]
        t = traj.times[idx]
        x0, noise = traj.latents[:, -1], obj.noise[:, j]
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        with torch.no_grad():
            with pol.reference():
                ref_old_v = pol.velocity(xt, t, traj.cond, 1.0)
            with obj.old.applied():
                old_v = pol.velocity(xt, t, traj.cond, 1.0)
        points.append((idx, t, xt, noise - x0))
        frozen.append((ref_old_v, old_v))
    want, clipped = 0.0, 0
    for (idx, t, xt, target_v), (ref_old_v, old_v) in zip(points, frozen):
        model_v = pol.velocity(xt, t, traj.cond, 1.0)
        loss, _, clip = released_term(model_v, ref_old_v, old_v, target_v, adv[rows, idx], groups, 2, 50.0,
                                      lr.loop.group_size, 0.001, 0.02)
        want = want + loss / k
        clipped += int(clip.sum())
    g_want = torch.autograd.grad(want, params, allow_unused=True)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert 0 < clipped < k * traj.batch_size
    for a, b in zip(g_got, g_want):
        if b is None:
            assert a is None or float(a.abs().max()) == 0
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)
    assert any(b is not None and float(b.abs().max()) > 0 for b in g_want)


def test_times_are_shared_and_noise_is_shared_by_each_group(tmp_path):
    """dgpo:L1063-1064: M distinct grid steps among 0..trunc_steps, the same for every row (and rank: seeded by the run
    seed and the iteration); dgpo:L1102-1106: one noise per group, drawn afresh per time, identical on any rank."""
    m = _module(tmp_path, "objective.trunc_steps=3", "objective.num_times=3")
    lr, obj = m.learner, m.learner.objective
    plan, traj, steps, adv = _batch(m)
    assert steps == [0, 1, 2, 3]
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps, adv=adv, groups=plan.group_ids)
    idx, noise = obj.index.clone(), obj.noise.clone()
    assert (idx == idx[0]).all() and len(set(idx[0].tolist())) == 3 and set(idx[0].tolist()) <= {0, 1, 2, 3}
    g = plan.group_ids
    for a in range(len(g)):
        for b in range(len(g)):
            assert torch.equal(noise[a], noise[b]) == bool(g[a] == g[b])
    assert not torch.equal(noise[0, 0], noise[0, 1])  # afresh per time
    half = slice(traj.batch_size // 2, traj.batch_size)  # another rank's rows draw the same times and noise
    sub = plan.rows(half)
    obj.begin_update(lr, _rows(traj, half), 0, sub.step_noise_seeds, steps, adv=adv[half], groups=sub.group_ids)
    assert torch.equal(obj.index, idx[half]) and torch.equal(obj.noise, noise[half])
    obj.begin_update(lr, traj, 1, plan.step_noise_seeds, steps, adv=adv, groups=plan.group_ids)
    assert not torch.equal(obj.noise, noise)  # the next iteration draws afresh


def _rows(traj, sl):
    import dataclasses

    return dataclasses.replace(traj, latents=traj.latents[sl], velocities=traj.velocities[sl],
                               log_probs=traj.log_probs[sl], trainable=traj.trainable[sl], cond=traj.cond.index(
                                   torch.arange(traj.batch_size)[sl]), prompts=traj.prompts[sl], meta=traj.meta[sl])


def test_the_old_copy_schedule_and_the_rollout_switch(tmp_path):
    """After optimizer step g (0-based) the old copy moves with d = min(0.3, 0.001·g) (dgpo:L1174-1177); the rollouts
    run under it once more than switch_ema_ref steps were taken (dgpo:L799-800, ``global_step > switch_ema_ref``)."""
    m = _module(tmp_path, "objective.switch_ema_ref=2", "objective.ema_ref_rate=0.1")
    lr, obj = m.learner, m.learner.objective
    params = list(lr.policy.trainable_parameters())
    for g, d in [(0, 0.0), (1, 0.1), (2, 0.2), (5, 0.3)]:
        shadow = [s.clone() for s in obj.old.shadow]
        _perturb(params, 0.01, g)
        lr.opt_steps = g + 1
        obj.end_iteration(lr)
        for s0, s, p in zip(shadow, obj.old.shadow, params):
            torch.testing.assert_close(s, d * s0 + (1 - d) * p.detach(), rtol=0, atol=1e-7)
    lr.opt_steps = 2
    obj.end_iteration(lr)
    live = [p.detach().clone() for p in params]
    _perturb(obj.old.shadow, 0.1, 9)
    with obj.behaviour():  # 2 steps taken: not more than switch_ema_ref = 2
        assert all(torch.equal(p, q) for p, q in zip(params, live))
    lr.opt_steps = 3
    obj.end_iteration(lr)
    with obj.behaviour():
        assert all(torch.equal(p, s) for p, s in zip(params, obj.old.shadow))
    assert all(torch.equal(p, q) for p, q in zip(params, live))  # restored after the rollout
    sd = obj.state_dict()
    assert sd["steps_done"] == 3 and len(sd["old"]["shadow"]) == len(params)


def test_the_ema_reference_variant_uses_the_old_copy(tmp_path):
    """use_ema_ref (TDM-R1's dynamic reference, dgpo:L1123-1124): the group margins are against the old copy."""
    m = _module(tmp_path, "objective.use_ema_ref=true")
    lr, obj = m.learner, m.learner.objective
    _perturb(obj.old.shadow, 0.05, 3)
    plan, traj, steps, adv = _batch(m)
    obj.begin_update(lr, traj, 0, plan.step_noise_seeds, steps, adv=adv, groups=plan.group_ids)
    j, pol = 0, lr.policy
    t = traj.times[obj.index[:, j]]
    x0, noise = traj.latents[:, -1], obj.noise[:, j]
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    with torch.no_grad():
        v = pol.velocity(xt, t, traj.cond, 1.0)
        with obj.old.applied():
            v_old = pol.velocity(xt, t, traj.cond, 1.0)
    want = dsm_loss(v, noise - x0) - dsm_loss(v_old, noise - x0)
    torch.testing.assert_close(obj.margin[:, j], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides,field", [
    (["train.train_steps=[0]"], "train.train_steps"),
    (["objective.trunc_steps=4"], "objective.trunc_steps"),
    (["objective.num_times=4"], "objective.num_times"),
    (["objective.beta_dpo=0"], "objective.beta_dpo"),
    (["objective.clip_dsm=maybe"], "objective.clip_dsm"),
    (["objective.ref_guidance=0.5"], "objective.ref_guidance"),
    (["train.weighting=noise"], "train.weighting"),
])
def test_settings_dgpo_cannot_use_are_one_line(cli, overrides, field):
    r = cli("stepflow.train", *BASE, *overrides)
    assert one_line_error(r, field).startswith(f"stepflow: error: {field}")


def test_the_recipe_composes(tmp_path):
    from stepflow.train import settings

    s = settings(compose_config("train", ["experiment=league/dgpo"]))
    o = s.objective
    assert type(o).__name__ == "Dgpo" and o.couples_rows and o.forward_process and not o.needs_density
    assert (o.beta_dpo, o.num_times, o.trunc_steps, o.clip_range, o.switch_ema_ref) == (100.0, 4, 4, 0.01, 500)
    assert s.sampler.name == "ode" and s.advantage.name == "uniform" and s.advantage.std_scope == "group"
    assert s.train.beta_kl == 0.02 and s.loop.guidance == 1.0 and not s.loop.same_latent
