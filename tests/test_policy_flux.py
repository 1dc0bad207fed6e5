"""FluxPolicy on tiny random FLUX.1-dev / -schnell pipelines (fp32, CPU), loaded through the real loader.

The key tests: the policy's plain Euler ODE on its own (resolution-shifted) grid reproduces ``FluxPipeline.__call__``
(latents and images, guidance embedding, true CFG); the grid is the one the pipeline's transformer is called at; the
SDE samplers and x̂0 estimates are well defined on it; the LoRA loads into the pipeline.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("diffusers")

from stepflow.errors import ModelLoadError  # noqa: E402
from stepflow.policies.base import Cond  # noqa: E402
from stepflow.policies.flux import FluxPolicy, flux_mu, pack_latents, unpack_latents  # noqa: E402
from stepflow.testing.tiny_policies import TINY_HEIGHT, tiny_flux_policy  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog on the square"]
SEQ = 32  # T5 tokens
H = TINY_HEIGHT
GUIDANCE = 3.5  # FLUX.1-dev's embedded guidance


@pytest.fixture(scope="module")
def dirs(tiny_pipeline):
    return {v: tiny_pipeline(f"flux_{v}") for v in ("dev", "schnell")}


def _load(path, variant="dev", height=H, **kw):
    kw.setdefault("embedded_guidance", GUIDANCE if variant == "dev" else None)
    kw.setdefault("dtype", "float32")
    return FluxPolicy.from_pretrained(str(path), height=height, width=height, max_sequence_length=SEQ, **kw)


@pytest.fixture(scope="module")
def policies(dirs):
    return {v: _load(d, v) for v, d in dirs.items()}


@torch.no_grad()
def _euler(policy, prompts, latents, steps, guidance=1.0):
    """x_{k+1} = x_k + (τ_{k+1} − τ_k) · v(x_k, τ_k) on the policy's own grid."""
    cond = policy.encode(prompts)
    tau = policy.time_grid(steps)
    x = latents.clone().float()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond, guidance=guidance)
    return x


def _pipe(policy, latents, steps, cfg=1.0, output_type="latent", pipe=None, height=H):
    """FluxPipeline.__call__ from the same (packed) latents; returns unpacked latents or images."""
    pipe = pipe or policy.pipe
    extra = {"true_cfg_scale": cfg, "negative_prompt": ""} if cfg != 1.0 else {}
    out = pipe(PROMPTS, height=height, width=height, num_inference_steps=steps, guidance_scale=GUIDANCE,
               max_sequence_length=SEQ, latents=pack_latents(latents.clone()), output_type=output_type, **extra).images
    if output_type == "latent":
        return unpack_latents(out, *latents.shape[-2:])
    return out


def _capture_timesteps(pipe):
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs["timestep"].detach().clone())

    return seen, pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)


def test_loaded_attributes(policies):
    dev, schnell = policies["dev"], policies["schnell"]
    assert dev.latent_shape == (16, H // 8, H // 8) and dev.image_seq_len == (H // 16) ** 2
    assert dev.embedded_guidance == GUIDANCE and dev.pipe.transformer.config.guidance_embeds
    assert schnell.embedded_guidance is None and not schnell.pipe.transformer.config.guidance_embeds
    assert dev.dtype == torch.float32
    assert not any(p.requires_grad for m in [dev.vae, *dev.text_encoders] for p in m.parameters())
    assert len(dev.text_encoders) == 2


def test_pack_unpack_roundtrip_matches_the_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 8, 6)
    p = pack_latents(x)
    assert torch.equal(p, FluxPipeline._pack_latents(x, 2, 16, 8, 6))
    assert torch.equal(unpack_latents(p, 8, 6), x)
    assert torch.equal(FluxPipeline._unpack_latents(p, 64, 48, 8), x)


