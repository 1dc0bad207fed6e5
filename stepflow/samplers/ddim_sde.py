"""The DDIM-style SDE (method.md §3.1, §3.3; paper Sec. 5.5, App. B):
``x_s = (1−s)·x̂0 + sqrt((s² − σ²)₊)·x̂1 + σ·ε`` (``conf/sampler/ddim_sde.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass

from stepflow.math.sde import ddim_sde_std, ddim_sde_step
from stepflow.samplers.base import Sampler, check_bool, check_eta, check_logprob, check_schedule, grid_times

__all__ = ["DdimSde"]


@dataclass
class DdimSde(Sampler):
    """eta: η in [0, 1]; schedule: ``eta_s_sqrt1mt`` σ = η s √(1−t) (the paper's) | ``eta_s`` σ = η s (B.2-a) |
    ``eta_t_sqrt1mt`` σ = η t √(1−t) (x̂1 coefficient clamped); first_step_guard: inside √(1−t) replace t = 1 by
    τ_1 so that step 0 is stochastic; logprob: the log-prob convention."""

    name = "ddim_sde"
    noise_field = "sampler.eta"

    eta: float = 0.9
    schedule: str = "eta_s_sqrt1mt"
    first_step_guard: bool = False
    logprob: str = "gaussian"

    def __post_init__(self) -> None:
        check_schedule(self.schedule)
        check_logprob(self.logprob)
        check_eta(self.eta)
        check_bool("first_step_guard", self.first_step_guard)

    def std(self, t, t_next, t_guard=None):
        return ddim_sde_std(*grid_times(t, t_next), self.eta, self.schedule, self.first_step_guard, t_guard)

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None):
        return ddim_sde_step(x, v, t, t_next, eta=self.eta, schedule=self.schedule,
                             first_step_guard=self.first_step_guard, t_guard=t_guard, noise=noise,
                             prev_sample=prev_sample, generator=generator, logprob=self.logprob)

    def describe(self) -> str:
        return f"{self.name} (schedule {self.schedule})"
