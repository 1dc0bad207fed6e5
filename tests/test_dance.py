"""DanceGRPO (XueZeyue/DanceGRPO@15cc71d; docs/method.md §2.1): the Dance-SDE step against a transcription of the
released ``flux_step`` and against ``torch.distributions.Normal``; FastVideo's σ grid against its formula and its
threading through the rollout and the update (the held-out evaluation keeps the model's grid); the per-sample random
subset of trained steps (drawn from the row's own seed, the released loss normalisation, the same as no subset at
fraction 1); the unbiased group std of the advantage; the settings each new field refuses; and the league config."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from stepflow.errors import StepflowError
from stepflow.math.sde import SamplerConfig, dance_sde_step, fastvideo_time_grid, sde_step, step_std, time_grid
from stepflow.testing.harness import compose_config

BASE = ["experiment=smoke", "reward=pickscore_tiny"]
DANCE = ["sampler=dance_sde", "loop.time_grid=fastvideo", "advantage=uniform", "advantage.unbiased_std=true",
         "train.step_subset=random_per_sample"]


# ------------------------------------------------------------------------------------------------------------
# the released code, transcribed (fastvideo/train_grpo_flux.py)
# ------------------------------------------------------------------------------------------------------------
def _sd3_time_shift(shift, t):  # L127-128
    return (shift * t) / (1 + (shift - 1) * t)


def _released_grid(steps, shift):  # L311-313
    return _sd3_time_shift(shift, torch.linspace(1, 0, steps + 1))


def _released_flux_step(model_output, latents, eta, sigmas, index, prev_sample):
    """``flux_step(..., grpo=True, sde_solver=True)``, L131-168, line for line (``prev_sample`` given)."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
    log_term = -0.5 * eta**2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    log_prob = ((-((prev_sample.detach().to(torch.float32) - prev_sample_mean.to(torch.float32)) ** 2)
                 / (2 * (std_dev_t**2))) - math.log(std_dev_t) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample_mean, std_dev_t, log_prob


def _batch(b=5, shape=(3, 4, 4), seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)


# ------------------------------------------------------------------------------------------------------------
# 1. the Dance-SDE step
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("eta", [0.3, 1.7])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_dance_step_is_the_released_flux_step(eta, shift):
    """Mean, std and log-prob of every step of a 10-step FastVideo grid (σ = 1 first, exactly 0 last) equal the
    transcribed ``flux_step``; the sampled state is mean + η·sqrt(Δt)·ε; kl_scale is η."""
    sigmas = _released_grid(10, shift)
    x, v = _batch()
    prev = x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    for k in range(10):
        mean, std, lp = _released_flux_step(v, x, eta, sigmas, k, prev)
        out = dance_sde_step(x, v, sigmas[k], sigmas[k + 1], eta=eta, prev_sample=prev)
        torch.testing.assert_close(out.mean, mean, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(out.std, torch.full((5,), std), atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(out.log_prob, lp, atol=2e-5, rtol=1e-5)
        assert torch.equal(out.kl_scale, torch.full((5,), float(eta))) and out.trainable.all()
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(k))
        drawn = dance_sde_step(x, v, sigmas[k], sigmas[k + 1], eta=eta, noise=noise)
        torch.testing.assert_close(drawn.next, mean + std * noise, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(drawn.mean, out.mean)


def test_dance_log_prob_is_torch_normal_and_its_std_is_eta_sqrt_dt():
    """log π = mean_dims log N(x'; μ, (η√Δt)²), per-sample times batched (B,), through the sampler dispatch."""
    g = fastvideo_time_grid(10, 3.0)
    ks = torch.tensor([0, 2, 5, 8, 9])
    x, v = _batch()
    cfg = SamplerConfig(name="dance_sde")
    assert cfg.eta == 0.3 and cfg.logprob == "gaussian"
    out = sde_step(cfg, x, v, g[ks], g[ks + 1], noise=torch.randn(x.shape, generator=torch.Generator().manual_seed(3)))
    std = 0.3 * torch.sqrt((g[ks] - g[ks + 1]).double())
    torch.testing.assert_close(out.std.double(), std, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(step_std(cfg, g[ks], g[ks + 1]).double(), std, atol=1e-7, rtol=1e-6)
    ref = Normal(out.mean.double(), std.view(-1, 1, 1, 1)).log_prob(out.next.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), ref, atol=1e-5, rtol=1e-6)
    want = x - (g[ks] - g[ks + 1]).view(-1, 1, 1, 1) * (v + 0.09 / (2 * g[ks].view(-1, 1, 1, 1))
                                                        * (x + (1 - g[ks]).view(-1, 1, 1, 1) * v))
    torch.testing.assert_close(out.mean, want, atol=2e-6, rtol=1e-5)  # docs/method.md §2.1's drift form


def test_dance_eta_zero_is_euler_and_bad_eta_is_refused():
    x, v = _batch()
    out = sde_step(SamplerConfig(name="dance_sde", eta=0.0), x, v, 0.5, 0.4)
    torch.testing.assert_close(out.mean, x - 0.1 * v, atol=1e-6, rtol=1e-6)
    assert not out.trainable.any()
    assert SamplerConfig(name="dance_sde", eta=2.0).eta == 2.0  # a diffusion coefficient, not capped at 1
    with pytest.raises(ValueError, match="^eta:"):
        SamplerConfig(name="dance_sde", eta=-0.1)
    with pytest.raises(ValueError, match="^eta:"):
        SamplerConfig(name="ddim_sde", eta=2.0)
    assert SamplerConfig(name="ddim_sde").eta == 0.9 == SamplerConfig(name="cps").eta  # unchanged defaults


# ------------------------------------------------------------------------------------------------------------
# 2. the FastVideo grid
# ------------------------------------------------------------------------------------------------------------
def test_fastvideo_grid_is_the_formula_by_hand():
    """τ_k = 3u/(1 + 2u), u = 1 − k/10: one shift, no σ_min, exact 1 and 0 at the ends; the released tensor."""
    g = fastvideo_time_grid(10, 3.0)
    hand = [3 * (1 - k / 10) / (1 + 2 * (1 - k / 10)) for k in range(11)]
    assert g.dtype == torch.float32 and g.shape == (11,)
    assert float(g[0]) == 1.0 and float(g[-1]) == 0.0
    assert g.tolist() == pytest.approx(hand, abs=1e-7)
    assert g[9].item() == pytest.approx(0.25) and g[1].item() == pytest.approx(2.7 / 2.8)
    assert torch.equal(g, _released_grid(10, 3.0))
    assert torch.equal(fastvideo_time_grid(10, 1.0), torch.linspace(1, 0, 11))  # shift 1: uniform
    assert not torch.allclose(g, time_grid(10, 3.0))  # diffusers' grid: shifted twice, σ_min, last τ ≈ 0.009
    with pytest.raises(ValueError, match="^shift:"):
        fastvideo_time_grid(10, 0.0)


def test_either_grid_has_the_same_noise_free_steps():
    """The steps without noise depend only on the grid's ends, which both grids share: the candidates GRPOModule
    computes for weighting=auto on the model's grid are the steps the fastvideo rollout can train."""
    from stepflow.config import TrainConfig
    from stepflow.objectives.base import trainable_steps

    for cfg in [SamplerConfig(name=n) for n in ("flow_sde", "dance_sde", "cps", "ddim_sde")] + [
            SamplerConfig(name="ddim_sde", schedule=s) for s in ("eta_s", "eta_t_sqrt1mt")]:
        for shift in (1.0, 3.0):
            a = trainable_steps(TrainConfig(), cfg, time_grid(10, shift))
            b = trainable_steps(TrainConfig(), cfg, fastvideo_time_grid(10, shift))
            assert a == b, (cfg, shift)


def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    m = build_module(compose_config("train", [*BASE, *overrides]), tmp_path)
    m.learner.optimizer = m._own_optimizer()  # what GRPOModule gives the learner outside a Trainer
    return m


def test_the_rollout_and_the_update_run_on_the_fastvideo_grid(tmp_path, monkeypatch):
    """loop.time_grid=fastvideo: the iteration's trajectory (what the update steps on) holds FastVideo's grid with the
    policy's shift (loop.grid_shift overrides it); the policy's own grid (the held-out evaluation's) is unchanged."""
    import stepflow.core.algorithm as alg

    seen = []
    real = alg.update

    def spy(learner, traj, *a, **kw):
        seen.append(traj.times.clone())
        return real(learner, traj, *a, **kw)

    monkeypatch.setattr(alg, "update", spy)
    m = _module(tmp_path, *DANCE)
    lr = m.learner
    model_grid = lr.policy.time_grid(4)
    res = alg.iteration(lr, 0)
    assert torch.equal(seen[-1], fastvideo_time_grid(4, lr.policy.shift))
    assert not torch.equal(seen[-1], model_grid)
    assert torch.equal(lr.policy.time_grid(4), model_grid)  # heldout.sample_ode reads this
    assert res.update["train/steps_per_sample"] == 2.0  # int(4 · 0.6) of the 4 steps
    m3 = _module(tmp_path / "s3", *DANCE, "loop.grid_shift=3")
    assert torch.equal(m3.learner.grid(), fastvideo_time_grid(4, 3.0))
    assert torch.equal(_module(tmp_path / "m", "sampler=dance_sde").learner.grid(), model_grid)


# ------------------------------------------------------------------------------------------------------------
# 3. the per-sample random subset of trained steps
# ------------------------------------------------------------------------------------------------------------
def test_subset_counts_and_row_independence():
    """Every row trains int(S·fraction) distinct steps (released: int(15·0.6) = 9); a row's draw depends on its seed
    alone (the same on any rank, in any batch order); rows draw different subsets."""
    from stepflow.core.algorithm import steps_per_sample, subset_steps

    assert steps_per_sample(15, 0.6) == 9 and steps_per_sample(9, 0.6) == 5 and steps_per_sample(4, 0.6) == 2
    assert steps_per_sample(4, 0.9) == 3 and steps_per_sample(3, 0.2) == 0  # a floor (int()), not a rounding
    seeds = torch.arange(64, dtype=torch.long) + 123_456_789
    mask = subset_steps(9, seeds, 0.6)
    assert mask.shape == (64, 9) and (mask.sum(1) == 5).all()
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(subset_steps(9, seeds[perm], 0.6), mask[perm])
    assert torch.equal(subset_steps(9, seeds[:7], 0.6), mask[:7])  # another rank's shard: the same rows' draws
    assert len({tuple(r.tolist()) for r in mask}) > 20
    assert (mask.float().mean(0) - 5 / 9).abs().max() < 0.25  # every step is drawn


def _grads_of_update(m, traj, adv, seeds):
    """The gradient the update would step with (the optimizer step is skipped), flattened."""
    import stepflow.core.algorithm as alg
    import stepflow.core.update as upd

    lr = m.learner
    params = list(lr.policy.trainable_parameters())
    got = []

    def capture(learner, ps, max_norm):
        got.append(torch.cat([p.grad.flatten().clone() for p in ps]))
        return None

    orig = upd.clip_and_step
    upd.clip_and_step = capture
    try:
        res = alg.update(lr, traj, adv, None, 0, seeds=seeds)
    finally:
        upd.clip_and_step = orig
    for p in params:
        p.grad = None
    return got[0], res


def _rollout(m):
    from stepflow.core.rollout import rollout

    lr = m.learner
    plan = lr.plan.plan(0)
    traj = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance, grid=lr.grid())
    adv = torch.randn(traj.batch_size, generator=torch.Generator().manual_seed(5)).view(-1, 1).expand(
        -1, lr.loop.num_steps).contiguous() * 2
    return plan, traj, adv


def test_the_update_is_the_released_mean_over_sample_step_pairs(tmp_path):
    """With the subset, the update's gradient is that of Σ_i Σ_{k ∈ S_i} max(−Aρ, −A clip(ρ, 1 ± ϵ))/(N·n), ρ from
    the Dance-SDE log-probs of the rollout's transitions written out here (fastvideo/train_grpo_flux.py L571-605 with
    grad_accum·train_timesteps = N·n), micro-batched by 3 rows."""
    from stepflow.core.algorithm import subset_steps

    m = _module(tmp_path, *DANCE, "train.micro_batch_size=3", "train.clip_eps=1e-4")
    lr = m.learner
    plan, traj, adv = _rollout(m)
    got, res = _grads_of_update(m, traj, adv, plan.step_noise_seeds)
    mask = subset_steps(4, plan.step_noise_seeds, 0.6)
    n, rows = 2, traj.batch_size
    params = list(lr.policy.trainable_parameters())
    lr.policy.train()
    times = traj.times
    total = 0.0
    for i in range(rows):
        for k in torch.nonzero(mask[i]).flatten().tolist():
            x_k = traj.latents[i:i + 1, k]
            v = lr.policy.velocity(x_k, times[k], traj.cond.index([i]), lr.guidance)
            lp = dance_sde_step(x_k, v, times[k], times[k + 1], eta=0.3, prev_sample=traj.latents[i:i + 1, k + 1]).log_prob
            ratio = torch.exp(lp - traj.log_probs[i:i + 1, k])
            a = adv[i:i + 1, k].clamp(-5, 5)
            loss = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 1e-4, 1 + 1e-4))) / (rows * n)
            total = total + loss
    total.backward()
    want = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    lr.policy.eval()
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-4)
    assert res["train/steps_per_sample"] == 2.0 and res["train/steps_trained"] == 4.0


