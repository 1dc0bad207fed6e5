"""The rewards' image preprocessing as their *published* code defines it, and the aesthetic predictor's released
head, written here independently of stepflow (nothing here imports it): what the reward tests compare stepflow's
rewards against.

Every definition starts from Flow-GRPO's uint8 rounding of the decoded float image (:func:`flow_grpo_uint8`), then
``Image.fromarray``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)  # OpenAI CLIP mean / std
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)


def flow_grpo_uint8(images: torch.Tensor) -> list[np.ndarray]:
    """``flow_grpo/rewards.py`` (``pickscore_score``, ``aesthetic_score``, ``imagereward_score``):
    ``(images * 255).round().clamp(0, 255).to(torch.uint8)``, NCHW -> NHWC."""
    return list((images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy())


def _short_side_size(w: int, h: int, size: int) -> tuple[int, int]:
    """Both torchvision ``Resize(size)`` and transformers' ``get_resize_output_image_size(default_to_square=False)``:
    short side -> size, long side -> ``int(size * long / short)``; returns PIL's (width, height)."""
    short, long = min(w, h), max(w, h)
    new_long = int(size * long / short)
    return (size, new_long) if w <= h else (new_long, size)


def _to_chw_normalized(a: np.ndarray) -> torch.Tensor:
    x = a.astype(np.float32) / np.float32(255)
    return torch.from_numpy(((x - MEAN) / STD).transpose(2, 0, 1).copy())


def clip_processor_reference(a: np.ndarray, size: int = 224, crop: int = 224) -> torch.Tensor:
    """transformers 4's (PIL) ``CLIPImageProcessor``, as PickScore's README (``AutoProcessor`` of
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``) and Flow-GRPO's ``pickscore_scorer.py::PickScoreScorer.__call__`` /
    ``aesthetic_scorer.py::AestheticScorer.__call__`` run it, with the released ``preprocessor_config.json``
    (``size: 224, crop_size: 224, resample: 3``): ``PIL.Image.resize`` bicubic of the short side
    (``image_transforms.resize`` -> ``to_pil_image`` -> ``Image.resize(..., resample=BICUBIC, reducing_gap=None)``),
    ``center_crop`` at ``top = (h - crop) // 2``, ``left = (w - crop) // 2``, ``rescale(1/255)``, ``normalize``."""
    im = Image.fromarray(a)
    im = im.resize(_short_side_size(*im.size, size), Image.BICUBIC)
    x = np.asarray(im)
    top, left = (x.shape[0] - crop) // 2, (x.shape[1] - crop) // 2
    return _to_chw_normalized(x[top:top + crop, left:left + crop])


def imagereward_reference(a: np.ndarray, size: int = 224) -> torch.Tensor:
    """``ImageReward/ImageReward.py::_transform(224)``: torchvision ``Resize(224, BICUBIC)`` on the PIL image (=
    ``Image.resize`` bicubic, short side -> 224), ``CenterCrop(224)`` (``top = int(round((h - 224) / 2.0))``, then
    ``Image.crop``), RGB, ``ToTensor`` (/255), ``Normalize`` with the CLIP mean/std."""
    im = Image.fromarray(a)
    im = im.resize(_short_side_size(*im.size, size), Image.BICUBIC)
    w, h = im.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return _to_chw_normalized(np.asarray(im.crop((left, top, left + size, top + size)).convert("RGB")))


def hpsv2_reference(a: np.ndarray, size: int = 224, antialias: bool = True) -> torch.Tensor:
    """HPSv2's ``preprocess_val``: ``hpsv2/img_score.py`` builds it with ``create_model_and_transforms(...,
    light_augmentation=True)`` -> ``hpsv2/src/open_clip/transform.py::image_transform(224, is_train=False,
    resize_longest_max=True)`` = ``[_convert_to_rgb_or_rgba, ToTensor(), ResizeMaxSize(224, fill=0),
    MaskAwareNormalize(mean, std)]``. ``ResizeMaxSize.forward`` on the float tensor: ``scale = 224 / max(H, W)``,
    ``new = (round(H * scale), round(W * scale))``, ``F.resize(img, new, BICUBIC)`` (torchvision's tensor resize =
    ``interpolate(mode="bicubic", align_corners=False, antialias=True)`` on torchvision >= 0.17, no clamp), then
    ``F.pad`` with 0 by ``[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2]``."""
    x = torch.from_numpy(a.copy()).permute(2, 0, 1).float() / 255
    height, width = x.shape[1:]
    scale = size / float(max(height, width))
    new = (round(height * scale), round(width * scale))
    x = F.interpolate(x[None], size=new, mode="bicubic", align_corners=False, antialias=antialias)[0]
    ph, pw = size - new[0], size - new[1]
    x = F.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=0.0)
    return (x - torch.from_numpy(MEAN)[:, None, None]) / torch.from_numpy(STD)[:, None, None]


def aesthetic_head() -> torch.nn.Sequential:
    """The LAION aesthetic predictor's released head (``sac+logos+ava1-l14-linearMSE.pth``: an MLP on the 768-wide
    CLIP ViT-L/14 image embedding), written out independently of stepflow's class: its Linear layers are
    ``layers.0/2/4/6/7`` of :func:`aesthetic_state_dict`."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(768, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))


def aesthetic_state_dict(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``head``'s weights under the released file's keys (``layers.<i>.weight`` / ``.bias``)."""
    return {"layers." + k: v for k, v in head.state_dict().items()}
