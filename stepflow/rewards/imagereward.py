"""ImageReward (Xu et al. 2023) on stepflow's own BLIP port; loads the official ``THUDM/ImageReward`` checkpoint.

The ``image-reward`` package is not a dependency (it pins timm 0.6.13 and breaks on transformers 5); this is a
re-implementation of its scoring path with the same state-dict names:

    tokens  = BertTokenizer(prompt, padding="max_length", truncation=True, max_length=35)   ([CLS] first, kept)
    img     = blip.visual_encoder(Normalize_CLIP(CenterCrop(Resize_bicubic(image, 224))))     (B, 1+N, 1024)
    h       = blip.text_encoder(tokens, encoder_hidden_states=img)  (BERT + cross-attention)  (B, 35, 768)
    reward  = (mlp(h[:, 0]) - 0.16717362830052426) / 1.0333394966054072

with ``mlp`` Linear 768→1024→128→64→16→1 (dropouts 0.2/0.2/0.1, no activations; keys ``mlp.layers.{0,2,4,6,7}``).
The ViT sizes are read from the checkpoint (ImageReward: ViT-L/16 at 224 px); the head count is not stored, so it is
the ``vit_num_heads`` option (16). The head's input size follows the med config's ``hidden_size`` (768 for the
real model), so tiny test models can use a narrow BERT. ``blip.vision_proj``/``blip.text_proj`` (ITC heads) are in
the checkpoint but unused by the score, and are not built.

Image path (the official one): the decoded float image in [0, 1] is rounded to uint8 (``(x * 255).round()``, as
Flow-GRPO's ``imagereward_score``), made a PIL image and passed through ImageReward's ``_transform(224)``
(``ImageReward/ImageReward.py``): torchvision ``Resize(224, BICUBIC)`` on the PIL image (``PIL.Image.resize`` of the
short side to 224, long side ``int(224 * long / short)``), ``CenterCrop(224)`` (offsets
``round((h - 224) / 2)``), ``ToTensor``, CLIP mean/std.

``reward.dtype=bfloat16`` runs BLIP (ViT + BERT) in bf16; the MLP head and ``(s - mean) / std`` stay fp32 (the
official ``inference_rank`` also casts the [CLS] feature with ``.float()`` before the head). The checkpoint is read
with ``torch.load(weights_only=True)``: ``ImageReward.pt`` is the ``state_dict`` that ``ImageReward/utils.py::load``
passes straight to ``load_state_dict`` (an ``OrderedDict`` of tensors), which torch's default allowlist covers; no
extra global is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from stepflow.rewards.aesthetic import AestheticMLP
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.blip import MedConfig, MedTextEncoder, VisionTransformer
from stepflow.rewards.loading import (
    check_keys,
    check_local,
    load_guard,
    load_state_dict,
    pick_device,
    pick_dtype,
    resolve_file,
    to_pil,
)

IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class BLIPBackbone(nn.Module):
    """The two BLIP towers ImageReward uses (``blip.visual_encoder``, ``blip.text_encoder``)."""

    def __init__(self, med: MedConfig, vit: dict):
        super().__init__()
        self.visual_encoder = VisionTransformer(**vit)
        self.text_encoder = MedTextEncoder(med)


class ImageRewardModel(nn.Module):
    """``blip`` + ``mlp`` head. ``forward`` returns the normalized reward (B,) and the raw head output (B,)."""

    def __init__(self, med: MedConfig, vit: dict, mean: float = IMAGEREWARD_MEAN, std: float = IMAGEREWARD_STD):
        super().__init__()
        if med.encoder_width != vit["embed_dim"]:
            med = MedConfig.from_dict({**med.to_dict(), "encoder_width": vit["embed_dim"]})  # BLIP sets this too
        self.med_config, self.vit_config = med, dict(vit)
        self.blip = BLIPBackbone(med, vit)
        self.mlp = AestheticMLP(med.hidden_size)  # ImageReward's MLP: the same layout as the LAION head
        for name, p in self.mlp.layers.named_parameters():  # ImageReward's init (overwritten by the checkpoint)
            if name.endswith("weight"):
                nn.init.normal_(p, std=1.0 / (med.hidden_size + 1))
            else:
                nn.init.zeros_(p)
        self.mean, self.std = float(mean), float(std)

    def forward(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        img = self.blip.visual_encoder(pixel_values)
        img_mask = torch.ones(img.shape[:2], dtype=torch.long, device=img.device)
        h = self.blip.text_encoder(input_ids, attention_mask=attention_mask, encoder_hidden_states=img,
                                   encoder_attention_mask=img_mask)
        raw = self.mlp(h[:, 0].float()).squeeze(-1)
        return (raw - self.mean) / self.std, raw


def blip_tokenizer(path: str, key: str = "reward.tokenizer_path"):
    """BERT WordPiece tokenizer (``bert-base-uncased``) plus BLIP's added ``[DEC]`` (bos) and ``[ENC]`` tokens."""
    from transformers import BertTokenizer

    local = check_local(path, "ImageReward tokenizer", key)
    with load_guard("ImageReward tokenizer (BERT WordPiece, bert-base-uncased)", path, key):
        tok = BertTokenizer.from_pretrained(local)
        tok.add_special_tokens({"bos_token": "[DEC]"})
        tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        tok.enc_token_id = tok.convert_tokens_to_ids("[ENC]")  # v5 tokenizers lack additional_special_tokens_ids
    return tok


