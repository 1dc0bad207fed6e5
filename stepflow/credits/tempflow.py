"""TempFlow-GRPO's credit (docs/method.md §13.1): each trained step's column of branch rewards normalised within the
prompt group (population std + eps)."""

from __future__ import annotations

from stepflow.credits.branched import BranchCredit

__all__ = ["TempFlow"]


class TempFlow(BranchCredit):
    """:func:`stepflow.math.branch_credit.tempflow_advantages` on the (B·K, S) branch rewards (one completion per
    branch: ``granularities`` [1])."""

    name = "tempflow"

    def column_advantages(self, rewards, group_ids):
        from stepflow.math.branch_credit import tempflow_advantages

        if rewards.shape[2] != 1:
            raise ValueError(f"advantage=tempflow: one completion per branch (granularities [1]), got {rewards.shape[2]}")
        return tempflow_advantages(rewards[..., 0], group_ids, eps=self.eps, global_std=self.std_scope == "global")
