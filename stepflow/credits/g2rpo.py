"""Granular-GRPO's credit (docs/method.md §13.2): branch rewards normalised per (step, granularity) with the sample
std + eps, summed over the granularities."""

from __future__ import annotations

from stepflow.credits.branched import BranchCredit

__all__ = ["G2rpo"]


class G2rpo(BranchCredit):
    """:func:`stepflow.math.branch_credit.g2rpo_advantages` on the (B·K, S, G) branch rewards. ``jump_last`` (default
    true, as released: ``run_ode_sample_step`` stops one time short of the suffix ``σ[k+2::g]`` and returns the x̂0
    of its last evaluation, so a stride that misses 0 ends with an Euler step to 0 from the suffix's second-last
    time)."""

    name = "g2rpo"

    def __init__(self, jump_last: bool = True, **fields):
        super().__init__(jump_last=jump_last, **fields)

    def column_advantages(self, rewards, group_ids):
        from stepflow.math.branch_credit import g2rpo_advantages

        return g2rpo_advantages(rewards, group_ids, eps=self.eps)
