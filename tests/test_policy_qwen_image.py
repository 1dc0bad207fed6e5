"""QwenImagePolicy on a tiny random Qwen-Image pipeline (fp32, CPU), loaded through the real loader.

The key tests: the policy's Euler ODE on its grid reproduces ``QwenImagePipeline.__call__`` with and without its true
CFG (negative prompt " ", per-token norm rescale); the prompt encoding is the pipeline's (template, 34 dropped tokens,
per-prompt lengths with a mask); the grid is the one the pipeline calls its transformer at; the LoRA loads into the
pipeline.
"""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("diffusers")

from stepflow.errors import ModelLoadError  # noqa: E402
from stepflow.policies.base import Cond  # noqa: E402
from stepflow.policies.flux import pack_latents, unpack_latents  # noqa: E402
from stepflow.policies.qwen_image import LORA_TARGETS_QWEN_IMAGE, QwenImagePolicy  # noqa: E402
from stepflow.testing.tiny_policies import TINY_HEIGHT, make_qwen_tokenizer  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog on the square"]  # different lengths: the batch needs a mask
H = TINY_HEIGHT
CFG = 4.0  # the model card's true_cfg_scale


@pytest.fixture(scope="module")
def tiny_dir(tiny_pipeline):
    return tiny_pipeline("qwen_image")


def _load(path, **kw):
    kw.setdefault("dtype", "float32")
    return QwenImagePolicy.from_pretrained(str(path), height=H, width=H, **kw)


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return _load(tiny_dir)


@torch.no_grad()
def _euler(policy, prompts, latents, steps, guidance=1.0):
    cond = policy.encode(prompts)
    tau = policy.time_grid(steps)
    x = latents.clone().float()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond, guidance=guidance)
    return x


def _pipe(policy, latents, steps, cfg=1.0, output_type="latent", pipe=None):
    pipe = pipe or policy.pipe
    extra = {"negative_prompt": " "} if cfg != 1.0 else {}
    out = pipe(PROMPTS, height=H, width=H, num_inference_steps=steps, true_cfg_scale=cfg,
               latents=pack_latents(latents.clone()), output_type=output_type, **extra).images
    return unpack_latents(out, *latents.shape[-2:]) if output_type == "latent" else out


def test_tokenizer_splits_the_template_as_qwens(policy):
    """The tiny tokenizer gives the pipeline's template exactly the 34 prefix tokens the pipeline drops."""
    tok = make_qwen_tokenizer()
    text = policy.pipe.prompt_template_encode
    assert policy.pipe.prompt_template_encode_start_idx == 34
    ids = tok(text.format("a cat")).input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[:4] == ["<|im_start|>", "system", "\u010a", "Describe"] and pieces[33] == "\u010a"
    assert pieces[34:36] == ["a", "\u0120cat"] and pieces[36] == "<|im_end|>"
    assert len(tok(text.format("")).input_ids) == 34 + 5  # prefix + <|im_end|> \n <|im_start|> assistant \n


def test_loaded_attributes(policy):
    assert policy.latent_shape == (16, H // 8, H // 8) and policy.image_seq_len == (H // 16) ** 2
    assert policy.negative_prompt == " " and policy.cfg_renorm and policy.guidance == CFG
    assert policy.dtype == torch.float32 and len(policy.text_encoders) == 1
    assert not any(p.requires_grad for m in [policy.vae, *policy.text_encoders] for p in m.parameters())


def test_time_grid_is_the_pipelines(policy):
    """The grid = the times QwenImagePipeline calls its transformer at + 0: dynamic shift then shift_terminal
    stretching (the last non-zero σ is 0.02); it starts at exactly 1."""
    seen = []
    handle = policy.pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["timestep"].detach().clone()), with_kwargs=True)
    try:
        policy.pipe(PROMPTS[:1], height=H, width=H, num_inference_steps=5, true_cfg_scale=1.0, output_type="latent")
    finally:
        handle.remove()
    grid = policy.time_grid(5)
    assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0 and abs(float(grid[-2]) - 0.02) < 1e-6
    assert torch.allclose(grid[:-1], torch.stack([s[0] for s in seen]), atol=1e-6)


