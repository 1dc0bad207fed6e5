"""Flow-GRPO-Fast's SDE window (``conf/window/fixed.yaml``): steps ``[start, start + size)`` every iteration."""

from __future__ import annotations

from dataclasses import dataclass

from stepflow.windows.base import Window, check_fits, check_int

__all__ = ["Fixed"]


@dataclass
class Fixed(Window):
    """start: the window's first step; size: its steps."""

    name = "fixed"

    start: int = 0
    size: int = 3

    def __post_init__(self) -> None:
        check_int("size", self.size, 1)
        check_int("start", self.start, 0)

    def steps(self, iteration, num_steps, seed=0):
        check_fits(self.start, self.size, num_steps)
        return list(range(self.start, self.start + self.size))

    def union(self, num_steps):
        return list(range(self.start, self.start + self.size))
