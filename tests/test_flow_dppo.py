"""Flow-DPPO (objective=flow_dppo, stepflow/objectives/flow_dppo.py): the masked surrogate against transcriptions of
the two releases' lines (plain torch, written independently of our code), the term as the iteration wires it (μ_old
from the rollout's velocity, the sampler's std), the NFEs it spends, the recipe, the refusals, LoRA and full
fine-tuning (the recipe's command-line run: tests/test_league_recipes_cli.py).

References read:
- verl-project/verl-omni@a1139bafffb5b9711f0a6b6edff8ecaa60bfff30 verl_omni/trainer/diffusion/diffusion_algos.py
  L361-463 (``FlowDPPOLoss.compute_loss``);
- Tencent-Hunyuan/UniRL@1a7b501e8fe8517b432a130220d2ff462f9b5afa unirl/algorithms/flowdppo.py L43-138
  (``_gaussian_kl_div``, ``_flowdppo_kl_adv_loss``) and L342-368 (``_compute_sigma_t``).
"""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.testing.harness import compose_config, one_line_error

BASE = ["experiment=smoke", "reward=pickscore_tiny", "objective=flow_dppo", "sampler=flow_sde", "advantage=uniform",
        "loop.same_latent=false"]


# ---------------------------------------------------------------- the releases, transcribed
def verl_omni_flow_dppo(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t, sqrt_dt,
                        kl_mask_threshold, add_kl_coefficient=True):
    """verl-omni diffusion_algos.py L396-424, the loss lines verbatim (config fields as arguments)::

        advantages = advantages.detach()
        log_ratio = log_prob - old_log_prob
        ratio = torch.exp(log_ratio)
        unclipped_loss = -advantages * ratio
        mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
        if getattr(loss_cfg, "add_kl_coefficient", True):
            sigma_t = std_dev_t * cls._broadcast_sqrt_dt(sqrt_dt, std_dev_t)
            kl_per_elem = mean_diff_sq / (2 * sigma_t.pow(2))
        else:
            kl_per_elem = mean_diff_sq / 2
        if kl_per_elem.ndim > 1:
            kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))
        ...
        high_kl_mask = kl_per_sample >= kl_mask_threshold
        pos_rm_mask = high_kl_mask & (ratio > 1.0) & (advantages > 0)
        neg_rm_mask = high_kl_mask & (ratio < 1.0) & (advantages < 0)
        rm_mask = pos_rm_mask | neg_rm_mask
        keep_mask = (~rm_mask).detach()
        zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
        per_elem_loss = torch.where(keep_mask, unclipped_loss, zero)
        pg_loss = torch.mean(per_elem_loss)
    """
    advantages = advantages.detach()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    if add_kl_coefficient:
        sdt = sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (std_dev_t.ndim - 1)))  # _broadcast_sqrt_dt (L368-372)
        sigma_t = std_dev_t * sdt
        kl_per_elem = mean_diff_sq / (2 * sigma_t.pow(2))
    else:
        kl_per_elem = mean_diff_sq / 2
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))
    high_kl_mask = kl_per_sample >= kl_mask_threshold
    pos_rm_mask = high_kl_mask & (ratio > 1.0) & (advantages > 0)
    neg_rm_mask = high_kl_mask & (ratio < 1.0) & (advantages < 0)
    rm_mask = pos_rm_mask | neg_rm_mask
    keep_mask = (~rm_mask).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
    per_elem_loss = torch.where(keep_mask, unclipped_loss, zero)
    return torch.mean(per_elem_loss), rm_mask.float().mean(), kl_per_sample