def test_the_subset_follows_the_row_not_its_place_in_the_batch(tmp_path):
    """The same rows in another order (another rank's shard layout, another shuffle) give the same gradient."""
    from stepflow.core.rollout import Trajectory

    m = _module(tmp_path, *DANCE)
    plan, traj, adv = _rollout(m)
    base, _ = _grads_of_update(m, traj, adv, plan.step_noise_seeds)
    p = torch.randperm(traj.batch_size, generator=torch.Generator().manual_seed(3))
    shuffled = Trajectory(latents=traj.latents[p], velocities=traj.velocities[p], log_probs=traj.log_probs[p],
                          trainable=traj.trainable[p], times=traj.times, cond=traj.cond.index(p.tolist()),
                          prompts=[traj.prompts[i] for i in p], meta=[traj.meta[i] for i in p])
    again, _ = _grads_of_update(m, shuffled, adv[p], plan.step_noise_seeds[p])
    torch.testing.assert_close(again, base, atol=1e-8, rtol=1e-5)
    other, _ = _grads_of_update(m, traj, adv, plan.step_noise_seeds + 1)  # other draws: another gradient
    assert not torch.allclose(other, base, rtol=1e-3)


def test_lockstep_ranks_pad_each_term_and_end_at_the_last_backward(tmp_path):
    """FSDP2 / DeepSpeed (every pass a collective): each term runs as many micro-batches as the rank with most rows
    that drew it, and the accumulation boundary falls on the chunk's last backward even when no row drew the last
    step (a one-process lockstep Dist stands in; the boundary calls are recorded)."""
    import dataclasses

    from stepflow.core.algorithm import subset_steps

    m = _module(tmp_path, *DANCE, "train.micro_batch_size=1")
    lr = m.learner
    plan, traj, adv = _rollout(m)
    mask = subset_steps(4, plan.step_noise_seeds, 0.6)
    live = ~mask[:, 3]  # the rows that did not draw the last step; the others get advantage 0 and are dropped
    assert 0 < int(live.sum()) < traj.batch_size
    adv = adv * live.view(-1, 1)
    calls = []
    lr.dist = dataclasses.replace(lr.dist, lockstep=True)
    lr.dist.boundary = calls.append
    _grads_of_update(m, traj, adv, plan.step_noise_seeds)
    assert len(calls) == int(mask[live].sum())  # one backward per (row, step) pair at micro-batch 1, no padding
    assert calls[-1] is True and calls.count(True) == 1


