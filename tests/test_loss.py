"""stepflow.math.loss against autograd of the unclipped policy gradient, hand-computed clipped values,
torch.distributions.kl_divergence, and method.md's closed-form KLs in terms of Δv (§2, §3.5)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from stepflow.math.loss import distill_loss, gaussian_kl, grpo_surrogate, policy_loss
from stepflow.math.sde import SamplerConfig, sde_step, time_grid


def test_gradient_at_ratio_one_is_minus_adv_grad_log_prob():
    gen = torch.Generator().manual_seed(0)
    feat = torch.randn(5, 3, generator=gen)
    theta = torch.randn(5, 3, generator=gen, requires_grad=True)
    adv = torch.randn(5, generator=gen)
    lp = (torch.tanh(theta) * feat).sum(1)
    loss, st = grpo_surrogate(lp, lp.detach(), adv, clip_eps=1e-4)
    (g,) = torch.autograd.grad(loss, theta)
    lp2 = (torch.tanh(theta) * feat).sum(1)
    (ref,) = torch.autograd.grad(-(adv * lp2).mean(), theta)
    torch.testing.assert_close(g, ref)
    # and analytically: ∂/∂θ_ij = −A_i · feat_ij · (1 − tanh²θ_ij) / B
    torch.testing.assert_close(g, -(adv.view(-1, 1) * feat * (1 - torch.tanh(theta.detach()) ** 2)) / 5)
    assert float(st["clip_frac"]) == 0.0 and float(st["ratio_mean"]) == 1.0
    torch.testing.assert_close(loss, -adv.mean())


def test_clipping_both_sides():
    """ε = 0.2; rows (A, ρ): (+1, 1.5) clipped, (+1, 0.5) not, (−1, 0.5) clipped, (−1, 1.5) not.
    Per-row max(−Aρ, −A clip ρ): −1.2, −0.5, 0.8, 1.5 -> mean 0.15; d/dlp = −Aρ/B on unclipped rows, 0 else."""
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    lp = torch.log(ratio).clone().requires_grad_(True)
    loss, st = grpo_surrogate(lp, torch.zeros(4), adv, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([0.0, -0.5 / 4, 0.0, 1.5 / 4]))
    assert float(st["clip_frac"]) == 1.0
    assert float(st["ratio_min"]) == pytest.approx(0.5) and float(st["ratio_max"]) == pytest.approx(1.5)
    assert float(st["ratio_mean"]) == pytest.approx(1.0)
    # inside the trust region nothing is clipped, for either sign of A
    lp_in = torch.log(torch.tensor([1.1, 0.9, 0.9, 1.1])).requires_grad_(True)
    loss_in, st_in = grpo_surrogate(lp_in, torch.zeros(4), adv, clip_eps=0.2)
    (g_in,) = torch.autograd.grad(loss_in, lp_in)
    torch.testing.assert_close(g_in, -adv * torch.tensor([1.1, 0.9, 0.9, 1.1]) / 4)
    assert float(st_in["clip_frac"]) == 0.0


def test_gaussian_kl_matches_torch_distributions():
    gen = torch.Generator().manual_seed(1)
    mu = torch.randn(4, 2, 3, 3, generator=gen, dtype=torch.float64)
    ref_mu = torch.randn(4, 2, 3, 3, generator=gen, dtype=torch.float64)
    std = torch.tensor([0.1, 0.5, 1.3, 0.0], dtype=torch.float64)
    got = gaussian_kl(mu, ref_mu, std)
    for i in range(3):
        ref = kl_divergence(Normal(mu[i], std[i]), Normal(ref_mu[i], std[i])).mean()
        torch.testing.assert_close(got[i], ref)
    assert got[3].item() == 0.0  # σ = 0 rows (untrainable) contribute nothing


def _two_policies(cfg, ks):
    g = time_grid(10, 3.0)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(ks), 4, 4, generator=gen)
    v = torch.randn(len(ks), 4, 4, generator=gen)
    v_ref = v + 0.3 * torch.randn(len(ks), 4, 4, generator=gen)
    ks = torch.tensor(ks)
    t, s = g[ks], g[ks + 1]
    return (sde_step(cfg, x, v, t, s, t_guard=g[1]), sde_step(cfg, x, v_ref, t, s, t_guard=g[1]),
            (v - v_ref), t, s, g)


def test_flow_sde_kl_closed_form_and_parity_is_exact_times_dt():
    """method.md §2: exact per-dim KL = (Δt/2)(1/σ_d + σ_d(1−t)/(2t))²·mean(Δv²); Flow-GRPO's value
    mean((μθ − μref)²)/(2σ_d²) equals the exact KL × Δt."""
    out, ref, dv, t, s, g = _two_policies(SamplerConfig("flow_sde", a=0.7), [0, 1, 4, 8, 9])
    exact = gaussian_kl(out.mean, ref.mean, out.std)
    parity = gaussian_kl(out.mean, ref.mean, out.kl_scale)
    for i in range(len(t)):
        ti, dt = float(t[i]), float(t[i] - s[i])
        tt = float(g[1]) if ti == 1.0 else ti
        sd = 0.7 * math.sqrt(ti / (1 - tt))
        closed = dt / 2 * (1 / sd + sd * (1 - ti) / (2 * ti)) ** 2 * (dv[i] ** 2).mean().item()
        assert exact[i].item() == pytest.approx(closed, rel=1e-4)
        assert parity[i].item() == pytest.approx(exact[i].item() * dt, rel=1e-5)
        code = ((out.mean[i] - ref.mean[i]) ** 2).mean().item() / (2 * sd**2)
        assert parity[i].item() == pytest.approx(code, rel=1e-5)


def test_ddim_kl_closed_form_and_parity_equals_exact():
    """method.md §3.5: μθ − μref = [c(1−t) − t(1−s)]·Δv, KL = that² · mean(Δv²) / (2σ²); kl_scale = std for ddim."""
    out, ref, dv, t, s, g = _two_policies(SamplerConfig("ddim_sde", eta=0.9, first_step_guard=True), [0, 3, 7, 8])
    exact = gaussian_kl(out.mean, ref.mean, out.std)
    torch.testing.assert_close(gaussian_kl(out.mean, ref.mean, out.kl_scale), exact)
    for i in range(len(t)):
        ti, si, sig = float(t[i]), float(s[i]), float(out.std[i])
        c = math.sqrt(si**2 - sig**2)
        closed = (c * (1 - ti) - ti * (1 - si)) ** 2 * (dv[i] ** 2).mean().item() / (2 * sig**2)
        assert exact[i].item() == pytest.approx(closed, rel=1e-3)


def test_policy_loss_combines_surrogate_and_kl_with_mask():
    gen = torch.Generator().manual_seed(3)
    mean = torch.randn(4, 6, generator=gen, requires_grad=True)
    ref_mean = torch.randn(4, 6, generator=gen)
    std = torch.tensor([0.5, 0.2, 0.0, 1.0])
    lp = torch.randn(4, generator=gen, requires_grad=True)
    old = lp.detach() + 0.05 * torch.randn(4, generator=gen)
    adv = torch.randn(4, generator=gen)
    mask = std > 0
    out = policy_loss(lp, old, adv, clip_eps=0.1, mean=mean, ref_mean=ref_mean, std=std, beta=0.04, mask=mask)
    sur, _ = grpo_surrogate(lp[mask], old[mask], adv[mask], 0.1)
    kl = torch.stack([kl_divergence(Normal(mean[i], std[i]), Normal(ref_mean[i], std[i])).mean()
                      for i in range(4) if mask[i]]).mean()
    torch.testing.assert_close(out.loss, sur + 0.04 * kl)
    torch.testing.assert_close(out.kl, kl.detach())
    torch.testing.assert_close(out.policy_loss, sur.detach())
    g_lp, g_mu = torch.autograd.grad(out.loss, (lp, mean))
    r_lp, r_mu = torch.autograd.grad(sur + 0.04 * kl, (lp, mean))
    torch.testing.assert_close(g_lp, r_lp)
    torch.testing.assert_close(g_mu, r_mu)
    assert not out.kl.requires_grad and not out.clip_frac.requires_grad
    # parity mode divides by kl_scale instead of std
    ks = torch.tensor([1.0, 2.0, 0.0, 0.5])
    par = policy_loss(lp, old, adv, clip_eps=0.1, mean=mean, ref_mean=ref_mean, kl_scale=ks, beta=0.04,
                      kl_mode="flow_grpo_parity", mask=mask)
    torch.testing.assert_close(par.kl, gaussian_kl(mean, ref_mean, ks)[mask].mean().detach())
    # β = 0 and no means: loss is the surrogate, kl reported as 0
    plain = policy_loss(lp, old, adv, clip_eps=0.1)
    torch.testing.assert_close(plain.loss, grpo_surrogate(lp, old, adv, 0.1)[0])
    assert plain.kl.item() == 0.0


def test_policy_loss_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="^beta:"):
        policy_loss(x, x, x, clip_eps=0.1, beta=0.1)
    with pytest.raises(ValueError, match="^kl_mode:"):
        policy_loss(x, x, x, clip_eps=0.1, kl_mode="approx")
    with pytest.raises(ValueError, match="^clip_eps:"):
        grpo_surrogate(x, x, x, 0.0)


def test_distill_loss_weights_and_stop_gradient():
    gen = torch.Generator().manual_seed(4)
    student = torch.randn(3, 2, 2, generator=gen, requires_grad=True)
    target = torch.randn(3, 2, 2, generator=gen, requires_grad=True)
    adv = torch.tensor([1.5, -0.5, 0.0])
    err = ((student - target) ** 2).mean(dim=(1, 2)).detach()
    for weight, w in [("relu", torch.tensor([1.5, 0.0, 0.0])), ("signed", adv),
                      ("exp", torch.exp(adv / 2.0))]:
        loss = distill_loss(student, target, adv, weight=weight, temperature=2.0)
        torch.testing.assert_close(loss, (w * err).mean())
    loss = distill_loss(student, target, adv, weight="relu")
    gs, gt = torch.autograd.grad(loss, (student, target), allow_unused=True)
    assert gt is None  # the target is a stop-gradient
    torch.testing.assert_close(gs[0], 2 * 1.5 * (student[0] - target[0]).detach() / 4 / 3)
    assert gs[1].abs().sum() == 0
    with pytest.raises(ValueError, match="^weight:"):
        distill_loss(student, target, adv, weight="softmax")
    with pytest.raises(ValueError, match="^temperature:"):
        distill_loss(student, target, adv, weight="exp", temperature=0.0)
