"""Each reward's image preprocessing against its *published* definition, not against stepflow's code.

For every reward, the test builds tiny random models at the real input size (224 px; big patches keep them cheap),
saves them in the released files' format, loads them back through the rewards' own loading code, records the pixel
tensor the reward actually feeds its vision tower (a forward pre-hook), and compares it with a tensor built
independently (``tests/helpers/references.py``) from the official code's definition with PIL / NumPy /
``torch.nn.functional``, for square (512²), wide (320×480), tall (480×320) and odd (333×517) decoded images. Every
definition starts from Flow-GRPO's uint8 rounding of the decoded float image,
``(x * 255).round().clamp(0, 255).to(uint8)`` (``flow_grpo/rewards.py``: ``pickscore_score``, ``aesthetic_score``,
``imagereward_score``), then ``Image.fromarray``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.references import (
    MEAN,
    STD,
    aesthetic_head,
    aesthetic_state_dict,
    clip_processor_reference,
    flow_grpo_uint8,
    hpsv2_reference,
    imagereward_reference,
)
from PIL import Image

SIZES = [(512, 512), (320, 480), (480, 320), (333, 517)]  # (H, W); 517 -> 347 px long side: odd overhang 123
PROMPTS = ["a photo of a cat", "two red cubes on the table"]


def decoded(h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Two 'decoded' images in [0, 1]: a smooth picture plus fine noise, values between the uint8 levels."""
    g = torch.Generator().manual_seed(seed + h * 1000 + w)
    base = F.interpolate(torch.rand(2, 3, max(h // 16, 2), max(w // 16, 2), generator=g), size=(h, w), mode="bilinear")
    return (0.8 * base + 0.2 * torch.rand(2, 3, h, w, generator=g)).clamp(0, 1)


class Capture:
    """Forward pre-hook on a vision tower: records the pixel tensor the reward really feeds it."""

    def __init__(self, module: torch.nn.Module):
        self.seen: list[torch.Tensor] = []
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.seen.append((args[0] if args else kwargs["pixel_values"]).detach().float().clone())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _assert_pixels(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


# ------------------------------------------------------------------ CLIP rewards: PickScore, CLIPScore, aesthetic


@pytest.fixture(scope="module")
def clip224_dir(tmp_path_factory):
    """A tiny CLIPModel with a 224-px vision tower, saved like the hub repos: ``save_pretrained`` weights + tokenizer
    and the released (legacy) ``preprocessor_config.json`` of ``openai/clip-vit-large-patch14`` /
    ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``."""
    from transformers import CLIPModel

    from stepflow.testing.tiny_rewards import clip_tokenizer, tiny_clip_config

    torch.manual_seed(0)
    tok = clip_tokenizer()
    cfg = tiny_clip_config(tok, image_size=224, patch_size=56, num_layers=1)
    d = tmp_path_factory.mktemp("clip224")
    CLIPModel(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    (d / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": MEAN.tolist(), "image_std": STD.tolist(),
        "resample": 3, "size": 224}))
    return str(d)


@pytest.fixture(scope="module")
def aesthetic_mlp(tmp_path_factory):
    p = tmp_path_factory.mktemp("aes") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(aesthetic_state_dict(aesthetic_head()), p)
    return str(p)


@pytest.mark.parametrize("hw", SIZES)
def test_clip_rewards_feed_the_pil_clip_processor_pixels(clip224_dir, aesthetic_mlp, hw):
    """PickScore, CLIPScore and the aesthetic predictor feed CLIP exactly transformers 4's PIL ``CLIPImageProcessor``
    output (:func:`clip_processor_reference`) of the uint8-rounded image."""
    from stepflow.rewards.aesthetic import AestheticScore
    from stepflow.rewards.clip_based import CLIPScore, PickScore

    images = decoded(*hw)
    expected = torch.stack([clip_processor_reference(a) for a in flow_grpo_uint8(images)])
    rewards = [PickScore(model_path=clip224_dir, processor_path=clip224_dir, device="cpu"),
               CLIPScore(model_path=clip224_dir, device="cpu"),
               AestheticScore(clip_path=clip224_dir, mlp_path=aesthetic_mlp, device="cpu")]
    for r in rewards:
        with Capture(r.clip.model.vision_model) as cap:
            r(images, PROMPTS)
        _assert_pixels(cap.seen[0], expected)


def test_clip_reference_is_not_the_torchvision_processor(clip224_dir):
    """The check above can tell the processors apart: transformers 5's default (torchvision) ``CLIPImageProcessor``
    gives other pixels on non-square images, and a rounding-free path differs from the uint8 one."""
    from transformers import CLIPImageProcessor

    images = decoded(320, 480)
    u8 = flow_grpo_uint8(images)
    expected = torch.stack([clip_processor_reference(a) for a in u8])
    tv = CLIPImageProcessor.from_pretrained(clip224_dir)(images=[Image.fromarray(a) for a in u8],
                                                         return_tensors="pt")["pixel_values"]
    assert (tv - expected).abs().max() > 1e-3
    unrounded = [Image.fromarray((a * 255).astype(np.uint8)) for a in images.permute(0, 2, 3, 1).numpy()]  # trunc
    trunc = torch.stack([clip_processor_reference(np.asarray(im)) for im in unrounded])
    assert (trunc - expected).abs().max() > 1e-3


# ------------------------------------------------------------------ HPSv2


@pytest.fixture(scope="module")
def hps224(tmp_path_factory):
    """A tiny open_clip model at 224 px saved as an HPSv2 checkpoint (``{"state_dict": ...}``)."""
    import open_clip

    d = tmp_path_factory.mktemp("hps224")
    arch = "stepflow-test-hps224"
    cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 8,
                                           "patch_size": 56},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 1}}
    (d / f"{arch}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(str(d / f"{arch}.json"))
    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None)
    torch.save({"state_dict": model.state_dict()}, d / "HPS_v2.1_compressed.pt")
    return d, arch


