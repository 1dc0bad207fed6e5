"""A credit scheme: the final reward's centred rank within its prompt group (``advantage=rank``).

In a group of n samples, sample i's rank r_i ∈ 1..n is the average rank of its final reward R_T (ties share the mean
of the ranks they span, as ``scipy.stats.rankdata(method="average")``); its advantage is

    A_i = scale · (r_i − (n + 1)/2) / ((n − 1)/2)    ∈ [−scale, scale]

(0 in a group of one or a group whose rewards are all equal), the same at every step. It reads only R_T, so the loop
neither estimates nor scores intermediate states. No mean or std is taken: the common fields ``std_scope``, ``eps``
and ``unbiased_std`` have no effect; ``adv_clip`` still clamps.
"""

from __future__ import annotations

import math

import torch

from stepflow.credits.base import Credit

__all__ = ["RankCredit", "centred_ranks"]


def centred_ranks(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) values and group ids -> (B,) float64 centred ranks in [−1, 1] within each group (ties averaged)."""
    v = values.detach().to(torch.float64)
    g = torch.as_tensor(group_ids).to(v.device)
    same = g[:, None] == g[None, :]  # (B, B) same group
    below = ((v[None, :] < v[:, None]) & same).sum(1).to(torch.float64)  # group members with a lower reward
    tied = ((v[None, :] == v[:, None]) & same).sum(1).to(torch.float64)  # with the same reward (itself included)
    n = same.sum(1).to(torch.float64)
    rank = below + (tied + 1) / 2  # 1-based, ties averaged
    half = (n - 1) / 2
    return torch.where(n > 1, (rank - (n + 1) / 2) / half.clamp(min=0.5), torch.zeros_like(rank))


class RankCredit(Credit):
    """Centred, scaled rank of R_T within each prompt group, repeated over the T steps (module docstring).

    scale: the advantages lie in [−scale, scale]. The common fields (``std_scope``, ``eps``, ``adv_clip``,
    ``unbiased_std``, ``reward_source``) are taken and forwarded to :class:`stepflow.credits.base.Credit`."""

    name = "rank"
    needs_stepwise_rewards = False  # reads R_T only

    def __init__(self, scale: float = 1.0, **common):
        super().__init__(**common)
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale: must be a finite float > 0, got {scale!r}")
        self.scale = float(scale)

    def advantages(self, rewards, group_ids, num_steps, trained):
        """rewards (B, T+1) (only the last column is finite) -> ((B, T) float32, no gains, extra stats: logged as
        ``train/rank_adv_min``, ``train/rank_adv_max`` (before ``adv_clip``) and ``train/rank_tied_frac`` (rows that
        share their reward with another row of their group))."""
        final = rewards[:, -1]
        ranks = centred_ranks(final, group_ids)
        adv = (self.scale * ranks).to(torch.float32)[:, None].expand(-1, num_steps).contiguous()
        g = torch.as_tensor(group_ids).to(final.device)
        same = g[:, None] == g[None, :]
        tied = (((final[None, :] == final[:, None]) & same).sum(1) > 1).double().mean()
        return adv, None, {"rank_adv_min": float(adv.min()), "rank_adv_max": float(adv.max()),
                           "rank_tied_frac": float(tied)}
