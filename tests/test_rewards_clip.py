"""PickScore, CLIPScore and the aesthetic predictor on a tiny random CLIPModel that the test builds, saves with
``save_pretrained`` and loads back through the rewards' own loading code; each score is checked against the
published formula computed here with the raw ``CLIPModel.forward`` (``logits_per_image`` / normalized embeds)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from helpers.references import aesthetic_head, aesthetic_state_dict

from stepflow.errors import RewardLoadError

PROMPTS = ["a photo of a cat", "a red cube on a table", "two dogs", "an astronaut riding a horse"]


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(1)
    return torch.rand(len(PROMPTS), 3, 40, 48, generator=g)  # non-square: exercises resize + center crop


def _reference(d, images, prompts):
    """logits_per_image.diag(), the normalized image embeds and logit_scale.exp(), via the plain CLIPModel forward on
    the pixels of the published preprocessing (transformers 4's PIL ``CLIPImageProcessor``, built independently in
    ``helpers.references.clip_processor_reference``) of the uint8-rounded images."""
    from helpers.references import clip_processor_reference, flow_grpo_uint8
    from transformers import CLIPModel, CLIPTokenizer

    model, tok = CLIPModel.from_pretrained(d).eval(), CLIPTokenizer.from_pretrained(d)
    pix = torch.stack([clip_processor_reference(a, size=32, crop=32) for a in flow_grpo_uint8(images)])
    inp = tok(prompts, return_tensors="pt", padding=True, truncation=True, max_length=77)
    with torch.no_grad():
        out = model(pixel_values=pix, **inp)
    return out.logits_per_image.diag(), out.image_embeds, model.logit_scale.exp().item()


def test_pickscore_is_logit_scale_times_cosine(tiny_clip_dir, images):
    from stepflow.rewards.clip_based import PickScore

    r = PickScore(model_path=tiny_clip_dir, processor_path=tiny_clip_dir, device="cpu")
    out = r(images, PROMPTS)
    logits, _, scale = _reference(tiny_clip_dir, images, PROMPTS)
    assert out.scores.shape == (len(PROMPTS),)
    torch.testing.assert_close(out.scores, logits / 26, rtol=1e-4, atol=1e-5)  # Flow-GRPO default: /26
    torch.testing.assert_close(out.components["logit"], logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.components["cosine"], logits / scale, rtol=1e-4, atol=1e-5)
    assert out.scores.std() > 0  # different prompts/images really give different scores
    raw = PickScore(model_path=tiny_clip_dir, processor_path=tiny_clip_dir, scale=1.0, device="cpu")
    torch.testing.assert_close(raw(images, PROMPTS).scores, logits, rtol=1e-4, atol=1e-4)


def test_pickscore_batches_are_chunked_consistently(tiny_clip_dir, images):
    from stepflow.rewards.clip_based import PickScore

    r = PickScore(model_path=tiny_clip_dir, processor_path=tiny_clip_dir, device="cpu", batch_size=3)
    whole = PickScore(model_path=tiny_clip_dir, processor_path=tiny_clip_dir, device="cpu")(images, PROMPTS).scores
    torch.testing.assert_close(r(images, PROMPTS).scores, whole, rtol=1e-5, atol=1e-6)


def test_clipscore_modes(tiny_clip_dir, images):
    from stepflow.rewards.clip_based import CLIPScore

    logits, _, scale = _reference(tiny_clip_dir, images, PROMPTS)
    cos = logits / scale
    outs = {m: CLIPScore(model_path=tiny_clip_dir, mode=m, scale="1/30", device="cpu")(images, PROMPTS).scores
            for m in ("hessel", "cosine", "logit")}
    torch.testing.assert_close(outs["cosine"], cos, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs["hessel"], 2.5 * cos.clamp(min=0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(outs["logit"], logits / 30, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="mode"):
        CLIPScore(model_path=tiny_clip_dir, mode="nope", device="cpu")


def test_aesthetic_is_mlp_of_normalized_embedding(tiny_clip_dir, images, tmp_path):
    from stepflow.rewards.aesthetic import AestheticScore

    torch.manual_seed(3)
    head = aesthetic_head().eval()  # the released head, written out independently of stepflow's class
    for p in head.parameters():
        nn.init.normal_(p, std=0.2)
    torch.save(aesthetic_state_dict(head), tmp_path / "aes.pth")
    r = AestheticScore(clip_path=tiny_clip_dir, mlp_path=str(tmp_path / "aes.pth"), device="cpu")
    _, img_emb, _ = _reference(tiny_clip_dir, images, PROMPTS)
    torch.testing.assert_close(img_emb.norm(dim=-1), torch.ones(len(PROMPTS)))  # CLIPModel returns them normalized
    with torch.no_grad():
        expected = head(img_emb).squeeze(-1)
    out = r(images, PROMPTS)
    torch.testing.assert_close(out.scores, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.components["raw"], expected, rtol=1e-4, atol=1e-4)
    # a directory holding mlp_filename works too, and scale multiplies
    r2 = AestheticScore(clip_path=tiny_clip_dir, mlp_path=str(tmp_path), mlp_filename="aes.pth", scale=0.1,
                        device="cpu")
    torch.testing.assert_close(r2(images, PROMPTS).scores, 0.1 * expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ load errors: one line, naming the path


def _one_line_error(fn, *needles):
    with pytest.raises(RewardLoadError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_load_errors_are_one_line_and_name_the_path(tiny_clip_dir, tmp_path):
    from stepflow.rewards.aesthetic import AestheticScore
    from stepflow.rewards.clip_based import PickScore
    from stepflow.rewards.registry import build_reward

    missing = str(tmp_path / "no_such_model")
    _one_line_error(lambda: PickScore(model_path=missing, processor_path=tiny_clip_dir, device="cpu"),
                    missing, "reward.model_path=")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(lambda: PickScore(model_path=tiny_clip_dir, processor_path=str(empty), device="cpu"),
                    str(empty), "reward.processor_path=")
    # a hub id that is not cached (HF_HUB_OFFLINE=1 in conftest): fails at once, names the id and the override
    msg = _one_line_error(lambda: build_reward({"_target_": "stepflow.rewards.clip_based.PickScore",
                                                "model_path": "stepflow-test/no-such-pickscore"}),
                          "stepflow-test/no-such-pickscore", "reward.model_path=/local/dir")
    assert "hf download" in msg
    # through Hydra: the one-line error, not an InstantiationException
    _one_line_error(lambda: build_reward("aesthetic", [f"clip_path={tiny_clip_dir}",
                                                       f"mlp_path={tmp_path / 'nope.pth'}", "device=cpu"]),
                    str(tmp_path / "nope.pth"), "reward.mlp_path=")
    torch.save({"something": torch.zeros(1)}, tmp_path / "wrong.pth")
    _one_line_error(lambda: AestheticScore(clip_path=tiny_clip_dir, mlp_path=str(tmp_path / "wrong.pth"),
                                           device="cpu"), str(tmp_path / "wrong.pth"))


def test_configs_build_through_hydra(tiny_clip_dir, images):
    """conf/reward/{pickscore,clipscore}.yaml instantiate the classes with their documented defaults, and
    conf/reward/multi.yaml composes nested sub-reward configs (weights 0.8 / 0.2, Flow-GRPO's sum)."""
    from stepflow.rewards.clip_based import CLIPScore, PickScore
    from stepflow.rewards.multi import MultiReward
    from stepflow.rewards.ocr import OCRReward
    from stepflow.rewards.registry import build_reward, reward_config

    assert reward_config("pickscore").scale == "1/26"
    pick = build_reward("pickscore", [f"model_path={tiny_clip_dir}", f"processor_path={tiny_clip_dir}"])
    assert isinstance(pick, PickScore) and abs(pick.scale - 1 / 26) < 1e-12
    clip = build_reward("clipscore", [f"model_path={tiny_clip_dir}"])
    assert isinstance(clip, CLIPScore) and clip.mode == "hessel" and clip.w == 2.5

    multi = build_reward("multi", [f"rewards.pickscore.model_path={tiny_clip_dir}",
                                   f"rewards.pickscore.processor_path={tiny_clip_dir}",
                                   "rewards.ocr.engine=builtins:str"])
    assert isinstance(multi, MultiReward) and multi.weights == {"ocr": 0.8, "pickscore": 0.2}
    assert isinstance(multi.rewards["ocr"], OCRReward)
    prompts = ['a sign saying "0"'] * 2 + PROMPTS[2:]
    imgs = images.clone()
    imgs[0] = 0.0  # str(array) of a black image contains "0": OCR reward 1
    out = multi(imgs, prompts)
    o, p = multi.rewards["ocr"](imgs, prompts).scores, pick(imgs, prompts).scores
    assert o[0] == 1.0
    torch.testing.assert_close(out.scores, 0.8 * o + 0.2 * p)
    torch.testing.assert_close(out.components["pickscore"], p)
    torch.testing.assert_close(out.components["pickscore/logit"], p * 26, rtol=1e-5, atol=1e-5)
    # a sub-reward that cannot load names the nested override key
    _one_line_error(lambda: build_reward("multi", ["rewards.pickscore.model_path=/no/such/dir",
                                                   "rewards.ocr.engine=builtins:str"]),
                    "/no/such/dir", "reward.rewards.pickscore.model_path=")


# ------------------------------------------------------------------ reward.dtype=bfloat16


def _bf16_close(fp32: torch.Tensor, bf16: torch.Tensor, tol: float) -> None:
    """bf16 really ran (not bit-identical to fp32) and agrees with fp32 within ``tol`` (a few bf16 ulps of the
    score's scale: bf16 keeps 8 significant bits, relative step 2**-8 = 0.0039)."""
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert not torch.equal(fp32, bf16)
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=tol)


