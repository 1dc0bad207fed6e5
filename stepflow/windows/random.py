"""A random subset of timesteps (``conf/window/random.yaml``): ``size`` steps drawn anew every iteration from
``[start, T)``, the same for every sample (MixGRPO-random semantics; not DanceGRPO's per-sample subset)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stepflow.windows.base import Span, check_fits

__all__ = ["Random"]


@dataclass
class Random(Span):
    """start: the lowest step drawn; size: steps drawn (seeded by the run's seed and the iteration)."""

    name = "random"

    def steps(self, iteration, num_steps, seed=0):
        check_fits(self.start, self.size, num_steps, first=1)
        rng = np.random.default_rng([seed, iteration, 7_771])
        return sorted(int(k) for k in rng.choice(np.arange(self.start, num_steps), size=self.size, replace=False))

    def union(self, num_steps):
        return list(range(self.start, num_steps))
