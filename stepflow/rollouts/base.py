"""The RolloutStrategy interface: how an iteration collects the samples it trains on and the rewards its credit
reads (docs/method.md §10, §13; docs/guide.md "Extending stepflow").

:func:`stepflow.core.algorithm.iteration` runs every strategy through the same phases::

    ctx   = strategy.context(learner, it)                  # the grid, SDE window, trained steps, states needed
    col   = strategy.collect(learner, mine, ctx, phases)   # phases "rollout", "estimate" (and "reward" when overlapped)
    col   = strategy.score(learner, col, mine, ctx)        # phase "reward": one reward call
    cred  = strategy.credit(learner, col, rewards, plan, ctx)       # phase "advantage": over every rank's rows
    batch = strategy.training_batch(learner, col, cred, mine, ctx)  # phase "update": the rows the update trains

Built-ins: :class:`stepflow.rollouts.trajectory.TrajectoryRollout` (the rollout's own states, scored through their
x̂0 estimates or their ODE completions) and :class:`stepflow.rollouts.branches.BranchRollout` (K SDE branches of an
ODE anchor at every trained step: TempFlow-GRPO, Granular-GRPO). A credit names its strategy
(:meth:`stepflow.credits.base.Credit.rollout_strategy`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from stepflow.core import stop
from stepflow.errors import StopRequested
from stepflow.math.advantage import AdvantageOut

__all__ = ["RolloutStrategy", "Context", "Collected", "Credited", "TrainBatch", "stop_point", "log_once"]


@dataclass
class Context:
    """What an iteration resolves before it rolls out."""

    it: int
    grid: Tensor  #: (T+1,) the rollout's σ grid
    sde: list[int] | None  #: the SDE window's steps (None: every step follows the sampler)
    trained: list[int]  #: the objective's trained steps (forward-process objectives: the steps their times lie on)
    need: list[int] = field(default_factory=list)  #: the states whose rewards are computed
    tail: Tensor | None = None  #: MixGRPO-Flash's post-window grid (None: the grid's Euler steps)
    keep: list[int] | None = None  #: loop.retain_graph: the steps whose graphs the rollout keeps
    budget: float | None = None  #: loop.retain_graph=auto: the GiB the kept graphs may take


@dataclass
class Collected:
    """What a strategy collected: the rollout's trajectory (this rank's rows), the x̂0 estimates it made (or None),
    the scores once rewarded (None before), and whatever else the strategy keeps for its later phases."""

    traj: Any
    x0_hat: Tensor | None = None
    scores: Any = None
    extra: dict = field(default_factory=dict)


@dataclass
class Credited:
    """The advantage phase's result over every rank's rows: ``out`` what is logged, ``dropped`` (B_global,) the rows
    whose rewards were not finite, ``train`` the advantages the update reads (the strategy's own layout)."""

    out: AdvantageOut
    dropped: Tensor
    train: Tensor


@dataclass
class TrainBatch:
    """What :func:`stepflow.core.update.update` trains on this rank (its arguments)."""

    traj: Any
    adv: Tensor  #: (B_local, T)
    x0_hat: Tensor | None = None
    weights: Tensor | None = None
    groups: Tensor | None = None
    measure: bool = False
    seeds: Tensor | None = None
    mask: Tensor | None = None
    rows: dict = field(default_factory=dict)  #: per-row (B_local,) data of the credit for the objective (row_info)


class RolloutStrategy:
    """The interface (see the module docstring). ``branched``: the rows the update trains are not the rollout's
    own (their advantages are per branch); ``trains`` and ``sde_hint``: what a branched strategy trains and which SDE
    to choose, in the one-line refusals of :mod:`stepflow.core.requirements` (``advantage=<name> <trains>``)."""

    name = "rollout"
    branched = False
    trains = "trains GRPO on the rollout's own steps"
    sde_hint = "sampler=flow_sde or another SDE"

    def context(self, learner: Any, it: int) -> Context:
        grid = learner.grid()  # loop.time_grid: the policy's own, or FastVideo's (DanceGRPO)
        sde = learner.window_steps(it)  # the SDE window (None: every step); the others follow the ODE
        trained = learner.objective.trained_steps(learner.train, learner.sampler, grid, sde)
        return Context(it, grid, sde, trained)

    def collect(self, learner: Any, mine: Any, ctx: Context, phases: Any) -> Collected:
        raise NotImplementedError

    def score(self, learner: Any, col: Collected, mine: Any, ctx: Context) -> Collected:
        raise NotImplementedError

    def credit(self, learner: Any, col: Collected, rewards: Tensor, plan: Any, ctx: Context) -> Credited:
        raise NotImplementedError

    def training_batch(self, learner: Any, col: Collected, cred: Credited, mine: Any, ctx: Context) -> TrainBatch:
        raise NotImplementedError

    def metrics(self, learner: Any, col: Collected, batch: TrainBatch, ctx: Context) -> dict[str, float]:
        """The strategy's own metrics of the iteration, after the update (every rank calls it)."""
        return {}

    def stepwise(self, col: Collected) -> bool:
        """Rewards were computed at intermediate states (the log's ``train/reward_step{k}``)."""
        return True


def stop_point(learner: Any) -> None:
    """A phase boundary: every rank agrees to go on or to stop (the same collective on every rank)."""
    if learner.dist.stop_requested():
        raise StopRequested(stop.reason())


def log_once(learner: Any, msg: str) -> None:
    if msg not in learner.logged:
        learner.logged.add(msg)
        logging.getLogger("stepflow.train").info(msg)
