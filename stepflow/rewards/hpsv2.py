"""HPS v2 / v2.1 (Human Preference Score, Wu et al. 2023) on open_clip.

The model is open_clip ``ViT-H-14`` with the fine-tuned HPS checkpoint (``xswu/HPSv2``, file
``HPS_v2.1_compressed.pt``; ``HPS_v2_compressed.pt`` for v2.0), whose ``state_dict`` replaces all CLIP weights.
HPSv2's ``img_score.py`` computes ``logits = image_features @ text_features.T`` with the normalized features of
``model(image, text)`` and takes the diagonal, so the score is the **cosine** of the L2-normalized embeddings (no
logit scale; typical v2.1 values 0.25-0.35). Tokenization is open_clip's (context 77).

Image path (the official one): the decoded float image in [0, 1] is rounded to uint8 (``(x * 255).round()``, as
Flow-GRPO does before every reward) and made a PIL image, which goes through HPSv2's own eval transform, not
open_clip's default. ``img_score.py`` builds the model with ``create_model_and_transforms(...,
light_augmentation=True)``, whose ``preprocess_val`` is ``hpsv2/src/open_clip/transform.py::image_transform(224,
is_train=False, resize_longest_max=True)``:

    convert RGB -> ToTensor (uint8 / 255) -> ResizeMaxSize(224): scale = 224 / max(H, W),
    (h, w) = (round(H * scale), round(W * scale)), torchvision ``F.resize`` of the *float tensor*, bicubic,
    then zero padding to 224 x 224 (left/top pad = pad // 2) -> Normalize(CLIP mean, std)

i.e. the whole image is kept and letterboxed in black (open_clip's default would resize the short side and crop the
long one). The resize runs on the float tensor (HPSv2 moved ``ToTensor`` before the resize), so it is neither
rounded to uint8 nor clamped; torchvision >= 0.17 antialiases tensor resizes by default, older torchvision did not
(``antialias=False`` reproduces the scorer under torchvision < 0.17). One deviation: when the long side is already
224 the official transform skips the resize *and the padding*, and a non-square input then fails in the ViT; here
such an image is padded instead.

``reward.dtype=bfloat16`` runs the open_clip model in bf16 (the cosine is taken in fp32); HPSv2's own scorer runs
under CUDA fp16 autocast. The checkpoint is read with ``torch.load(weights_only=True)``: HPSv2's training code saves
``{"iterations", "name", "state_dict", "optimizer"[, "scaler"]}`` (``src/training/file_utils.py::save_ckpt``), i.e.
ints, strings, dicts and tensors, which torch's default allowlist covers; no extra global is allowed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from PIL import Image
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

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class HPSv2Transform:
    """HPSv2's ``preprocess_val`` (``image_transform(size, is_train=False, resize_longest_max=True)``, see the module
    docstring): PIL image -> (3, size, size) float tensor."""

    def __init__(self, size: int, mean: Sequence[float] = OPENAI_CLIP_MEAN, std: Sequence[float] = OPENAI_CLIP_STD,
                 antialias: bool = True):
        self.size, self.antialias = int(size), bool(antialias)
        self.mean = torch.tensor(mean, dtype=torch.float32)[:, None, None]
        self.std = torch.tensor(std, dtype=torch.float32)[:, None, None]

    def __call__(self, image: Image.Image) -> Tensor:
        import torchvision.transforms.functional as TF

        x = TF.to_tensor(image.convert("RGB"))  # (3, H, W) float32 = uint8 / 255
        height, width = x.shape[1:]
        scale = self.size / float(max(height, width))
        if scale != 1.0:
            new = (round(height * scale), round(width * scale))  # Python round, as ResizeMaxSize
            x = TF.resize(x, list(new), TF.InterpolationMode.BICUBIC, antialias=self.antialias)
        pad_h, pad_w = self.size - x.shape[1], self.size - x.shape[2]
        if pad_h or pad_w:
            x = TF.pad(x, [pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
        return (x - self.mean) / self.std


class HPSv2(Reward):
    """checkpoint: a local file, a local dir holding ``filename``, or an HF repo id (default ``xswu/HPSv2``).
    arch: the open_clip architecture (``ViT-H-14``); model_config: optional path to an open_clip model-config JSON
    registered under ``arch`` (for custom/tiny architectures). ``scale`` multiplies the cosine. ``antialias``: the
    tensor resize's antialiasing (see the module docstring)."""

    name = "hpsv2"

    def __init__(self, checkpoint: str = "xswu/HPSv2", filename: str = "HPS_v2.1_compressed.pt",
                 arch: str = "ViT-H-14", model_config: str | None = None, scale: float = 1.0, antialias: bool = True,
                 device: str = "auto", dtype: str = "float32", batch_size: int = 32):
        import open_clip

        self.device, self.dtype = pick_device(device), pick_dtype(dtype)
        if model_config is not None:
            with load_guard("open_clip model config", str(model_config), "reward.model_config"):
                with open(model_config) as f:
                    cfg = json.load(f)
                open_clip.factory._MODEL_CONFIGS[arch] = cfg  # add_model_config() keys by file name; we key by arch
        path = resolve_file(checkpoint, filename, "HPSv2 checkpoint", "reward.checkpoint")
        sd = load_state_dict(path, "HPSv2 checkpoint", "reward.checkpoint")
        with load_guard(f"open_clip {arch}", arch, "reward.arch"):
            model = open_clip.create_model(arch, pretrained=None, device="cpu")
            tokenizer = open_clip.get_tokenizer(arch)
        with load_guard("HPSv2 checkpoint", path, "reward.checkpoint"):
            res = model.load_state_dict(sd, strict=False)
        check_keys(res.missing_keys, "HPSv2 checkpoint", path, "reward.checkpoint", ignore=("attn_mask",))
        size = model.visual.image_size
        if isinstance(size, (tuple, list)):
            if size[0] != size[1]:
                raise ValueError(f"hpsv2: HPSv2's transform needs a square image_size, {arch} has {tuple(size)}")
            size = size[0]
        self.preprocess = HPSv2Transform(size, getattr(model.visual, "image_mean", None) or OPENAI_CLIP_MEAN,
                                         getattr(model.visual, "image_std", None) or OPENAI_CLIP_STD, antialias)
        self.model = model.eval().to(self.device, self.dtype).requires_grad_(False)
        self.tokenizer = tokenizer
        self.scale, self.batch_size = float(scale), batch_size
        self.checkpoint_path = os.fspath(path)

    def pixels(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> the (B, 3, 224, 224) fp32 tensor HPSv2's scorer feeds the model."""
        return torch.stack([self.preprocess(im) for im in to_pil(images)])

    @torch.no_grad()
    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        pix = self.pixels(images).to(self.device, self.dtype)
        txt = self.tokenizer(list(prompts)).to(self.device)
        img_f = F.normalize(self.model.encode_image(pix).float(), dim=-1)  # normalized in fp32 whatever the dtype
        txt_f = F.normalize(self.model.encode_text(txt).float(), dim=-1)
        cos = (img_f * txt_f).sum(-1)  # = diag(img_f @ txt_f.T), HPSv2's score
        return RewardOut(self.scale * cos, {"cosine": cos})
