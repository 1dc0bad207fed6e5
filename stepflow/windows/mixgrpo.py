"""MixGRPO's progressive window as released (``conf/window/mixgrpo.yaml``; :func:`stepflow.math.window.mixgrpo_window`):
``range(cur, min(cur + size, T − 2))`` with ``cur`` moved by ``stride`` every ``every`` iterations; and
MixGRPO-Flash's post-window DPM-Solver++(2M) tail (``post_solver=dpmpp2m``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from stepflow.math.window import POST_SOLVERS, mixgrpo_window
from stepflow.windows.base import Window, check_int

__all__ = ["MixGrpo"]


@dataclass
class MixGrpo(Window):
    """start: the first position (in 0..T − 3); size: steps in the window (it shrinks at the end of the grid);
    stride: steps moved at each shift (0 = a frozen window, MixGRPO-Flash*); every: iterations between shifts;
    roll_back: past the last position (T − 2) the window restarts at ``start`` (MixGRPO's ``--roll_back``, which every
    released script passes), else it stays there, empty, for the rest of the run; post_solver: the ODE after the
    window's last step: ``euler`` (MixGRPO; the grid's own steps) | ``dpmpp2m`` (MixGRPO-Flash, ``--dpm_algorithm_type
    dpmsolver++ --dpm_apply_strategy post``: DPM-Solver++(2M) on a compressed grid of ``int(max((T − last)·
    post_compress_ratio, 1))`` points; only the final latent is kept, so it needs uniform credit);
    post_compress_ratio: ``--dpm_post_compress_ratio`` (0.4 in ..._MixGRPO_Flash.sh, 0.2 in ..._MixGRPO_Flash*.sh)."""

    name = "mixgrpo"

    start: int = 0
    size: int = 4
    stride: int = 1
    every: int = 25
    roll_back: bool = True
    post_solver: str = "euler"
    post_compress_ratio: float = 0.4

    def __post_init__(self) -> None:
        check_int("size", self.size, 1)
        check_int("stride", self.stride, 0)
        check_int("every", self.every, 1)
        check_int("start", self.start, 0)
        if not isinstance(self.roll_back, bool):
            raise ValueError(f"roll_back: must be true or false, got {self.roll_back!r}")
        if self.post_solver not in POST_SOLVERS:
            raise ValueError(f"post_solver: must be one of {', '.join(POST_SOLVERS)}, got {self.post_solver!r}")
        r = self.post_compress_ratio
        if not (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and 0 < r <= 1):
            raise ValueError(f"post_compress_ratio: must be a float > 0 and at most 1 (the fraction of the steps after the "
                             f"window that the DPM-Solver tail keeps; MixGRPO-Flash 0.4, Flash* 0.2), got {r!r}")

    def steps(self, iteration, num_steps, seed=0):
        return mixgrpo_window(self, iteration, num_steps)

    def union(self, num_steps):
        return list(range(self.start, num_steps - 2))  # the window's end is exclusive: it never holds T - 2, T - 1

    def tail(self, grid: Tensor, steps: list[int] | None, shift: float) -> Tensor | None:
        """``flash_grid(grid, last, post_compress_ratio, shift)[last + 1:]`` (:func:`stepflow.math.solvers.flash_grid`;
        ``last`` = the window's last step) for ``post_solver=dpmpp2m``; None for ``euler``, no window, or an
        **empty** window: that iteration rolls out all-Euler, as MixGRPO does (the released Flash crashes there,
        sampling_utils.py L44, which its 300 iterations never reach)."""
        if not self.keeps_states and steps:
            from stepflow.math.solvers import flash_grid

            last = max(steps)
            return flash_grid(grid, last, self.post_compress_ratio, shift)[last + 1:]
        return None

    @property
    def keeps_states(self) -> bool:
        return self.post_solver == "euler"
