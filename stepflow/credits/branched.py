"""The credits of branch rollouts (docs/method.md §13): TempFlow-GRPO and Granular-GRPO. Their rewards come from K SDE
branches of an ODE anchor at every trained step, each completed by the ODE (:class:`stepflow.rollouts.branches.
BranchRollout`); the advantages are per (row, branch, step)."""

from __future__ import annotations

import torch
from torch import Tensor

from stepflow.credits.base import Credit

__all__ = ["BranchCredit"]


class BranchCredit(Credit):
    """Shared by tempflow and g2rpo: ``branches`` K SDE branches per rollout row at every trained step, completed by
    the ODE at each of ``granularities`` (Euler strides); :meth:`branch_advantages` (B, K, S, G) -> (B, K, S).
    ``jump_last``: a completion whose stride misses τ_T = 0 ends with an Euler step to 0 from the suffix's second-last
    time (FastVideo's loop, as Granular-GRPO and E-GRPO release it) instead of visiting its last time first."""

    def __init__(self, branches: int = 4, granularities: list[int] | None = None, jump_last: bool = False, **common):
        super().__init__(**common)
        if not isinstance(jump_last, bool):
            raise ValueError(f"jump_last: must be a bool, got {jump_last!r}")
        if not (isinstance(branches, int) and not isinstance(branches, bool) and branches >= 1):
            raise ValueError(f"branches: must be an integer >= 1, got {branches!r}")
        gran = list(granularities) if isinstance(granularities, (list, tuple)) else [1] if granularities is None else None
        if not gran or any(not isinstance(g, int) or isinstance(g, bool) or g < 1 for g in gran) or len(set(gran)) < len(gran):
            raise ValueError(f"granularities: must be a list of distinct integers >= 1 (e.g. [1, 2]), got {granularities!r}")
        if self.completes_states:
            raise ValueError(f"reward_source: advantage={self.name} rewards its branches' ODE completions already; "
                             "leave advantage.reward_source=tweedie (its default)")
        self.branches, self.granularities, self.jump_last = branches, gran, jump_last

    def requirements(self, s) -> list[str]:
        """Every granularity completes some trained step on its own grid: a stride beyond the ``loop.num_steps`` grid
        is one jump to the end wherever it branches, the same completion as a smaller stride's, summed twice."""
        from stepflow.core.branch import completion_grid
        from stepflow.core.requirements import candidate_steps
        from stepflow.math.sde import time_grid

        t = s.loop.num_steps
        grid, steps = time_grid(t, shift=1.0), [k for k in candidate_steps(s) if k < t - 1]
        if len(self.granularities) < 2 or not steps:
            return []
        def completions(g: int) -> tuple:
            return tuple(tuple(completion_grid(grid, k, g, self.jump_last).tolist()) for k in steps)

        distinct: dict[tuple, int] = {}
        for g in range(1, t):  # the strides that complete the trained steps differently on this grid
            distinct.setdefault(completions(g), g)
        seen: dict[tuple, int] = {}
        for g in sorted(self.granularities):
            key = completions(g)
            if key in seen:
                ok = sorted(distinct.values())
                return [f"advantage.granularities: stride {g} completes every trained step {steps} of the {t}-step grid "
                        f"as stride {seen[key]} does (a stride past the steps left is one jump to the end), so the same "
                        f"completion would be summed twice; on this grid only the strides {ok} differ: choose among "
                        f"them (e.g. advantage.granularities={ok[:2]}), or train earlier steps / more loop.num_steps"]
            seen[key] = g
        return []

    def rollout_strategy(self):
        from stepflow.rollouts.branches import BranchRollout

        return BranchRollout(self.branches, tuple(self.granularities), jump_last=self.jump_last)

    def states_needed(self, trained, num_steps):
        return [num_steps]

    def advantages(self, rewards, group_ids, num_steps, trained):
        raise ValueError(f"advantage={self.name}: its advantages come from branch rollouts (branch_advantages), not "
                         "from one rollout's rewards")

    def column_advantages(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """(B·K, S, G) rewards, (B·K,) groups -> (B·K, S) unclipped advantages."""
        raise NotImplementedError

    def branch_advantages(self, rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        """rewards: (B, K, S, G) the reward of row i's branch j at trained step s completed at granularity g;
        group_ids: (B,) (a group: every row and branch of a prompt). Returns (B, K, S) float32, clipped to ±adv_clip,
        and the stats."""
        b, k, s, g = rewards.shape
        gid = torch.as_tensor(group_ids).repeat_interleave(k)
        raw = self.column_advantages(rewards.reshape(b * k, s, g), gid)
        adv = raw.clamp(-self.adv_clip, self.adv_clip)
        stats = {"adv_clip_frac": float((raw.abs() > self.adv_clip).double().mean()),
                 "zero_rows": float((adv.view(b, k * s) == 0).all(1).sum()),
                 "num_groups": float(len(torch.unique(torch.as_tensor(group_ids))))}
        return adv.view(b, k, s), stats