def test_fraction_one_trains_exactly_as_without_a_subset(tmp_path):
    """step_fraction = 1: every row trains every step at weight 1/(N·S), which is the update without the option."""
    m = _module(tmp_path, *DANCE, "train.step_fraction=1.0")
    plan, traj, adv = _rollout(m)
    a, _ = _grads_of_update(m, traj, adv, plan.step_noise_seeds)
    m.learner.train.step_subset = None
    b, _ = _grads_of_update(m, traj, adv, plan.step_noise_seeds)
    torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# 4. the advantage's unbiased group std
# ------------------------------------------------------------------------------------------------------------
def test_unbiased_group_std_by_hand():
    """(R − mean)/(std + 1e-8) with the sample std (ddof 1, torch's default): released L537-543; a constant group
    gets 0; the default (population std) is unchanged."""
    from stepflow.math.advantage import AdvantageConfig, AdvantageEstimator, uniform_advantages

    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    m = 3.0
    s1 = math.sqrt(((1 - m) ** 2 + (2 - m) ** 2 + (3 - m) ** 2 + (6 - m) ** 2) / 3)  # 14/3
    want = [(x - m) / (s1 + 1e-8) for x in (1, 2, 3, 6)] + [0.0] * 4
    got = uniform_advantages(r, gid, 3, eps=1e-8, unbiased=True)
    assert got.shape == (8, 3) and got[:, 0].tolist() == pytest.approx(want, rel=1e-6)
    released = torch.zeros(8)
    for g in range(2):
        grp = r[4 * g:4 * g + 4]
        released[4 * g:4 * g + 4] = (grp - grp.mean()) / (grp.std() + 1e-8)
    torch.testing.assert_close(got[:, 0], released)
    pop = math.sqrt(14 / 4)
    assert uniform_advantages(r, gid, 1, eps=1e-8)[0, 0].item() == pytest.approx(-2 / (pop + 1e-8), rel=1e-6)
    est = AdvantageEstimator(AdvantageConfig(scheme="uniform", eps=1e-8, unbiased_std=True, std_scope="group"))
    rewards = torch.full((8, 4), float("nan"))
    rewards[:, -1] = r
    out = est(rewards, gid, 3)
    torch.testing.assert_close(out.advantages, got.clamp(-5, 5))
    one = uniform_advantages(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 0, 1]), 1, unbiased=True)
    assert one[2, 0].item() == 0.0  # a group of one row (the others dropped): 0, not NaN
    with pytest.raises(ValueError, match="^unbiased_std:"):
        AdvantageConfig(unbiased_std="yes")


