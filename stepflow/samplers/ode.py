"""Deterministic Euler (``conf/sampler/ode.yaml``): no noise, no density, nothing trainable (distillation,
evaluation; and every rollout step outside an SDE window)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepflow.math.sde import ode_step
from stepflow.samplers.base import Sampler, grid_times

__all__ = ["Ode"]


@dataclass
class Ode(Sampler):
    """The Euler step ``x − Δt·v``: std 0, log_prob 0, untrainable."""

    name = "ode"
    has_density = False

    def std(self, t, t_next, t_guard=None):
        return torch.zeros_like(grid_times(t, t_next)[0])

    def step(self, x, v, t, t_next, *, t_guard=None, noise=None, prev_sample=None, generator=None):
        return ode_step(x, v, t, t_next, prev_sample=prev_sample)