@pytest.mark.parametrize("hw", SIZES)
def test_hpsv2_feeds_hpsv2s_letterboxed_pixels(hps224, hw):
    """HPSv2 feeds open_clip exactly HPSv2's ``preprocess_val`` (:func:`hpsv2_reference`: whole image, long side to
    224, black padding), not open_clip's resize-short-side + center crop."""
    from stepflow.rewards.hpsv2 import HPSv2

    d, arch = hps224
    images = decoded(*hw)
    u8 = flow_grpo_uint8(images)
    r = HPSv2(checkpoint=str(d), arch=arch, model_config=str(d / f"{arch}.json"), device="cpu")
    with Capture(r.model.visual) as cap:
        r(images, PROMPTS)
    _assert_pixels(cap.seen[0], torch.stack([hpsv2_reference(a) for a in u8]))
    if hw[0] != hw[1]:  # the letterbox: rows (or columns) outside the resized image are black before Normalize
        black = (-torch.from_numpy(MEAN) / torch.from_numpy(STD))[:, None]
        edge = cap.seen[0][0, :, 0, :] if hw[0] < hw[1] else cap.seen[0][0, :, :, 0]
        torch.testing.assert_close(edge, black.expand_as(edge), rtol=0, atol=1e-6)
    # the torchvision < 0.17 behaviour (no antialiasing of tensor resizes) on request
    r_old = HPSv2(checkpoint=str(d), arch=arch, antialias=False, device="cpu")
    _assert_pixels(r_old.pixels(images), torch.stack([hpsv2_reference(a, antialias=False) for a in u8]))


def test_hpsv2_reference_is_not_open_clips_default_or_pil():
    """The check above can tell the transforms apart: open_clip's default eval transform (center crop) and a PIL
    (uint8) resize both give other pixels."""
    import open_clip

    a = flow_grpo_uint8(decoded(320, 480))[0]
    expected = hpsv2_reference(a)
    _, _, default = open_clip.create_model_and_transforms("ViT-B-32", pretrained=None)
    assert (default(Image.fromarray(a)) - expected).abs().max() > 0.5
    im = Image.fromarray(a).resize((224, 149), Image.BICUBIC)
    pil = hpsv2_reference(np.asarray(im))  # already 224 wide: only padded
    assert (pil - expected).abs().max() > 1e-3


# ------------------------------------------------------------------ ImageReward


@pytest.fixture(scope="module")
def ir224(tmp_path_factory):
    """A tiny BLIP ImageReward at 224 px, laid out like ``THUDM/ImageReward`` (``ImageReward.pt`` state dict,
    ``med_config.json``) plus a BERT ``vocab.txt``."""
    from helpers.tiny_text import MED, write_bert_vocab

    from stepflow.rewards.blip import MedConfig
    from stepflow.rewards.imagereward import ImageRewardModel

    d = tmp_path_factory.mktemp("ir224")
    tok = write_bert_vocab(tmp_path_factory.mktemp("ir224_tok"))
    (d / "med_config.json").write_text(json.dumps(MED))
    torch.manual_seed(0)
    vit = dict(img_size=224, patch_size=56, embed_dim=48, depth=1, num_heads=4)
    torch.save(ImageRewardModel(MedConfig.from_dict(MED), vit).state_dict(), d / "ImageReward.pt")
    return d, tok


@pytest.mark.parametrize("hw", SIZES)
def test_imagereward_feeds_imagerewards_transform_pixels(ir224, hw):
    """ImageReward feeds its ViT exactly ImageReward's ``_transform(224)`` (:func:`imagereward_reference`)."""
    from stepflow.rewards.imagereward import ImageReward

    d, tok = ir224
    images = decoded(*hw)
    r = ImageReward(model_path=str(d), tokenizer_path=str(tok), vit_num_heads=4, device="cpu")
    with Capture(r.model.blip.visual_encoder) as cap:
        r(images, PROMPTS)
    _assert_pixels(cap.seen[0], torch.stack([imagereward_reference(a) for a in flow_grpo_uint8(images)]))


def test_center_crop_conventions_differ_on_odd_overhangs():
    """Why CLIP and ImageReward have separate references: on a 333×517 image (long side 347, overhang 123, 3 mod 4)
    transformers floors the crop offset (61) where torchvision rounds it (62)."""
    a = flow_grpo_uint8(decoded(333, 517))[0]
    assert (clip_processor_reference(a) - imagereward_reference(a)).abs().max() > 1e-3
    a = flow_grpo_uint8(decoded(320, 480))[0]  # overhang 112: the same crop
    torch.testing.assert_close(clip_processor_reference(a), imagereward_reference(a), rtol=0, atol=1e-6)