@pytest.mark.parametrize("cfg", [1.0, CFG])
def test_euler_ode_matches_pipeline(policy, cfg):
    """The policy's ODE sampler == QwenImagePipeline.__call__ (same prompts, latents, steps; true CFG with " " and
    the norm rescale), as latents and as images."""
    steps = 4
    latents = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _euler(policy, PROMPTS, latents, steps, cfg)
    ref = _pipe(policy, latents, steps, cfg)
    err = (ours - ref).abs().max().item()
    print(f"max-abs Qwen-Image ODE vs QwenImagePipeline (true cfg {cfg}): {err:.3e}")
    assert err <= 1e-4
    assert (ours - latents).abs().max() > 1e-2
    img = _pipe(policy, latents, steps, cfg, output_type="pt")
    with torch.no_grad():
        ours_img = policy.decode(ours)
    assert ours_img.shape == (2, 3, H, H) and ours_img.dtype == torch.float32
    assert (ours_img - img).abs().max().item() <= 1e-4


def test_cfg_renorm_and_negative_prompt_matter(tiny_dir, policy):
    latents = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(2))
    base = _euler(policy, PROMPTS, latents, 2, CFG)
    assert (base - _euler(policy, PROMPTS, latents, 2)).abs().max() > 1e-3
    plain = _load(tiny_dir, cfg_renorm=False)
    assert (_euler(plain, PROMPTS, latents, 2, CFG) - base).abs().max() > 1e-3
    empty = _load(tiny_dir, negative_prompt="")
    assert (_euler(empty, PROMPTS, latents, 2, CFG) - base).abs().max() > 1e-4
    # the rescaled CFG velocity has the conditional velocity's norm on every packed token
    x = torch.randn(2, *policy.latent_shape)
    cond = policy.encode(PROMPTS)
    with torch.no_grad():
        v = policy.velocity(x, 0.7, cond, guidance=CFG)
        v_c = policy.velocity(x, 0.7, cond)
    assert torch.allclose(pack_latents(v).norm(dim=-1), pack_latents(v_c).norm(dim=-1), rtol=1e-4)


