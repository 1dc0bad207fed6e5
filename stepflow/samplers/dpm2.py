"""DiffusionNFT's deterministic rollout sampler (``conf/sampler/dpm2.yaml``): multistep DPM-Solver++(2M) on the
x0-predictions ``x − t v`` (:mod:`stepflow.math.solvers`), first order at the first and the last step. No density."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepflow.math.sde import ode_step
from stepflow.math.solvers import dpm2_step, dpm_order
from stepflow.samplers.base import Sampler, grid_times

__all__ = ["Dpm2"]


@dataclass
class Dpm2(Sampler):
    """A rollout step ``k`` takes :func:`stepflow.math.solvers.dpm_order` (k, T) of the T-step grid with the x̂0 of the
    state before it (whichever step made that state). One step alone (:meth:`step`, no previous x̂0) is the Euler
    step of ``ode`` (= its own first-order step, DDIM η = 0, up to rounding)."""

    name = "dpm2"
    has_density = False
    multistep = True

    def std(self, t, t_next, t_guard=None):
        return torch.zeros_like(grid_times(t, t_next)[0])

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None):
        return ode_step(x, v, t, t_next, prev_sample=prev_sample)

    def rollout_step(self, x, v, k, times, *, noise, x0_prev):
        return dpm2_step(x, v, times[k], times[k + 1], order=dpm_order(k, len(times) - 1), x0_prev=x0_prev,
                         t_prev=times[k - 1] if k > 0 else None)
