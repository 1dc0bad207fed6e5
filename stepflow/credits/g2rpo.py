"""Granular-GRPO's credit (docs/method.md §13.2): branch rewards normalised per (step, granularity) with the sample
std + eps, summed over the granularities."""

from __future__ import annotations

from stepflow.credits.branched import BranchCredit

__all__ = ["G2rpo"]


class G2rpo(BranchCredit):
    """:func:`stepflow.math.branch_credit.g2rpo_advantages` on the (B·K, S, G) branch rewards."""

    name = "g2rpo"

    def column_advantages(self, rewards, group_ids):
        from stepflow.math.branch_credit import g2rpo_advantages

        return g2rpo_advantages(rewards, group_ids, eps=self.eps)
