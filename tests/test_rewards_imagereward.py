"""ImageReward on a tiny random BLIP: built from a med_config + ViT sizes, saved the way the official files are laid
out (``ImageReward.pt`` state dict + ``med_config.json`` + a BERT ``vocab.txt``), loaded back through the reward's
loading code, and checked against a step-by-step functional forward written here from the ImageReward/BLIP
definitions: ViT (pre-norm, eps 1e-6) -> BERT with cross-attention (post-norm, -10000 padding mask) ->
(MLP(h[CLS]) - 0.16717362830052426) / 1.0333394966054072. Also: bf16, and checkpoints that would run code are
refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.references import flow_grpo_uint8, imagereward_reference
from helpers.tiny_text import MED, write_bert_vocab

from stepflow.errors import RewardLoadError

MEAN, STD = 0.16717362830052426, 1.0333394966054072
PROMPTS = ["a photo of a cat", "two red cubes on the table", "a sign", "xyzzy dogs"]  # "xyzzy" -> [UNK]
VIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4)


@pytest.fixture(scope="module")
def ir_dir(tmp_path_factory):
    from stepflow.rewards.blip import MedConfig
    from stepflow.rewards.imagereward import ImageRewardModel

    d = tmp_path_factory.mktemp("imagereward")
    tok = write_bert_vocab(tmp_path_factory.mktemp("bert_tok"))
    (d / "med_config.json").write_text(json.dumps(MED))
    torch.manual_seed(0)
    model = ImageRewardModel(MedConfig.from_dict(MED), VIT)
    with torch.no_grad():  # make every parameter non-trivial (LayerNorms, biases, the head)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sd = model.state_dict()
    # keys the official checkpoint has but the score does not use: must be ignored
    sd["blip.vision_proj.weight"] = torch.zeros(256, VIT["embed_dim"])
    sd["blip.text_proj.weight"] = torch.zeros(256, MED["hidden_size"])
    sd["blip.text_encoder.embeddings.position_ids"] = torch.arange(40)[None]
    torch.save(sd, d / "ImageReward.pt")
    return d, tok, {k: v.clone() for k, v in model.state_dict().items()}


def _ln(x, sd, p, eps):
    return F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps)


def _lin(x, sd, p):
    return x @ sd[p + ".weight"].T + sd[p + ".bias"]


def _attn(q_in, kv_in, sd, p, heads, mask):
    q, k, v = _lin(q_in, sd, p + ".query"), _lin(kv_in, sd, p + ".key"), _lin(kv_in, sd, p + ".value")
    split = lambda t: t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    a = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
    return (a.softmax(-1) @ v).transpose(1, 2).reshape(q_in.shape[0], q_in.shape[1], -1)


def _reference(sd, pix, ids, mask):
    """The ImageReward forward, written out op by op on the raw state dict."""
    # --- BLIP ViT (pre-norm blocks, LayerNorm eps 1e-6, exact GELU)
    p = "blip.visual_encoder."
    x = F.conv2d(pix, sd[p + "patch_embed.proj.weight"], sd[p + "patch_embed.proj.bias"], stride=VIT["patch_size"])
    x = x.flatten(2).transpose(1, 2)
    x = torch.cat([sd[p + "cls_token"].expand(x.shape[0], -1, -1), x], 1) + sd[p + "pos_embed"]
    for i in range(VIT["depth"]):
        b = f"{p}blocks.{i}."
        h = _ln(x, sd, b + "norm1", 1e-6)
        B, N, C = h.shape
        qkv = _lin(h, sd, b + "attn.qkv").view(B, N, 3, VIT["num_heads"], C // VIT["num_heads"]).permute(2, 0, 3, 1, 4)
        a = (qkv[0] @ qkv[1].transpose(-1, -2) * (C // VIT["num_heads"]) ** -0.5).softmax(-1) @ qkv[2]
        x = x + _lin(a.transpose(1, 2).reshape(B, N, C), sd, b + "attn.proj")
        x = x + _lin(F.gelu(_lin(_ln(x, sd, b + "norm2", 1e-6), sd, b + "mlp.fc1")), sd, b + "mlp.fc2")
    img = _ln(x, sd, p + "norm", 1e-6)
    # --- med BERT with cross-attention (post-norm), [CLS] kept as the first token
    t = "blip.text_encoder."
    eps = MED["layer_norm_eps"]
    pos = sd[t + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    h = sd[t + "embeddings.word_embeddings.weight"][ids] + pos
    h = _ln(h, sd, t + "embeddings.LayerNorm", eps)
    self_mask = (1.0 - mask[:, None, None, :].float()) * -10000.0
    for i in range(MED["num_hidden_layers"]):
        L = f"{t}encoder.layer.{i}."
        a = _attn(h, h, sd, L + "attention.self", MED["num_attention_heads"], self_mask)
        h = _ln(_lin(a, sd, L + "attention.output.dense") + h, sd, L + "attention.output.LayerNorm", eps)
        c = _attn(h, img, sd, L + "crossattention.self", MED["num_attention_heads"], 0.0)
        h = _ln(_lin(c, sd, L + "crossattention.output.dense") + h, sd, L + "crossattention.output.LayerNorm", eps)
        f = _lin(F.gelu(_lin(h, sd, L + "intermediate.dense")), sd, L + "output.dense")
        h = _ln(f + h, sd, L + "output.LayerNorm", eps)
    # --- head: Linear 768(here 32)->1024->128->64->16->1, no activations (dropout off at eval)
    z = h[:, 0]
    for j in (0, 2, 4, 6, 7):
        z = _lin(z, sd, f"mlp.layers.{j}")
    raw = z.squeeze(-1)
    return (raw - MEAN) / STD, raw


def _pixels(images):
    """ImageReward's ``_transform`` at 32 px (square inputs: bicubic resize, a no-op CenterCrop, CLIP mean/std) of the
    uint8-rounded images (:func:`helpers.references.imagereward_reference`)."""
    return torch.stack([imagereward_reference(a, size=VIT["img_size"]) for a in flow_grpo_uint8(images)])


def test_imagereward_matches_stepwise_forward(ir_dir):
    from transformers import BertTokenizer

    from stepflow.rewards.imagereward import ImageReward

    d, tokdir, sd = ir_dir
    images = torch.rand(len(PROMPTS), 3, 48, 48, generator=torch.Generator().manual_seed(5))
    r = ImageReward(model_path=str(d), tokenizer_path=str(tokdir), vit_num_heads=VIT["num_heads"], device="cpu")
    out = r(images, PROMPTS)

    tok = BertTokenizer.from_pretrained(str(tokdir))
    enc = tok(PROMPTS, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert (enc["input_ids"][:, 0] == tok.cls_token_id).all()  # ImageReward keeps [CLS] (BLIP-ITM swaps in [ENC])
    with torch.no_grad():
        expected, raw = _reference(sd, _pixels(images), enc["input_ids"], enc["attention_mask"])
    assert out.scores.shape == (len(PROMPTS),)
    torch.testing.assert_close(out.scores, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.components["raw"], raw, rtol=1e-4, atol=1e-4)
    assert out.scores.std() > 0.01
    # ImageReward pads every prompt to 35 tokens
    assert r.tokenize(PROMPTS)["input_ids"].shape == (len(PROMPTS), 35)
    # the model's sizes were read from the checkpoint
    assert r.model.vit_config["img_size"] == 32 and r.model.vit_config["depth"] == 2
    assert r.model.med_config.encoder_width == VIT["embed_dim"]


def test_imagereward_checkpoint_file_and_errors(ir_dir, tmp_path):
    from stepflow.rewards.imagereward import ImageReward

    d, tokdir, _ = ir_dir
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    a = ImageReward(model_path=str(d), tokenizer_path=str(tokdir), vit_num_heads=4, device="cpu")(images, PROMPTS[:2])
    b = ImageReward(model_path=str(d / "ImageReward.pt"), med_config=str(d / "med_config.json"),
                    tokenizer_path=str(tokdir), vit_num_heads=4, device="cpu")(images, PROMPTS[:2])
    torch.testing.assert_close(a.scores, b.scores)

    def err(**kw):
        with pytest.raises(RewardLoadError) as ei:
            ImageReward(**{"model_path": str(d), "tokenizer_path": str(tokdir), "vit_num_heads": 4, "device": "cpu",
                           **kw})
        assert "\n" not in str(ei.value), str(ei.value)
        return str(ei.value)

    assert str(tmp_path / "nope") in err(model_path=str(tmp_path / "nope"))
    assert "reward.tokenizer_path" in err(tokenizer_path=str(tmp_path / "no_tok"))
    assert "med_cfg.json" in err(med_config="med_cfg.json")
    sd = torch.load(d / "ImageReward.pt")
    del sd["mlp.layers.0.weight"]
    torch.save(sd, tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text(json.dumps(MED))
    assert "mlp.layers.0.weight" in err(model_path=str(tmp_path))
    assert "stepflow-test/no-such-ir" in err(model_path="stepflow-test/no-such-ir")  # uncached hub id, offline


def test_imagereward_runs_in_bf16(ir_dir):
    """``reward.dtype=bfloat16`` (through the Hydra config; it used to crash: a bf16 head fed fp32) runs BLIP in bf16
    with the MLP head in fp32, and agrees with fp32 to a bf16 tolerance (~3x the measured 5e-3)."""
    from stepflow.rewards.registry import build_reward

    d, tokdir, _ = ir_dir
    images = torch.rand(len(PROMPTS), 3, 40, 48, generator=torch.Generator().manual_seed(5))
    ov = [f"model_path={d}", f"tokenizer_path={tokdir}", f"vit_num_heads={VIT['num_heads']}", "device=cpu"]
    fp32, bf16 = build_reward("imagereward", ov), build_reward("imagereward", ov + ["dtype=bfloat16"])
    assert bf16.model.blip.visual_encoder.patch_embed.proj.weight.dtype == torch.bfloat16
    assert bf16.model.mlp.layers[0].weight.dtype == torch.float32
    a, b = fp32(images, PROMPTS), bf16(images, PROMPTS)
    assert not torch.equal(a.scores, b.scores)
    torch.testing.assert_close(b.scores, a.scores, rtol=0, atol=0.015)
    torch.testing.assert_close(b.components["raw"], a.components["raw"], rtol=0, atol=0.015)


def test_imagereward_checkpoint_cannot_run_code(ir_dir, tmp_path):
    """ImageReward.pt is read with weights_only=True: a payload does not run; one line naming the path and
    reward.model_path. The ``weights_only`` option is gone."""
    from helpers.payloads import assert_payload_refused, payload_checkpoint

    from stepflow.rewards.imagereward import ImageReward
    from stepflow.rewards.registry import build_reward, reward_config

    d, tokdir, sd = ir_dir
    path, marker = payload_checkpoint(tmp_path, "ImageReward.pt", sd)
    (tmp_path / "med_config.json").write_text(json.dumps(MED))
    assert_payload_refused(lambda: build_reward("imagereward", [f"model_path={tmp_path}", f"tokenizer_path={tokdir}",
                                                                "vit_num_heads=4", "device=cpu"]),
                           path, marker, "reward.model_path=")
    assert "weights_only" not in reward_config("imagereward")
    with pytest.raises(TypeError):
        ImageReward(model_path=str(d), tokenizer_path=str(tokdir), weights_only=False, device="cpu")
