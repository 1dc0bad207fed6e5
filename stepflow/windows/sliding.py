"""stepflow's simplified progressive window, after MixGRPO (``conf/window/sliding.yaml``): ``size`` steps moved by
``stride`` every ``every`` iterations from ``start`` up to the last position (``T − size``), then held there."""

from __future__ import annotations

from dataclasses import dataclass

from stepflow.windows.base import Window, check_fits, check_int

__all__ = ["Sliding"]


@dataclass
class Sliding(Window):
    """start: the first position; size: steps in the window; stride: steps moved at each shift; every: iterations
    between shifts."""

    name = "sliding"

    start: int = 0
    size: int = 3
    stride: int = 1
    every: int = 10

    def __post_init__(self) -> None:
        check_int("size", self.size, 1)
        check_int("stride", self.stride, 1)
        check_int("every", self.every, 1)
        check_int("start", self.start, 0)

    def steps(self, iteration, num_steps, seed=0):
        check_fits(self.start, self.size, num_steps)
        lo = min(self.start + (iteration // self.every) * self.stride, num_steps - self.size)
        return list(range(lo, lo + self.size))

    def union(self, num_steps):
        return list(range(self.start, num_steps))  # it moves up to the last position and holds there
