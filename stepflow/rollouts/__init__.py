"""Rollout strategies (:class:`stepflow.rollouts.base.RolloutStrategy`): how an iteration collects the samples it
trains on and the rewards its credit reads. A credit names its strategy (``Credit.rollout_strategy``)."""

from stepflow.rollouts.base import RolloutStrategy

__all__ = ["RolloutStrategy"]
