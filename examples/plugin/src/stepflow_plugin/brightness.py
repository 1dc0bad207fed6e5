"""A reward: the mean luminance of each image (``reward=brightness``).

luminance = 0.299·R + 0.587·G + 0.114·B (ITU-R BT.601 luma weights) per pixel, averaged over the image, in [0, 1].
``target`` null: the score is that mean (brighter is better); a number in [0, 1]: ``1 − |mean − target|`` (closest to
the target brightness is best).
"""

from __future__ import annotations

import math

import torch

from stepflow.rewards.base import Reward, RewardOut

__all__ = ["Brightness", "REC601"]

#: ITU-R BT.601 luma weights of R, G, B
REC601 = (0.299, 0.587, 0.114)


class Brightness(Reward):
    """Mean Rec. 601 luminance of each image (``target`` null) or ``1 − |mean − target|``. Components (each (B,),
    logged as ``train/<name>``): ``luminance``, the mean luminance whatever ``target`` is."""

    name = "brightness"  # the metric names: eval/brightness

    def __init__(self, target: float | None = None, batch_size: int = 64):
        # rewards are built by hydra.utils.instantiate: a ValueError is shown as one line, prefixed with "reward: "
        # unless it already starts with "reward", so the message names its field in full
        if target is not None and not (isinstance(target, (int, float)) and not isinstance(target, bool)
                                       and math.isfinite(target) and 0.0 <= target <= 1.0):
            raise ValueError(f"reward.target: must be null or a float in [0, 1], got {target!r}")
        if not (isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1):
            raise ValueError(f"reward.batch_size: must be an integer >= 1, got {batch_size!r}")
        self.target = None if target is None else float(target)
        self.batch_size = batch_size

    def score(self, images, prompts, meta):
        """images (B, 3, H, W) in [0, 1] (``Reward.__call__`` has checked and clamped them); prompts, meta unused."""
        w = torch.tensor(REC601, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
        luminance = (images.float() * w).sum(dim=1).mean(dim=(1, 2))  # (B,)
        scores = luminance if self.target is None else 1.0 - (luminance - self.target).abs()
        return RewardOut(scores=scores, components={"luminance": luminance})