def unirl_flow_dppo(new_logp, old_logp, new_means, old_means, advantages, sigma_t, kl_mask_threshold):
    """UniRL flowdppo.py L86-111 (and ``_gaussian_kl_div`` L51) verbatim, [B, S'] rows; the caller's ``.mean()``
    (L319)::

        log_diff = new_logp - old_logp
        ratio = torch.exp(log_diff)
        adv = advantages.detach()
        unclipped_loss = -adv * ratio
        kl_per_elem = _gaussian_kl_div(new_means, old_means, sigma_t)  # (p - q) ** 2 / (2 * sigma**2)
        kl_per_sample = kl_per_elem.mean(dim=tuple(range(2, kl_per_elem.ndim)))  # [B, S']
        kl_mask = kl_per_sample < kl_mask_threshold
        pos_rm_mask = (~kl_mask) & (ratio > 1.0) & (adv > 0)
        neg_rm_mask = (~kl_mask) & (ratio < 1.0) & (adv < 0)
        rm_mask = pos_rm_mask | neg_rm_mask
        keep_adv_mask = (~rm_mask).detach()
        zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
        loss_per_elem = torch.where(keep_adv_mask, unclipped_loss, zero)
    """
    log_diff = new_logp - old_logp
    ratio = torch.exp(log_diff)
    adv = advantages.detach()
    unclipped_loss = -adv * ratio
    kl_per_elem = (new_means - old_means) ** 2 / (2 * sigma_t**2)
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(2, kl_per_elem.ndim)))
    kl_mask = kl_per_sample < kl_mask_threshold
    pos_rm_mask = (~kl_mask) & (ratio > 1.0) & (adv > 0)
    neg_rm_mask = (~kl_mask) & (ratio < 1.0) & (adv < 0)
    rm_mask = pos_rm_mask | neg_rm_mask
    keep_adv_mask = (~rm_mask).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
    return torch.where(keep_adv_mask, unclipped_loss, zero).mean()


def _inputs():
    """8 hand-made rows covering each branch of the mask: (A sign) x (ratio above / below 1) x (D above / below ε),
    plus a row exactly at the threshold (masked: ``>=``) and a zero advantage."""
    adv = torch.tensor([1.5, 1.5, -2.0, -2.0, 0.7, -0.3, 0.9, 0.0])
    dlog = torch.tensor([0.02, -0.03, -0.01, 0.04, 0.01, -0.02, 0.05, 0.03])  # log π_θ − log π_old
    old_lp = torch.tensor([-1.0, -0.5, 0.2, -0.3, -0.8, 0.1, -0.2, -0.4])
    std = torch.full((8,), 0.5)  # 2 s² = 1/2: D = 2·δ² for a constant drift δ
    eps = 2.0**-9
    # old means on a dyadic grid, so that row 6's drift 2^-5 is exact: D = 2·2^-10 = ε exactly
    old_mean = (torch.arange(18, dtype=torch.float32).view(2, 3, 3) * 0.25 - 2).expand(8, 2, 3, 3).clone()
    d = torch.tensor([50, 40, 30, 20, 1e-3, 2e-3, 1.0, 10.0]) * eps  # D per row: 0-3 and 7 ≫ ε, 4-5 ≪ ε, 6 = ε
    drift = torch.sqrt(d / 2)
    drift[6] = 2.0**-5
    mean = old_mean + drift.view(8, 1, 1, 1)
    return adv, old_lp, old_lp + dlog, old_mean, mean, std, eps


def test_masked_surrogate_matches_verl_omni_and_unirl():
    from stepflow.objectives.flow_dppo import dppo_divergence, dppo_loss

    adv, old_lp, lp, old_mean, mean, std, eps = _inputs()
    lp = lp.clone().requires_grad_(True)
    # std_dev_t · sqrt_dt = s: split it as the releases carry it (σ_t (B,1,1,1), sqrt(−dt) (B,))
    sqrt_dt = torch.full((8,), 0.5)
    std_dev_t = (std / sqrt_dt).view(8, 1, 1, 1)
    ref, ref_masked, ref_d = verl_omni_flow_dppo(old_lp, lp, adv, old_mean, mean, std_dev_t, sqrt_dt, eps)
    div = dppo_divergence(mean, old_mean, std)
    torch.testing.assert_close(div, ref_d, rtol=1e-6, atol=0)
    ours, st = dppo_loss(lp, old_lp, adv, div, eps)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)
    assert float(st["masked_frac"]) == pytest.approx(float(ref_masked))
    # rows 0 (A>0, ρ>1), 2 (A<0, ρ<1), 6 (D = ε exactly, A>0, ρ>1) are masked; 1, 3 (corrective: moving back),
    # 4, 5 (D < ε) and 7 (A = 0) kept
    assert float(div[6]) == eps
    assert float(st["masked_frac"]) == pytest.approx(3 / 8)
    # the gradient: the masked rows give none, the kept ones −A·ρ/B
    (g,) = torch.autograd.grad(ours, lp)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref)
    assert g[[0, 2, 6]].abs().max() == 0 and g[[1, 3, 4, 5]].abs().min() > 0
    # UniRL: the same rows as [B, S'=1] with σ_t of shape [1, S', 1, 1, 1]
    uni = unirl_flow_dppo(lp.view(8, 1), old_lp.view(8, 1), mean.view(8, 1, 2, 3, 3), old_mean.view(8, 1, 2, 3, 3),
                          adv.view(8, 1), std[:1].view(1, 1, 1, 1, 1), eps)
    torch.testing.assert_close(ours, uni, rtol=1e-6, atol=1e-9)


