"""stepflow.math.forward against independent references: numbers worked out by hand (shown in each test), transcriptions
of the released lines (NVlabs/DiffusionNFT @ 24af555 ``scripts/train_nft_sd3.py`` = "nft:L", and
scxue/advantage_weighted_matching @ be51372 ``advantage_weighted_matching/scripts/train_sd3_awm.py`` = "awm:L"),
copied inline with only ``config.*`` turned into arguments, and closed-form gradients derived in the docstrings."""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.math.forward import (
    advantageflow_loss,
    advantageflow_stable,
    advantageflow_target,
    awm_advantage,
    awm_ema_decay,
    awm_log_prob,
    awm_policy_loss,
    awm_train_indices,
    nft_loss,
    nft_old_decay,
    nft_reward,
    noised,
    velocity_kl,
    x0_from_velocity,
)


# ------------------------------------------------------------------------------------------------------------------
# transcriptions of the released code (the reference implementations)
# ------------------------------------------------------------------------------------------------------------------
def released_nft_reward(adv, adv_clip_max, adv_mode):
    """nft:L910-929."""
    advantages_clip = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        advantages_clip = torch.clamp(advantages_clip, 0, adv_clip_max)
    elif adv_mode == "negative_only":
        advantages_clip = torch.clamp(advantages_clip, -adv_clip_max, 0)
    elif adv_mode == "one_only":
        advantages_clip = torch.where(
            advantages_clip > 0, torch.ones_like(advantages_clip), torch.zeros_like(advantages_clip)
        )
    elif adv_mode == "binary":
        advantages_clip = torch.sign(advantages_clip)
    normalized_advantages_clip = (advantages_clip / adv_clip_max) / 2.0 + 0.5
    return torch.clamp(normalized_advantages_clip, 0, 1)