# ------------------------------------------------------------------------------------------------------------
# settings and the league config
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,needle", [
    (["objective=nft", "sampler=dpm2"], "train.step_subset=random_per_sample: draws each sample's"),
    (["train.weighting=auto"], "train.step_subset=random_per_sample: each sample trains its own steps"),
    (["train.step_fraction=0.2"], "train.step_fraction: int(4 trained steps x 0.2) = 0"),
    (["train.step_fraction=0"], "train.step_fraction: must be in (0, 1]"),
    (["train.step_subset=random"], "train.step_subset: must be null or one of random_per_sample"),
    (["loop.time_grid=karras"], "loop.time_grid: must be one of model, fastvideo"),
    (["loop.time_grid=model", "loop.grid_shift=3"], "loop.grid_shift: shifts the loop.time_grid=fastvideo grid only"),
    (["loop.grid_shift=0"], "loop.grid_shift: must be a float > 0 or null"),
    (["sampler.eta=-1"], "sampler.eta: must be a finite float >= 0 for dance_sde"),
])
def test_settings_refuse(overrides, needle):
    from stepflow.train import settings

    with pytest.raises(StepflowError) as err:
        settings(compose_config("train", [*BASE, *DANCE, *overrides]))
    assert str(err.value).startswith(needle), str(err.value)


def test_the_defaults_are_off_and_the_league_config_is_the_released_recipe():
    from stepflow.train import settings

    s = settings(compose_config("train"))
    assert s.train.step_subset is None and s.loop.time_grid == "model" and s.advantage.unbiased_std is False
    d = settings(compose_config("train", ["experiment=league/dancegrpo"]))
    assert (d.sampler.name, d.sampler.eta, d.loop.time_grid, d.window.name) == ("dance_sde", 0.3, "fastvideo", "none")
    assert (d.train.step_subset, d.train.step_fraction, d.train.timestep_fraction) == ("random_per_sample", 0.6, 0.99)
    assert d.train.train_steps is None and d.train.clip_eps == 1e-4 and d.train.beta_kl == 0.0
    assert (d.advantage.scheme, d.advantage.std_scope, d.advantage.eps, d.advantage.unbiased_std) == (
        "uniform", "group", 1e-8, True)
    assert d.loop.same_latent is True and d.loop.guidance == 1.0
    assert (d.loop.iterations, d.loop.prompts_per_iter, d.loop.group_size, d.loop.num_steps) == (60, 4, 16, 10)
