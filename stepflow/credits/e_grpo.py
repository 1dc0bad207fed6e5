"""E-GRPO's credit (arXiv 2601.00423; shengjun-zhang/VisualGRPO@ae619bf, ``algorithm=grpo_merge``): branches of an
ODE anchor in which consecutive low-noise (low-entropy) steps are merged into one high-entropy SDE step.

At each trained step k (``train.train_steps``, the released ``eta_step_list``) every rollout row draws one SDE
transition from the anchor's X_k straight to ``τ_{k+m}`` (``merge``, the released ``eta_step_merge_list``: the
Flow-SDE step of fastvideo/workers/sampler/flux_sampler.py:162-191 with ``dt = σ_{k+m} − σ_k``), completed by the
Euler ODE on ``σ[k+m+1::g]`` at each granularity g (flux_sampler.py:537-575); the other steps are the ODE. The
advantage is normalised within the samples that share the merged step (a step column of the prompt's group),
per granularity, summed over granularities (fastvideo/workers/rollout_buffer.py:102-130): Granular-GRPO's formula
(:func:`stepflow.math.branch_credit.g2rpo_advantages`), which this credit inherits.
"""

from __future__ import annotations

from stepflow.credits.g2rpo import G2rpo
from stepflow.rollouts.branches import BranchRollout

__all__ = ["EGrpo", "MergedBranchRollout"]


class MergedBranchRollout(BranchRollout):
    """The branch rollout whose SDE branch at trained step ``train.train_steps[i]`` spans ``merge[i]`` grid
    intervals (steps not listed: 1)."""

    name = "merged_branches"

    def __init__(self, branches: int, granularities: tuple[int, ...], merge: tuple[int, ...] | None,
                 jump_last: bool = True):
        super().__init__(branches, granularities, jump_last=jump_last)
        self.merge = merge

    def span(self, k, learner):
        if not self.merge:
            return 1
        return dict(zip(learner.train.train_steps or [], self.merge)).get(k, 1)


class EGrpo(G2rpo):
    """Fields: those of Granular-GRPO's credit (``branches`` per row, ``granularities``, ``eps``, ``unbiased_std``,
    ...), and ``merge``: one span m >= 1 per step of ``train.train_steps`` (the released ``eta_step_merge_list``;
    null: every span 1, which is Granular-GRPO's rollout); ``jump_last``: the released completion's end, as
    Granular-GRPO's (a stride that misses τ_T = 0 ends with an Euler step to 0 from the suffix's second-last time;
    false: the suffix's last time is visited first)."""

    name = "e_grpo"

    def __init__(self, merge: list[int] | None = None, jump_last: bool = True, **fields):
        super().__init__(jump_last=jump_last, **fields)
        ms = list(merge) if isinstance(merge, (list, tuple)) else None if merge is None else False
        if ms is False or (ms is not None and (not ms or any(not isinstance(m, int) or isinstance(m, bool) or m < 1
                                                             for m in ms))):
            raise ValueError(f"merge: must be null or a non-empty list of integers >= 1 (one span per step of "
                             f"train.train_steps), got {merge!r}")
        self.merge = ms

    def rollout_strategy(self):
        return MergedBranchRollout(self.branches, tuple(self.granularities),
                                   None if self.merge is None else tuple(self.merge), jump_last=self.jump_last)

    def requirements(self, s) -> list[str]:
        """``merge`` pairs with ``train.train_steps`` one to one, and every merged step lands before the image."""
        if self.merge is None:
            return []
        steps, t = s.train.train_steps, s.loop.num_steps
        if steps is None:
            return [f"advantage.merge: gives one span per step of train.train_steps, which is null; list the trained "
                    f"steps (e.g. train.train_steps={list(range(len(self.merge)))})"]
        if len(steps) != len(self.merge):
            return [f"advantage.merge: {len(self.merge)} spans for the {len(steps)} steps of train.train_steps="
                    f"{list(steps)}; give one span per trained step"]
        out = [f"advantage.merge: step {k} spanning {m} intervals lands at state {k + m}, past state {t - 1} (the last "
               f"before the image of the {t}-step grid); lower its span" for k, m in zip(steps, self.merge)
               if k + m > t - 1]
        if any(m > 1 for m in self.merge) and s.train.weighting == "noise":
            out.append("train.weighting=noise: weighs each step by its one-interval σ√Δt, not a merged step's; use "
                       "train.weighting=none with advantage.merge")
        return out
