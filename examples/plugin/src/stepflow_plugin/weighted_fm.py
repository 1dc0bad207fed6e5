"""An objective: advantage-weighted flow matching on the rollout's final samples (``objective=weighted_fm``).

Each row's final latent x0 = X_T is re-noised at K grid times t of its own, ``x_t = (1 − t)·x0 + t·ε`` with fresh
ε ~ N(0, I), and the model's velocity is regressed onto the flow-matching target ε − x0, each row weighted by its
advantage:

    L = mean_i w_i · ‖v_θ(x_t, t) − (ε − x0)‖²,   w_i = sigmoid(A_i / temperature)   (+ train.beta_kl · KL)

with ‖·‖² the mean over the latent's dims, A_i the row's advantage at the grid step of its time and KL the mean
squared distance to the reference policy's velocity (``ForwardObjective.kl_terms``, only when train.beta_kl > 0).
Rows with A > 0 are pulled toward their samples harder than rows with A < 0 (w ∈ (0, 1); A = 0 gives 1/2). It reads
no log-prob, so any rollout sampler works (ODE included).
"""

from __future__ import annotations

import math

import torch

from stepflow.objectives.base import ForwardObjective

__all__ = ["WeightedFM", "weighted_fm_loss"]


def weighted_fm_loss(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, adv: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, weights): ``mean_i w_i·mean_dims (v_i − (ε_i − x0_i))²``, ``w = sigmoid(A/temperature)``.
    v (with grad), x0, eps: (B, ...); adv: (B,)."""
    w = torch.sigmoid(adv.float() / temperature).detach()
    err = ((v.float() - (eps.float() - x0.float())) ** 2).flatten(1).mean(1)  # (B,)
    return (w * err).mean(), w


class WeightedFM(ForwardObjective):
    """Advantage-weighted flow matching (module docstring).

    num_times: K, the grid times per row (at most the number of candidate steps), drawn without replacement per row;
    temperature: of the sigmoid weight (> 0; small: nearly 0/1 weights, large: nearly uniform 1/2).
    The candidate steps are ``train.train_steps`` or, when null, every step of the grid. The common objective fields
    (``rollout_sampler``, ``same_latent``, and ``adv_clip_max``, which this objective does not read) are forwarded to
    :class:`stepflow.objectives.base.ForwardObjective`."""

    name = "weighted_fm"

    def __init__(self, num_times: int = 2, temperature: float = 1.0, **common):
        super().__init__(**common)
        if not (isinstance(num_times, int) and not isinstance(num_times, bool) and num_times >= 1):
            raise ValueError(f"num_times: must be an integer >= 1, got {num_times!r}")
        if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature: must be a finite float > 0, got {temperature!r}")
        self.num_times, self.temperature = num_times, float(temperature)

    def trained_steps(self, train, sampler, grid, window):
        """The grid steps the times are drawn among (no density is read, so noise-free steps count too)."""
        t_steps = grid.shape[0] - 1
        return list(train.train_steps) if train.train_steps is not None else list(range(t_steps))

    def num_terms(self, steps):
        return max(1, min(self.num_times, len(steps)))

    def draw_indices(self, steps, gen, shared):
        """K distinct grid indices among ``steps``, drawn with the row's own generator."""
        perm = torch.randperm(len(steps), generator=gen)[: self.num_terms(steps)]
        return torch.tensor(steps, dtype=torch.long)[perm]

    def loss(self, learner, traj, adv, term, rows, times, x0_hat):
        x0, eps, t, x_t, cond, a = self.point(learner, traj, adv, term, rows, times)
        v_ref = self.velocity_under(learner, None, x_t, t, cond) if self.train.beta_kl > 0 else None
        v = learner.policy.velocity(x_t, t, cond, learner.guidance)
        fm, w = weighted_fm_loss(v, x0, eps, a, self.temperature)
        kl, kd = self.kl_terms(learner, v, v_ref)
        # every key but "loss" is a detached diagnostic, logged as train/<key>
        return {"loss": fm + kl, "wfm_loss": fm.detach(), "wfm_weight_mean": w.mean(), **kd}
