"""FluxKontextPolicy on a tiny random FLUX.1 Kontext pipeline (fp32, CPU), loaded through the real loader.

The key test: the policy's Euler ODE on its grid reproduces ``FluxKontextPipeline.__call__`` on the same noise, the
same source images and instructions (the source resized to the output size, ``_auto_resize=False``; the latent
concatenation of the source tokens with ids (1, i, j); the guidance embedding; true CFG with a negative prompt),
Δ ≤ 2e-6 in fp32; the grid is the one the pipeline calls its transformer at (μ of the output tokens only); the
source is VAE-encoded once per distinct source and carried by the conditioning; LoRA loads into the pipeline; full
fine-tuning saves a transformer the loader takes back.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.policies.flux import pack_latents, unpack_latents  # noqa: E402
from stepflow.policies.flux_kontext import FluxKontextPolicy  # noqa: E402
from stepflow.testing.tiny_edit import save_tiny_flux_kontext, write_edit_set  # noqa: E402

H = 64
PROMPTS = ["make the circle blue", "a red dog on the square"]
GUIDANCE = 2.5  # the embedded (distilled) guidance


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_flux_kontext(tmp_path_factory.mktemp("tiny_flux_kontext"))


@pytest.fixture(scope="module")
def edit_set(tmp_path_factory):
    return write_edit_set(tmp_path_factory.mktemp("edit_set"), size=H)


@pytest.fixture(scope="module")
def sources(edit_set):
    return [str(edit_set / "images" / "red_circle.png"), str(edit_set / "images" / "blue_square.png")]


def _load(path, **kw):
    kw.setdefault("dtype", "float32")
    return FluxKontextPolicy.from_pretrained(str(path), height=H, width=H, max_sequence_length=32, **kw)


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return _load(tiny_dir)


@torch.no_grad()
def _euler(policy, sources, latents, steps, guidance=1.0):
    cond = policy.encode(PROMPTS, sources)
    tau = policy.time_grid(steps)
    x = latents.clone().float()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond, guidance=guidance)
    return x


def _pipe(policy, sources, latents, steps, cfg=1.0, output_type="latent", pipe=None):
    from PIL import Image

    pipe = pipe or policy.pipe
    extra = {"negative_prompt": "", "true_cfg_scale": cfg} if cfg != 1.0 else {}
    images = [Image.open(s).convert("RGB") for s in sources]
    out = pipe(image=images, prompt=PROMPTS, height=H, width=H, max_area=H * H, _auto_resize=False,
               num_inference_steps=steps, guidance_scale=GUIDANCE, latents=pack_latents(latents.clone()),
               max_sequence_length=32, output_type=output_type, **extra).images
    return unpack_latents(out, *latents.shape[-2:]) if output_type == "latent" else out


@pytest.mark.parametrize("cfg", [1.0, 2.0])
def test_euler_ode_matches_pipeline(policy, sources, cfg):
    """The policy's ODE == FluxKontextPipeline.__call__ (same noise, sources, instructions, steps; the embedded
    guidance; true CFG with the empty negative prompt), as latents and as images."""
    steps = 4
    latents = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _euler(policy, sources, latents, steps, cfg)
    ref = _pipe(policy, sources, latents, steps, cfg)
    err = (ours - ref).abs().max().item()
    print(f"max-abs FLUX.1 Kontext ODE vs FluxKontextPipeline (true cfg {cfg}): {err:.3e}")
    assert err <= 2e-6
    assert (ours - latents).abs().max() > 1e-2
    img = _pipe(policy, sources, latents, steps, cfg, output_type="pt")
    with torch.no_grad():
        ours_img = policy.decode(ours)
    assert ours_img.shape == (2, 3, H, H) and (ours_img - img).abs().max().item() <= 1e-5


def test_time_grid_is_the_pipelines_with_mu_of_the_output_tokens(policy, sources):
    seen = []
    handle = policy.pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["timestep"].detach().clone()), with_kwargs=True)
    try:
        _pipe(policy, sources, torch.randn(2, *policy.latent_shape), 5)
    finally:
        handle.remove()
    grid = policy.time_grid(5)
    assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0
    assert torch.allclose(grid[:-1], torch.stack([s[0] for s in seen]), atol=1e-6)
    assert policy.image_seq_len == (H // 16) ** 2  # the output's tokens, not output + source


def test_source_tokens_follow_the_latents_with_ids_of_frame_one(policy, sources):
    """The transformer sees [x tokens, source tokens] and ids (0, i, j) then (1, i, j), as the pipeline passes them."""
    calls = []
    handle = policy.pipe.transformer.register_forward_pre_hook(lambda m, a, kw: calls.append(kw), with_kwargs=True)
    try:
        latents = torch.randn(2, *policy.latent_shape)
        _pipe(policy, sources, latents, 1)
        with torch.no_grad():
            policy.velocity(latents, 1.0, policy.encode(PROMPTS, sources))
    finally:
        handle.remove()
    ref, ours = calls[0], calls[-1]
    n = (H // 16) ** 2
    assert ref["hidden_states"].shape == ours["hidden_states"].shape == (2, 2 * n, 64)
    assert torch.allclose(ref["hidden_states"], ours["hidden_states"], atol=1e-6)
    assert torch.equal(ref["img_ids"], ours["img_ids"]) and set(ours["img_ids"][n:, 0].tolist()) == {1.0}


def test_each_source_is_encoded_once_and_rides_in_the_condition(tiny_dir, sources):
    pol = _load(tiny_dir)
    calls = []
    hook = pol.vae.encoder.register_forward_hook(lambda *a: calls.append(1))
    try:
        c = pol.encode(PROMPTS * 2, sources + sources)  # two groups of the same sources
        pol.encode(PROMPTS[:1], sources[:1])
    finally:
        hook.remove()
    assert len(calls) == 2  # once per distinct source
    assert c.image.shape == (4, 16, H // 8, H // 8) and torch.equal(c.image[0], c.image[2])
    group = c.repeat(3)  # the loop's group / estimate batches keep each row's source
    assert torch.equal(group.image[3], c.image[1]) and torch.equal(c.index([1]).image[0], c.image[1])
    x = torch.randn(4, *pol.latent_shape)
    with torch.no_grad():
        swapped = pol.velocity(x, 0.5, pol.encode(PROMPTS * 2, sources[::-1] * 2))
        v = pol.velocity(x, 0.5, c)
    assert (swapped - v).abs().max() > 1e-4


def test_a_pixel_tensor_and_its_png_are_the_same_source(policy, sources):
    import numpy as np
    from PIL import Image

    t = torch.from_numpy(np.asarray(Image.open(sources[0]).convert("RGB"), dtype=np.float32) / 255).permute(2, 0, 1)
    a = policy.encode(PROMPTS[:1], [t]).image
    b = policy.encode(PROMPTS[:1], sources[:1]).image
    assert torch.allclose(a, b, atol=1e-6)


def test_lora_loads_into_the_kontext_pipeline(tiny_dir, sources, tmp_path):
    """A trained adapter, saved, loaded by FluxKontextPipeline.load_lora_weights: the pipeline samples what the
    policy does."""
    from diffusers import FluxKontextPipeline

    pol = _load(tiny_dir, lora={"rank": 2, "alpha": 4,
                                "targets": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "proj_mlp"]})
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    pol.save_trained(tmp_path / "lora")
    pipe = FluxKontextPipeline.from_pretrained(str(tiny_dir), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(3))
    ours = _euler(pol, sources, latents, 2)
    ref = _pipe(pol, sources, latents, 2, pipe=pipe)
    with pol.disable_adapter():  # policy.pipe shares the policy's transformer: without the adapter, the base model
        base = _pipe(pol, sources, latents, 2)
    assert (ours - ref).abs().max().item() <= 1e-5 and (ref - base).abs().max().item() > 1e-4


def test_full_finetuning_saves_a_transformer_the_loader_takes_back(tiny_dir, sources, tmp_path):
    pol = _load(tiny_dir, finetune="full")
    assert pol.finetune == "full" and not pol.has_lora
    trainable = {id(p) for p in pol.trainable_parameters()}
    assert trainable == {id(p) for p in pol.transformer.parameters()}
    pol.prepare_reference()  # the frozen initial copy, as the loop makes it before the first update
    with torch.no_grad():
        for p in pol.transformer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    pol.save_trained(tmp_path / "transformer")
    back = _load(tiny_dir, transformer_path=str(tmp_path / "transformer"))
    x = torch.randn(2, *pol.latent_shape)
    with torch.no_grad():
        ours = pol.velocity(x, 0.6, pol.encode(PROMPTS, sources))
        again = back.velocity(x, 0.6, back.encode(PROMPTS, sources))
        with pol.reference():
            ref = pol.velocity(x, 0.6, pol.encode(PROMPTS, sources))
    assert (ours - again).abs().max().item() <= 1e-6 and (ours - ref).abs().max().item() > 1e-4


def test_another_familys_folder_is_one_line_naming_model_path(tiny_pipeline):
    """A Qwen-Image folder given as FLUX.1 Kontext weights: one ModelLoadError line naming model.path and both
    families (a FLUX.1 text-to-image folder is the same family and is not refused: its components load)."""
    from stepflow.errors import ModelLoadError

    with pytest.raises(ModelLoadError) as info:
        _load(tiny_pipeline("qwen_image"))
    assert "model.path" in str(info.value) and "\n" not in str(info.value)
