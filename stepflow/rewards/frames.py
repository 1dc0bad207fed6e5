"""A video reward from an image reward: the mean of its per-frame scores over sampled frames (``reward=frames``).

This is how the references score text-to-video (Wan): Flow-GRPO scores every ``frame_interval = 4``-th frame of each
video and averages the frames' rewards (``flow_grpo/ocr.py`` ``OcrScorer_video_or_image``: ``img[::4]``; it also
drops frames scoring 0 from the mean, which is not reproduced here), DanceGRPO scores the first frame with HPSv2
(``fastvideo/train_grpo_wan_2_1.py``, ``video_first_frame_to_pil``). The frame sampling is stated and configurable:

- ``stride`` (default, Flow-GRPO's): frames ``0, k, 2k, ...`` (``reward.stride=k``, default 4);
- ``first`` (DanceGRPO's): frame 0 only; ``last``: the last frame; ``all``: every frame;
- ``spaced``: ``reward.count`` frames evenly spaced from the first to the last (``round(linspace(0, F-1, count))``);
- ``indices``: the listed frames (``reward.indices=[0,8,16]``; negative counts from the end).

The sampled frames of every video are scored in one call of the image reward (B·n images, each with its video's
prompt and metadata); the score of a video is the mean over its n frames, and so is each component.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stepflow.errors import RewardLoadError, StepflowError
from stepflow.rewards.base import Reward, RewardOut

__all__ = ["FRAME_SAMPLING", "FrameReward", "frame_indices"]

FRAME_SAMPLING = ("stride", "first", "last", "all", "spaced", "indices")


def frame_indices(num_frames: int, frames: str = "stride", stride: int = 4, count: int | None = None,
                  indices: Sequence[int] | None = None) -> list[int]:
    """The frames of a ``num_frames``-frame video that ``frames`` samples (see the module docstring); a listed index
    outside the video is one line naming ``reward.indices``."""
    f = int(num_frames)
    if frames == "stride":
        return list(range(0, f, int(stride)))
    if frames == "first":
        return [0]
    if frames == "last":
        return [f - 1]
    if frames == "all":
        return list(range(f))
    if frames == "spaced":
        n = min(int(count), f)
        return sorted({int(round(x)) for x in torch.linspace(0, f - 1, n).tolist()})
    if frames == "indices":
        out = []
        for i in indices or []:
            j = int(i) + f if int(i) < 0 else int(i)
            if not 0 <= j < f:
                raise StepflowError(f"reward.indices: frame {i} is outside a video of {f} frames (0..{f - 1}); list "
                                    f"frames of the model's videos (model.num_frames)")
            out.append(j)
        return out
    raise StepflowError(f"reward.frames: must be one of {', '.join(FRAME_SAMPLING)}, got {frames!r}")


class FrameReward(Reward):
    """Scores videos (B, 3, F, H, W) with an image reward: the mean of its scores over the frames ``frames`` samples.

    image: the per-frame reward: a reward name of ``conf/reward`` (``"pickscore"``; ``image_overrides``: its
    ``key=value`` overrides) or a config with ``_target_``, or a built :class:`Reward`. frames / stride / count /
    indices: the frame sampling (module docstring).
    """

    modality = "video"

    def __init__(self, image: Any = "pickscore", frames: str = "stride", stride: int = 4, count: int | None = None,
                 indices: Sequence[int] | None = None, image_overrides: Sequence[str] = (), name: str | None = None):
        from stepflow.rewards.registry import build_reward

        if frames not in FRAME_SAMPLING:
            raise StepflowError(f"reward.frames: must be one of {', '.join(FRAME_SAMPLING)}, got {frames!r}")
        if frames == "stride" and not (isinstance(stride, int) and not isinstance(stride, bool) and stride >= 1):
            raise StepflowError(f"reward.stride: must be an integer >= 1 (every stride-th frame), got {stride!r}")
        if frames == "spaced" and not (isinstance(count, int) and not isinstance(count, bool) and count >= 1):
            raise StepflowError(f"reward.count: frames=spaced needs a frame count >= 1, got {count!r}")
        if frames == "indices" and not indices:
            raise StepflowError("reward.indices: frames=indices needs a non-empty list of frames, e.g. [0, 8, 16]")
        try:
            inner = build_reward(image, list(image_overrides)) if isinstance(image, str) else build_reward(
                dict(image) if isinstance(image, Mapping) else image)
        except RewardLoadError as e:  # point the override hint at the nested reward
            raise RewardLoadError(f"frames/{getattr(image, 'name', image)}: {e}") from None
        if inner.modality != "image":
            raise StepflowError(f"reward.image: {inner.describe()} already scores {inner.modality}s; reward=frames "
                                "wraps an image reward (use the video reward directly)")
        if inner.pairwise:
            raise StepflowError(f"reward.image: {inner.describe()} is a pairwise judge; reward=frames averages scalar "
                                "per-frame scores (use a scalar image reward)")
        self.image = inner
        self.frames, self.stride, self.count = frames, int(stride), count
        self.indices = None if indices is None else [int(i) for i in indices]
        self.name = name or f"{inner.name}_frames"
        self.batch_size = max(1, inner.batch_size)  # videos per call of score(): their frames go to the image reward

    def describe(self) -> str:
        how = {"stride": f"every {self.stride}th frame", "spaced": f"{self.count} evenly spaced frames",
               "indices": f"frames {self.indices}"}.get(self.frames, f"the {self.frames} frame(s)")
        return f"reward={self.name} (the mean of {self.image.describe()} over {how})"

    def sampled(self, num_frames: int) -> list[int]:
        """The frames scored in a ``num_frames``-frame video."""
        return frame_indices(num_frames, self.frames, self.stride, self.count, self.indices)

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict[str, Any]] | None) -> RewardOut:
        b, f = images.shape[0], images.shape[2]
        idx = self.sampled(f)
        n = len(idx)
        frames = images[:, :, idx].transpose(1, 2).flatten(0, 1)  # (B·n, 3, H, W), row i·n + j = frame idx[j] of i
        rep = [p for p in prompts for _ in range(n)]
        out = self.image(frames, rep, None if meta is None else [m for m in meta for _ in range(n)])
        comps = {k: v.float().view(b, n).mean(1) for k, v in out.components.items()}
        return RewardOut(out.scores.float().view(b, n).mean(1), comps)
