"""The Reward interface: ``reward(images, prompts, meta) -> RewardOut``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class RewardOut:
    """scores: (B,) fp32, the reward the RL loop maximises; components: named (B,) tensors for logging."""

    scores: Tensor
    components: dict[str, Tensor] = field(default_factory=dict)


class Reward:
    """Base class. Subclasses implement :meth:`score`; ``__call__`` validates shapes and batches.

    images: (B, 3, H, W) float in [0, 1]; prompts: B strings; meta: optional B dicts (e.g. GenEval metadata).
    """

    name: str = "reward"
    #: largest batch handed to :meth:`score` at once (the loop makes one call per iteration; we chunk here)
    batch_size: int = 64

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict[str, Any]] | None) -> RewardOut:
        raise NotImplementedError

    def describe(self) -> str:
        """The reward in a message (``reward=<name>``; a served one adds where it is served)."""
        return f"reward={self.name}"

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict[str, Any]] | None = None) -> RewardOut:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"reward {self.name}: images must be (B, 3, H, W) in [0, 1], got {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"reward {self.name}: {images.shape[0]} images but {len(prompts)} prompts")
        outs = []
        for i in range(0, images.shape[0], self.batch_size):
            sl = slice(i, i + self.batch_size)
            outs.append(self.score(images[sl].float().clamp(0, 1), list(prompts[sl]), None if meta is None else list(meta[sl])))
        comps = {k: torch.cat([o.components[k].float().cpu() for o in outs]) for k in outs[0].components}
        return RewardOut(torch.cat([o.scores.float().cpu() for o in outs]), comps)
