"""Edit rewards: judge an edited image against its source (``Reward.reads_source``).

``source_similarity`` (``reward=source_similarity``): ``1 − mean |edited − source|`` over pixels and channels, in
[0, 1] (1: the edit left the source unchanged). A pixel-level stand-in for flow_grpo's ``image_similarity`` (CLIP
cosine between the edited and the reference image, half of its Kontext reward), measurable on tiny images without
weights: the smoke runs' reward of the editing families, and the consistency half of an edit reward that a
``reward=multi`` pairs with an instruction-following one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from stepflow.rewards.base import Reward, RewardOut

__all__ = ["SourceSimilarity"]


class SourceSimilarity(Reward):
    """``1 − mean |edited − source|`` per image (source resized to the edited image's size by the data layer)."""

    name = "source_similarity"
    batch_size = 256
    reads_source = True

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict[str, Any]] | None,
              source: Tensor | None = None) -> RewardOut:
        l1 = (images - source.to(images.device)).abs().mean(dim=(1, 2, 3))
        return RewardOut(1.0 - l1, {"l1": l1})
