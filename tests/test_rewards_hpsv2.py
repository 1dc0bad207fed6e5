"""HPSv2 on a tiny random open_clip model: saved as an HPS-style checkpoint ({"state_dict": ...}), loaded back by the
reward, and checked against HPSv2's own formula run on open_clip directly: diag(image_features @ text_features.T)
with the normalized features of ``model(image, text)``."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from stepflow.rewards.errors import RewardLoadError

ARCH = "stepflow-test-tiny-hps"
TINY = {"embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 8, "patch_size": 8},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 4, "layers": 2}}
PROMPTS = ["a photo of a cat", "a blue sphere", "three red cubes"]


@pytest.fixture(scope="module")
def hps_ckpt(tmp_path_factory):
    import open_clip

    d = tmp_path_factory.mktemp("hps")
    (d / f"{ARCH}.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(str(d / f"{ARCH}.json"))  # the public way; the reward registers it itself too
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(ARCH, pretrained=None, output_dict=True)
    with torch.no_grad():
        model.logit_scale.fill_(4.0)  # must NOT enter the HPS score
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, d / "HPS_v2.1_compressed.pt")
    return d, model.eval(), preprocess


def test_hpsv2_is_cosine_of_normalized_embeddings(hps_ckpt):
    import open_clip

    from stepflow.rewards.hpsv2 import HPSv2

    d, model, preprocess = hps_ckpt
    images = torch.rand(len(PROMPTS), 3, 48, 48, generator=torch.Generator().manual_seed(2))
    r = HPSv2(checkpoint=str(d), arch=ARCH, model_config=str(d / f"{ARCH}.json"), device="cpu")
    out = r(images, PROMPTS)

    u8 = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    pix = torch.stack([preprocess(Image.fromarray(a)) for a in u8])
    text = open_clip.get_tokenizer(ARCH)(PROMPTS)
    with torch.no_grad():
        o = model(pix, text)  # open_clip returns normalized features
        expected = torch.diagonal(o["image_features"] @ o["text_features"].T)
    assert out.scores.shape == (len(PROMPTS),)
    torch.testing.assert_close(out.scores, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.components["cosine"], expected, rtol=1e-4, atol=1e-5)
    assert out.scores.abs().max() <= 1.0 + 1e-5 and out.scores.std() > 0

    # the checkpoint file itself works as `checkpoint`, and `scale` multiplies
    r2 = HPSv2(checkpoint=str(d / "HPS_v2.1_compressed.pt"), arch=ARCH, scale=2.0, device="cpu")
    torch.testing.assert_close(r2(images, PROMPTS).scores, 2 * expected, rtol=1e-4, atol=1e-5)


def test_hpsv2_load_errors(hps_ckpt, tmp_path):
    from stepflow.rewards.hpsv2 import HPSv2

    d, _, _ = hps_ckpt
    with pytest.raises(RewardLoadError) as ei:
        HPSv2(checkpoint=str(tmp_path / "missing.pt"), arch=ARCH, device="cpu")
    assert "\n" not in str(ei.value) and str(tmp_path / "missing.pt") in str(ei.value)
    torch.save({"state_dict": {"visual.proj": torch.zeros(1)}}, tmp_path / "wrong.pt")
    with pytest.raises(RewardLoadError) as ei:
        HPSv2(checkpoint=str(tmp_path / "wrong.pt"), arch=ARCH, device="cpu")
    assert "\n" not in str(ei.value) and "wrong.pt" in str(ei.value) and "reward.checkpoint" in str(ei.value)
    with pytest.raises(RewardLoadError) as ei:  # a hub id that is not cached (offline)
        HPSv2(checkpoint="stepflow-test/no-such-hps", arch=ARCH, device="cpu")
    assert "stepflow-test/no-such-hps" in str(ei.value) and "HPS_v2.1_compressed.pt" in str(ei.value)
