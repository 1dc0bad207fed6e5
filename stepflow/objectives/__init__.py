"""What the update minimises: ``objective=<name>`` (docs/method.md §11), chosen once at build time.

An :class:`~stepflow.objectives.base.Objective` (a part: ``objective=<option>``, its YAML's ``_target_``) declares what it needs from an iteration (log-probs or not, the
rollout sampler, the states whose x̂0 it reads, which steps or times it trains, extra copies of the weights) and
computes the loss of one term on a micro-batch; :func:`stepflow.core.algorithm.iteration` asks it instead of branching.

=============  ==========================================================================================
grpo           the clipped likelihood ratio of the rollout's SDE steps + β·KL (Flow-GRPO; the default)
distill        gain-weighted ODE progressive distillation (paper App. A)
nft            DiffusionNFT: implicit positive / negative policies on the forward process (NVlabs/DiffusionNFT)
awm            Advantage Weighted Matching: advantage-weighted flow matching (scxue/advantage_weighted_matching)
advantageflow  AdvantageFlow: advantage-weighted x0 least squares with proximity terms (arXiv 2605.26013)
=============  ==========================================================================================
"""

from __future__ import annotations

from stepflow.config import TrainConfig
from stepflow.objectives.base import ForwardObjective, Objective
from stepflow.objectives.forward import AdvantageFlow, Awm, Nft
from stepflow.objectives.grpo import Distill, Grpo

__all__ = ["Objective", "ForwardObjective", "Grpo", "Distill", "Nft", "Awm", "AdvantageFlow", "build_objective"]


def build_objective(objective: Objective, train: TrainConfig) -> Objective:
    """The objective (built from its option, ``stepflow.config.ObjectiveConfig``) with the update's settings."""
    return objective.bind(train)
