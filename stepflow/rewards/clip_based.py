"""CLIP-embedding rewards on transformers ``CLIPModel``: PickScore and CLIPScore (and the embedder the aesthetic
predictor shares).

Image path (the official one): the decoded float image in [0, 1] is rounded to uint8 (``(x * 255).round()``, as
Flow-GRPO's ``pickscore_score``/``aesthetic_score`` do), made a PIL image and passed through the model's CLIP image
processor **with PIL resizing**: ``CLIPImageProcessorPil`` (transformers 5) is the PIL/NumPy processor that
transformers 4 called ``CLIPImageProcessor`` and that PickScore's README, Flow-GRPO's ``pickscore_scorer.py`` and
``aesthetic_scorer.py`` ran: ``PIL.Image.resize`` bicubic of the short side to 224 (long side
``int(224 * long / short)``), center crop at ``((h - 224) // 2, (w - 224) // 2)``, ``x / 255``, CLIP mean/std.
transformers 5's default ``CLIPImageProcessor`` resizes torch tensors instead, which is not the same resampling
(PickScore logits move by up to ~6e-3 on non-square images), so it is not used. Prompts are tokenized with padding,
truncation and ``max_length=77``.

``reward.dtype=bfloat16`` runs the CLIP towers in bf16; normalization, cosine and ``logit_scale`` are fp32.

transformers 5 note: ``get_image_features``/``get_text_features`` return a ``BaseModelOutputWithPooling`` whose
``pooler_output`` is the projected embedding (4.x returned the tensor); :func:`_features` accepts both.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.loading import check_local, load_guard, pick_device, pick_dtype, to_pil


def parse_scale(x: float | int | str) -> float:
    """``0.5``, ``"1/26"`` or ``"0.5"`` -> float (YAML cannot write 1/26 as a number)."""
    return float(Fraction(x)) if isinstance(x, str) else float(x)


def _features(out: Any) -> Tensor:
    """The projected embedding from ``get_*_features`` on transformers 4 (a tensor) or 5 (an output object)."""
    if isinstance(out, Tensor):
        return out
    pooled = getattr(out, "pooler_output", None)
    if pooled is None:
        raise TypeError(f"get_*_features returned {type(out).__name__} without pooler_output")
    return pooled


class CLIPEmbedder:
    """A transformers ``CLIPModel`` + its processor, loaded from HF ids or local ``save_pretrained`` dirs.

    model_path: the CLIPModel weights; processor_path: the processor (tokenizer + image processor), default the same.
    key_prefix: the config-key prefix shown in load errors (``reward.``).
    """

    def __init__(self, model_path: str, processor_path: str | None = None, device: str = "auto",
                 dtype: str = "float32", text: bool = True, what: str = "CLIP", key_prefix: str = "reward.",
                 model_key: str = "model_path", processor_key: str = "processor_path"):
        from transformers import AutoTokenizer, CLIPImageProcessorPil, CLIPModel

        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype)
        processor_path = processor_path or model_path
        pkey = key_prefix + (processor_key if processor_path != model_path else model_key)
        mpath = check_local(model_path, f"{what} model", key_prefix + model_key)
        ppath = check_local(processor_path, f"{what} processor", pkey)
        with load_guard(f"{what} model", model_path, key_prefix + model_key):
            self.model = CLIPModel.from_pretrained(mpath).eval().to(self.device, self.dtype)
        with load_guard(f"{what} processor", processor_path, pkey):
            # the PIL processor (transformers 4's CLIPImageProcessor), whatever image_processor_type the config names
            self.image_processor = CLIPImageProcessorPil.from_pretrained(ppath)
            self.tokenizer = AutoTokenizer.from_pretrained(ppath) if text else None
        self.model.requires_grad_(False)

    def pixels(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> the fp32 ``pixel_values`` the official scorers feed the model (module docstring)."""
        return self.image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]

    @torch.no_grad()
    def image_embeds(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> (B, D) projected, *unnormalized* image embeddings (fp32)."""
        pix = self.pixels(images).to(self.device, self.dtype)
        return _features(self.model.get_image_features(pixel_values=pix)).float()

    @torch.no_grad()
    def text_embeds(self, prompts: Sequence[str]) -> Tensor:
        """B prompts -> (B, D) projected, *unnormalized* text embeddings."""
        tok = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
        out = self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                           attention_mask=tok["attention_mask"].to(self.device))
        return _features(out).float()

    def cosine_and_scale(self, images: Tensor, prompts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """cos(normalized image emb, normalized text emb) (B,) and ``logit_scale.exp()`` (a scalar)."""
        img = F.normalize(self.image_embeds(images), dim=-1)
        txt = F.normalize(self.text_embeds(prompts), dim=-1)
        return (img * txt).sum(-1), self.model.logit_scale.detach().float().exp()


class PickScore(Reward):
    """PickScore (Kirstain et al. 2023): ``scale · logit_scale.exp() · cos(img, txt)``, model
    ``yuvalkirstain/PickScore_v1``.

    The processor is the CLIP-H one (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``). ``scale`` defaults to 1/26, as
    Flow-GRPO, which puts typical scores near 0.8-0.95; ``scale: 1`` gives the paper's raw logit (~21-23).
    Components: ``logit`` (the unscaled PickScore) and ``cosine``.
    """

    name = "pickscore"

    def __init__(self, model_path: str = "yuvalkirstain/PickScore_v1",
                 processor_path: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", scale: float | str = "1/26",
                 device: str = "auto", dtype: str = "float32", batch_size: int = 32):
        self.clip = CLIPEmbedder(model_path, processor_path, device, dtype, what="PickScore")
        self.scale = parse_scale(scale)
        self.batch_size = batch_size

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        cos, logit_scale = self.clip.cosine_and_scale(images, prompts)
        logit = logit_scale * cos
        return RewardOut(self.scale * logit, {"logit": logit, "cosine": cos})


class CLIPScore(Reward):
    """CLIP image-text similarity on ``openai/clip-vit-large-patch14`` (or any CLIPModel).

    mode:
      - ``hessel`` (default): ``w · max(cos, 0)`` with ``w = 2.5``, the CLIPScore of Hessel et al. (2021);
      - ``cosine``: the plain cosine of the normalized embeddings, in [-1, 1];
      - ``logit``: ``scale · logit_scale.exp() · cos``; Flow-GRPO's ``clipscore`` is this with ``scale: 1/30``
        (``logits_per_image.diag() / 30``).
    Components: ``cosine``.
    """

    name = "clipscore"
    MODES = ("hessel", "cosine", "logit")

    def __init__(self, model_path: str = "openai/clip-vit-large-patch14", processor_path: str | None = None,
                 mode: str = "hessel", w: float = 2.5, scale: float | str = 1.0, device: str = "auto",
                 dtype: str = "float32", batch_size: int = 32):
        if mode not in self.MODES:
            raise ValueError(f"clipscore: mode must be one of {self.MODES}, got {mode!r}")
        self.clip = CLIPEmbedder(model_path, processor_path, device, dtype, what="CLIP")
        self.mode, self.w, self.scale, self.batch_size = mode, float(w), parse_scale(scale), batch_size

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        cos, logit_scale = self.clip.cosine_and_scale(images, prompts)
        if self.mode == "hessel":
            s = self.w * cos.clamp(min=0)
        elif self.mode == "cosine":
            s = cos
        else:
            s = self.scale * logit_scale * cos
        return RewardOut(s, {"cosine": cos})
