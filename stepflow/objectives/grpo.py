"""The reverse-process objectives: clipped GRPO on the rollout's SDE transitions, and gain-weighted ODE distillation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stepflow.core.rollout import model_velocity
from stepflow.math.loss import distill_loss, guard_log_ratio, policy_loss
from stepflow.math.sde import sde_step
from stepflow.objectives.base import Objective, need, policy_velocity, transition

__all__ = ["Grpo", "Distill"]


class Grpo(Objective):
    """``mean_i max(−A ρ, −A clip(ρ, 1 ± ϵ)) + β·KL(π_θ ‖ π_ref)`` with ρ the likelihood ratio of the rollout's
    X_{k+1} given X_k (docs/method.md §5; a merged step: X_{k+m} at τ_{k+m}, ``Trajectory.step_end``); ``train.weighting=guard`` replaces log ρ by GRPO-Guard's normalised one,
    ``guard_released`` also divides the step's surrogate by its Δt (GRPO-Guard as released, docs/method.md §12.1)."""

    name = "grpo"
    loss_fields = {"loss": ("train.lr", "train.clip_eps", "train.beta_kl"), "policy_loss": ("train.lr", "train.clip_eps"),
                   "kl": ("train.beta_kl", "train.kl_mode")}

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        o, pol, dev, k = self.train, learner.policy, learner.policy.device, term
        x_k, x_next, t, t_next, cond = transition(traj, rows, k, times, dev)  # a merged step: to τ_{k+m}
        vel = model_velocity(pol, cond, learner.guidance)  # a predictor-corrector step's own evaluations (lc_langevin)
        ref_mean = None
        if o.beta_kl > 0:  # before the policy's forward: FSDP2 must not run a module forward between a forward
            # with autograd and its backward (the no-grad forward reshards what the backward needs)
            with torch.no_grad(), pol.reference():  # π_ref: the LoRA disabled, or the frozen initial transformer
                v_ref = pol.velocity(x_k, t, cond, learner.guidance)
                ref_mean = sde_step(learner.sampler, x_k, v_ref, t, t_next, t_guard=times[1], prev_sample=x_next,
                                    velocity=vel).mean
        v = policy_velocity(learner, traj, k, rows, x_k, t, cond)  # kept by the rollout, or recomputed
        a = adv[rows, k].to(dev)
        out = sde_step(learner.sampler, x_k, v, t, t_next, t_guard=times[1], prev_sample=x_next, velocity=vel)
        lp, lp_old = out.log_prob, traj.log_probs[rows, k].to(dev)
        if learner.weighting.guard:  # GRPO-Guard: the noise-normalised log-ratio in place of log π_θ − log π_old
            old = sde_step(learner.sampler, x_k, traj.velocities[rows, k].to(dev), t, t_next, t_guard=times[1],
                           prev_sample=x_next)
            lp, lp_old = guard_log_ratio(x_next, out.mean, old.mean, out.std), torch.zeros_like(lp_old)
        lo = policy_loss(lp, lp_old, a, clip_eps=o.clip_eps, mean=out.mean, ref_mean=ref_mean, std=out.std,
                         kl_scale=out.kl_scale, beta=o.beta_kl, kl_mode=o.kl_mode,
                         policy_scale=learner.weighting.policy_scale(t, t_next))  # guard_released: 1/Δt
        return {"loss": lo.loss, "policy_loss": lo.policy_loss, "kl": lo.kl, "clip_frac": lo.clip_frac,
                "ratio_mean": lo.ratio_mean, "ratio_min": lo.ratio_min, "ratio_max": lo.ratio_max,
                "adv_abs": a.abs().mean().detach()}


class Distill(Objective):
    """Gain-weighted ODE progressive distillation (paper App. A, docs/method.md §6.3): the student's Tweedie x̂0 at
    (X_k, t_k) toward sg[x̂0 two steps later] (X_T beyond the end), weighted by the step's advantage. Trains the ODE's
    steps (no density needed); reads the x̂0 of every state k + 2."""

    name = "distill"
    loss_fields = {"loss": ("train.lr", "objective.weight", "objective.temperature")}
    needs_density = False
    drops_zero_advantage = False
    reads_estimates = True
    needs_stepwise_advantages = True  #: weights its targets by the gain advantages of every step

    def __init__(self, weight: str = "relu", temperature: float = 1.0, **common):
        super().__init__(**common)
        need(weight in ("relu", "signed", "exp"), f"weight: must be relu, signed or exp, got {weight!r}")
        need(isinstance(temperature, (int, float)) and temperature > 0, f"temperature: must be > 0, got {temperature}")
        self.weight, self.temperature = weight, temperature

    @property
    def uses_reference(self) -> bool:
        return False

    def states(self, trained: Sequence[int], num_steps: int) -> list[int]:
        return sorted({min(k + 2, num_steps) for k in trained})

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        dev, k = learner.policy.device, term
        x_k = traj.latents[rows, k].to(dev)
        t = times[k]
        v = policy_velocity(learner, traj, k, rows, x_k, t, traj.cond.index(rows).to(dev))
        a: Tensor = adv[rows, k].to(dev)
        target = x0_hat[rows, min(k + 2, traj.num_steps)].to(dev)
        loss = distill_loss(x_k - t * v, target, a, weight=self.cfg.weight, temperature=self.cfg.temperature)
        return {"loss": loss, "distill_loss": loss.detach()}
