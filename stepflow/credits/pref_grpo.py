"""Pref-GRPO's credit (arXiv 2508.20751; CodeGoat24/Pref-GRPO@c06662d fastvideo/train_flux_pref_grpo.py): the reward of
a sample is its pairwise **win rate** within its group, ``w_i = (Σ_{j≠i} P(i beats j)) / (G − 1)`` over every pair of
the group (a judge's tie counts ½ to each side), rounded to 3 decimals as released; the advantage is the group's
``(w − mean)/(std + 1e-8)`` with the unbiased std, times 0.7 (the release's weight on the preference advantage),
repeated over the steps and clipped to ±5.

Where the preferences come from (the reward's :meth:`~stepflow.rewards.base.Reward.compare`):

- a scalar reward (``reward.pairwise`` False, the embedded world's shapes_geneval): ``P(i beats j)`` follows from
  the two scores (1 / ½ on a tie / 0, :func:`~stepflow.rewards.base.preference_from_scores`), read from the one
  reward call every credit makes, after the rows of every rank are gathered;
- a pairwise judge (``reward.pairwise`` True, UnifiedReward-Think in the release): :class:`PairwiseRollout`'s reward
  phase decodes the final images, gathers them from every rank, and calls ``reward.compare`` on the group's pairs
  (each rank a share of them: pair p on rank p mod world), the win counts then summed over ranks.

Either way the credit's ``advantages`` read the win rates (the rewards Pref-GRPO trains on).
"""

from __future__ import annotations

import torch
from torch import Tensor

from stepflow.credits.base import Credit, _num
from stepflow.math.advantage import _group_index, uniform_advantages
from stepflow.rewards.base import preference_from_scores
from stepflow.rollouts.base import Credited
from stepflow.rollouts.trajectory import TrajectoryRollout, finite_advantages

__all__ = ["PrefGrpo", "PairwiseRollout", "group_pairs", "win_rates", "win_rates_from_scores"]


