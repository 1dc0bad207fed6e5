"""ShapesPolicy: shapes, encode cache, decode range, save/load round trip, LoRA targets and the reference context,
and the shipped base-model asset."""

from pathlib import Path

import pytest
import torch

from stepflow.policies.base import LORA_TARGETS_SD3
from stepflow.policies.shapes import ShapesPolicy, build_vocab, default_asset_dir, tokenize_words, world_vocab

TINY = dict(num_layers=2, num_attention_heads=2, attention_head_dim=8, text_dim=16, text_layers=1, text_heads=2,
            pooled_dim=16, init="default")
PROMPTS = ["a photo of a red circle", "a photo of two squares", "", "a photo of a triangle left of a circle"]


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return ShapesPolicy.build(**TINY).eval()


def test_vocab_covers_the_world():
    from stepflow.shapes import load_prompts

    vocab, longest = world_vocab()
    words = {w for r in load_prompts("eval") + load_prompts("train") for w in tokenize_words(r["prompt"])}
    assert words <= set(vocab)
    assert vocab[:3] == ["[PAD]", "[BOS]", "[UNK]"] and longest >= 8


def test_shapes_and_ranges(policy):
    c = policy.encode(PROMPTS)
    L = policy.config.max_length
    assert c.tokens.shape == (4, L, 16) and c.pooled.shape == (4, 16) and c.mask.shape == (4, L)
    assert c.mask[2].sum() == 1  # the empty prompt is just [BOS]
    assert (c.tokens[~c.mask] == 0).all()  # padding states are zero
    x = torch.randn(4, *policy.latent_shape)
    assert policy.latent_shape == (3, 32, 32)
    with torch.no_grad():
        v = policy.velocity(x, torch.rand(4), c)
        v_cfg = policy.velocity(x, 0.5, c, guidance=3.0)
    assert v.shape == x.shape and v.dtype == torch.float32 and v_cfg.shape == x.shape
    img = policy.decode(x * 3)
    assert img.shape == (4, 3, 32, 32) and img.min() >= 0 and img.max() <= 1
    assert torch.allclose(policy.decode(policy.encode_images(img)), img)
    grid = policy.time_grid(10)
    assert grid[0] == 1 and grid[-1] == 0 and len(grid) == 11


def test_encode_caches_per_prompt(policy):
    policy.clear_cache()
    a = policy.encode(["a photo of a blue square", "a photo of a blue square"])
    assert len(policy._cache) == 1
    b = policy.encode(["a photo of a green circle", "a photo of a blue square"])
    assert len(policy._cache) == 2
    assert torch.equal(a.tokens[0], b.tokens[1]) and torch.equal(a.pooled[1], b.pooled[1])
    # unknown words map to [UNK] instead of failing
    assert policy.text_encoder.tokenize(["a zebra"])[0, 2].item() == 2


def test_save_from_pretrained_round_trip(policy, tmp_path):
    policy.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()
    p2 = ShapesPolicy.from_pretrained(tmp_path / "m")
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        v1 = policy.velocity(x, 0.3, policy.encode(PROMPTS))
        v2 = p2.velocity(x, 0.3, p2.encode(PROMPTS))
    assert torch.equal(v1, v2)
    assert p2.config.vocab == policy.config.vocab and p2.shift == policy.shift
    with pytest.raises(FileNotFoundError, match="config.json"):
        ShapesPolicy.from_pretrained(tmp_path / "nothing")


def test_lora_targets_and_reference_context(tmp_path):
    torch.manual_seed(0)
    pol = ShapesPolicy.build(vocab=build_vocab(PROMPTS), **TINY).eval()
    x, c = torch.randn(2, 3, 32, 32), pol.encode(PROMPTS[:2])
    with torch.no_grad():
        base = pol.velocity(x, 0.5, c)
    pol.add_lora(rank=4, alpha=8)
    names = [n for n, _ in pol.transformer.named_parameters() if "lora_A" in n]
    adapted = {n.split(".lora_A")[0].split("transformer_blocks.")[1].split(".", 1)[1] for n in names}
    assert adapted == set(LORA_TARGETS_SD3)  # to_q/k/v, to_out.0, add_q/k/v_proj, to_add_out
    assert all(p.requires_grad for p in pol.lora_parameters())
    assert not any(p.requires_grad for n, p in pol.transformer.named_parameters() if "lora_" not in n)
    with torch.no_grad():
        for n, p in pol.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.5)
        adapted_v = pol.velocity(x, 0.5, c)
        with pol.disable_adapter():
            ref = pol.velocity(x, 0.5, c)
    assert not torch.allclose(adapted_v, base, atol=1e-4)
    assert torch.allclose(ref, base, atol=1e-6)
    # save_pretrained writes base weights only (loadable without peft)
    pol.save_pretrained(tmp_path / "b")
    with torch.no_grad():
        assert torch.allclose(ShapesPolicy.from_pretrained(tmp_path / "b").velocity(x, 0.5, c), base, atol=1e-6)


def test_shipped_asset_loads_and_is_small():
    d = default_asset_dir()
    w = Path(d) / "model.safetensors"
    assert w.is_file(), f"missing shipped weights {w}"
    assert w.stat().st_size <= 20 * 2**20
    assert (Path(d) / "README.md").is_file()
    pol = ShapesPolicy.from_pretrained()
    assert pol.latent_shape == (3, 32, 32)
    with torch.no_grad():
        img = pol.decode(pol.velocity(torch.randn(2, 3, 32, 32), 1.0, pol.encode(["a photo of a circle", ""])))
    assert img.shape == (2, 3, 32, 32)


def test_asset_found_through_package_resources():
    from importlib import resources

    res = resources.files("stepflow") / "assets" / "shapes_base" / "config.json"
    assert res.is_file()


def test_x_prediction_and_dit_init():
    torch.manual_seed(0)
    pol = ShapesPolicy.build(vocab=build_vocab(PROMPTS), **{**TINY, "init": "dit", "prediction": "x"}).eval()
    x, c = torch.randn(2, 3, 32, 32), pol.encode(PROMPTS[:2])
    t = torch.tensor([0.5, 0.01])
    with torch.no_grad():
        raw = pol.transformer(hidden_states=x, encoder_hidden_states=c.tokens, pooled_projections=c.pooled,
                              timestep=t * 1000, return_dict=False)[0]
        v = pol.velocity(x, t, c)
    assert torch.count_nonzero(raw) == 0  # adaLN-Zero: a fresh model outputs 0
    expect = (x - raw) / t.clamp_min(pol.config.t_eps).view(-1, 1, 1, 1)
    assert torch.allclose(v, expect)
    with pytest.raises(ValueError, match="prediction"):
        ShapesPolicy.build(vocab=build_vocab(PROMPTS), **{**TINY, "prediction": "eps"})
