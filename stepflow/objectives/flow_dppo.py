"""Flow-DPPO (arXiv 2606.11025): GRPO's ratio clipping replaced by an exact per-step Gaussian-KL trust-region mask.

As released in verl-project/verl-omni ``FlowDPPOLoss`` (verl_omni/trainer/diffusion/diffusion_algos.py L361-463,
commit a1139ba) and Tencent-Hunyuan/UniRL ``_flowdppo_kl_adv_loss`` (unirl/algorithms/flowdppo.py L54-138, commit
1a7b501): per row i of step k,

    ρ = exp(log π_θ − log π_old),   D = mean_dims (μ_θ − μ_old)² / (2 s²)   (s = σ_t·√Δt, the step's std)
    drop = (D ≥ ε_D) ∧ [(A > 0 ∧ ρ > 1) ∨ (A < 0 ∧ ρ < 1)]
    L_k = mean_i ( −A_i·ρ_i if not drop_i else 0 )

``add_kl_coefficient=False`` measures ``D = mean_dims (μ_θ − μ_old)² / 2`` instead. μ_old is the rollout's step mean
(re-made from the rollout's velocity: the same step, no extra NFE), s the sampler's step std (docs/method.md §15.7).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stepflow.math.loss import gaussian_kl
from stepflow.math.sde import sde_step
from stepflow.objectives.base import Objective, need, policy_velocity, transition

__all__ = ["FlowDppo", "dppo_divergence", "dppo_loss"]


def dppo_divergence(mean: Tensor, old_mean: Tensor, std: Tensor, add_kl_coefficient: bool = True) -> Tensor:
    """Per-row D (B,): ``mean_dims (μ_θ − μ_old)² / (2 std²)`` (the exact KL of two Gaussians of one std, per dim),
    or ``mean_dims (μ_θ − μ_old)² / 2`` without ``add_kl_coefficient``. mean, old_mean: (B, ...); std: (B,). Detached."""
    with torch.no_grad():
        if add_kl_coefficient:
            return gaussian_kl(mean.detach(), old_mean, std)
        return ((mean.detach() - old_mean) ** 2).reshape(mean.shape[0], -1).mean(dim=1) / 2


def dppo_loss(log_prob: Tensor, old_log_prob: Tensor, adv: Tensor, div: Tensor,
              threshold: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-DPPO's masked surrogate of one step (to be minimised): ``mean_i keep_i·(−A_i ρ_i)`` with ``keep = ¬drop``,
    ``drop = (D ≥ threshold) ∧ [(A > 0 ∧ ρ > 1) ∨ (A < 0 ∧ ρ < 1)]``. log_prob (with grad), old_log_prob, adv, div:
    (B,). Returns (loss 0-d, detached stats: the release's mask fractions and ratio statistics)."""
    adv = adv.detach().to(log_prob.dtype)
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped = -adv * ratio
    high = div >= threshold
    pos_rm = high & (ratio > 1.0) & (adv > 0)
    neg_rm = high & (ratio < 1.0) & (adv < 0)
    keep = (~(pos_rm | neg_rm)).detach()
    loss = torch.where(keep, unclipped, torch.zeros((), dtype=unclipped.dtype, device=unclipped.device)).mean()
    with torch.no_grad():
        r = ratio.detach()
        stats = {"masked_frac": (~keep).float().mean(), "kl_mask_frac": high.float().mean(),
                 "pos_rm_frac": pos_rm.float().mean(), "neg_rm_frac": neg_rm.float().mean(),
                 "dppo_kl": div.mean(), "ratio_mean": r.mean(), "ratio_min": r.min(), "ratio_max": r.max()}
    return loss, stats


class FlowDppo(Objective):
    """``mean_i keep_i·(−A ρ) + β·KL(π_θ ‖ π_ref)``: the Flow-DPPO mask (:func:`dppo_loss`) on the rollout's SDE
    transitions; ``kl_mask_threshold`` = ε_D (released 1e-5, on the per-dim mean), ``add_kl_coefficient`` divides the
    squared mean drift by 2 s² (True, released) or by 2. The KL to the reference is ``train.beta_kl`` (released 0)."""

    name = "flow_dppo"

    def __init__(self, kl_mask_threshold: float = 1e-5, add_kl_coefficient: bool = True, **common):
        super().__init__(**common)
        need(isinstance(kl_mask_threshold, (int, float)) and not isinstance(kl_mask_threshold, bool)
             and kl_mask_threshold > 0, f"kl_mask_threshold: must be a float > 0, got {kl_mask_threshold!r}")
        need(isinstance(add_kl_coefficient, bool), f"add_kl_coefficient: must be a bool, got {add_kl_coefficient!r}")
        self.kl_mask_threshold, self.add_kl_coefficient = float(kl_mask_threshold), add_kl_coefficient

    def requirements(self, s) -> list[str]:
        if s.train.weighting in ("guard", "guard_released"):
            return [f"train.weighting: {s.train.weighting} replaces the ratio GRPO clips, and objective=flow_dppo masks "
                    "the plain ratio instead of clipping it; set train.weighting=none (or another weighting)"]
        return []

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        o, pol, dev, k = self.train, learner.policy, learner.policy.device, term
        x_k, x_next, t, t_next, cond = transition(traj, rows, k, times, dev)  # a merged step: to τ_{k+m}
        ref_mean = None
        if o.beta_kl > 0:  # before the policy's forward (FSDP2: no module forward between a forward and its backward)
            with torch.no_grad(), pol.reference():
                v_ref = pol.velocity(x_k, t, cond, learner.guidance)
                ref_mean = sde_step(learner.sampler, x_k, v_ref, t, t_next, t_guard=times[1], prev_sample=x_next).mean
        v = policy_velocity(learner, traj, k, rows, x_k, t, cond)
        a = adv[rows, k].to(dev)
        out = sde_step(learner.sampler, x_k, v, t, t_next, t_guard=times[1], prev_sample=x_next)
        with torch.no_grad():  # μ_old: the rollout's own step mean, from its velocity (no NFE)
            old = sde_step(learner.sampler, x_k, traj.velocities[rows, k].to(dev), t, t_next, t_guard=times[1],
                           prev_sample=x_next)
        div = dppo_divergence(out.mean, old.mean, out.std, self.add_kl_coefficient)
        policy, st = dppo_loss(out.log_prob, traj.log_probs[rows, k].to(dev), a, div, self.kl_mask_threshold)
        kl = policy.new_zeros(())
        if ref_mean is not None:
            scale = out.std if o.kl_mode == "exact" else out.kl_scale
            kl = gaussian_kl(out.mean, ref_mean, scale).mean()
        loss = policy + o.beta_kl * kl if o.beta_kl > 0 else policy
        return {"loss": loss, "policy_loss": policy.detach(), "kl": kl.detach(), "clip_frac": st.pop("masked_frac"),
                **st, "adv_abs": a.abs().mean().detach()}
