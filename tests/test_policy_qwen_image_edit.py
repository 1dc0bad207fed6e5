"""QwenImageEditPolicy on a tiny random Qwen-Image-Edit pipeline (fp32, CPU), loaded through the real loader.

The key test: the policy's Euler ODE on its grid reproduces ``QwenImageEditPipeline.__call__`` on the same noise,
source image and instruction, with and without its true CFG (negative prompt " " encoded with the source, the
per-token norm rescale), at the pipeline's own image sizing (the source at its aspect ratio over 1024², multiples of
32; slow: ~4k source tokens on a CPU) and, fast, at a small area (the pipeline's ``calculate_dimensions`` given that
area); Δ ≤ 2e-6 in fp32. The pipeline is called one image at a time: with a *list* of images its ``image_processor.
resize`` leaves them unresized, so Qwen2.5-VL would see the original sources (the single-image path is the documented
one, and the policy's). Also: the tokenizer splits the edit template as Qwen's (64 dropped tokens end at
``<|vision_start|>``); the source's sizes; sources encoded once; a batch of mixed source sizes is one line.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.errors import StepflowError  # noqa: E402
from stepflow.policies.flux import pack_latents, unpack_latents  # noqa: E402
from stepflow.policies.qwen_image_edit import QwenImageEditPolicy  # noqa: E402
from stepflow.testing.tiny_edit import make_qwen_edit_tokenizer, save_tiny_qwen_image_edit  # noqa: E402

H = 64
PROMPTS = ["make the circle blue", "a red dog on the square"]  # different lengths: the batch needs a mask
CFG = 4.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny_qwen_image_edit"))


def _png(path, w, h, seed):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("sources")
    return [_png(d / "a.png", 80, 48, 0), _png(d / "b.png", 80, 48, 1)]  # 5:3, not square


def _load(path, **kw):
    kw.setdefault("dtype", "float32")
    return QwenImageEditPolicy.from_pretrained(str(path), height=H, width=H, **kw)


@pytest.fixture(scope="module")
def small(tiny_dir):
    return _load(tiny_dir, source_area=64 * 64)


@torch.no_grad()
def _euler(policy, sources, latents, steps, guidance=1.0):
    cond = policy.encode(PROMPTS, sources)
    tau = policy.time_grid(steps)
    x = latents.clone().float()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond, guidance=guidance)
    return x


def _pipe(policy, sources, latents, steps, cfg, output_type="latent", area=None, monkeypatch=None):
    """The pipeline row by row (one image per call, the documented path); ``area``: its calculate_dimensions' target
    area (the pipeline's own 1024² when None)."""
    from PIL import Image

    if area is not None:
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as mod

        orig = mod.calculate_dimensions
        monkeypatch.setattr(mod, "calculate_dimensions", lambda target_area, ratio: orig(area, ratio))
    extra = {"negative_prompt": " "} if cfg != 1.0 else {}
    rows = []
    for i, (prompt, src) in enumerate(zip(PROMPTS, sources)):
        out = policy.pipe(image=Image.open(src).convert("RGB"), prompt=prompt, height=H, width=H,
                          num_inference_steps=steps, true_cfg_scale=cfg, latents=pack_latents(latents[i:i + 1].clone()),
                          output_type=output_type, **extra).images
        rows.append(unpack_latents(out, *latents.shape[-2:]) if output_type == "latent" else out)
    return torch.cat(rows)


def _check(policy, sources, cfg, **kw):
    steps = 3
    latents = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _euler(policy, sources, latents, steps, cfg)
    ref = _pipe(policy, sources, latents, steps, cfg, **kw)
    err = (ours - ref).abs().max().item()
    print(f"max-abs Qwen-Image-Edit ODE vs QwenImageEditPipeline (true cfg {cfg}, source {policy.source_area} px): "
          f"{err:.3e}")
    assert err <= 2e-6
    assert (ours - latents).abs().max() > 1e-2
    return ours, latents


@pytest.mark.parametrize("cfg", [1.0, CFG])
def test_euler_ode_matches_pipeline_at_a_small_source_area(small, sources, cfg, monkeypatch):
    ours, latents = _check(small, sources, cfg, area=64 * 64, monkeypatch=monkeypatch)
    img = _pipe(small, sources, latents, 3, cfg, output_type="pt", area=64 * 64, monkeypatch=monkeypatch)
    with torch.no_grad():
        assert (small.decode(ours) - img).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.extended  # ~2 min each on 2 cores: make test-extended (the small-area parity runs in CI)
@pytest.mark.parametrize("cfg", [1.0, CFG])
def test_euler_ode_matches_pipeline_at_its_own_image_sizing(tiny_dir, sources, cfg):
    """The pipeline's fixed 1024² source area: a 5:3 source becomes 1312 x 800 (its ``calculate_dimensions``)."""
    policy = _load(tiny_dir)
    assert policy.source_area == 1024 * 1024 and policy.source_size(_pil(sources[0])) == (800, 1312)
    _check(policy, sources, cfg)


def _pil(path):
    from PIL import Image

    return Image.open(path).convert("RGB")


def test_tokenizer_splits_the_edit_template_as_qwens(small):
    tok = make_qwen_edit_tokenizer()
    assert small.pipe.prompt_template_encode_start_idx == 64
    pieces = tok.convert_ids_to_tokens(tok(small.pipe.prompt_template_encode.format("make it red")).input_ids)
    assert pieces[:4] == ["<|im_start|>", "system", "\u010a", "Describe"]
    assert pieces[61:67] == ["<|im_start|>", "user", "\u010a", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


def test_the_encoding_holds_the_vision_tokens_and_a_negative_per_source(small, sources):
    c = small.encode(PROMPTS, sources)
    text_only = len(make_qwen_edit_tokenizer()(PROMPTS[0]).input_ids)
    assert c.tokens.shape[1] > text_only + 5  # vision_start + vision tokens + vision_end + the instruction + 5
    assert c.negative is not None and torch.equal(c.negative.image, c.image)
    assert c.image.shape == (2, 16, 64 // 8, 96 // 8)  # 5:3 at 64² area: 96 x 64 (sides rounded to 32)
    assert not torch.equal(c.negative.tokens[0], c.negative.tokens[1])  # the negative saw each row's source
    with pytest.raises(StepflowError):
        small.negative_cond(2)


def test_source_sizes_aspect_and_output(tiny_dir, small, sources):
    assert small.source_size(_pil(sources[0])) == (64, 96)
    out = _load(tiny_dir, source_area=64 * 64, source_fit="output")
    assert out.source_size(_pil(sources[0])) == (H, H)
    assert out.encode(PROMPTS, sources).image.shape[-2:] == (H // 8, H // 8)


def test_sources_are_encoded_once(tiny_dir, sources):
    pol = _load(tiny_dir, source_area=64 * 64)
    vae, vl = [], []
    h1 = pol.vae.encoder.register_forward_hook(lambda *a: vae.append(1))
    h2 = pol.text_encoders[0].register_forward_hook(lambda *a: vl.append(1))
    try:
        pol.encode(PROMPTS * 2, sources * 2)
        pol.encode(PROMPTS, sources)
    finally:
        h1.remove()
        h2.remove()
    assert len(vae) == 2 and len(vl) == 1  # one VAE pass per source; one VL call for the 2 pairs + 2 negatives


def test_a_batch_of_mixed_source_sizes_is_one_line(small, sources, tmp_path):
    square = _png(tmp_path / "sq.png", 64, 64, 2)
    with pytest.raises(StepflowError) as info:
        small.encode(PROMPTS, [sources[0], square])
    msg = str(info.value)
    assert "\n" not in msg and "source_fit=output" in msg


def test_a_bad_source_fit_or_area_is_one_line(tiny_dir):
    for kw, field in (({"source_fit": "crop"}, "model.source_fit"), ({"source_area": 10}, "model.source_area")):
        with pytest.raises(StepflowError) as info:
            _load(tiny_dir, **kw)
        assert str(info.value).startswith(field) and "\n" not in str(info.value)
