"""HPS v2 / v2.1 (Human Preference Score, Wu et al. 2023) on open_clip.

The model is open_clip ``ViT-H-14`` with the fine-tuned HPS checkpoint (``xswu/HPSv2``, file
``HPS_v2.1_compressed.pt``; ``HPS_v2_compressed.pt`` for v2.0), whose ``state_dict`` replaces all CLIP weights.
HPSv2's ``img_score.py`` computes ``logits = image_features @ text_features.T`` with the normalized features of
``model(image, text)`` and takes the diagonal, so the score is the **cosine** of the L2-normalized embeddings (no
logit scale; typical v2.1 values 0.25-0.35). Preprocessing is open_clip's eval transform (resize shortest side to
224 bicubic, center crop, CLIP mean/std) on the uint8-rounded image, tokenization open_clip's (context 77).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.loading import (
    check_keys,
    load_guard,
    load_state_dict,
    pick_device,
    pick_dtype,
    resolve_file,
    to_pil,
)


class HPSv2(Reward):
    """checkpoint: a local file, a local dir holding ``filename``, or an HF repo id (default ``xswu/HPSv2``).
    arch: the open_clip architecture (``ViT-H-14``); model_config: optional path to an open_clip model-config JSON
    registered under ``arch`` (for custom/tiny architectures). ``scale`` multiplies the cosine."""

    name = "hpsv2"

    def __init__(self, checkpoint: str = "xswu/HPSv2", filename: str = "HPS_v2.1_compressed.pt",
                 arch: str = "ViT-H-14", model_config: str | None = None, scale: float = 1.0,
                 weights_only: bool = True, device: str = "auto", dtype: str = "float32", batch_size: int = 32):
        import open_clip

        self.device, self.dtype = pick_device(device), pick_dtype(dtype)
        if model_config is not None:
            with load_guard("open_clip model config", str(model_config), "reward.model_config"):
                with open(model_config) as f:
                    cfg = json.load(f)
                open_clip.factory._MODEL_CONFIGS[arch] = cfg  # add_model_config() keys by file name; we key by arch
        path = resolve_file(checkpoint, filename, "HPSv2 checkpoint", "reward.checkpoint")
        sd = load_state_dict(path, "HPSv2 checkpoint", "reward.checkpoint", weights_only=weights_only)
        with load_guard(f"open_clip {arch}", arch, "reward.arch"):
            model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=None, device="cpu")
            tokenizer = open_clip.get_tokenizer(arch)
        with load_guard("HPSv2 checkpoint", path, "reward.checkpoint"):
            res = model.load_state_dict(sd, strict=False)
        check_keys(res.missing_keys, "HPSv2 checkpoint", path, "reward.checkpoint", ignore=("attn_mask",))
        self.model = model.eval().to(self.device, self.dtype).requires_grad_(False)
        self.preprocess, self.tokenizer = preprocess, tokenizer
        self.scale, self.batch_size = float(scale), batch_size
        self.checkpoint_path = os.fspath(path)

    @torch.no_grad()
    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        pix = torch.stack([self.preprocess(im) for im in to_pil(images)]).to(self.device, self.dtype)
        txt = self.tokenizer(list(prompts)).to(self.device)
        img_f = self.model.encode_image(pix, normalize=True).float()
        txt_f = self.model.encode_text(txt, normalize=True).float()
        cos = (img_f * txt_f).sum(-1)  # = diag(img_f @ txt_f.T), HPSv2's score
        return RewardOut(self.scale * cos, {"cosine": cos})
