"""Gradient coherence (stepflow.math.coherence): closed forms, a Monte-Carlo check, and the per-step gradients of a real
(tiny) GRPO module."""

from __future__ import annotations

import math

import pytest
import torch

from stepflow.core.algorithm import step_gradients
from stepflow.math.coherence import mean_pairwise_cosine, signal_fraction
from stepflow.testing.harness import compose_config


def test_cosine_closed_forms():
    v = torch.randn(50)
    assert mean_pairwise_cosine(torch.stack([v, 2 * v, 3 * v])) == pytest.approx(1.0)
    assert mean_pairwise_cosine(torch.stack([v, -v])) == pytest.approx(-1.0)
    assert mean_pairwise_cosine(torch.eye(4)) == pytest.approx(0.0)
    # three unit vectors at 120 degrees: every pair has cosine -1/2
    a = [torch.tensor([math.cos(2 * math.pi * i / 3), math.sin(2 * math.pi * i / 3)]) for i in range(3)]
    assert mean_pairwise_cosine(torch.stack(a)) == pytest.approx(-0.5)
    assert signal_fraction(torch.stack([v, v, v])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="g: expected"):
        signal_fraction(torch.randn(1, 5))
    with pytest.raises(ValueError, match="g: expected"):
        mean_pairwise_cosine(torch.randn(5))


@pytest.mark.parametrize("rho", [0.0, 0.05, 0.3])
def test_signal_fraction_monte_carlo(rho):
    """g_i = mu + sigma n_i with |mu|^2 / (|mu|^2 + sigma^2 D) = rho: both estimators recover rho."""
    gen = torch.Generator().manual_seed(0)
    d, n = 20000, 16
    mu = torch.randn(d, generator=gen)
    mu = mu / mu.norm() * math.sqrt(rho * d)
    sigma = math.sqrt(1 - rho)  # E|noise|^2 = (1 - rho) d, E|g|^2 = d
    g = mu + sigma * torch.randn(n, d, generator=gen, dtype=torch.float64).float()
    # the pair-mean has std ~ sqrt(2 / (n (n-1) D)) around rho (noise-noise products)
    assert signal_fraction(g) == pytest.approx(rho, abs=0.01)
    assert mean_pairwise_cosine(g) == pytest.approx(rho, abs=0.01)


def test_step_gradients_are_the_loss_gradients_and_leave_weights_alone(tmp_path):
    """Linear in the advantages (on-policy ratio = 1, β = 0), zero for zero advantages, one row per step, weights
    unchanged and LoRA grads cleared afterwards."""
    from stepflow.core.rollout import rollout
    from stepflow.train import build_module

    module = build_module(compose_config("train", ["experiment=smoke"]), tmp_path)
    lr, pol, lp = module.learner, module.policy, module.loop
    plan = lr.plan.plan(0)
    traj = rollout(pol, plan, lr.sampler, lp.num_steps, 1.0)
    # any advantages (B, T) do: both signs, every step
    adv = torch.randn((traj.batch_size, lp.num_steps), generator=torch.Generator().manual_seed(0))
    steps = [k for k in range(lp.num_steps) if bool(traj.trainable[:, k].all())]
    before = [p.detach().clone() for p in pol.lora_parameters()]
    g1 = step_gradients(lr, traj, adv, steps)
    g2 = step_gradients(lr, traj, 2 * adv, steps)
    g0 = step_gradients(lr, traj, torch.zeros_like(adv), steps)
    assert g1.shape == (len(steps), sum(p.numel() for p in pol.lora_parameters()))
    assert bool((g1.norm(dim=1) > 0).all())
    torch.testing.assert_close(g2, 2 * g1, rtol=1e-4, atol=1e-9)
    assert float(g0.abs().max()) == 0.0
    for b, p in zip(before, pol.lora_parameters()):
        assert torch.equal(b, p.detach()) and p.grad is None
    # independent reference: on-policy (ratio 1) the GRPO gradient of step k is -mean_i A_ik grad log pi(x_k+1 | x_k)
    from stepflow.math.sde import sde_step

    k = steps[0]
    params = list(pol.lora_parameters())
    pol.train()
    v = pol.velocity(traj.latents[:, k], traj.times[k], traj.cond, 1.0)
    out = sde_step(lr.sampler, traj.latents[:, k], v, traj.times[k], traj.times[k + 1],
                   t_guard=traj.times[1], prev_sample=traj.latents[:, k + 1])
    ref = torch.autograd.grad(-(adv[:, k] * out.log_prob).mean(), params, allow_unused=True)
    ref = torch.cat([(r if r is not None else torch.zeros_like(p)).flatten() for r, p in zip(ref, params)])
    torch.testing.assert_close(g1[0], ref, rtol=1e-4, atol=1e-10)