def released_nft_policy_loss(forward_prediction, old_prediction, xt, x0, t, r, beta, adv_clip_max):
    """nft:L934-960 (t_expanded from L866)."""
    t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
    positive_prediction = beta * forward_prediction + (1 - beta) * old_prediction.detach()
    implicit_negative_prediction = (1.0 + beta) * old_prediction.detach() - beta * forward_prediction
    x0_prediction = xt - t_expanded * positive_prediction
    with torch.no_grad():
        weight_factor = (
            torch.abs(x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
    with torch.no_grad():
        negative_weight_factor = (
            torch.abs(negative_x0_prediction.double() - x0.double()).mean(dim=tuple(range(1, x0.ndim)), keepdim=True)
            .clip(min=0.00001)
        )
    negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(dim=tuple(range(1, x0.ndim)))
    ori_policy_loss = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    return (ori_policy_loss * adv_clip_max).mean()


def released_return_decay(step, decay_type):
    """nft:L169-189."""
    if decay_type == 0:
        flat, uprate, uphold = 0, 0.0, 0.0
    elif decay_type == 1:
        flat, uprate, uphold = 0, 0.001, 0.5
    elif decay_type == 2:
        flat, uprate, uphold = 75, 0.0075, 0.999
    else:
        raise AssertionError
    if step < flat:
        return 0.0
    decay = (step - flat) * uprate
    return min(decay, uphold)


def released_awm_log_prob(model_output, random_noise, clean_latents, timestep, weighting, ghuber_power):
    """awm:L237-251 (timestep: (B,))."""
    model_output = model_output.double()
    log_prob = -(model_output - (random_noise.double() - clean_latents.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    if weighting == "t":
        log_prob = log_prob * timestep.view(-1)
    elif weighting == "t**2":
        log_prob = log_prob * timestep.view(-1) ** 2
    elif weighting == "Uniform":
        log_prob = log_prob
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * timestep.view(-1)
    elif weighting == "ghuber":
        log_prob = -(torch.pow(-log_prob + 1e-10, ghuber_power) - torch.pow(
            torch.tensor(1e-10, device=log_prob.device, dtype=log_prob.dtype), ghuber_power)
        ) * timestep.view(-1) / ghuber_power
    return log_prob


def released_discrete_wo_init(num_steps, timestep_fraction, train_timesteps, generator):
    """awm:L1198-1202 (``torch.rand`` given the generator so the draws can be compared)."""
    boundaries = torch.linspace(1, int(num_steps * timestep_fraction), steps=train_timesteps + 1)
    lower_bounds = boundaries[:-1].long()
    upper_bounds = boundaries[1:].long()
    rand_u = torch.rand(train_timesteps, generator=generator)
    return (lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()).tolist()


# ------------------------------------------------------------------------------------------------------------------
# shared pieces
# ------------------------------------------------------------------------------------------------------------------
def test_noised_and_tweedie_by_hand():
    """x0 = [2, −2], ε = [0, 4], t = 0.25: x_t = 0.75·x0 + 0.25·ε = [1.5, −0.5]; with the exact velocity ε − x0 =
    [−2, 6], x̂0 = x_t − 0.25·v = [2, −2] = x0. Per-sample t = (0, 1) gives x0 and ε."""
    x0 = torch.tensor([[2.0, -2.0]])
    eps = torch.tensor([[0.0, 4.0]])
    xt = noised(x0, eps, 0.25)
    torch.testing.assert_close(xt, torch.tensor([[1.5, -0.5]]))
    torch.testing.assert_close(x0_from_velocity(xt, eps - x0, 0.25), x0)
    two = torch.cat([x0, x0])
    torch.testing.assert_close(noised(two, torch.cat([eps, eps]), torch.tensor([0.0, 1.0])), torch.cat([x0, eps]))
    with pytest.raises(ValueError, match="t:"):
        noised(two, two, torch.tensor([0.1, 0.2, 0.3]))


def test_velocity_kl_by_hand_and_reference_detached():
    """rows (v − v_ref) = [1, 3] and [2, 0]: mean_dims of squares 5 and 2, mean 3.5; dL/dv = 2(v − v_ref)/(D·B)."""
    v = torch.tensor([[1.0, 3.0], [2.0, 0.0]], requires_grad=True)
    v_ref = torch.zeros(2, 2, requires_grad=True)
    kl = velocity_kl(v, v_ref)
    assert kl.item() == pytest.approx(3.5)
    assert velocity_kl(v, v_ref, dtype=torch.float64).dtype == torch.float64
    kl.backward()
    torch.testing.assert_close(v.grad, 2 * v.detach() / 4)
    assert v_ref.grad is None


# ------------------------------------------------------------------------------------------------------------------
# §1 DiffusionNFT
# ------------------------------------------------------------------------------------------------------------------
ADV = torch.tensor([-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 7.0])


@pytest.mark.parametrize("mode,expected", [
    # A_c = clip(A, ±5) = [−5, −5, −2.5, 0, 1, 5, 5]; r = A_c/10 + 0.5
    ("all", [0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0]),
    # clip(A_c, 0, 5) = [0, 0, 0, 0, 1, 5, 5]
    ("positive_only", [0.5, 0.5, 0.5, 0.5, 0.6, 1.0, 1.0]),
    # clip(A_c, −5, 0) = [−5, −5, −2.5, 0, 0, 0, 0]
    ("negative_only", [0.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.5]),
    # A_c > 0 → 1 else 0 (the advantage, not r): r = 0.6 or 0.5
    ("one_only", [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6]),
    # sign(A_c) = [−1, −1, −1, 0, 1, 1, 1]: r = 0.4 / 0.5 / 0.6
    ("binary", [0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6]),
])
def test_nft_reward_modes_by_hand_and_released(mode, expected):
    r = nft_reward(ADV, 5.0, mode)
    torch.testing.assert_close(r, torch.tensor(expected))
    torch.testing.assert_close(r, released_nft_reward(ADV, 5.0, mode))


def test_nft_reward_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        nft_reward(ADV, 5.0, "positive")


def test_nft_loss_by_hand():
    """One row, D = 2, t = 0.5, x_t = [1, 1], x0 = [0, 0], v = [2, 4], v_old = [4, 2], r = 0.7 (A = 2), A_max = 5.

    β = 1: v⁺ = v = [2, 4] → x̂0⁺ = [0, −1]: mean sq 0.5 / mean abs 0.5 → L⁺ = 1;
           v⁻ = 2 v_old − v = [6, 0] → x̂0⁻ = [−2, 1]: 2.5 / 1.5 → L⁻ = 5/3;
           loss = 5·(0.7·1 + 0.3·5/3)/1 = 6.
    β = 0.5: v⁺ = [3, 3] → x̂0⁺ = [−0.5, −0.5]: 0.25/0.5 → L⁺ = 0.5;
             v⁻ = 1.5 v_old − 0.5 v = [5, 1] → x̂0⁻ = [−1.5, 0.5]: 1.25/1 → L⁻ = 1.25;
             loss = 5·(0.7·0.5 + 0.3·1.25)/0.5 = 7.25.
    A second row with x̂0^± = x0 exactly (weight clamped to 1e-5, L^± = 0) halves the batch mean."""
    xt = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    x0 = torch.zeros(2, 2)
    v = torch.tensor([[2.0, 4.0], [0.0, 0.0]])
    v_old = torch.tensor([[4.0, 2.0], [0.0, 0.0]])
    r = nft_reward(torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(r, torch.tensor([0.7, 0.7]))
    loss1, st1 = nft_loss(v[:1], v_old[:1], xt[:1], x0[:1], 0.5, r[:1], beta=1.0)
    assert loss1.item() == pytest.approx(6.0, rel=1e-6)
    assert st1["positive_loss"].item() == pytest.approx(1.0) and st1["negative_loss"].item() == pytest.approx(5 / 3)
    assert st1["unweighted_policy_loss"].item() == pytest.approx(1.2)
    assert st1["old_deviate"].item() == pytest.approx(4.0)  # mean([−2, 2]²)
    loss2, _ = nft_loss(v, v_old, xt, x0, 0.5, r, beta=0.5)
    assert loss2.item() == pytest.approx(7.25 / 2, rel=1e-6)
    assert loss2.dtype == torch.float64  # the released float64 weight promotes the quotient (nft:L942-947)


def test_nft_loss_matches_the_released_lines():
    gen = torch.Generator().manual_seed(0)
    B = 5
    x0 = torch.randn(B, 2, 3, 3, generator=gen)
    eps = torch.randn(B, 2, 3, 3, generator=gen)
    t = torch.rand(B, generator=gen) * 0.9 + 0.05
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v_old = eps - x0 + 0.3 * torch.randn(B, 2, 3, 3, generator=gen)
    v0 = v_old + 0.2 * torch.randn(B, 2, 3, 3, generator=gen)
    r = released_nft_reward(torch.randn(B, generator=gen) * 4, 5.0, "all")
    for beta in (1.0, 0.1):
        v = v0.clone().requires_grad_(True)
        ours, _ = nft_loss(v, v_old, xt, x0, t, r, beta)
        (g,) = torch.autograd.grad(ours, v)
        v2 = v0.clone().requires_grad_(True)
        ref = released_nft_policy_loss(v2, v_old, xt, x0, t, r, beta, 5.0)
        (g_ref,) = torch.autograd.grad(ref, v2)
        assert ref.dtype == ours.dtype == torch.float64
        torch.testing.assert_close(ours, ref, rtol=0, atol=0)  # the same ops in the same order and dtypes
        torch.testing.assert_close(g, g_ref, rtol=0, atol=0)


@pytest.mark.parametrize("beta", [1.0, 0.1, 1e-3])
def test_nft_gradient_on_policy_is_2r_minus_1_times_velocity_error(beta):
    """At v = v_old (d = 0): v⁺ = v⁻ = v_old, so e = x̂0 − x0 = x_t − t v_old − x0 = −t (v − target), target = ε − x0,
    and W = sg(mean|e|) = t·mean|v − target| for both sides. ∂L⁺/∂v = −(2/D) t β e/W, ∂L⁻/∂v = +(2/D) t β e/W, so
    ∂loss/∂v_i = (A_max/(β B))·(r_i − (1 − r_i))·(−2 t β e/(D W)) = A_max (2r_i − 1)·2 t (v − target)/(D B mean|v − target|).
    This holds for every β (not only β → 0), and is 0 at r = 1/2."""
    gen = torch.Generator().manual_seed(1)
    B, D = 4, 12
    x0 = torch.randn(B, 3, 2, 2, generator=gen)
    eps = torch.randn(B, 3, 2, 2, generator=gen)
    t = torch.tensor([0.2, 0.5, 0.7, 0.9])
    xt = noised(x0, eps, t)
    target = eps - x0
    v_old = target + 0.5 * torch.randn(B, 3, 2, 2, generator=gen)
    r = torch.tensor([0.0, 0.5, 0.8, 1.0])
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, xt, x0, t, r, beta)
    (g,) = torch.autograd.grad(loss, v)
    err = (v_old - target).double()
    mabs = err.abs().reshape(B, -1).mean(1).view(-1, 1, 1, 1)
    tt = t.double().view(-1, 1, 1, 1)
    expected = 5.0 * (2 * r.double().view(-1, 1, 1, 1) - 1) * 2 * tt * err / (D * B * mabs)
    torch.testing.assert_close(g.double(), expected, rtol=1e-5, atol=1e-7)
    assert g[1].abs().max().item() < 1e-6  # r = 1/2: no gradient (up to the rounding of v^± ≠ v_old)


@pytest.mark.parametrize("decay_type,steps,expected", [
    (0, [0, 1, 75, 1000], [0.0, 0.0, 0.0, 0.0]),
    # min(0.001·step, 0.5): the plateau starts at step 500
    (1, [0, 1, 250, 499, 500, 501, 10_000], [0.0, 0.001, 0.25, 0.499, 0.5, 0.5, 0.5]),
    # 0 before 75; then min(0.0075·(step − 75), 0.999): 0.999 first reached at step 75 + 133.2 → 209
    (2, [0, 74, 75, 76, 175, 208, 209, 10_000], [0.0, 0.0, 0.0, 0.0075, 0.75, 0.9975, 0.999, 0.999]),
])
def test_nft_old_decay_schedules(decay_type, steps, expected):
    got = [nft_old_decay(s, decay_type) for s in steps]
    assert got == pytest.approx(expected)
    assert got == pytest.approx([released_return_decay(s, decay_type) for s in steps])
    with pytest.raises(ValueError, match="decay_type"):
        nft_old_decay(0, 3)


# ------------------------------------------------------------------------------------------------------------------
# §2 AWM
# ------------------------------------------------------------------------------------------------------------------
def test_awm_advantage_by_hand():
    """clip(A, ±5)/5·advantage_max."""
    a = torch.tensor([-7.0, -5.0, 2.5, 0.0, 7.0])
    torch.testing.assert_close(awm_advantage(a), torch.tensor([-1.0, -1.0, 0.5, 0.0, 1.0]))
    torch.testing.assert_close(awm_advantage(a, advantage_max=None), torch.tensor([-5.0, -5.0, 2.5, 0.0, 5.0]))
    torch.testing.assert_close(awm_advantage(a, advantage_max=2.0), torch.tensor([-2.0, -2.0, 1.0, 0.0, 2.0]))


@pytest.mark.parametrize("kind,expected", [
    # v − target = [4, 4] → ℓ = 16; t = 0.5; p = 0.25: (16 + 1e-10)^0.25 ≈ 2, (1e-10)^0.25 = 10^−2.5
    ("ghuber", -((16 + 1e-10) ** 0.25 - 10 ** -2.5) * 0.5 / 0.25),
    ("Uniform", -16.0),
    ("t", -8.0),
    ("t**2", -4.0),
    ("huber", -(math.sqrt(16 + 1e-10) - 1e-5) * 0.5),
])
def test_awm_log_prob_by_hand(kind, expected):
    v = torch.tensor([[5.0, 1.0]])
    target = torch.tensor([[1.0, -3.0]])
    lp = awm_log_prob(v, target, 0.5, kind=kind)
    assert lp.dtype == torch.float64 and lp.shape == (1,)
    assert lp.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["ghuber", "Uniform", "t", "t**2", "huber"])
def test_awm_log_prob_matches_the_released_lines(kind):
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(6, 4, 3, 3, generator=gen)
    eps = torch.randn(6, 4, 3, 3, generator=gen)
    v = (eps - x0 + 0.7 * torch.randn(6, 4, 3, 3, generator=gen)).to(torch.bfloat16)
    t = torch.rand(6, generator=gen)
    ours = awm_log_prob(v, eps.double() - x0.double(), t, kind=kind, p=0.25)
    ref = released_awm_log_prob(v, eps, x0, t, kind, 0.25)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


def test_awm_on_policy_gradient_is_adv_times_weight_gradient():
    """On-policy ρ ≡ 1, so ∇_v loss = −mean_i A_i ∇ log p_i = mean_i A_i ∇w(ℓ_i, t_i). For ghuber
    w = ((ℓ + 1e-10)^p − c)·t/p, ∂w/∂ℓ = t (ℓ + 1e-10)^(p − 1), ∂ℓ/∂v = 2 (v − target)/D, so
    ∂loss/∂v_i = A_i t_i (ℓ_i + 1e-10)^(p − 1)·2 (v_i − target_i)/(D N); for Uniform, A_i·2 (v_i − target_i)/(D N)."""
    gen = torch.Generator().manual_seed(3)
    N, D, p = 6, 8, 0.25
    target = torch.randn(N, 2, 2, 2, generator=gen, dtype=torch.float64)
    v = (target + torch.randn(N, 2, 2, 2, generator=gen, dtype=torch.float64)).requires_grad_(True)
    t = torch.linspace(0.2, 0.9, N, dtype=torch.float64)
    adv = awm_advantage(torch.randn(N, generator=gen) * 3).double()
    diff = (v - target).detach()
    ell = (diff**2).reshape(N, -1).mean(1)
    for kind, dw_dl in [("ghuber", t * (ell + 1e-10) ** (p - 1)), ("Uniform", torch.ones(N, dtype=torch.float64))]:
        lp = awm_log_prob(v, target, t, kind=kind, p=p)
        loss, st = awm_policy_loss(lp, lp.detach(), adv, clip_range=1.0)
        (g,) = torch.autograd.grad(loss, v)
        expected = (adv * dw_dl).view(-1, 1, 1, 1) * 2 * diff / (D * N)
        torch.testing.assert_close(g, expected.to(g.dtype), rtol=1e-5, atol=1e-10)
        assert st["ratio_mean"].item() == 1.0 and st["clip_frac"].item() == 0.0
        torch.testing.assert_close(loss, -adv.mean())


def test_awm_policy_loss_clipping_by_hand():
    """c = 0.2; rows (A, ρ): (+1, 1.5) clipped, (+1, 0.5) not, (−1, 0.5) clipped, (−1, 1.5) not.
    max(−Aρ, −A clip ρ) = −1.2, −0.5, 0.8, 1.5 → mean 0.15; ∂/∂logp = −Aρ/N on unclipped rows, 0 else;
    |ρ − 1| > c on all four → clip_frac 1."""
    ratio = torch.tensor([1.5, 0.5, 0.5, 1.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    lp = torch.log(ratio).requires_grad_(True)
    loss, st = awm_policy_loss(lp, torch.zeros(4, dtype=torch.float64), adv, clip_range=0.2)
    assert loss.item() == pytest.approx(0.15)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([0.0, -0.5 / 4, 0.0, 1.5 / 4], dtype=torch.float64))
    assert st["clip_frac"].item() == 1.0
    assert st["ratio_min"].item() == pytest.approx(0.5) and st["ratio_max"].item() == pytest.approx(1.5)


def test_awm_train_indices_released_default_strata():
    """14 steps, n = 6, frac 0.9: boundaries linspace(1, 12, 7) = [1, 2.83, 4.67, 6.5, 8.33, 10.17, 12] → strata
    [1,2) [2,4) [4,6) [6,8) [8,10) [10,12): index 0 (t = 1) and 12, 13 are never drawn; every index 1..11 is."""
    strata = [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    seen = set()
    for seed in range(200):
        idx = awm_train_indices(14, 6, 0.9, torch.Generator().manual_seed(seed))
        assert len(idx) == 6
        for j, (lo, hi) in zip(idx, strata):
            assert lo <= j < hi
        assert idx == released_discrete_wo_init(14, 0.9, 6, torch.Generator().manual_seed(seed))
        seen.update(idx)
    assert seen == set(range(1, 12))
    a = awm_train_indices(14, generator=torch.Generator().manual_seed(7))
    b = awm_train_indices(14, generator=torch.Generator().manual_seed(7))
    assert a == b


def test_awm_train_indices_ten_steps():
    """10 steps: M = 9, linspace(1, 9, 7) = [1, 2.33, 3.67, 5, 6.33, 7.67, 9] → strata [1,2) [2,3) [3,5) [5,6) [6,7)
    [7,9): M − 1 = 8 ≥ 6, so the released draw is used as is."""
    strata = [(1, 2), (2, 3), (3, 5), (5, 6), (6, 7), (7, 9)]
    for seed in range(50):
        idx = awm_train_indices(10, generator=torch.Generator().manual_seed(seed))
        assert all(lo <= j < hi for j, (lo, hi) in zip(idx, strata))
        assert idx == released_discrete_wo_init(10, 0.9, 6, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("num_steps,each_once,released", [
    # M = int(0.9 N); M − 1 < 6 eligible indices. The released strata collapse (floor b_j = floor b_{j+1}) and
    # yield their lower bound: linspace(1, M, 7) floored →
    (7, [1, 2, 3, 4, 5], [1, 1, 2, 3, 4, 5]),  # M = 6: floors [1, 1, 2, 3, 4, 5, 6]
    (6, [1, 2, 3, 4], [1, 1, 2, 3, 3, 4]),  # M = 5: floors [1, 1, 2, 3, 3, 4, 5]
    (4, [1, 2], [1, 1, 1, 2, 2, 2]),  # M = 3: floors [1, 1, 1, 2, 2, 2, 3]
    (3, [1], [1, 1, 1, 1, 1, 1]),  # M = 2
])
def test_awm_train_indices_short_grids(num_steps, each_once, released):
    gen = torch.Generator().manual_seed(0)
    assert awm_train_indices(num_steps, generator=gen) == each_once
    for seed in range(20):
        got = awm_train_indices(num_steps, generator=torch.Generator().manual_seed(seed), short="released")
        assert got == released
        assert got == released_discrete_wo_init(num_steps, 0.9, 6, torch.Generator().manual_seed(seed))


def test_awm_train_indices_no_eligible_index():
    with pytest.raises(ValueError, match="no index"):
        awm_train_indices(2)  # M = int(1.8) = 1


def test_awm_ema_decay_by_hand():
    """min(0.3, 0.001·step): linear up to step 300, flat after."""
    steps = [0, 1, 150, 299, 300, 301, 5000]
    assert [awm_ema_decay(s) for s in steps] == pytest.approx([0.0, 0.001, 0.15, 0.299, 0.3, 0.3, 0.3])
    assert awm_ema_decay(10, kind="constant") == 0.3


# ------------------------------------------------------------------------------------------------------------------
# AdvantageFlow
# ------------------------------------------------------------------------------------------------------------------
def test_advantageflow_loss_and_target_by_hand():
    """f = [1, 2], x0 = [0, 0], f_old = [1, 0], f_ref = [0, 2], A = 2, γ = 0.5, λ = 0.25 (D = 2):
    fit mean sq (1 + 4)/2 = 2.5 → ×2 = 5; old (0 + 4)/2 = 2 → ×0.5 = 1; ref (1 + 0)/2 = 0.5 → ×0.25 = 0.125;
    ℓ = 6.125. f* = (2·[0, 0] + 0.5·[1, 0] + 0.25·[0, 2]) / 2.75 = [2/11, 2/11]."""
    f = torch.tensor([[1.0, 2.0]])
    x0 = torch.zeros(1, 2)
    f_old = torch.tensor([[1.0, 0.0]])
    f_ref = torch.tensor([[0.0, 2.0]])
    adv = torch.tensor([2.0])
    loss, st = advantageflow_loss(f, x0, f_old, f_ref, adv, 0.5, 0.25)
    assert loss.item() == pytest.approx(6.125)
    assert st["fit"].item() == pytest.approx(5.0) and st["prox_old"].item() == pytest.approx(2.0)
    assert st["prox_ref"].item() == pytest.approx(0.5) and st["unstable_frac"].item() == 0.0
    torch.testing.assert_close(advantageflow_target(x0, f_old, f_ref, adv, 0.5, 0.25), torch.full((1, 2), 2 / 11))


def test_advantageflow_minimiser_is_stationary_and_a_minimum():
    gen = torch.Generator().manual_seed(4)
    B = 4
    x0, f_old, f_ref = (torch.randn(B, 2, 3, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    adv = torch.tensor([1.5, -0.3, 0.0, -0.9])  # negative A is fine while A + γ + λ > 0
    gamma, lam = 0.7, 0.4
    assert advantageflow_stable(adv, gamma, lam).all()
    fstar = advantageflow_target(x0, f_old, f_ref, adv, gamma, lam).double().requires_grad_(True)
    loss, _ = advantageflow_loss(fstar, x0, f_old, f_ref, adv, gamma, lam)
    (g,) = torch.autograd.grad(loss, fstar)
    assert g.abs().max().item() < 1e-6
    for seed in range(5):
        bump = 1e-2 * torch.randn(B, 2, 3, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        worse, _ = advantageflow_loss(fstar.detach() + bump, x0, f_old, f_ref, adv, gamma, lam)
        assert worse.item() > loss.item()


@pytest.mark.parametrize("adv,gamma,lam", [(1.0, 0.0, 0.0), (-1.0, 0.7, 0.4), (-1.0, 0.5, 0.4), (-1.0, 0.75, 0.25),
                                           (-2.0, 0.5, 0.5), (0.0, 0.1, 0.0)])
def test_advantageflow_convex_iff_a_plus_gamma_plus_lambda_positive(adv, gamma, lam):
    """B = 1, D = 1: ℓ(f) = A(f − x0)² + γ(f − f_old)² + λ(f − f_ref)² has ℓ'' = 2(A + γ + λ)."""
    x0, f_old, f_ref = torch.tensor([[0.3]]), torch.tensor([[-0.2]]), torch.tensor([[1.1]])
    a = torch.tensor([adv])

    def fn(f):
        return advantageflow_loss(f.view(1, 1), x0, f_old, f_ref, a, gamma, lam)[0]

    h = torch.autograd.functional.hessian(fn, torch.tensor([0.5])).item()
    assert h == pytest.approx(2 * (adv + gamma + lam), abs=1e-6)
    stable = bool(advantageflow_stable(a, gamma, lam).item())
    assert stable == (h > 1e-6)
    target = advantageflow_target(x0, f_old, f_ref, a, gamma, lam)
    assert bool(torch.isnan(target).all()) == (not stable)


def test_advantageflow_is_t_squared_velocity_least_squares():
    """f − x0 = x_t − t v − x0 = −t (v − (ε − x0)), and f − f_old = −t (v − v_old): the x0-space loss equals
    t²·(A‖v − target‖² + γ‖v − v_old‖² + λ‖v − v_ref‖²) (means over dims)."""
    gen = torch.Generator().manual_seed(5)
    x0, eps, v, v_old, v_ref = (torch.randn(3, 4, 2, 2, generator=gen, dtype=torch.float64) for _ in range(5))
    t = torch.tensor([0.3, 0.6, 0.9])
    adv = torch.tensor([1.0, -0.2, 0.5])
    xt = noised(x0, eps, t)
    f, fo, fr = (x0_from_velocity(xt, w, t) for w in (v, v_old, v_ref))
    loss, _ = advantageflow_loss(f, x0, fo, fr, adv, 0.5, 0.1)

    def md(z):
        return (z**2).reshape(3, -1).mean(1)

    tt = t.double()
    ref = (tt**2 * (adv.double() * md(v - (eps - x0)) + 0.5 * md(v - v_old) + 0.1 * md(v - v_ref))).mean()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_detached_inputs_get_no_gradient():
    """Only the current velocity (or f) is trained: old, reference, data and advantages are constants."""
    gen = torch.Generator().manual_seed(6)
    x0, eps, v_old = (torch.randn(2, 3, generator=gen).requires_grad_(True) for _ in range(3))
    v = torch.randn(2, 3, generator=gen, requires_grad=True)
    xt = noised(x0, eps, 0.5).detach().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, xt, x0, 0.5, torch.tensor([0.2, 0.9]), 1.0)
    loss.backward()
    assert v.grad is not None and v_old.grad is None and x0.grad is None and xt.grad is None
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    f_old = torch.randn(2, 3, requires_grad=True)
    l2, _ = advantageflow_loss(v, x0, f_old, f_old, adv, 1.0, 1.0)
    l2.backward()
    assert adv.grad is None and f_old.grad is None
    assert not math.isnan(loss.item())
