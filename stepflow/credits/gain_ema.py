"""App. A: a per-step EMA baseline subtracted from the gains, then normalised (docs/method.md §6.1)."""

from __future__ import annotations

from stepflow.credits.gain import GainCredit
from stepflow.math.advantage import EmaBaseline

__all__ = ["GainEma"]


class GainEma(GainCredit):
    """``G_k − b_k`` with the EMA baseline ``b_k ← α·b_k + (1−α)·mean_i G_k`` (:class:`stepflow.math.advantage.EmaBaseline`:
    the batch is centred by the baseline before it sees the batch); ``ema_alpha`` = α. Its state is checkpointed."""

    name = "gain_ema"

    def __init__(self, ema_alpha: float = 0.9, **fields):
        super().__init__(**fields)
        if not (isinstance(ema_alpha, (int, float)) and 0.0 <= ema_alpha < 1.0):
            raise ValueError(f"ema_alpha: must be a float in [0, 1), got {ema_alpha!r}")
        self.ema_alpha = ema_alpha
        self.ema = EmaBaseline(ema_alpha)

    def signal(self, g):
        return self.ema(g)

    def state_dict(self):
        return {"ema": self.ema.state_dict()}

    def load_state_dict(self, state):
        if "ema" in state:
            self.ema.load_state_dict(state["ema"])