def test_grad_coherence_experiment_writes_json_and_png(tmp_path):
    """experiments/grad_coherence.py end to end on the smoke config: per-step rho for both schemes, a PNG."""
    import json

    mod = _grad_coherence_module()
    res = mod.main(["--batches", "2", "--out", str(tmp_path), "experiment=smoke"])
    saved = json.loads((tmp_path / "coherence.json").read_text())
    assert (tmp_path / "coherence.png").stat().st_size > 1000
    assert saved["steps"] == res["steps"] and len(saved["steps"]) >= 1
    for scheme in ("gain", "uniform"):
        r = saved["schemes"][scheme]
        assert len(r["rho_per_step"]) == len(r["grad_norm_per_step"]) == len(saved["steps"])
        assert all(-1.0 <= x <= 1.0 for x in r["rho_per_step"])


def _grad_coherence_module():
    from helpers.experiments import load_experiment

    return load_experiment("grad_coherence")


def test_weighted_update_closed_forms():
    """The combined every-step update of each weighting, against the definitions written out here:
    noise w_k = σ_k / mean σ; grad_rms: every weighted step has the RMS norm; gain_var w_k = Var G_k / mean Var."""
    mod = _grad_coherence_module()
    g = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * torch.tensor([[1.0], [3.0], [0.2]])
    stds = torch.tensor([0.4, 0.2, 0.1])
    gains = torch.tensor([[0.0, 1.0, 0.0], [2.0, -1.0, 0.0], [1.0, 0.0, 0.0]])
    upd, w = mod.weighted_update(g, "none", stds, gains)
    torch.testing.assert_close(upd, g.mean(0))
    upd, w = mod.weighted_update(g, "noise", stds, gains)
    torch.testing.assert_close(upd, (g[0] * 0.4 + g[1] * 0.2 + g[2] * 0.1) / (0.7 / 3) / 3)
    upd, w = mod.weighted_update(g, "grad_rms", stds, gains)
    rms = float(g.norm(dim=1).pow(2).mean().sqrt())
    torch.testing.assert_close((w[:, None] * g).norm(dim=1), torch.full((3,), rms))
    upd, w = mod.weighted_update(g, "gain_var", stds, gains)
    var = torch.tensor([2 / 3, 2 / 3, 0.0])  # population variances of the columns
    torch.testing.assert_close(w, var / var.mean())


def test_grad_coherence_weightings_end_to_end(tmp_path):
    """--weightings on the smoke config: shares sum to 1; grad_rms makes every step's share 1/S; noise's shares are
    σ_k²·E|g_k|² normalised; at ratio 1 (β = 0) GRPO-Guard's gradient is step k's log-prob gradient times σ_k, so its
    per-step ρ̂ equals the unweighted one while its shares follow σ_k²; a weightings.png."""
    import json

    mod = _grad_coherence_module()
    ws = "none,noise,guard,grad_rms,gain_var"
    res = mod.main(["--batches", "2", "--schemes", "gain", "--weightings", ws, "--out", str(tmp_path),
                    "experiment=smoke", "train.beta_kl=0"])
    saved = json.loads((tmp_path / "coherence.json").read_text())
    assert (tmp_path / "weightings.png").stat().st_size > 1000
    r = saved["weightings"]
    assert list(r) == ws.split(",")
    S = len(res["steps"])
    assert S >= 2
    for w in r.values():
        assert abs(sum(w["share_per_step"]) - 1) < 1e-5 and -1 <= w["rho_update"] <= 1
    torch.testing.assert_close(torch.tensor(r["grad_rms"]["share_per_step"]), torch.full((S,), 1 / S))
    torch.testing.assert_close(torch.tensor(r["guard"]["rho_per_step"]), torch.tensor(r["none"]["rho_per_step"]),
                               rtol=1e-3, atol=1e-4)
    none_sq = torch.tensor(r["none"]["share_per_step"], dtype=torch.float64)
    noise_sq = torch.tensor(r["noise"]["share_per_step"], dtype=torch.float64)
    guard_sq = torch.tensor(r["guard"]["share_per_step"], dtype=torch.float64)
    # noise and guard both scale step k by ∝ σ_k, so their shares agree, and differ from unweighted unless σ is flat
    torch.testing.assert_close(noise_sq, guard_sq, rtol=1e-3, atol=1e-5)
    ratio = noise_sq / none_sq
    assert float(ratio.max() / ratio.min()) > 1.01
