"""TurningPoint-GRPO's credit (docs/method.md §13.3): incremental rewards over an SDE window 0..n−1, turning points
credited R_T − R_{t−1} with the balanced bonus, one normalisation per step column."""

from __future__ import annotations

import torch

from stepflow.credits.base import Credit

__all__ = ["TurningPoint"]


class TurningPoint(Credit):
    """R_0 = ``rewards[:, 0]`` (with ``reward_source=completion``, as released: the pure-ODE image from the same
    noise), R_t = ``rewards[:, t]`` for the window's t = 1..n (the first t SDE steps, then the ODE), R_sde =
    ``rewards[:, T]``; :func:`stepflow.math.branch_credit.turning_point_rewards` with the released flags, then
    :func:`~stepflow.math.branch_credit.per_step_advantages`. The trained steps must be the window ``0..n−1`` (the
    released ``sde_window_range = (0, n)``)."""

    name = "turning_point"
    trains_window_from_zero = True

    def states_needed(self, trained, num_steps):
        return sorted({*range(len(trained) + 1), num_steps})

    def gain_steps(self, trained):
        return list(trained)

    def advantages(self, rewards, group_ids, num_steps, trained):
        from stepflow.math.branch_credit import per_step_advantages, turning_point_rewards

        n = len(trained)
        if trained != list(range(n)) or n == 0:
            raise ValueError(f"advantage=turning_point: the trained steps must be an SDE window starting at step 0 "
                             f"(TurningPoint-GRPO's sde_window_range (0, n)), got {trained}; set train.train_steps=null "
                             "with window=none or a window that starts at 0")
        r = rewards.detach().to(torch.float64)
        tp = turning_point_rewards(r[:, 0], r[:, 1:n + 1], r[:, num_steps], eta=1.0)
        adv = torch.zeros(r.shape[0], num_steps, dtype=torch.float32)
        adv[:, :n] = per_step_advantages(tp.rewards, group_ids, eps=self.eps, global_std=self.std_scope == "global")
        g = torch.zeros(r.shape[0], num_steps, dtype=torch.float64)
        g[:, :n] = tp.rewards.double()
        return adv, g, {"turning_frac": float(tp.turning.double().mean())}
