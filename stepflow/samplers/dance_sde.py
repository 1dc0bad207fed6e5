"""DanceGRPO's SDE (method.md §2.1): the Flow-GRPO Euler–Maruyama step with a constant diffusion coefficient η,
``std = η·sqrt(Δt)`` (``conf/sampler/dance_sde.yaml``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from stepflow.math.sde import dance_sde_std, dance_sde_step
from stepflow.samplers.base import Sampler, check_logprob, grid_times

__all__ = ["DanceSde"]


@dataclass
class DanceSde(Sampler):
    """eta: the diffusion coefficient (>= 0, not capped at 1; DanceGRPO's released 0.3); logprob: the log-prob
    convention (the released one is the Gaussian, constants kept)."""

    name = "dance_sde"
    noise_field = "sampler.eta"

    eta: float = 0.3
    logprob: str = "gaussian"

    def __post_init__(self) -> None:
        check_logprob(self.logprob)
        if not (isinstance(self.eta, (int, float)) and math.isfinite(self.eta) and self.eta >= 0):
            raise ValueError(f"eta: must be a finite float >= 0 for dance_sde, got {self.eta!r}")

    def std(self, t, t_next, t_guard=None):
        return dance_sde_std(*grid_times(t, t_next), self.eta)

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None):
        return dance_sde_step(x, v, t, t_next, eta=self.eta, noise=noise, prev_sample=prev_sample,
                              generator=generator, logprob=self.logprob)