@pytest.mark.parametrize("height", [64, 256])
def test_time_grid_is_the_pipelines_dynamic_shift(dirs, height):
    """The grid = the times FluxPipeline calls its transformer at (captured) + a trailing 0; it equals the closed form
    σ' = e^μ / (e^μ + 1/σ − 1), σ = linspace(1, 1/N, N), μ = calculate_shift(image tokens); starts at exactly 1."""
    pol = _load(dirs["dev"], height=height)
    steps = 5
    seen, handle = _capture_timesteps(pol.pipe)
    try:
        pol.pipe(PROMPTS[:1], height=height, width=height, num_inference_steps=steps, guidance_scale=GUIDANCE,
                 max_sequence_length=SEQ, output_type="latent")
    finally:
        handle.remove()
    grid = pol.time_grid(steps)
    assert grid.shape == (steps + 1,) and grid.dtype == torch.float32
    assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0 and bool((grid[1:] < grid[:-1]).all())
    called = torch.stack([s[0] for s in seen])  # FluxPipeline passes timestep = t / 1000 (in latents' dtype)
    assert torch.allclose(grid[:-1], called, atol=1e-6), (grid, called)
    mu = flux_mu((height // 16) ** 2, pol.scheduler.config)
    assert math.isclose(mu, 0.5 + ((height // 16) ** 2 - 256) * (1.15 - 0.5) / (4096 - 256))
    sig = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    closed = math.exp(mu) / (math.exp(mu) + (1.0 / sig - 1.0))
    assert torch.allclose(grid[:-1].double(), closed, atol=1e-6)


def test_grid_shifts_with_resolution_and_schnell_is_unshifted(dirs, policies):
    small, big = _load(dirs["dev"], height=64).time_grid(4), _load(dirs["dev"], height=512).time_grid(4)
    assert (big[1:-1] > small[1:-1]).all()  # more image tokens -> larger mu -> more time near the noise
    assert torch.allclose(policies["schnell"].time_grid(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))


@pytest.mark.parametrize("variant,cfg", [("dev", 1.0), ("dev", 2.0), ("schnell", 1.0), ("schnell", 2.0)])
def test_euler_ode_matches_pipeline(policies, variant, cfg):
    """The policy's ODE sampler == FluxPipeline.__call__ (same prompts, latents, steps, guidance embedding; true CFG
    with the empty negative prompt for cfg != 1), as latents and as images."""
    pol = policies[variant]
    steps = 4
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _euler(pol, PROMPTS, latents, steps, cfg)
    ref = _pipe(pol, latents, steps, cfg)
    err = (ours - ref).abs().max().item()
    print(f"max-abs FLUX-{variant} ODE vs FluxPipeline (true cfg {cfg}): {err:.3e}")
    assert err <= 1e-4
    assert (ours - latents).abs().max() > 1e-2
    img = _pipe(pol, latents, steps, cfg, output_type="pt")
    with torch.no_grad():
        ours_img = pol.decode(ours)
    assert ours_img.shape == (2, 3, H, H) and ours_img.dtype == torch.float32
    assert (ours_img - img).abs().max().item() <= 1e-4


def test_embedded_guidance_and_cfg_change_the_result(dirs, policies):
    pol = policies["dev"]
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(2))
    base = _euler(pol, PROMPTS, latents, 2)
    other = _load(dirs["dev"], embedded_guidance=1.0)
    assert (_euler(other, PROMPTS, latents, 2) - base).abs().max() > 1e-4
    assert (_euler(pol, PROMPTS, latents, 2, guidance=3.0) - base).abs().max() > 1e-4
    with pytest.raises(ValueError, match="embedded_guidance"):
        _load(dirs["dev"], embedded_guidance=None)


def test_encode_cache_and_negative(policies):
    pol = policies["dev"]
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in pol.text_encoders]
    try:
        pol.clear_prompt_cache()
        c1 = pol.encode(["a cat", "a dog", "a cat"])
        assert len(calls) == 2  # one batch through each of the two encoders
        c2 = pol.encode(["a dog"])
        assert len(calls) == 2  # cached: no encoder ran
        neg = pol.negative_cond(3)
        n = len(calls)
        pol.negative_cond(2)
        assert len(calls) == n
    finally:
        for h in hooks:
            h.remove()
    assert isinstance(c1, Cond) and c1.tokens.shape == (3, SEQ, 32) and c1.pooled.shape == (3, 32)
    assert torch.equal(c1.tokens[0], c1.tokens[2]) and neg.tokens.shape[0] == 3
    ref, pooled, text_ids = pol.pipe.encode_prompt("a dog", None, max_sequence_length=SEQ)
    assert torch.allclose(c2.tokens[0], ref[0]) and torch.allclose(c2.pooled[0], pooled[0])
    assert text_ids.shape == (SEQ, 3) and not text_ids.any()


def test_lora_targets_save_and_load_with_diffusers(dirs, tmp_path):
    from diffusers import FluxPipeline

    from stepflow.policies.flux import LORA_TARGETS_FLUX

    flow_grpo = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj", "attn.add_q_proj",
                 "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                 "ff_context.net.2"]  # Flow-GRPO scripts/train_flux.py
    assert sorted(LORA_TARGETS_FLUX) == sorted(flow_grpo)
    pol = _load(dirs["dev"], lora={"rank": 4, "alpha": 8.0, "targets": list(LORA_TARGETS_FLUX)})
    names = {n for n, _ in pol.transformer.named_modules() if n.endswith("lora_A")}
    for target in flow_grpo:
        assert any(n.startswith("transformer_blocks.0.") and n.endswith(f"{target}.lora_A") for n in names), target
    for target in ("attn.to_q", "attn.to_k", "attn.to_v"):  # single-stream blocks share the attention names
        assert any(n.startswith("single_transformer_blocks.0.") and n.endswith(f"{target}.lora_A") for n in names)
    trainable = {n for n, p in pol.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(4))
    ours = _euler(pol, PROMPTS, latents, 3)
    with pol.disable_adapter():
        base = _euler(pol, PROMPTS, latents, 3)
    assert (ours - base).abs().max() > 1e-3

    pol.save_lora(tmp_path / "lora")
    pipe = FluxPipeline.from_pretrained(str(dirs["dev"]))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ref = _pipe(pol, latents, 3, pipe=pipe)
    err = (ours - ref).abs().max().item()
    print(f"max-abs FLUX LoRA policy vs FluxPipeline.load_lora_weights: {err:.3e}")
    assert err <= 1e-4

    pol2 = _load(dirs["dev"], lora={"path": str(tmp_path / "lora")})
    assert pol2.has_lora and all(p.requires_grad for p in pol2.lora_parameters())
    assert (_euler(pol2, PROMPTS, latents, 3) - ours).abs().max().item() <= 1e-4


def test_bf16_time_and_guidance_reach_the_embedding_in_fp32(dirs):
    """The FLUX transformer casts timestep and guidance to its dtype before the time embedding (bf16: 1000·0.91335 ->
    912, 3500 -> 3504); the policy's pre-hook feeds the exact fp32 values; FluxPipeline's own call is untouched."""
    pol = _load(dirs["dev"], dtype="bfloat16", gradient_checkpointing=True, offload_text_encoders=True,
                lora={"rank": 2})
    seen = []
    proj = pol.transformer.time_text_embed.time_proj
    handle = proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    try:
        x = torch.randn(2, *pol.latent_shape)
        cond = pol.encode(PROMPTS)
        t = torch.tensor([0.91335, 0.60215])
        v = pol.velocity(x, t, cond)
        assert len(seen) == 2  # time, then guidance
        assert seen[0].dtype == torch.float32 and torch.equal(seen[0], t * 1000)
        assert torch.equal(seen[1], torch.full((2,), GUIDANCE * 1000))
        seen.clear()
        pol.pipe(PROMPTS[:1], height=H, width=H, num_inference_steps=1, max_sequence_length=SEQ,
                 output_type="latent")
        assert seen[0].dtype == torch.bfloat16  # the pipeline's own path: the transformer's cast, no hook
    finally:
        handle.remove()
    assert v.dtype == torch.float32 and torch.isfinite(v).all() and pol.transformer.is_gradient_checkpointing
    v.pow(2).mean().backward()  # grads reach the LoRA through checkpointed blocks
    assert all(p.grad is not None for p in pol.lora_parameters())
    assert pol.decode(x).dtype == torch.float32
    pol.precache(["a blue circle"])
    pol.free_text_encoders()
    assert pol.encode(["a blue circle"]).tokens.shape[0] == 1
    with pytest.raises(RuntimeError, match="precache"):
        pol.encode(["never seen"])


def test_time_inputs_refuse_a_changed_time_scale(policies):
    """If a diffusers change made the hook replace something that is not the time, it fails loudly."""
    from stepflow.policies.base import TimeInputs

    ti = TimeInputs()
    module = torch.nn.Identity()
    with ti.feeding([torch.tensor([913.35])]):
        assert torch.equal(ti(module, (torch.tensor([912.0]).bfloat16(),))[0], torch.tensor([913.35]))
    ti2 = TimeInputs()
    with ti2.feeding([torch.tensor([913.35])]), pytest.raises(RuntimeError, match="time scaling"):
        ti2(module, (torch.tensor([0.91335]),))


# ---------------------------------------------------------------------------------------------------- SDE on the grid
@pytest.mark.parametrize("height,steps", [(512, 6), (1024, 28), (64, 1)])
def test_sde_steps_and_estimates_on_flux_grid(dirs, height, steps):
    """FLUX's shifted grid (512 px / 6 steps as Flow-GRPO, 1024 px / 28 steps as the model card): every sampler's
    per-step std and log-prob are finite (t = 1 handled by t_guard = τ_1), and the x̂0 estimate is exact for
    point-mass data (v = (x − c)/t) from every grid state."""
    from stepflow.math.estimate import estimate_x0
    from stepflow.math.sde import SamplerConfig, sde_step, step_std

    pol = FluxPolicy(_load(dirs["dev"]).pipe, height=height, width=height, max_sequence_length=SEQ)
    grid = pol.time_grid(steps)
    assert float(grid[0]) == 1.0 and grid[1] < 1.0
    g = torch.Generator().manual_seed(0)
    c = torch.randn(3, 4, 4, 4, generator=g)
    configs = [SamplerConfig(name="flow_sde", a=0.7), SamplerConfig(name="ddim_sde", schedule="eta_s"),
               SamplerConfig(name="ddim_sde", schedule="eta_s_sqrt1mt"),
               SamplerConfig(name="ddim_sde", schedule="eta_s_sqrt1mt", first_step_guard=True),
               SamplerConfig(name="ddim_sde", schedule="eta_t_sqrt1mt"), SamplerConfig(name="cps")]
    for cfg in configs:
        x = torch.randn(3, 4, 4, 4, generator=g)
        for k in range(steps):
            t, s = grid[k], grid[k + 1]
            v = (x - c) / t  # exact velocity of point-mass data
            out = sde_step(cfg, x, v, t, s, t_guard=grid[1], generator=g)
            std = step_std(cfg, t, s, t_guard=grid[1])
            assert torch.isfinite(out.next).all() and torch.isfinite(out.log_prob).all(), (cfg, k)
            assert torch.isfinite(std).all() and float(std) >= 0 and torch.allclose(out.std, std.expand(3))
            assert bool(out.trainable.all()) == (float(std) > 0)
            x = out.next
        assert torch.isfinite(x).all()
    if steps > 1:
        with pytest.raises(ValueError, match="t_guard"):  # t == 1 exactly: the guard is needed and asked for
            sde_step(SamplerConfig(name="flow_sde"), x, torch.zeros_like(x), grid[0], grid[1])
    # x̂0 of point-mass data from the states x_t = (1 − t) c + t ε at every grid time: exact for any substeps
    t_all = grid[:-1].repeat_interleave(3)
    cc = c.repeat(steps, 1, 1, 1)
    eps = torch.randn(cc.shape, generator=g)
    xt = (1 - t_all.view(-1, 1, 1, 1)) * cc + t_all.view(-1, 1, 1, 1) * eps

    def vfn(y, tau, rows):
        return (y - cc[rows]) / tau.view(-1, 1, 1, 1)

    for sub in (1, 3):
        for adaptive in (False, True):
            x0 = estimate_x0(vfn, xt, t_all, sub, adaptive=adaptive, compact=True)
            assert (x0 - cc).abs().max() < 1e-4, (sub, adaptive)


def test_rollout_on_the_policys_grid(policies):
    """stepflow.core.rollout.rollout with the tiny FLUX policy: the trajectory's times are the policy's grid, log-probs
    finite, and the ODE rollout equals the Euler sampler."""
    from stepflow.core.data import IterationPlan
    from stepflow.core.rollout import rollout
    from stepflow.math.sde import SamplerConfig

    pol = policies["dev"]
    seeds = torch.tensor([3, 4])
    plan = IterationPlan(PROMPTS, [{}, {}], torch.tensor([0, 1]), seeds + 10, seeds)
    for name in ("flow_sde", "ddim_sde", "cps"):
        n0 = pol.nfe
        traj = rollout(pol, plan, SamplerConfig(name=name), 4, 1.0)
        assert torch.equal(traj.times, pol.time_grid(4)) and pol.nfe - n0 == 8
        assert torch.isfinite(traj.log_probs).all() and torch.isfinite(traj.latents).all()
    traj = rollout(pol, IterationPlan(PROMPTS, [{}, {}], torch.tensor([0, 1]), seeds, seeds), SamplerConfig(name="ode"),
                   4, 1.0)
    assert (traj.latents[:, -1] - _euler(pol, PROMPTS, traj.latents[:, 0], 4)).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------------- config, errors
def test_tiny_configs_build_into_cache_and_load(tmp_path, monkeypatch, compose):
    import hydra.utils

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path))
    pol = tiny_flux_policy(max_sequence_length=SEQ)
    assert (tmp_path / "flux_dev_tiny-v1-s0" / "model_index.json").is_file()
    assert isinstance(pol, FluxPolicy) and pol.embedded_guidance == GUIDANCE
    for name, guidance in (("flux_tiny", GUIDANCE), ("flux_schnell_tiny", None)):
        cfg = compose("train", [f"model={name}", "lora.rank=4"])
        kwargs, lora = OmegaConf.to_container(cfg.model, resolve=True), OmegaConf.to_container(cfg.lora)
        pol = hydra.utils.instantiate(kwargs, _convert_="all")
        assert isinstance(pol, FluxPolicy) and pol.embedded_guidance == guidance
        assert lora["rank"] == 4 and "ff.net.0.proj" in lora["targets"]
        v = pol.velocity(torch.randn(1, *pol.latent_shape), 0.5, pol.encode(["a cat"]))
        assert v.shape == (1, *pol.latent_shape) and v.dtype == torch.float32
    assert (tmp_path / "flux_schnell_tiny-v1-s0" / "model_index.json").is_file()


@pytest.mark.parametrize("path", ["/nonexistent/flux", "black-forest-labs/not-a-real-model-xyz"])
def test_bad_path_is_one_line_error(path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    with pytest.raises(ModelLoadError) as info:
        FluxPolicy.from_pretrained(path)
    msg = str(info.value)
    assert "\n" not in msg and path in msg and "model.path=" in msg and "FLUX" in msg
    err = info.value
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def test_dir_without_model_index_is_one_line_error(tmp_path):
    with pytest.raises(ModelLoadError, match="has no model_index.json \\(not a diffusers pipeline folder\\)"):
        FluxPolicy.from_pretrained(str(tmp_path))
