"""Coefficients-preserving sampling (FlowCPS, method.md §3.3): ``std = s·sin(η π/2)``,
``μ = x̂0(1−s) + x̂1·sqrt(s² − std²)`` (``conf/sampler/cps.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass

from stepflow.math.sde import cps_std, cps_step
from stepflow.samplers.base import Sampler, check_eta, check_logprob, grid_times

__all__ = ["Cps"]


@dataclass
class Cps(Sampler):
    """eta: η in [0, 1]; logprob: FlowCPS's constant-free ``cps_constfree`` (−mean_dims (x_s − μ)²) by default, or
    the Gaussian density of the same step."""

    name = "cps"
    noise_field = "sampler.eta"

    eta: float = 0.9
    logprob: str = "cps_constfree"

    def __post_init__(self) -> None:
        check_logprob(self.logprob)
        check_eta(self.eta)

    def std(self, t, t_next, t_guard=None):
        return cps_std(*grid_times(t, t_next), self.eta)

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None):
        return cps_step(x, v, t, t_next, eta=self.eta, noise=noise, prev_sample=prev_sample, generator=generator,
                        logprob=self.logprob)