def test_clip_rewards_run_in_bf16(tiny_clip_dir, images, tmp_path):
    """``reward.dtype=bfloat16`` (through the Hydra configs) runs the CLIP towers in bf16 for PickScore, CLIPScore
    and the aesthetic predictor, and the scores agree with fp32."""
    from stepflow.rewards.registry import build_reward

    torch.manual_seed(3)
    head = aesthetic_head()
    for p in head.parameters():
        nn.init.normal_(p, std=0.2)
    torch.save(aesthetic_state_dict(head), tmp_path / "aes.pth")
    # tolerances: ~3x the measured bf16 error; the logit is 57 * cos, the cosine ~1e-2, the aesthetic score ~1
    cases = {"pickscore": ([f"model_path={tiny_clip_dir}", f"processor_path={tiny_clip_dir}", "scale=1"], 0.08),
             "clipscore": ([f"model_path={tiny_clip_dir}", "mode=cosine"], 2e-3),
             "aesthetic": ([f"clip_path={tiny_clip_dir}", f"mlp_path={tmp_path / 'aes.pth'}"], 0.05)}
    for name, (ov, tol) in cases.items():
        fp32 = build_reward(name, ov + ["device=cpu"])
        bf16 = build_reward(name, ov + ["device=cpu", "dtype=bfloat16"])
        assert bf16.clip.model.dtype == torch.bfloat16, name
        a, b = fp32(images, PROMPTS), bf16(images, PROMPTS)
        _bf16_close(a.scores, b.scores, tol)


def test_aesthetic_mlp_pickle_cannot_run_code(tiny_clip_dir, tmp_path):
    """The MLP file is read with weights_only=True: a payload in it does not run; one-line error naming the path and
    reward.mlp_path."""
    from helpers.payloads import assert_payload_refused, payload_checkpoint

    from stepflow.rewards.registry import build_reward

    path, marker = payload_checkpoint(tmp_path, "aes.pth", aesthetic_state_dict(aesthetic_head()))
    assert_payload_refused(lambda: build_reward("aesthetic", [f"clip_path={tiny_clip_dir}", f"mlp_path={path}",
                                                              "device=cpu"]), path, marker, "reward.mlp_path=")
