"""Weighted combination of rewards (Flow-GRPO's ``multi_score``), e.g. ``{ocr: 0.8, pickscore: 0.2}``.

With r_i (B,) the raw scores of sub-reward i on the batch of one call and w_i its weight:

- ``sum`` (default; Flow-GRPO's ``avg``):    s = Σ_i w_i · r_i
- ``sum_then_normalize``:                    s = z(Σ_i w_i · r_i)
- ``normalize_then_sum``:                    s = Σ_i w_i · z(r_i)

where z is a per-batch standardization over the B images of that call: z(x) = (x − mean(x)) / (std(x) + eps),
population std (divide by B), eps = 1e-6; for B = 1, z(x) = 0. The normalizing modes make a score depend on the
rest of the batch, so they are meant for training batches, not for comparing single evaluation images; the whole
batch is scored in one call (no chunking at this level; each sub-reward still chunks its own work).

Components: ``<name>`` = r_i (raw, unweighted), ``<name>/<component>`` = that reward's own components, and
``weighted_sum`` = Σ_i w_i · r_i (before any normalization).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stepflow.errors import RewardLoadError
from stepflow.rewards.base import Reward, RewardOut

MODES = ("sum", "sum_then_normalize", "normalize_then_sum")


def standardize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """(x − mean) / (population std + eps) over the batch; zeros for a batch of one."""
    if x.numel() < 2:
        return torch.zeros_like(x)
    return (x - x.mean()) / (x.std(unbiased=False) + eps)


class MultiReward(Reward):
    """rewards: ``{name: Reward or reward config}`` (configs are built with ``build_reward``);
    weights: ``{name: weight}`` with exactly the same names; mode: see the module docstring."""

    name = "multi"
    batch_size = 1 << 30

    def __init__(self, rewards: Mapping[str, Any], weights: Mapping[str, float], mode: str = "sum",
                 eps: float = 1e-6):
        from stepflow.rewards.registry import build_reward

        if mode not in MODES:
            raise ValueError(f"multi reward: mode must be one of {MODES}, got {mode!r}")
        names, wnames = list(rewards), list(weights)
        if not names:
            raise ValueError("multi reward: no sub-rewards given (reward.rewards is empty)")
        if set(names) != set(wnames):
            raise ValueError(f"multi reward: rewards {sorted(names)} and weights {sorted(wnames)} must name the same "
                             f"rewards (add reward.weights.<name>=w or remove the reward)")
        self.rewards: dict[str, Reward] = {}
        for n in names:
            try:
                self.rewards[n] = build_reward(rewards[n])
            except RewardLoadError as e:  # point the override hint at the nested key
                msg = str(e).replace("set reward.", f"set reward.rewards.{n}.")
                raise RewardLoadError(f"multi/{n}: {msg}") from None
        kinds = {n: r.modality for n, r in self.rewards.items()}
        if len(set(kinds.values())) > 1:
            raise ValueError(f"multi reward: the sub-rewards score different inputs ({kinds}); wrap the image rewards "
                             "for a video model in reward=frames")
        self.modality = next(iter(kinds.values()))  # what every sub-reward scores: images or videos
        self.weights: dict[str, float] = {n: float(weights[n]) for n in names}
        self.mode, self.eps = mode, float(eps)
        #: an edit's source images are read once here and handed to the sub-rewards that read them
        self.reads_source = any(r.reads_source for r in self.rewards.values())

    def describe(self) -> str:
        return f"reward={self.name} of " + ", ".join(r.describe() for r in self.rewards.values())

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None,
              source: Tensor | None = None) -> RewardOut:
        comps: dict[str, Tensor] = {}
        weighted = torch.zeros(images.shape[0])
        normalized = torch.zeros(images.shape[0])
        for n, reward in self.rewards.items():
            out = reward(images, prompts, meta, source=source)
            r = out.scores.float().cpu()
            comps[n] = r
            for k, v in out.components.items():
                comps[f"{n}/{k}"] = v
            weighted = weighted + self.weights[n] * r
            if self.mode == "normalize_then_sum":
                normalized = normalized + self.weights[n] * standardize(r, self.eps)
        comps["weighted_sum"] = weighted
        if self.mode == "sum":
            s = weighted
        elif self.mode == "sum_then_normalize":
            s = standardize(weighted, self.eps)
        else:
            s = normalized
        return RewardOut(s, comps)
