"""The Reward interface: ``reward(images, prompts, meta) -> RewardOut``.

A reward scores what its :attr:`Reward.modality` says: ``"image"`` (B, 3, H, W) or ``"video"`` (B, 3, F, H, W), both
in [0, 1]. An image reward scores a video model's frames through :class:`stepflow.rewards.frames.FrameReward` (the
mean of a per-frame score over the sampled frames, as Flow-GRPO and DanceGRPO score Wan); :func:`check_modality`
refuses a reward whose modality is not the model's, in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from stepflow.errors import StepflowError

#: what a reward scores / a policy decodes to, and the shape of one batch of it
MODALITIES = {"image": "(B, 3, H, W)", "video": "(B, 3, F, H, W)"}


@dataclass
class RewardOut:
    """scores: (B,) fp32, the reward the RL loop maximises; components: named (B,) tensors for logging."""

    scores: Tensor
    components: dict[str, Tensor] = field(default_factory=dict)


class Reward:
    """Base class. Subclasses implement :meth:`score`; ``__call__`` validates shapes and batches.

    images: (B, 3, H, W) float in [0, 1] (a ``"video"`` reward: videos (B, 3, F, H, W)); prompts: B strings; meta:
    optional B dicts (e.g. GenEval metadata).
    """

    name: str = "reward"
    #: what :meth:`score` reads: ``"image"`` (B, 3, H, W) or ``"video"`` (B, 3, F, H, W) (:data:`MODALITIES`)
    modality: str = "image"
    #: largest batch handed to :meth:`score` at once (the loop makes one call per iteration; we chunk here)
    batch_size: int = 64
    #: a pairwise judge: :meth:`compare` is its own (a preference model that reads two images, UnifiedReward-Think in
    #: Pref-GRPO), and a credit that reads preferences calls it on the images; False: :meth:`compare` follows
    #: from the scalar scores (:func:`preference_from_scores`), which such a credit reads without new reward calls
    pairwise: bool = False
    #: capability: the reward judges an edit against its source image (an editing data set's): :meth:`score` then
    #: receives ``source=`` (B, 3, H, W) in [0, 1], each row's source image at the edited image's size, read off the
    #: prompt records (:func:`stepflow.core.data.source_images`) unless the caller passes it. False: ``score`` is
    #: called as always (a reward that ignores the source keeps working on edits)
    reads_source: bool = False

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict[str, Any]] | None) -> RewardOut:
        """Score B images (a :attr:`reads_source` reward: ``score(images, prompts, meta, source=...)``)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The reward in a message (``reward=<name>``; a served one adds where it is served)."""
        return f"reward={self.name}"

    @torch.no_grad()
    def compare(self, images_a: Tensor, images_b: Tensor, prompts: Sequence[str],
                meta: Sequence[dict[str, Any]] | None = None) -> Tensor:
        """P(a beats b) for P pairs: images_a, images_b (P, 3, H, W) in [0, 1], each pair for its prompt -> (P,) fp32 in
        [0, 1]. The default (a scalar reward) scores both sides and compares: 1 if a scores higher, 0 if lower, 0.5
        on a tie (:func:`preference_from_scores`). A pairwise judge overrides it (and sets ``pairwise = True``)."""
        if images_a.shape != images_b.shape:
            raise ValueError(f"reward {self.name}: compare needs pairs of images of one shape, got "
                             f"{tuple(images_a.shape)} and {tuple(images_b.shape)}")
        return preference_from_scores(self(images_a, prompts, meta).scores, self(images_b, prompts, meta).scores)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict[str, Any]] | None = None,
                 source: Tensor | None = None) -> RewardOut:
        """Validate, chunk by :attr:`batch_size`, score. ``source``: (B, 3, H, W) source images of an edit for a
        :attr:`reads_source` reward (None: read off ``meta``); ignored by a reward that does not read it."""
        ndim = 5 if self.modality == "video" else 4
        if images.ndim != ndim or images.shape[1] != 3:
            raise ValueError(f"reward {self.name}: {self.modality}s must be {MODALITIES[self.modality]} in [0, 1], got "
                             f"{tuple(images.shape)}" + (f"; {_FIX[self.modality]}" if images.ndim == 9 - ndim else ""))
        if len(prompts) != images.shape[0]:
            raise ValueError(f"reward {self.name}: {images.shape[0]} images but {len(prompts)} prompts")
        if self.reads_source and source is None:
            from stepflow.core.data import source_images

            source = source_images(meta, images.shape[-2:], what=self.describe())
        if self.reads_source and source.shape != images.shape:
            raise ValueError(f"reward {self.name}: source images {tuple(source.shape)} do not match the edited images "
                             f"{tuple(images.shape)}")
        outs = []
        for i in range(0, images.shape[0], self.batch_size):
            sl = slice(i, i + self.batch_size)
            extra = {"source": source[sl].float().clamp(0, 1)} if self.reads_source else {}
            outs.append(self.score(images[sl].float().clamp(0, 1), list(prompts[sl]), None if meta is None else list(meta[sl]),
                                   **extra))
        comps = {k: torch.cat([o.components[k].float().cpu() for o in outs]) for k in outs[0].components}
        return RewardOut(torch.cat([o.scores.float().cpu() for o in outs]), comps)


def preference_from_scores(scores_a: Tensor, scores_b: Tensor) -> Tensor:
    """P(a beats b) of a scalar reward: 1 where ``scores_a > scores_b``, 0 where lower, 0.5 on a tie (as Pref-GRPO counts
    a judge's tie, CodeGoat24/Pref-GRPO@c06662d fastvideo/train_flux_pref_grpo.py L110-120). (P,) -> (P,) fp32."""
    a, b = scores_a.float(), scores_b.float()
    return (a > b).float() + 0.5 * (a == b).float()


_FIX = {"image": "score a video model's frames with reward=frames reward.image=<this reward>",
        "video": "this reward scores videos (model.modality=video), not images"}


def check_modality(model_modality: str, reward: Reward, model: str = "the model") -> None:
    """One line when ``reward`` does not score what the model decodes to (``model_modality``: ``"image"`` /
    ``"video"``, :attr:`stepflow.policies.base.FlowPolicy.modality`): a video reward on an image model, or an image
    reward on a video model (which :class:`stepflow.rewards.frames.FrameReward` makes a video reward)."""
    mine = getattr(reward, "modality", "image")
    if mine == model_modality:
        return
    if model_modality == "video":
        raise StepflowError(f"reward: {reward.describe()} scores images {MODALITIES['image']}, but {model} makes videos "
                            f"{MODALITIES['video']}; score its frames with reward=frames reward.image=<that reward> "
                            "(the mean of the per-frame scores over every 4th frame, Flow-GRPO's Wan sampling)")
    raise StepflowError(f"reward: {reward.describe()} scores videos {MODALITIES['video']}, but {model} makes images "
                        f"{MODALITIES['image']}; give this model an image reward (reward=<name>, e.g. the reward.image of reward=frames)")