def group_pairs(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Every unordered pair (i < j) of rows in the same group, in the order of ``itertools.combinations`` over each
    group's rows (the release's L75). group_ids: (B,) -> (first (P,), second (P,)) long row indices."""
    inv, k = _group_index(group_ids, len(group_ids))
    firsts, seconds = [], []
    for g in range(k):
        rows = torch.nonzero(inv == g).flatten()
        i, j = torch.triu_indices(len(rows), len(rows), offset=1)
        firsts.append(rows[i])
        seconds.append(rows[j])
    if not firsts:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(firsts), torch.cat(seconds)


def win_counts(first: Tensor, second: Tensor, prefs: Tensor, batch: int) -> tuple[Tensor, Tensor]:
    """Wins and comparisons per row (float64 (B,) each) of the pairs ``(first, second)`` with ``prefs`` = P(first beats
    second): the first side gains ``p``, the second ``1 − p`` (a tie ½ each, release L105-120)."""
    p = prefs.double()
    wins = torch.zeros(batch, dtype=torch.float64).index_add_(0, first, p).index_add_(0, second, 1.0 - p)
    ones = torch.ones_like(p)
    count = torch.zeros(batch, dtype=torch.float64).index_add_(0, first, ones).index_add_(0, second, ones)
    return wins, count


def win_rates(wins: Tensor, count: Tensor, decimals: int | None = 3) -> Tensor:
    """``wins / comparisons`` per row, rounded to ``decimals`` as released (``round(w / c, 3)``, L125; None: not
    rounded); NaN for a row with no comparison (dropped from the iteration). -> (B,) float32."""
    rate = torch.where(count > 0, wins / count.clamp(min=1), torch.full_like(wins, float("nan")))
    if decimals is not None:
        rate = torch.round(rate, decimals=int(decimals))
    return rate.float()


def win_rates_from_scores(scores: Tensor, group_ids: Tensor, decimals: int | None = 3) -> Tensor:
    """A scalar reward's win rates: every in-group pair compared by :func:`preference_from_scores` (what the
    reward's default ``compare`` gives, without scoring again). A row whose score is not finite takes part in no pair
    and gets NaN. scores, group_ids: (B,) -> (B,) float32."""
    finite = torch.isfinite(scores)
    first, second = group_pairs(torch.where(finite, group_ids, -1 - torch.arange(len(scores))))
    first, second = first[finite[first]], second[finite[first]]
    wins, count = win_counts(first, second, preference_from_scores(scores[first], scores[second]), len(scores))
    return win_rates(wins, count, decimals)


class PrefGrpo(Credit):
    """The win rate's group-normalised advantage (the module docstring). Fields: the base ones (released: std over the
    group, unbiased, eps 1e-8, clip ±5), ``weight`` the factor on the normalised advantage (0.7 as released; the
    release adds 1.4 × a CLIP score's advantage when ``--use_clip``, which the embedded world has no analogue of),
    ``decimals`` the rounding of the win rate (3 as released; null: none)."""

    name = "pref_grpo"
    needs_stepwise_rewards = False

    def __init__(self, std_scope: str = "group", eps: float = 1e-8, adv_clip: float = 5.0, unbiased_std: bool = True,
                 reward_source: str = "tweedie", weight: float = 0.7, decimals: int | None = 3):
        super().__init__(std_scope=std_scope, eps=eps, adv_clip=adv_clip, unbiased_std=unbiased_std,
                         reward_source=reward_source)
        _num("weight", weight, 0.0, lo_open=True)
        if decimals is not None and not (isinstance(decimals, int) and not isinstance(decimals, bool) and decimals >= 0):
            raise ValueError(f"decimals: must be null or an int >= 0, got {decimals!r}")
        self.weight, self.decimals = float(weight), decimals

    def rollout_strategy(self):
        return PairwiseRollout()

    def advantages(self, rewards, group_ids, num_steps, trained):
        """rewards (B, T+1): the final column holds the win rates (:class:`PairwiseRollout` puts them there)."""
        adv = uniform_advantages(rewards[:, -1], group_ids, num_steps, std_scope=self.std_scope, eps=self.eps,
                                 unbiased=self.unbiased_std)
        return self.weight * adv, None, {}


class PairwiseRollout(TrajectoryRollout):
    """The rollout's own trajectories, their final images turned into win rates: by the scalar scores in the advantage
    phase, or (``reward.pairwise``) by the judge's ``compare`` in the reward phase."""

    name = "pairwise"

    def collect(self, learner, mine, ctx, phases):
        if getattr(learner.reward, "pairwise", False) and learner.loop.overlap_reward:
            raise ValueError(f"loop.overlap_reward: a pairwise judge (reward {learner.reward.name}) compares the images "
                             "of a group once the whole rollout exists; set loop.overlap_reward=false")
        return super().collect(learner, mine, ctx, phases)

    def score(self, learner, col, mine, ctx):
        if not getattr(learner.reward, "pairwise", False):
            return super().score(learner, col, mine, ctx)
        from stepflow.core.rollout import Scores

        dist, traj = learner.dist, col.traj
        images = torch.cat([learner.policy.decode(traj.latents[s:s + 64, -1]).float().cpu()
                            for s in range(0, traj.batch_size, 64)])
        every = dist.gather_rows(images)  # (B_global, 3, H, W): a group may sit on several ranks
        plan = learner.plan.plan(ctx.it)  # the global plan, the same on every rank
        first, second = group_pairs(plan.group_ids)
        mine_ = torch.arange(len(first)) % dist.world == dist.rank
        f, s = first[mine_], second[mine_]
        prefs = (learner.reward.compare(every[f], every[s], [plan.prompts[i] for i in f.tolist()],
                                        [plan.meta[i] for i in f.tolist()]) if len(f) else torch.zeros(0))
        wins, count = win_counts(f, s, prefs.float().cpu(), len(plan))
        both = dist.all_sum_tensor(torch.stack([wins, count]))
        rates = dist.local_rows(win_rates(both[0], both[1], learner.advantage.decimals))
        rewards = torch.full((traj.batch_size, traj.num_steps + 1), float("nan"))
        rewards[:, -1] = rates
        col.scores = Scores(rewards, {}, images=2 * len(f))  # this rank's share: two images a pair
        return col

    def credit(self, learner, col, rewards, plan, ctx) -> Credited:
        final = rewards[:, -1]
        if not getattr(learner.reward, "pairwise", False):
            final = win_rates_from_scores(final, plan.group_ids, learner.advantage.decimals)
        rates = torch.full_like(rewards, float("nan"))
        rates[:, -1] = final
        adv, dropped = finite_advantages(learner, rates, plan.group_ids, ctx.it, ctx.trained)
        adv.stats["win_rate_std"] = float(final[~dropped].double().std()) if int((~dropped).sum()) > 1 else 0.0
        return Credited(adv, dropped, adv.advantages)
