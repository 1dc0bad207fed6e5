"""A rollout sampler: Euler–Maruyama with a constant noise level ``sigma`` (``sampler=em_sde``).

One step from t to s = t − Δt (rectified flow, ``v = ε − x0``, t = 1 noise):

    x_s ~ N(mean, std² I),  mean = x_t − Δt·v,  std = sigma·sqrt(Δt)

The mean is the ODE's Euler drift alone: there is **no score correction**, so unlike Flow-GRPO's SDE
(``sampler=flow_sde``) this SDE does not preserve the ODE's marginals; the added noise is not removed later and the
samples are noisier than the model's for any sigma > 0. The step into t = 0 (the last one) is deterministic
(std 0, log-prob 0, not trainable), so the final image gets no noise of its own. The log-prob is the Gaussian's,
averaged over the non-batch dims (stepflow's convention, :func:`stepflow.math.sde.gaussian_log_prob`); ``kl_scale`` is
``std``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stepflow.math.sde import finish_step, prepare_step
from stepflow.samplers.base import Sampler, grid_times

__all__ = ["EulerMaruyama"]


@dataclass
class EulerMaruyama(Sampler):
    """Euler–Maruyama, ``std = sigma·sqrt(Δt)`` (0 on the step into t = 0), drift ``x − Δt·v`` without a score term.

    sigma: the constant noise level (>= 0; 0 is the Euler ODE, which trains nothing)."""

    name = "em_sde"
    noise_field = "sampler.sigma"  # named by the core's message when no step carries noise

    sigma: float = 0.5

    def __post_init__(self) -> None:
        s = self.sigma
        if not (isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0):
            raise ValueError(f"sigma: must be a finite float >= 0, got {s!r}")

    def std(self, t, t_next, t_guard=None):
        t, s = grid_times(t, t_next)
        return torch.where(s > 0, self.sigma * torch.sqrt((t - s).clamp(min=0)), torch.zeros_like(t))

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None):
        x, v, t, s = prepare_step(x, v, t, t_next)  # fp32, shapes checked, times (B,)
        mean = x - (t - s).view(-1, *([1] * (x.ndim - 1))) * v
        std = self.std(t, s).to(x.device)
        return finish_step(x, mean, std, std, noise=noise, prev_sample=prev_sample, generator=generator)

    def describe(self) -> str:
        return f"{self.name} (sigma={self.sigma:g})"
