"""Online DPO's credit (yifan123/flow_grpo@ac4c86e flow_grpo/stat_tracking.py L38-51, ``PerPromptStatTracker.update(
type='dpo')``): +1 for each prompt group's best sample, −1 for its worst, 0 for the others, so the update trains the
pairs only (objective=online_dpo reads the signs)."""

from __future__ import annotations

import torch

from stepflow.credits.base import Credit
from stepflow.math.advantage import _group_index

__all__ = ["BestWorst", "best_worst"]


def best_worst(final: torch.Tensor, group_ids: torch.Tensor, tie_pair: bool = True) -> torch.Tensor:
    """(B,) float32: per group +1 at the first maximal final reward, −1 at the first minimal one (``torch.argmax`` /
    ``argmin``); a group whose rewards are all equal gets −1 at its first row and +1 at its second with ``tie_pair``
    (the release's ``if max_idx == min_idx: min_idx = 0; max_idx = 1``), no pair without it."""
    out = torch.zeros(len(final), dtype=torch.float32)
    inv, k = _group_index(group_ids, len(final))
    for g in range(k):
        idx = torch.nonzero(inv == g).flatten()
        r = final[idx].double()
        hi, lo = int(torch.argmax(r)), int(torch.argmin(r))
        if hi == lo:  # every reward equal (argmax and argmin both return the first row)
            if not tie_pair or len(idx) < 2:
                continue
            lo, hi = 0, 1
        out[idx[hi]] = 1.0
        out[idx[lo]] = -1.0
    return out


class BestWorst(Credit):
    """``advantage=best_worst``: the release's DPO stat tracker, repeated over the T steps; reads only R_T.
    ``tie_pair``: an all-tied group still gives its first two rows as loser and winner (released), or no pair."""

    name = "best_worst"
    needs_stepwise_rewards = False

    def __init__(self, tie_pair: bool = True, **fields):
        super().__init__(**fields)
        if not isinstance(tie_pair, bool):
            raise ValueError(f"tie_pair: must be true or false, got {tie_pair!r}")
        self.tie_pair = tie_pair

    def advantages(self, rewards, group_ids, num_steps, trained):
        a = best_worst(rewards[:, -1], group_ids, self.tie_pair)
        return a.view(-1, 1).expand(-1, int(num_steps)).contiguous(), None, {}
