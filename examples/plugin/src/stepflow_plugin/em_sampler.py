"""A rollout sampler: Euler–Maruyama with a constant noise level ``sigma`` (``sampler=em_sde``).

One step from t to s = t − Δt (rectified flow, ``v = ε − x0``, t = 1 noise):

    x_s ~ N(mean, std² I),  mean = x_t − Δt·v,  std = sigma·sqrt(Δt)

The mean is the ODE's Euler drift alone: there is **no score correction**, so unlike Flow-GRPO's SDE
(``sampler=flow_sde``) this SDE does not preserve the ODE's marginals; the added noise is not removed later and the
samples are noisier than the model's for any sigma > 0. The step into t = 0 (the last one) is deterministic
(std 0, log-prob 0, not trainable), so the final image gets no noise of its own. The log-prob is the Gaussian's,
averaged over the non-batch dims (stepflow's convention, :func:`stepflow.sde.gaussian_log_prob`); ``kl_scale`` is
``std``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stepflow.samplers.base import Sampler, grid_times
from stepflow.sde import StepOut, gaussian_log_prob

__all__ = ["EulerMaruyama"]


def _per_row(t, b: int, device) -> torch.Tensor:
    """A time (float, 0-d or (B,)) as a (B,) fp32 tensor."""
    t = torch.as_tensor(t, dtype=torch.float32, device=device)
    return t.expand(b) if t.ndim == 0 else t.reshape(b)


def _rows(z: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, ..., 1) to broadcast against ``like``."""
    return z.view(-1, *([1] * (like.ndim - 1)))


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
        x, v = x.float(), v.float()
        if x.shape != v.shape:
            raise ValueError(f"v: expected shape {tuple(x.shape)}, got {tuple(v.shape)}")
        b = x.shape[0]
        tt, ss = _per_row(t, b, x.device), _per_row(t_next, b, x.device)
        mean = x - _rows(tt - ss, x) * v
        std = self.std(tt, ss).to(x.device)
        if prev_sample is not None:
            nxt = prev_sample.float()
            if nxt.shape != mean.shape:
                raise ValueError(f"prev_sample: expected shape {tuple(mean.shape)}, got {tuple(nxt.shape)}")
        else:
            if noise is None:
                noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            elif noise.shape != mean.shape:
                raise ValueError(f"noise: expected shape {tuple(mean.shape)}, got {tuple(noise.shape)}")
            nxt = mean + _rows(std, mean) * noise.float()
        log_prob = gaussian_log_prob(nxt, mean, std)
        return StepOut(next=nxt, mean=mean, std=std, log_prob=log_prob, trainable=std > 0, kl_scale=std)

    def describe(self) -> str:
        return f"{self.name} (sigma={self.sigma:g})"
