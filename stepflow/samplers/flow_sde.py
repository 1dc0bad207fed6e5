"""Flow-GRPO's SDE (method.md §2, paper Eq. 1): ``σ_d = a·sqrt(t/(1−t))``, Euler–Maruyama (``conf/sampler/flow_sde.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass

from stepflow.math.sde import flow_sde_std, flow_sde_step
from stepflow.samplers.base import Sampler, check_a, check_logprob, grid_times

__all__ = ["FlowSde"]


@dataclass
class FlowSde(Sampler):
    """a: the noise level, ``σ_d = a·sqrt(t/(1−t̃))`` (``t̃ = τ_1`` where ``t = 1``); logprob: the log-prob
    convention (:func:`stepflow.math.sde.gaussian_log_prob`)."""

    name = "flow_sde"
    noise_field = "sampler.a"

    a: float = 0.7
    logprob: str = "gaussian"

    def __post_init__(self) -> None:
        check_logprob(self.logprob)
        check_a(self.a)

    def std(self, t, t_next, t_guard=None):
        return flow_sde_std(*grid_times(t, t_next), self.a, t_guard)

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None):
        return flow_sde_step(x, v, t, t_next, a=self.a, t_guard=t_guard, noise=noise, prev_sample=prev_sample,
                             generator=generator, logprob=self.logprob)
