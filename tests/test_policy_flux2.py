"""Flux2Policy on a tiny random FLUX.2-dev pipeline (fp32, CPU), loaded through the real loader.

The key tests: the policy's plain Euler ODE on its own grid, and the rollout's ODE sampler, reproduce
``Flux2Pipeline.__call__`` from the same noise (latents and images, guidance embedding, the empirical-μ shift, the
batch-norm latent normalisation; Δ <= 2e-6); the grid is the one the pipeline calls its transformer at; the prompt
encoding is the pipeline's; the LoRA round-trips through ``Flux2Pipeline.load_lora_weights``; full fine-tuning saves
a transformer the pipeline loads; the SDE rollouts' log-probs and x̂0 estimates are well defined on this grid; bad
paths are one line naming the field.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.errors import ModelLoadError, StepflowError  # noqa: E402
from stepflow.policies.flux2 import LORA_TARGETS_FLUX2, Flux2Policy, flux2_mu, pack_tokens, unpack_tokens  # noqa: E402
from stepflow.testing.tiny_flux2_zimage import tiny_dir  # noqa: E402
from stepflow.testing.tiny_policies import TINY_HEIGHT  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog on the square"]
SEQ = 64
H = TINY_HEIGHT
GUIDANCE = 4.0  # Flux2Pipeline's default guidance_scale
TOL = 2e-6  # the bound (fp32)
#: measured: the policy runs the pipeline's operations in its order, so on the CPU in fp32 the results are bit-identical;
#: held exactly, so that a change of the arithmetic (a time computed another way, another CFG order) is seen
EXACT = 0.0


@pytest.fixture(scope="module")
def path():
    return tiny_dir("flux2")


def _load(path, height=H, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("embedded_guidance", GUIDANCE)
    return Flux2Policy.from_pretrained(str(path), height=height, width=height, max_sequence_length=SEQ, **kw)


@pytest.fixture(scope="module")
def policy(path):
    return _load(path)


def _noise(policy, seed=1, b=2):
    return torch.randn(b, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _euler(policy, latents, steps, guidance=1.0, prompts=PROMPTS):
    cond = policy.encode(prompts)
    tau = policy.time_grid(steps)
    x = latents.clone().float()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond, guidance=guidance)
    return x


def _pipe(policy, latents, steps, output_type="latent", pipe=None, guidance=GUIDANCE, height=H):
    """Flux2Pipeline.__call__ from the same (unpacked, normalised) latents; unpacked latents or images."""
    pipe = pipe or policy.pipe
    out = pipe(prompt=list(PROMPTS), height=height, width=height, num_inference_steps=steps, guidance_scale=guidance,
               max_sequence_length=SEQ, latents=latents.clone(), output_type=output_type).images
    return unpack_tokens(out, *latents.shape[-2:]) if output_type == "latent" else out


def test_loaded_attributes(policy):
    assert policy.latent_shape == (16, H // 16, H // 16) and policy.image_seq_len == (H // 16) ** 2
    assert policy.embedded_guidance == GUIDANCE and policy.pipe.transformer.config.guidance_embeds
    assert policy.dtype == torch.float32 and len(policy.text_encoders) == 1
    assert policy.text_encoder_out_layers == (10, 20, 30)
    assert not any(p.requires_grad for m in [policy.vae, *policy.text_encoders] for p in m.parameters())


def test_packing_and_patchify_match_the_pipeline():
    from diffusers import Flux2Pipeline

    x = torch.randn(2, 16, 4, 6)
    assert torch.equal(pack_tokens(x), Flux2Pipeline._pack_latents(x))
    assert torch.equal(unpack_tokens(pack_tokens(x), 4, 6), x)
    ids = Flux2Pipeline._prepare_latent_ids(x)
    assert torch.equal(Flux2Pipeline._unpack_latents_with_ids(pack_tokens(x), ids), x)


@pytest.mark.parametrize("seq,steps", [(16, 1), (16, 4), (256, 6), (1024, 28), (4096, 50), (4301, 8), (16384, 50)])
def test_mu_is_the_pipelines_empirical_mu(seq, steps):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    assert flux2_mu(seq, steps) == pytest.approx(compute_empirical_mu(seq, steps), abs=1e-12)


def _capture_timesteps(pipe):
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["timestep"].detach().clone()), with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("height,steps", [(64, 1), (64, 3), (256, 5), (256, 28)])
def test_time_grid_is_the_pipelines(path, height, steps):
    """The grid = the times Flux2Pipeline calls its transformer at (captured, timestep = t/1000) + a trailing 0; the
    closed form e^μ / (e^μ + 1/σ − 1) with μ = compute_empirical_mu(image tokens, steps); starts at exactly 1."""
    pol = _load(path, height=height)
    seen, handle = _capture_timesteps(pol.pipe)
    try:
        pol.pipe(prompt=PROMPTS[:1], height=height, width=height, num_inference_steps=steps, max_sequence_length=SEQ,
                 output_type="latent")
    finally:
        handle.remove()
    grid = pol.time_grid(steps)
    assert grid.shape == (steps + 1,) and float(grid[0]) == 1.0 and float(grid[-1]) == 0.0
    called = torch.stack([s[0] for s in seen])
    assert torch.equal((grid[:-1] * 1000) / 1000, called), (grid, called)  # the pipeline's t / 1000, bit for bit
    mu = flux2_mu((height // 16) ** 2, steps)
    sig = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    closed = torch.exp(torch.tensor(mu, dtype=torch.float64)) / (torch.exp(torch.tensor(mu, dtype=torch.float64))
                                                                  + (1.0 / sig - 1.0))
    assert torch.allclose(grid[:-1].double(), closed, atol=1e-6)


def test_the_transformer_sees_the_pipelines_timesteps_bit_for_bit(policy):
    """Flux2Pipeline passes ``timestep = (1000 σ) / 1000`` (the scheduler's timesteps over 1000), which differs from σ
    in the last bit for some σ; the policy passes the same value, captured at every one of 50 steps."""
    steps = 50
    seen, handle = _capture_timesteps(policy.pipe)
    try:
        policy.pipe(prompt=PROMPTS[:1], height=H, width=H, num_inference_steps=steps, max_sequence_length=SEQ,
                    output_type="latent")
        called = torch.stack([s[0] for s in seen])
        seen.clear()
        grid, cond = policy.time_grid(steps), policy.encode(PROMPTS[:1])
        with torch.no_grad():
            for k in range(steps):
                policy.velocity(_noise(policy, b=1), grid[k], cond)
        ours = torch.stack([s[0] for s in seen])
    finally:
        handle.remove()
    assert not torch.equal(grid[:-1], called)  # the round trip matters on this grid
    assert torch.equal(ours, called)


def test_grid_depends_on_steps_and_resolution(path):
    small = _load(path, height=64)
    assert not torch.allclose(small.time_grid(4)[1:3], small.time_grid(40)[1:3][:2])
    big = _load(path, height=512)
    assert (big.time_grid(4)[1:-1] > small.time_grid(4)[1:-1]).all()  # more tokens -> larger mu -> nearer the noise


@pytest.mark.parametrize("steps", [1, 4])
def test_euler_ode_matches_the_pipeline(policy, steps):
    latents = _noise(policy)
    ours = _euler(policy, latents, steps)
    ref = _pipe(policy, latents, steps)
    err = (ours - ref).abs().max().item()
    print(f"max-abs FLUX.2 ODE vs Flux2Pipeline ({steps} steps): {err:.3e}")
    assert err <= TOL and err == EXACT and (ours - latents).abs().max() > 1e-2
    img = _pipe(policy, latents, steps, output_type="pt")
    with torch.no_grad():
        ours_img = policy.decode(ours)
    assert ours_img.shape == (2, 3, H, H) and ours_img.dtype == torch.float32
    assert (ours_img - img).abs().max().item() <= TOL


def test_rollout_ode_matches_the_pipeline_and_sde_rollouts_are_well_defined(policy):
    """stepflow.core.rollout: the ODE sampler from the plan's seeded noise == Flux2Pipeline from that noise; the SDE
    samplers' times are the grid, log-probs finite, and the x̂0 estimate of one substep is Tweedie's x − t·v."""
    from stepflow.core.data import IterationPlan
    from stepflow.core.rollout import estimate_states, rollout
    from stepflow.math.sde import SamplerConfig

    seeds = torch.tensor([3, 4])
    plan = IterationPlan(list(PROMPTS), [{}, {}], torch.tensor([0, 1]), seeds + 10, seeds)
    traj = rollout(policy, plan, SamplerConfig(name="ode"), 4, 1.0)
    ref = _pipe(policy, traj.latents[:, 0], 4)
    err = (traj.latents[:, -1] - ref).abs().max().item()
    print(f"max-abs FLUX.2 rollout ODE vs Flux2Pipeline: {err:.3e}")
    assert err <= TOL and err == EXACT
    for name in ("flow_sde", "ddim_sde", "cps"):
        n0 = policy.nfe
        traj = rollout(policy, plan, SamplerConfig(name=name), 4, 1.0)
        assert torch.equal(traj.times, policy.time_grid(4)) and policy.nfe - n0 == 8
        assert torch.isfinite(traj.log_probs).all() and traj.trainable[:, 1:-1].all()
    x0 = estimate_states(policy, traj, substeps=1, guidance=1.0)
    tweedie = traj.latents[:, :-1] - traj.times[:-1].view(1, -1, 1, 1, 1) * traj.velocities
    assert torch.allclose(x0[:, :-1], tweedie, atol=1e-6) and torch.equal(x0[:, -1], traj.latents[:, -1])
    x3 = estimate_states(policy, traj, substeps=3, guidance=1.0)
    assert torch.isfinite(x3).all() and (x3[:, 1] - x0[:, 1]).abs().max() > 1e-5


def test_embedded_guidance_reaches_the_model(path, policy):
    latents = _noise(policy, seed=2)
    base = _euler(policy, latents, 2)
    other = _load(path, embedded_guidance=1.5)
    ours = _euler(other, latents, 2)
    assert (ours - base).abs().max() > 1e-4
    assert (ours - _pipe(other, latents, 2, guidance=1.5)).abs().max().item() <= TOL
    assert (_euler(policy, latents, 2, guidance=3.0) - base).abs().max() > 1e-4  # true CFG (the empty prompt)
    with pytest.raises(ValueError, match="embedded_guidance"):
        _load(path, embedded_guidance=None)


def test_encode_is_the_pipelines_and_cached(policy):
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in policy.text_encoders]
    try:
        policy.clear_prompt_cache()
        c = policy.encode(["a cat", "a dog", "a cat"])
        assert len(calls) == 1
        policy.encode(["a dog"])
        assert len(calls) == 1
    finally:
        for h in hooks:
            h.remove()
    assert c.tokens.shape == (3, SEQ, 48) and c.pooled.shape == (3, 0) and c.mask is None
    ref, text_ids = policy.pipe.encode_prompt(["a dog"], max_sequence_length=SEQ)
    assert torch.equal(c.tokens[1], ref[0]) and torch.equal(c.tokens[0], c.tokens[2])
    assert text_ids.shape == (1, SEQ, 4)


def test_lora_targets_save_and_load_with_diffusers(path, tmp_path):
    from diffusers import Flux2Pipeline

    pol = _load(path, lora={"rank": 4, "alpha": 8.0, "targets": list(LORA_TARGETS_FLUX2)})
    names = {n for n, _ in pol.transformer.named_modules() if n.endswith("lora_A")}
    for target in LORA_TARGETS_FLUX2[:-1]:
        assert any(n.startswith("transformer_blocks.0.") and n.endswith(f"{target}.lora_A") for n in names), target
    assert any(n.startswith("single_transformer_blocks.0.") and n.endswith("attn.to_qkv_mlp_proj.lora_A")
               for n in names)
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    latents = _noise(pol, seed=4)
    ours = _euler(pol, latents, 3)
    with pol.disable_adapter():
        assert (_euler(pol, latents, 3) - ours).abs().max() > 1e-3
    pol.save_trained(tmp_path / "lora")
    pipe = Flux2Pipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    err = (ours - _pipe(pol, latents, 3, pipe=pipe)).abs().max().item()
    print(f"max-abs FLUX.2 LoRA policy vs Flux2Pipeline.load_lora_weights: {err:.3e}")
    assert err <= TOL
    again = _load(path, lora={"path": str(tmp_path / "lora")})
    assert again.has_lora and all(p.requires_grad for p in again.lora_parameters())
    assert (_euler(again, latents, 3) - ours).abs().max().item() <= TOL


def test_full_finetuning_saves_a_transformer_the_pipeline_loads(path, tmp_path):
    from diffusers import Flux2Pipeline, Flux2Transformer2DModel

    pol = _load(path, finetune="full")
    trainable = list(pol.trainable_parameters())
    assert len(trainable) == len(list(pol.transformer.parameters())) and not pol.has_lora
    assert not any(p.requires_grad for m in [pol.vae, *pol.text_encoders] for p in m.parameters())
    pol.prepare_reference()
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    x = _noise(pol, seed=9)
    pol.velocity(x, torch.tensor([0.8, 0.4]), pol.encode(PROMPTS)).pow(2).mean().backward()
    opt.step()
    latents = _noise(pol, seed=5)
    ours = _euler(pol, latents, 2)
    with pol.reference():
        assert (_euler(pol, latents, 2) - ours).abs().max() > 1e-4  # the reference is the initial transformer
    out = pol.save_trained(tmp_path / "transformer")
    pipe = Flux2Pipeline.from_pretrained(str(path), transformer=Flux2Transformer2DModel.from_pretrained(str(out)))
    pipe.set_progress_bar_config(disable=True)
    assert (ours - _pipe(pol, latents, 2, pipe=pipe)).abs().max().item() <= TOL
    again = _load(path, transformer_path=str(out))
    assert (_euler(again, latents, 2) - ours).abs().max().item() <= TOL


def test_bf16_time_and_guidance_reach_the_time_projection_in_fp32(path):
    """The transformer casts timestep and guidance to its dtype before ×1000 (bf16: 1000·0.91335 -> 912); the
    policy's pre-hook feeds the sinusoid the exact fp32 values, in order; the pipeline's own call is untouched."""
    pol = _load(path, dtype="bfloat16", gradient_checkpointing=True, lora={"rank": 2})
    seen = []
    proj = pol.transformer.time_guidance_embed.time_proj
    handle = proj.register_forward_hook(lambda m, a, out: seen.append(a[0].detach().clone()))
    try:
        x = torch.randn(2, *pol.latent_shape)
        t = torch.tensor([0.91335, 0.60215])
        v = pol.velocity(x, t, pol.encode(PROMPTS))
        assert len(seen) == 2 and seen[0].dtype == torch.float32
        assert torch.equal(seen[0], (t * 1000) / 1000 * 1000) and torch.equal(seen[1], torch.full((2,), 4000.0))
        seen.clear()
        pol.pipe(prompt=PROMPTS[:1], height=H, width=H, num_inference_steps=1, max_sequence_length=SEQ,
                 output_type="latent")
        assert seen[0].dtype == torch.bfloat16  # the pipeline's own path: the transformer's cast, no hook
    finally:
        handle.remove()
    assert v.dtype == torch.float32 and torch.isfinite(v).all() and pol.transformer.is_gradient_checkpointing
    v.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in pol.lora_parameters())


# ---------------------------------------------------------------------------------------------------- bad input
def test_a_missing_or_damaged_path_is_one_line(tmp_path):
    for bad in (str(tmp_path / "nowhere"), str(tmp_path)):
        with pytest.raises(ModelLoadError) as info:
            Flux2Policy.from_pretrained(bad)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("model.path:") and "FLUX.2" in msg and bad in msg


def test_a_wrong_family_path_is_one_line_naming_the_field(path, tmp_path):
    from stepflow.policies.flux import FluxPolicy
    from stepflow.policies.zimage import ZImagePolicy
    from stepflow.testing.tiny_policies import tiny_flux_dir

    flux1 = tiny_flux_dir()
    for load, other, mine, theirs in ((Flux2Policy, flux1, "FLUX.2", "FLUX"), (Flux2Policy, tiny_dir("zimage"),
                                       "FLUX.2", "Z-Image"), (FluxPolicy, path, "FLUX", "FLUX.2"),
                                      (ZImagePolicy, path, "Z-Image", "FLUX.2")):
        with pytest.raises(ModelLoadError) as info:
            load.from_pretrained(str(other), dtype="float32")
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("model.path:") and f"holds {theirs} weights" in msg, msg
        assert f"not {mine}" in msg
    with pytest.raises(ModelLoadError, match=r"^model.transformer_path: .* holds FLUX weights"):
        _load(path, transformer_path=str(flux1 / "transformer"))


def test_bad_arguments_are_one_line(path):
    with pytest.raises(StepflowError, match=r"^model.embedded_guidance: must be >= 0"):
        _load(path, embedded_guidance=-1.0)
    with pytest.raises(StepflowError, match=r"^model.height: must be a positive multiple of 16"):
        _load(path, height=72)


def test_the_cli_with_a_missing_model_is_one_line(cli, tmp_path):
    from stepflow.testing.harness import one_line_error

    r = cli("stepflow.train", "experiment=smoke_flux2", f"model.path={tmp_path / 'nowhere'}",
            f"hydra.run.dir={tmp_path / 'run'}")
    assert "model.path" in one_line_error(r, str(tmp_path / "nowhere"))
