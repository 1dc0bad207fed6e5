"""Stepwise-Flow-GRPO's credit (docs/method.md §5; paper Eq. 3, 5, App. C): each step's reward gain
``G_k = R_{k+1} − R_k`` as its advantage, normalised jointly over group × steps (or per step)."""

from __future__ import annotations

import torch

from stepflow.credits.base import Credit
from stepflow.math.advantage import gains, group_normalize, normalize_per_step

__all__ = ["GainCredit", "Gain"]

NORMS = (None, "joint", "per_step")


class GainCredit(Credit):
    """The gain family's shared normalisation: ``norm`` None | joint (Eq. 5, over group × steps) | per_step
    (App. C: each step's column within its group). Subclasses say what they normalise (:meth:`signal`)."""

    default_norm = "joint"

    def __init__(self, norm: str | None = None, **common):
        super().__init__(**common)
        if norm not in NORMS:
            raise ValueError(f"norm: must be one of {NORMS}, got {norm!r}")
        self.norm = norm

    @property
    def effective_norm(self) -> str:
        return self.norm if self.norm is not None else self.default_norm

    def normalize(self, values, group_ids):
        fn = group_normalize if self.effective_norm == "joint" else normalize_per_step
        return fn(values, group_ids, std_scope=self.std_scope, eps=self.eps, unbiased=self.unbiased_std)

    def signal(self, g):
        """What is normalised, from the gains (B, T) float64: the gains themselves."""
        return g

    def advantages(self, rewards, group_ids, num_steps, trained):
        g = gains(rewards.detach().to(torch.float64))
        return self.normalize(self.signal(g), group_ids), g, {}


class Gain(GainCredit):
    """The gains normalised over every step (``over=all``, Eq. 5), or over the trained steps only (``over=trained``:
    a trained step's advantage then reads only the states around it, so the loop estimates and scores just those
    and stops the rollout after the last one)."""

    name = "gain"

    def __init__(self, over: str = "all", **fields):
        super().__init__(**fields)
        if over not in ("all", "trained"):
            raise ValueError(f"over: must be all or trained, got {over!r}")
        self.over = over

    def states_needed(self, trained, num_steps):
        if self.over == "trained":
            return sorted({s for k in trained for s in (k, k + 1)})
        return super().states_needed(trained, num_steps)

    def gain_steps(self, trained):
        return list(trained) if self.over == "trained" else None

    def advantages(self, rewards, group_ids, num_steps, trained):
        if self.over != "trained":
            return super().advantages(rewards, group_ids, num_steps, trained)
        g = torch.zeros(rewards.shape[0], num_steps, dtype=torch.float64)
        adv = torch.zeros(rewards.shape[0], num_steps, dtype=torch.float32)
        if trained:
            g[:, trained] = (rewards[:, [k + 1 for k in trained]] - rewards[:, trained]).detach().to(torch.float64)
            adv[:, trained] = self.normalize(g[:, trained], group_ids)
        return adv, g, {}