def test_encode_is_the_pipelines_with_lengths_and_mask(policy):
    calls = []
    hook = policy.text_encoders[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        policy.clear_prompt_cache()
        c = policy.encode(PROMPTS + [PROMPTS[0]])
        assert len(calls) == 1
        policy.encode([PROMPTS[1]])
        assert len(calls) == 1
    finally:
        hook.remove()
    ref, ref_mask = policy.pipe.encode_prompt(PROMPTS, max_sequence_length=policy.max_sequence_length)
    assert c.tokens.shape == (3, *ref.shape[1:]) and c.pooled.shape == (3, 0)
    assert torch.equal(c.mask[:2], ref_mask.bool()) and not c.mask[0].all() and c.mask[1].all()
    assert torch.allclose(c.tokens[:2] * c.mask[:2, :, None], ref * ref_mask[:, :, None], atol=1e-6)
    one = policy.encode([PROMPTS[0]])  # a batch of one prompt: its own length, no mask (as the pipeline)
    assert one.mask is None and one.tokens.shape[1] == int(c.mask[0].sum())
    # a batch padded for CFG ([negative, cond]) gives the same velocity as each prompt alone
    x = torch.randn(1, *policy.latent_shape)
    t = torch.tensor([0.6])
    both = Cond.cat([policy.negative_cond(1), one])
    assert both.mask is not None and both.tokens.shape[1] == max(policy.negative_cond(1).tokens.shape[1],
                                                                  one.tokens.shape[1])
    with torch.no_grad():
        v2 = policy._forward(torch.cat([x, x]), torch.cat([t, t]), both)
        v_alone = policy._forward(x, t, one)
    assert (v2[1:] - v_alone).abs().max() < 1e-5


def test_lora_targets_save_and_load_with_diffusers(tiny_dir, tmp_path):
    from diffusers import QwenImagePipeline

    flow_grpo = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                 "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                 "txt_mlp.net.2"]  # Flow-GRPO scripts/train_qwenimage_edit_plus.py
    assert sorted(LORA_TARGETS_QWEN_IMAGE) == sorted(flow_grpo)
    pol = _load(tiny_dir, lora={"rank": 4, "alpha": 8.0, "targets": list(LORA_TARGETS_QWEN_IMAGE)})
    names = {n for n, _ in pol.transformer.named_modules() if n.endswith("lora_A")}
    for target in flow_grpo:
        assert any(n.endswith(f"{target}.lora_A") for n in names), target
    assert all("lora_" in n for n, p in pol.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(4))
    ours = _euler(pol, PROMPTS, latents, 3, CFG)
    with pol.disable_adapter():
        base = _euler(pol, PROMPTS, latents, 3, CFG)
    assert (ours - base).abs().max() > 1e-3
    pol.save_lora(tmp_path / "lora")
    pipe = QwenImagePipeline.from_pretrained(str(tiny_dir))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    err = (ours - _pipe(pol, latents, 3, CFG, pipe=pipe)).abs().max().item()
    print(f"max-abs Qwen-Image LoRA policy vs QwenImagePipeline.load_lora_weights: {err:.3e}")
    assert err <= 1e-4
    pol2 = _load(tiny_dir, lora={"path": str(tmp_path / "lora")})
    assert pol2.has_lora and (_euler(pol2, PROMPTS, latents, 3, CFG) - ours).abs().max().item() <= 1e-4


def test_bf16_time_reaches_the_embedding_in_fp32(tiny_dir):
    pol = _load(tiny_dir, dtype="bfloat16", gradient_checkpointing=True, offload_text_encoders=True,
                lora={"rank": 2, "targets": list(LORA_TARGETS_QWEN_IMAGE)})
    seen = []
    handle = pol.transformer.time_text_embed.time_proj.register_forward_pre_hook(
        lambda m, a: seen.append(a[0].detach().clone()))
    try:
        t = torch.tensor([0.91335, 0.60215])
        v = pol.velocity(torch.randn(2, *pol.latent_shape), t, pol.encode(PROMPTS), guidance=CFG)
    finally:
        handle.remove()
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], torch.cat([t, t]))  # [uncond, cond] batch
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    v.pow(2).mean().backward()
    # every adapter gets a gradient except the last block's text stream, whose output the image never reads
    last = f"transformer_blocks.{len(pol.transformer.transformer_blocks) - 1}."
    no_grad = {n for n, p in pol.transformer.named_parameters() if "lora_" in n and p.grad is None}
    assert no_grad and all(n.startswith(last) and ("txt_mlp" in n or "to_add_out" in n) for n in no_grad), no_grad
    pol.precache(["a blue circle"])
    pol.free_text_encoders()
    assert pol.encode(["a blue circle"]).tokens.shape[0] == 1 and pol.negative_cond(1).tokens.shape[0] == 1
    with pytest.raises(RuntimeError, match="precache"):
        pol.encode(["never seen"])


def test_tiny_config_builds_into_cache_and_loads(tmp_path, monkeypatch, compose):
    import hydra.utils

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path))
    cfg = compose("train", ["model=qwen_image_tiny", "lora.rank=4"])
    kwargs, lora = OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.lora)
    pol = hydra.utils.instantiate(kwargs, _convert_="all")
    assert (tmp_path / "qwen_image_tiny-v1-s0" / "model_index.json").is_file()
    assert isinstance(pol, QwenImagePolicy) and lora["rank"] == 4 and "img_mlp.net.2" in lora["targets"]
    v = pol.velocity(torch.randn(1, *pol.latent_shape), 0.5, pol.encode(["a cat"]), guidance=CFG)
    assert v.shape == (1, *pol.latent_shape) and v.dtype == torch.float32


@pytest.mark.parametrize("path", ["/nonexistent/qwen", "Qwen/not-a-real-model-xyz"])
def test_bad_path_is_one_line_error(path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    with pytest.raises(ModelLoadError) as info:
        QwenImagePolicy.from_pretrained(path)
    msg = str(info.value)
    assert "\n" not in msg and path in msg and "model.path=" in msg and "Qwen-Image" in msg
    err = info.value
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