def image_transform(size: int):
    """ImageReward's ``_transform(n_px)``: bicubic resize of the short side, center crop, RGB, ToTensor, CLIP
    mean/std (torchvision on the PIL image)."""
    from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize, ToTensor

    return Compose([Resize(size, interpolation=InterpolationMode.BICUBIC), CenterCrop(size),
                    lambda im: im.convert("RGB"), ToTensor(), Normalize(CLIP_MEAN, CLIP_STD)])


class ImageReward(Reward):
    """model_path: HF repo id (``THUDM/ImageReward``), a local dir holding ``checkpoint`` and ``med_config``, or the
    checkpoint file itself (then ``med_config`` must be a path). tokenizer_path: ``bert-base-uncased`` or a local
    dir with its ``vocab.txt``. Component: ``raw`` (the head output before ``(x - mean) / std``)."""

    name = "imagereward"

    def __init__(self, model_path: str = "THUDM/ImageReward", checkpoint: str = "ImageReward.pt",
                 med_config: str = "med_config.json", tokenizer_path: str = "bert-base-uncased",
                 vit_num_heads: int = 16, max_length: int = 35, device: str = "auto", dtype: str = "float32",
                 batch_size: int = 16):
        self.device, self.dtype = pick_device(device), pick_dtype(dtype)
        key = "reward.model_path"
        if os.path.isfile(os.path.expanduser(str(model_path))):
            ckpt_path = os.path.expanduser(str(model_path))
        else:
            ckpt_path = resolve_file(model_path, checkpoint, "ImageReward checkpoint", key)
        if os.path.isfile(os.path.expanduser(str(med_config))):
            med_path = os.path.expanduser(str(med_config))
        else:
            med_src = os.path.dirname(ckpt_path) if os.path.isfile(os.path.expanduser(str(model_path))) else model_path
            med_path = resolve_file(med_src, med_config, "ImageReward med_config", "reward.med_config")
        with load_guard("ImageReward med_config", med_path, "reward.med_config"):
            med = MedConfig.from_json_file(med_path)
        sd = load_state_dict(ckpt_path, "ImageReward checkpoint", key)
        with load_guard("ImageReward checkpoint", ckpt_path, key):
            vit = VisionTransformer.sizes_from_state_dict(sd, "blip.visual_encoder.")
            vit["num_heads"] = int(vit_num_heads)
            model = ImageRewardModel(med, vit)
            res = model.load_state_dict(sd, strict=False)
        check_keys(res.missing_keys, "ImageReward checkpoint", ckpt_path, key)
        model = model.eval().to(self.device, self.dtype).requires_grad_(False)
        model.mlp.float()  # the head runs in fp32 whatever reward.dtype (forward feeds it h[:, 0].float())
        self.model = model
        self.tokenizer = blip_tokenizer(tokenizer_path)
        self.transform = image_transform(vit["img_size"])
        self.max_length, self.batch_size = int(max_length), batch_size

    def tokenize(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        return self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                              return_tensors="pt")

    def pixels(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] -> the (B, 3, 224, 224) fp32 tensor ImageReward feeds its ViT (module docstring)."""
        return torch.stack([self.transform(im) for im in to_pil(images)])

    @torch.no_grad()
    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        pix = self.pixels(images).to(self.device, self.dtype)
        tok = self.tokenize(prompts)
        reward, raw = self.model(pix, tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device))
        return RewardOut(reward.float(), {"raw": raw.float()})
