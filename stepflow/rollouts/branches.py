"""Branches of an ODE anchor (TempFlow-GRPO, Granular-GRPO; docs/method.md §13, the pieces in
:mod:`stepflow.core.branch_loop`): the anchors (phase rollout), K SDE branches of every row at every trained step
completed by the ODE (estimate), one reward call over every branch image and the anchors' own (reward), the branch
advantages over every rank's rows (advantage), and the update of the branch rows, each at its own step (update)."""

from __future__ import annotations

import torch

from stepflow.core.rollout import rollout
from stepflow.math.advantage import AdvantageOut
from stepflow.rollouts.base import Collected, Credited, RolloutStrategy, TrainBatch, stop_point

__all__ = ["BranchRollout"]


class BranchRollout(RolloutStrategy):
    """``branches`` K SDE branches per rollout row at every trained step, each completed by the ODE at each of
    ``granularities`` (Euler strides). The rows the update trains are the branch rows (B·K·S of this rank's B).

    ``jump_last``: a completion whose stride misses τ_T = 0 ends with an Euler step to 0 from its second-last time
    (FastVideo's released loop) instead of visiting its last time first (:func:`stepflow.core.branch.completion_grid`).
    :meth:`span`: the grid intervals the SDE branch at a trained step covers (1: one grid step; a subclass that
    merges steps, E-GRPO, returns m > 1: one SDE transition from τ_k to τ_{k+m}, trained as such)."""

    name = "branches"
    branched = True
    trains = "trains GRPO on branches of an ODE anchor at every trained step"
    sde_hint = "sampler=flow_sde (TempFlow-GRPO, Granular-GRPO) or another SDE"

    def __init__(self, branches: int = 4, granularities: tuple[int, ...] = (1,), jump_last: bool = False):
        self.branches, self.granularities, self.jump_last = int(branches), tuple(granularities), bool(jump_last)

    def span(self, k: int, learner) -> int:
        """The grid intervals the SDE branch at trained step ``k`` spans (default 1)."""
        return 1

    def context(self, learner, it):
        ctx = super().context(learner, it)
        ctx.need = [learner.loop.num_steps]  # the anchors' own final images (train/reward_final)
        return ctx

    def collect(self, learner, mine, ctx, phases):
        from stepflow.core.branch import branch_at
        from stepflow.core.branch_loop import anchor_rows

        pol = learner.policy
        with phases("rollout"):  # the ODE anchors, one per (prompt, initial noise)
            anchors_plan, amap = anchor_rows(mine)
            anchor = rollout(pol, anchors_plan, learner.sampler, learner.loop.num_steps, learner.guidance,
                             sde_steps=[], grid=ctx.grid)
        stop_point(learner)
        with phases("estimate"):  # K SDE branches of every row at every trained step, each completed by the ODE
            lat, vel, cond = anchor.latents[amap], anchor.velocities[amap], anchor.cond.index(amap)
            branches = []
            for k in ctx.trained:
                branches.append(branch_at(pol, lat, vel, anchor.times, cond, k, learner.sampler, self.branches,
                                          mine.step_noise_seeds, learner.guidance, self.granularities,
                                          span=self.span(k, learner), jump_last=self.jump_last))
                stop_point(learner)
        return Collected(anchor, None, None, {"amap": amap, "branches": branches})

    def score(self, learner, col, mine, ctx):
        from stepflow.core.branch_loop import score_branches

        col.scores, col.extra["rewards"] = score_branches(learner, col.traj, col.extra["amap"], col.extra["branches"],
                                                          mine)
        return col

    def credit(self, learner, col, rewards, plan, ctx):
        from stepflow.core.branch_loop import branch_advantages

        all_r = learner.dist.gather_rows(col.extra["rewards"])  # (B_global, K, S, G)
        adv_all, dropped, stats = branch_advantages(learner, all_r, plan.group_ids, ctx.it, ctx.trained,
                                                    learner.loop.num_steps)
        summary = torch.zeros(len(plan), learner.loop.num_steps, dtype=torch.float32)
        if ctx.trained:
            summary[:, ctx.trained] = adv_all.mean(1)
        return Credited(AdvantageOut(summary, None, stats), dropped, adv_all)

    def training_batch(self, learner, col, cred, mine, ctx):
        from stepflow.core.branch_loop import branch_trajectory

        traj, adv, mask = branch_trajectory(col.traj, col.extra["amap"], col.extra["branches"],
                                            learner.dist.local_rows(cred.train), list(mine.prompts), list(mine.meta))
        w = learner.weighting.weights(learner.sampler, ctx.grid, ctx.trained, None)  # noise: TempFlow's σ√Δt weights
        groups = mine.group_ids.repeat_interleave(self.branches * len(ctx.trained))
        return TrainBatch(traj, adv, None, w, groups, False, mask=mask)

    def metrics(self, learner, col, batch, ctx):
        return {"train/branch_rows": float(learner.dist.all_sum(batch.traj.batch_size))}
