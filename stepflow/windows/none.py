"""No window (``conf/window/none.yaml``): every denoising step follows the sampler (the paper)."""

from __future__ import annotations

from dataclasses import dataclass

from stepflow.windows.base import Window

__all__ = ["NoWindow"]


@dataclass
class NoWindow(Window):
    """Every step follows the sampler: :meth:`steps` and :meth:`union` are None."""

    name = "none"

    def steps(self, iteration, num_steps, seed=0):
        return None

    def union(self, num_steps):
        return None

    def check(self, num_steps):
        return None
