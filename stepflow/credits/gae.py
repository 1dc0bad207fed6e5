"""App. A: GAE over the gains (docs/method.md §6.2): γλ = 0 gives the gains, γλ = 1 gives R_T − R_k."""

from __future__ import annotations

from stepflow.credits.gain import GainCredit
from stepflow.math.advantage import gae

__all__ = ["Gae"]


class Gae(GainCredit):
    """``A_k = G_k + γλ·A_{k+1}`` (:func:`stepflow.math.advantage.gae`), then normalised; ``gamma``, ``lam`` in [0, 1]."""

    name = "gae"

    def __init__(self, gamma: float = 1.0, lam: float = 0.9, **fields):
        super().__init__(**fields)
        for name, v in (("gamma", gamma), ("lam", lam)):
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ValueError(f"{name}: must be a float in [0, 1], got {v!r}")
        self.gamma, self.lam = gamma, lam

    def signal(self, g):
        return gae(g, self.gamma, self.lam)
