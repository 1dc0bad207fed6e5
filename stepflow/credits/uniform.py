"""Flow-GRPO's credit (paper Eq. 4): the final reward's group-normalised advantage at every step."""

from __future__ import annotations

from stepflow.credits.base import Credit
from stepflow.math.advantage import uniform_advantages

__all__ = ["Uniform"]


class Uniform(Credit):
    """``(R_T − mean_c R_T)/(std_c R_T + eps)`` repeated over the T steps; reads only the final image's reward."""

    name = "uniform"
    needs_stepwise_rewards = False

    def advantages(self, rewards, group_ids, num_steps, trained):
        adv = uniform_advantages(rewards[:, -1], group_ids, num_steps, std_scope=self.std_scope, eps=self.eps,
                                 unbiased=self.unbiased_std)
        return adv, None, {}
