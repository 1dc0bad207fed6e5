"""``model=sd35_large``: the SD3 policy with SD3.5-Large's settings, on the tiny SD3.5-Large-like pipeline (an MMDiT
without SD3.5-Medium's dual attention), loaded through the same loader and config path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.policies.sd3 import SD3Policy  # noqa: E402
from stepflow.testing.harness import compose_config  # noqa: E402
from stepflow.testing.tiny_policies import TINY_HEIGHT  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog on the square"]
SEQ = 16
H = TINY_HEIGHT


@pytest.fixture(scope="module")
def tiny_dir(tiny_pipeline):
    return tiny_pipeline("sd35_large")


def _compose(*overrides):
    return compose_config("train", overrides)


@torch.no_grad()
def _euler(policy, latents, steps, guidance):
    cond = policy.encode(PROMPTS)
    tau = policy.time_grid(steps)
    x = latents.clone()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond, guidance=guidance)
    return x


def test_sd35_large_config_has_the_model_cards_settings():
    from omegaconf import OmegaConf

    from stepflow.policies.base import LORA_TARGETS_SD3

    cfg = _compose("model=sd35_large")
    kwargs = OmegaConf.to_container(cfg.model, resolve=True)
    assert kwargs["_target_"] == "stepflow.policies.sd3.SD3Policy.from_pretrained"
    assert kwargs["path"] == "stabilityai/stable-diffusion-3.5-large"
    assert tuple(cfg.lora.targets) == LORA_TARGETS_SD3  # no recipe: the top-level SD3 LoRA
    assert (kwargs["height"], kwargs["width"], kwargs["eval_guidance"]) == (1024, 1024, 3.5)
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_sequence_length"] == 256 and kwargs["finetune"] == "lora"


def test_tiny_large_has_no_dual_attention_and_matches_the_pipeline(tiny_dir):
    """The tiny large variant is a plain MMDiT (no attn2), and the policy's Euler ODE with CFG 3.5 (the model card's)
    reproduces StableDiffusion3Pipeline.__call__."""
    pol = SD3Policy.from_pretrained(str(tiny_dir), dtype="float32", height=H, width=H, max_sequence_length=SEQ)
    assert not any(".attn2." in n for n, _ in pol.transformer.named_modules())
    assert pol.shift == 3.0 and pol.latent_shape == (16, H // 8, H // 8)
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _euler(pol, latents, 4, 3.5)
    ref = pol.pipe(PROMPTS, num_inference_steps=4, height=H, width=H, guidance_scale=3.5, max_sequence_length=SEQ,
                   latents=latents.clone(), output_type="latent").images
    err = (ours - ref).abs().max().item()
    print(f"max-abs SD3.5-Large-tiny ODE vs StableDiffusion3Pipeline (cfg 3.5): {err:.3e}")
    assert err <= 1e-4 and (ours - latents).abs().max() > 1e-2


def test_tiny_large_config_builds_into_cache_and_trains_lora(tmp_path, monkeypatch):
    """``model=sd35_large_tiny`` builds into $STEPFLOW_CACHE; the top-level LoRA adapts both streams' attention and the
    adapter loads into the pipeline (load_lora_weights) with the same output."""
    from diffusers import StableDiffusion3Pipeline

    from stepflow.train import build_policy

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path))
    cfg = _compose("model=sd35_large_tiny", "lora.rank=4", "lora.alpha=8")
    pol = build_policy(cfg)
    assert (tmp_path / "sd35_large_tiny-v1-s0" / "model_index.json").is_file()
    assert isinstance(pol, SD3Policy) and pol.has_lora and pol.eval_guidance == 3.5
    names = {n for n, _ in pol.transformer.named_modules() if n.endswith("lora_A")}
    assert any(n.endswith("attn.add_q_proj.lora_A") for n in names) and any(n.endswith("attn.to_q.lora_A") for n in names)
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(2))
    ours = _euler(pol, latents, 3, 3.5)
    pol.save_trained(tmp_path / "lora")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "sd35_large_tiny-v1-s0"))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ref = pipe(PROMPTS, num_inference_steps=3, height=H, width=H, guidance_scale=3.5, max_sequence_length=32,
               latents=latents.clone(), output_type="latent").images
    assert (ours - ref).abs().max().item() <= 1e-4


def test_bad_path_names_the_large_repo_and_the_licence():
    import os

    from stepflow.errors import ModelLoadError

    os.environ["HF_HUB_OFFLINE"] = "1"
    with pytest.raises(ModelLoadError) as info:
        SD3Policy.from_pretrained("stabilityai/stable-diffusion-3.5-large")
    msg = str(info.value)
    assert "\n" not in msg and "stable-diffusion-3.5-large" in msg and "model.path=" in msg and "gated" in msg
