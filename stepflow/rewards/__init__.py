"""Reward models. Each takes images (B, 3, H, W) in [0, 1] and prompts and returns a RewardOut."""

from stepflow.rewards.base import Reward, RewardOut

__all__ = ["Reward", "RewardOut"]
