"""Flow-GRPO-Fast's window as released (``conf/window/random_start.yaml``): ``size`` consecutive steps at a start
drawn anew every iteration, the window inside ``[start, end)`` (``start = random.randint(range[0], range[1] − size)``,
window_range (0, 5), window_size 3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stepflow.windows.base import Window, check_fits, check_int

__all__ = ["RandomStart"]


@dataclass
class RandomStart(Window):
    """start, end: the window lies in ``[start, end)`` (Flow-GRPO-Fast's window_range (0, 5); end null = the grid's end T);
    size: its consecutive steps."""

    name = "random_start"

    start: int = 0
    end: int | None = 5
    size: int = 3

    def __post_init__(self) -> None:
        check_int("size", self.size, 1)
        check_int("start", self.start, 0)
        if self.end is not None and not (isinstance(self.end, int) and not isinstance(self.end, bool)
                                         and self.end >= self.start + self.size):
            raise ValueError(f"end: must be null or an integer >= start + size = {self.start + self.size} (the window "
                             f"[start, start + size) must fit below it), got {self.end!r}")

    def steps(self, iteration, num_steps, seed=0):
        check_fits(self.start, self.size, num_steps)
        end = num_steps if self.end is None else self.end
        if end > num_steps:
            raise ValueError(f"window.end: {end} is past the {num_steps}-step grid (loop.num_steps); lower window.end "
                             f"or set it to null")
        rng = np.random.default_rng([seed, iteration, 7_772])
        lo = int(rng.integers(self.start, end - self.size + 1))  # inclusive of end - size, as python's randint
        return list(range(lo, lo + self.size))

    def union(self, num_steps):
        return list(range(self.start, num_steps if self.end is None else min(self.end, num_steps)))
