"""SDE windows: which denoising steps of an iteration are stochastic (and trained); the others follow the ODE.

A window is a pure function of the iteration (and the seed), so a resumed run draws the same windows (docs/method.md
§9). Kinds (the ``window`` config group):

- ``none``: every step follows the sampler (the paper);
- ``fixed``: steps ``[start, start + size)`` (Flow-GRPO-Fast's window);
- ``sliding``: MixGRPO's progressive window of ``size`` steps, moved by ``stride`` every ``every`` iterations from
  ``start`` up to the last position (``T − size``), then held there;
- ``random``: ``size`` steps drawn anew every iteration from ``[start, T)`` (DanceGRPO's random subset of timesteps).

Steps outside the window carry no log-prob and are never trained; the x̂0 estimates and rewards of their states are
still computed where the credit scheme reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WindowConfig", "window_steps", "WINDOWS"]

WINDOWS = ("none", "fixed", "sliding", "random")


@dataclass
class WindowConfig:
    """The SDE window (see the module docstring)."""

    kind: str = "none"  #: none | fixed | sliding | random
    start: int = 0  #: first step of the window (sliding: its first position; random: the lowest step drawn)
    size: int = 3  #: steps in the window
    stride: int = 1  #: sliding: steps moved at each shift
    every: int = 10  #: sliding: iterations between shifts

    def __post_init__(self) -> None:
        if self.kind not in WINDOWS:
            raise ValueError(f"kind: must be one of {', '.join(WINDOWS)}, got {self.kind!r}")
        for name in ("size", "stride", "every"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
        if not (isinstance(self.start, int) and self.start >= 0):
            raise ValueError(f"start: must be an integer >= 0, got {self.start!r}")


def window_steps(cfg: WindowConfig, iteration: int, num_steps: int, seed: int = 0) -> list[int] | None:
    """The stochastic steps of ``iteration`` on a ``num_steps``-step grid, sorted; None = every step (``none``)."""
    if cfg.kind == "none":
        return None
    if cfg.start + (cfg.size if cfg.kind != "random" else 1) > num_steps or cfg.size > num_steps - cfg.start:
        raise ValueError(f"window.size: start {cfg.start} + size {cfg.size} do not fit a {num_steps}-step grid "
                         f"(loop.num_steps); lower window.start or window.size")
    if cfg.kind == "fixed":
        lo = cfg.start
    elif cfg.kind == "sliding":
        lo = min(cfg.start + (iteration // cfg.every) * cfg.stride, num_steps - cfg.size)
    else:
        rng = np.random.default_rng([seed, iteration, 7_771])
        return sorted(int(k) for k in rng.choice(np.arange(cfg.start, num_steps), size=cfg.size, replace=False))
    return list(range(lo, lo + cfg.size))
