"""The Credit interface: rewards -> per-step advantages (docs/method.md §5, §6, §13; docs/guide.md "Extending").

A credit is a part (``advantage=<option>``: one class and its YAML). The core asks it

- ``needs_stepwise_rewards``: it reads the rewards of intermediate states (else only the final image's);
- :meth:`states_needed`: which states' rewards it reads for the trained steps (the rollout stops after the last);
- :meth:`rollout_strategy`: how its rewards are collected (:mod:`stepflow.rollouts`: the trajectory's own states,
  their ODE completions, or branches of an ODE anchor);
- ``trains_window_from_zero``: it reads an SDE window that starts at step 0 (TurningPoint-GRPO);

and calls it: :meth:`Credit.__call__` (rewards (B, T+1) -> :class:`~stepflow.math.advantage.AdvantageOut`) or, for a
branched credit, :meth:`branch_advantages`. A new scheme overrides :meth:`advantages` (and the flags it changes); one
that reads more than the rewards (reward components, features of the final images) names them in :meth:`row_inputs`
(the rollout strategy gathers them over ranks into :attr:`Credit.inputs`), and one that hands per-row data to the
objective returns it in :meth:`row_outputs` (``AdvantageOut.rows`` -> ``Objective.row_info``).
Statistics are float64, advantages float32, clipped to ±``adv_clip``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from stepflow.math.advantage import AdvantageOut, _group_index

__all__ = ["Credit", "STD_SCOPES", "REWARD_SOURCES"]

STD_SCOPES = ("group", "global")
REWARD_SOURCES = ("tweedie", "completion")


def _num(name: str, v, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) and (
        hi is None or v <= hi)
    if not ok:
        rng = f"in [{lo:g}, {hi:g}]" if hi is not None else f"{'>' if lo_open else '>='} {lo:g}"
        raise ValueError(f"{name}: must be a float {rng}, got {v!r}")


class Credit:
    """Per-step advantages from rewards. Fields (every credit): ``std_scope`` group | global (the std over the whole
    batch, Flow-GRPO's ``global_std``), ``eps`` added to the std, ``adv_clip`` the clamp, ``unbiased_std`` the sample
    std (ddof 1) instead of the population std, ``reward_source`` tweedie (the x̂0 estimate of X_k by T′ Euler
    substeps, ``loop.substeps``) | completion (X_k completed to an image by the Euler ODE: the true reward of the
    state under the ODE, T − k NFEs per state)."""

    name = "credit"
    needs_stepwise_rewards = True  #: reads the rewards of intermediate states (False: only R_T)
    trains_window_from_zero = False  #: the trained steps must be an SDE window 0..n−1 (TurningPoint-GRPO)

    def __init__(self, std_scope: str = "group", eps: float = 1e-4, adv_clip: float = 5.0, unbiased_std: bool = False,
                 reward_source: str = "tweedie"):
        if std_scope not in STD_SCOPES:
            raise ValueError(f"std_scope: must be one of {STD_SCOPES}, got {std_scope!r}")
        if reward_source not in REWARD_SOURCES:
            raise ValueError(f"reward_source: must be tweedie or completion, got {reward_source!r}")
        if not isinstance(unbiased_std, bool):
            raise ValueError(f"unbiased_std: must be a bool, got {unbiased_std!r}")
        _num("eps", eps, 0.0)
        _num("adv_clip", adv_clip, 0.0, lo_open=True)
        self.std_scope, self.eps, self.adv_clip = std_scope, eps, adv_clip
        self.unbiased_std, self.reward_source = unbiased_std, reward_source

    # ------------------------------------------------------------------ what the iteration asks
    @property
    def cfg(self) -> Credit:
        """The credit's settings (itself: its fields are its attributes)."""
        return self

    @property
    def scheme(self) -> str:
        return self.name

    @property
    def completes_states(self) -> bool:
        """The rewards of intermediate states are those of their ODE completions (``reward_source=completion``)."""
        return self.reward_source == "completion"

    @property
    def branched(self) -> bool:
        """Its rewards come from branch rollouts of an ODE anchor (:meth:`rollout_strategy`)."""
        return self.rollout_strategy().branched

    def rollout_strategy(self):
        """How this credit's rewards are collected (:mod:`stepflow.rollouts`): the rollout's own states (their x̂0
        estimates, or their ODE completions with ``reward_source=completion``)."""
        from stepflow.rollouts.trajectory import TrajectoryRollout

        return TrajectoryRollout(completion=self.completes_states)

    def states_needed(self, trained: list[int], num_steps: int) -> list[int]:
        """The states k ∈ 0..T whose rewards R_k the advantages of the ``trained`` steps read (default: every one
        when stepwise, else the final image's)."""
        return list(range(num_steps + 1)) if self.needs_stepwise_rewards else [num_steps]

    def gain_steps(self, trained: list[int]) -> list[int] | None:
        """The steps whose gains are logged (``gain_abs_mean_step{k}``; None: every step)."""
        return None

    def row_inputs(self, learner, col) -> dict[str, Tensor]:
        """Per-row tensors (B_local, ...) of this rank's rows that :meth:`advantages` reads besides the rewards (``col``:
        the iteration's :class:`~stepflow.rollouts.base.Collected`: its trajectory and scores). The rollout strategy
        gathers them over every rank's rows into :attr:`inputs` (rows as the rewards'). Default: none."""
        return {}

    def row_outputs(self, adv: Tensor) -> dict[str, Tensor]:
        """Per-row (B,) tensors for the objective (``Objective.row_info``), of the rows :meth:`advantages` just saw,
        given their clipped advantages ``adv`` (B, T). Default: none."""
        return {}

    def advantages(self, rewards: Tensor, group_ids: Tensor, num_steps: int,
                   trained: list[int]) -> tuple[Tensor, Tensor | None, dict[str, float]]:
        """rewards (B, T+1) -> (advantages (B, T) float32 before clipping, the gains (B, T) float64 or None, extra
        stats). Only the columns :meth:`states_needed` names are finite."""
        raise NotImplementedError

    def __call__(self, rewards: Tensor, group_ids: Tensor, num_steps: int | None = None,
                 trained: list[int] | None = None, inputs: dict[str, Tensor] | None = None) -> AdvantageOut:
        """rewards: (B, T+1) (only the columns :meth:`states_needed` names are read; others may be NaN);
        group_ids: (B,) long; num_steps: T (checked against ``rewards``); trained: the trained steps; inputs: the
        gathered :meth:`row_inputs` of the same rows (:attr:`inputs` while :meth:`advantages` runs)."""
        self.inputs: dict[str, Tensor] = dict(inputs or {})
        if rewards.ndim != 2 or rewards.shape[1] < 2:
            raise ValueError(f"rewards: expected shape (B, T+1), got {tuple(rewards.shape)}")
        t = rewards.shape[1] - 1
        if num_steps is not None and num_steps != t:
            raise ValueError(f"num_steps: {num_steps} does not match rewards with {t + 1} columns")
        trained = sorted(trained or [])
        if not bool(torch.isfinite(rewards[:, self.states_needed(trained, t)]).all()):
            raise ValueError("rewards: non-finite values in the columns this scheme reads")
        raw, g, extra = self.advantages(rewards, group_ids, t, trained)
        adv = raw.clamp(-self.adv_clip, self.adv_clip)
        stats = self._stats(raw, adv, g, rewards, group_ids, self.gain_steps(trained))
        stats.update(extra)
        return AdvantageOut(advantages=adv, gains=None if g is None else g.to(torch.float32), stats=stats,
                            rows=self.row_outputs(adv))

    def branch_advantages(self, rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, dict[str, float]]:
        raise ValueError(f"advantage={self.name}: its rewards come from the rollout's own states, not from branches")

    def _stats(self, raw: Tensor, adv: Tensor, g: Tensor | None, rewards: Tensor, group_ids: Tensor,
               gain_steps: Sequence[int] | None = None) -> dict[str, float]:
        b, t = adv.shape
        inv, k = _group_index(group_ids, b)
        row_zero = (adv == 0).all(dim=1)  # (B,)
        group_nonzero = torch.zeros(k, dtype=torch.long).index_add_(0, inv.cpu(), (~row_zero).long().cpu())
        stats: dict[str, float] = {
            "zero_groups": float((group_nonzero == 0).sum().item()),
            "zero_rows": float(row_zero.sum().item()),
            "num_groups": float(k),
            "adv_clip_frac": float((raw.abs() > self.adv_clip).double().mean().item()),
        }
        adv_abs = adv.abs().double().mean(dim=0)
        for j in range(t):
            stats[f"adv_abs_mean_step{j}"] = float(adv_abs[j].item())
        if g is not None:
            g_abs = g.abs().mean(dim=0)
            for j in (range(t) if gain_steps is None else gain_steps):
                stats[f"gain_abs_mean_step{j}"] = float(g_abs[j].item())
            if gain_steps != []:
                stats["gain_mean"] = float((g if gain_steps is None else g[:, list(gain_steps)]).mean().item())
            telescope = (rewards[:, -1] - rewards[:, 0]).double()
            if bool(torch.isfinite(telescope).all()):
                stats["telescope_mean"] = float(telescope.mean().item())
        return stats

    def state_dict(self) -> dict:
        """What a checkpoint keeps (empty for a credit without state)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
