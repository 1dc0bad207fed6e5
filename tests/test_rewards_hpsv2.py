"""HPSv2 on a tiny random open_clip model: saved as an HPS-style checkpoint ({"state_dict": ...}), loaded back by the
reward, and checked against HPSv2's own formula run on open_clip directly: diag(image_features @ text_features.T)
with the normalized features of ``model(image, text)`` on the pixels of HPSv2's own transform (built independently
in ``helpers.references.hpsv2_reference``). Also: bf16, and checkpoints that would run code are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.payloads import assert_payload_refused, payload_checkpoint

from stepflow.errors import RewardLoadError

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
    model = open_clip.create_model(ARCH, pretrained=None, output_dict=True)
    with torch.no_grad():
        model.logit_scale.fill_(4.0)  # must NOT enter the HPS score
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, d / "HPS_v2.1_compressed.pt")
    return d, model.eval()


def test_hpsv2_is_cosine_of_normalized_embeddings(hps_ckpt):
    import open_clip
    from helpers.references import flow_grpo_uint8, hpsv2_reference

    from stepflow.rewards.hpsv2 import HPSv2

    d, model = hps_ckpt
    images = torch.rand(len(PROMPTS), 3, 40, 48, generator=torch.Generator().manual_seed(2))  # letterboxed
    r = HPSv2(checkpoint=str(d), arch=ARCH, model_config=str(d / f"{ARCH}.json"), device="cpu")
    out = r(images, PROMPTS)

    pix = torch.stack([hpsv2_reference(a, size=32) for a in flow_grpo_uint8(images)])
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

    d, _ = hps_ckpt
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


def test_hpsv2_runs_in_bf16(hps_ckpt):
    """``reward.dtype=bfloat16`` (through the Hydra config) runs open_clip in bf16; the cosine agrees with fp32 to a
    few bf16 steps (2**-8 = 0.0039 relative) and bf16 really ran."""
    from stepflow.rewards.registry import build_reward

    d, _ = hps_ckpt
    images = torch.rand(len(PROMPTS), 3, 40, 48, generator=torch.Generator().manual_seed(2))
    ov = [f"checkpoint={d}", f"arch={ARCH}", f"model_config={d / f'{ARCH}.json'}", "device=cpu"]
    fp32, bf16 = build_reward("hpsv2", ov), build_reward("hpsv2", ov + ["dtype=bfloat16"])
    assert bf16.model.visual.conv1.weight.dtype == torch.bfloat16
    a, b = fp32(images, PROMPTS).scores, bf16(images, PROMPTS).scores
    assert b.dtype == torch.float32 and not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=0, atol=6e-3)  # ~3x the measured 2e-3


# ------------------------------------------------------------------ checkpoints are read without running code


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
def test_hpsv2_checkpoint_cannot_run_code(hps_ckpt, tmp_path):
    from stepflow.rewards.registry import build_reward

    d, model = hps_ckpt
    ov = [f"arch={ARCH}", f"model_config={d / f'{ARCH}.json'}", "device=cpu"]
    path, marker = payload_checkpoint(tmp_path, "HPS_v2.1_compressed.pt", {"state_dict": model.state_dict()})
    msg = assert_payload_refused(lambda: build_reward("hpsv2", [f"checkpoint={path}"] + ov), path, marker,
                                 "reward.checkpoint=")
    assert "exec" in msg  # names what the file pickles
    (tmp_path / "legacy").mkdir()
    path, marker = payload_checkpoint(tmp_path / "legacy", "hps.bin", {"state_dict": model.state_dict()},
                                      legacy_pickle=True)
    assert_payload_refused(lambda: build_reward("hpsv2", [f"checkpoint={path}"] + ov), path, marker,
                           "reward.checkpoint=")


def test_hpsv2_training_layout_loads_weights_only(hps_ckpt, tmp_path):
    """HPSv2's ``save_ckpt`` layout (``src/training/file_utils.py``: iterations, name, state_dict, optimizer,
    scaler) loads with weights_only=True and no extra allowed globals; the ``weights_only`` option is gone."""
    from stepflow.rewards.hpsv2 import HPSv2
    from stepflow.rewards.registry import reward_config

    d, model = hps_ckpt
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.98))  # a real optimizer state, weights kept
    model(torch.rand(1, 3, 32, 32), torch.zeros(1, 77, dtype=torch.long))["image_features"].sum().backward()
    opt.step()
    scaler = {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
              "_growth_tracker": 17}
    torch.save({"iterations": 4000, "name": "hpsv2.1", "state_dict": model.state_dict(),
                "optimizer": opt.state_dict(), "scaler": scaler}, tmp_path / "HPS_v2.1.pt")
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    a = HPSv2(checkpoint=str(tmp_path / "HPS_v2.1.pt"), arch=ARCH, device="cpu")(images, PROMPTS[:2]).scores
    b = HPSv2(checkpoint=str(d), arch=ARCH, device="cpu")(images, PROMPTS[:2]).scores
    torch.testing.assert_close(a, b)
    assert "weights_only" not in reward_config("hpsv2")
    with pytest.raises(TypeError):
        HPSv2(checkpoint=str(d), arch=ARCH, weights_only=False, device="cpu")


def test_only_the_named_extra_globals_are_allowed(tmp_path):
    """``load_state_dict(..., safe_globals=...)`` allows exactly the callables named (none for HPSv2, ImageReward
    and the aesthetic MLP, whose files pickle only tensors and plain values); anything else stays refused."""
    import argparse

    from stepflow.rewards.loading import load_state_dict

    torch.save({"state_dict": {"w": torch.ones(2)}, "args": argparse.Namespace(lr=1e-3)}, tmp_path / "ns.pt")
    with pytest.raises(RewardLoadError, match=r"argparse\.Namespace.*reward\.checkpoint="):
        load_state_dict(str(tmp_path / "ns.pt"), "HPSv2 checkpoint", "reward.checkpoint")
    sd = load_state_dict(str(tmp_path / "ns.pt"), "HPSv2 checkpoint", "reward.checkpoint",
                         safe_globals=[argparse.Namespace])
    torch.testing.assert_close(sd["w"], torch.ones(2))
    path, marker = payload_checkpoint(tmp_path, "evil.pt", {"state_dict": {"w": torch.ones(2)}})
    with pytest.raises(RewardLoadError, match="exec"):
        load_state_dict(path, "HPSv2 checkpoint", "reward.checkpoint", safe_globals=[argparse.Namespace])
    assert not marker.exists()