def test_without_the_kl_coefficient_the_drift_is_halved_only():
    from stepflow.objectives.flow_dppo import dppo_divergence, dppo_loss

    adv, old_lp, lp, old_mean, mean, std, _ = _inputs()
    thr = 1e-4
    ref, _, ref_d = verl_omni_flow_dppo(old_lp, lp, adv, old_mean, mean, std.view(8, 1, 1, 1), torch.ones(8), thr,
                                        add_kl_coefficient=False)
    div = dppo_divergence(mean, old_mean, std, add_kl_coefficient=False)
    torch.testing.assert_close(div, ref_d, rtol=1e-6, atol=0)
    torch.testing.assert_close(dppo_loss(lp, old_lp, adv, div, thr)[0], ref, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- the term as the iteration wires it
def _module(tmp_path, *overrides):
    from stepflow.train import build_module

    return build_module(compose_config("train", [*BASE, *overrides]), tmp_path)


def _rollout(module, it=0):
    from stepflow.core.rollout import rollout

    lr = module.learner
    plan = lr.plan.plan(it)
    traj = rollout(lr.policy, plan, lr.sampler, lr.loop.num_steps, lr.guidance)
    adv = torch.randn(traj.batch_size, lr.loop.num_steps, generator=torch.Generator().manual_seed(3)) * 2
    return traj, adv


def test_the_term_is_the_released_loss_on_the_rollouts_own_means(tmp_path):
    """One term after the weights moved: μ_θ from the policy's velocity, μ_old from the rollout's velocity (the same
    step), s = σ_t·√Δt of flow_sde; the releases' loss written out on them; a threshold low enough to mask."""
    from stepflow.core.update import step_loss
    from stepflow.math.sde import sde_step

    m = _module(tmp_path, "objective.kl_mask_threshold=1e-9")
    lr = m.learner
    traj, adv = _rollout(m)
    with torch.no_grad():  # move the weights off the rollout's
        for p in lr.policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    k, rows, times = 1, torch.arange(traj.batch_size), traj.times
    out = step_loss(lr, traj, adv, k, rows, times)
    with torch.no_grad():
        x, xn = traj.latents[:, k], traj.latents[:, k + 1]
        v = lr.policy.velocity(x, times[k], traj.cond, lr.guidance)
        new = sde_step(lr.sampler, x, v, times[k], times[k + 1], t_guard=times[1], prev_sample=xn)
        old = sde_step(lr.sampler, x, traj.velocities[:, k], times[k], times[k + 1], t_guard=times[1], prev_sample=xn)
        torch.testing.assert_close(old.log_prob, traj.log_probs[:, k], rtol=1e-5, atol=1e-5)  # it is π_old
        # σ_t·√Δt of flow_sde (a = 0.7): std_dev_t = a·sqrt(t / (1 − t)), t = 1 guarded by the grid's τ_1
        t, tn = float(times[k]), float(times[k + 1])
        s = 0.7 * math.sqrt(t / (1 - t)) * math.sqrt(t - tn)
        assert float(new.std[0]) == pytest.approx(s, rel=1e-5)
        ref, masked, _ = verl_omni_flow_dppo(traj.log_probs[:, k], new.log_prob, adv[:, k], old.mean, new.mean,
                                             new.std.view(-1, 1, 1, 1), torch.ones(traj.batch_size), 1e-9)
    assert float(out["loss"]) == pytest.approx(float(ref), rel=1e-5, abs=1e-8)
    assert float(out["clip_frac"]) == pytest.approx(float(masked)) and 0 < float(masked) < 1


def test_first_update_is_on_policy_and_unmasked(tmp_path):
    m = _module(tmp_path, "train.updates_per_iter=1", "loop.iterations=1")
    res = m.iterate()
    assert abs(res["train/ratio_min"] - 1) < 1e-5 and abs(res["train/ratio_max"] - 1) < 1e-5
    assert res["train/clip_frac"] == 0.0 and res["train/dppo_kl"] == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------- cost, recipe, refusals, fine-tuning
def test_nfes_are_counted_by_the_common_rules(tmp_path):
    """The recipe on 1 prompt x 4 samples: T rollout NFEs per sample, one forward and one backward (2 forward-
    equivalents) per sample and trained step; the old means cost nothing (the rollout's velocities)."""
    from stepflow.train import build_module

    cfg = compose_config("train", ["experiment=league/flow_dppo", "model=shapes_tiny", "reward=pickscore_tiny",
                                   "loop.prompts_per_iter=1",
                                   "loop.group_size=4", "loop.iterations=1", "eval.every=0", "eval.at_start=false"])
    m = build_module(cfg, tmp_path).iterate()
    b, t, s = 4, 10, 3
    assert m["train/steps_trained"] == s
    assert (m["cost/nfe_rollout"], m["cost/nfe"], m["cost/nfe_backward"]) == (b * t, b * t + b * s, b * s)
    assert m["cost/nfe_fwd_equiv"] == b * t + b * s + 2 * b * s


def test_league_recipe_composes_with_the_released_settings():
    from stepflow.train import settings

    s = settings(compose_config("train", ["experiment=league/flow_dppo"]))
    o = s.objective
    assert (type(o).__name__, o.kl_mask_threshold, o.add_kl_coefficient) == ("FlowDppo", 1e-5, True)
    assert (s.sampler.name, s.sampler.a, s.window.name, s.window.start, s.window.end, s.window.size) == (
        "flow_sde", 0.7, "random_start", 0, 5, 3)
    assert (s.train.beta_kl, s.train.updates_per_iter, s.train.train_steps, s.advantage.std_scope) == (
        0.0, 2, None, "global")
    assert (s.loop.guidance, s.loop.same_latent, s.loop.num_steps, s.loop.group_size) == (1.0, False, 10, 16)


@pytest.mark.parametrize("overrides,field", [
    (["objective.kl_mask_threshold=0"], "objective.kl_mask_threshold"),
    (["objective.kl_mask_threshold=-1e-5"], "objective.kl_mask_threshold"),
    (["objective.add_kl_coefficient=maybe"], "objective.add_kl_coefficient"),
    (["train.weighting=guard"], "train.weighting"),
    (["train.weighting=guard_released"], "train.weighting"),
])
def test_settings_flow_dppo_cannot_use_are_one_line(cli, overrides, field):
    r = cli("stepflow.train", *BASE, *overrides)
    assert one_line_error(r, field).startswith(f"stepflow: error: {field}")


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_trains_with_lora_and_full_finetuning(tmp_path, finetune):
    from stepflow.train import build_module

    extra = ["model=sd3_tiny", "model.finetune=full", "loop.num_steps=3"] if finetune == "full" else []
    m = build_module(compose_config("train", [*BASE, "loop.iterations=1", *extra]), tmp_path)
    before = [p.detach().clone() for p in m.learner.policy.trainable_parameters()]
    res = m.iterate()
    assert math.isfinite(res["train/policy_loss"]) and math.isfinite(res["train/grad_norm"]) and res["train/grad_norm"] > 0
    assert any(float((p - q).abs().max()) > 0 for p, q in zip(m.learner.policy.trainable_parameters(), before))
