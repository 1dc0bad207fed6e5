"""Flow-GRPO-Fast's SDE window (``conf/window/fixed.yaml``): steps ``[start, start + size)`` every iteration."""

from __future__ import annotations

from dataclasses import dataclass

from stepflow.windows.base import Span, check_fits

__all__ = ["Fixed"]


@dataclass
class Fixed(Span):
    """start: the window's first step; size: its steps."""

    name = "fixed"

    def steps(self, iteration, num_steps, seed=0):
        check_fits(self.start, self.size, num_steps)
        return list(range(self.start, self.start + self.size))

    def union(self, num_steps):
        return list(range(self.start, self.start + self.size))
