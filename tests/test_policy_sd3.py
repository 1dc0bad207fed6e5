"""SD3Policy on the tiny random SD3 pipeline (fp32, CPU), loaded through the real loader.

The key test: the policy's plain Euler ODE with CFG reproduces ``StableDiffusion3Pipeline.__call__``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.errors import ModelLoadError  # noqa: E402
from stepflow.policies.base import Cond  # noqa: E402
from stepflow.policies.sd3 import SD3Policy  # noqa: E402
from stepflow.testing.tiny_policies import TINY_HEIGHT, tiny_sd3_policy  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog on the square"]
SEQ = 16  # T5 tokens: token states are 77 + 16 long
H = TINY_HEIGHT


@pytest.fixture(scope="module")
def tiny_dir(tiny_pipeline):
    return tiny_pipeline("sd3")


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return SD3Policy.from_pretrained(str(tiny_dir), dtype="float32", height=H, width=H, max_sequence_length=SEQ)


def _grid(policy, n):
    try:
        return policy.time_grid(n)
    except ImportError:  # stepflow.math.sde not there yet: the scheduler's sigmas are the same grid
        from diffusers import FlowMatchEulerDiscreteScheduler

        s = FlowMatchEulerDiscreteScheduler(shift=policy.shift)
        s.set_timesteps(n)
        return s.sigmas.float()


@torch.no_grad()
def _euler(policy, prompts, latents, steps, guidance):
    """x_{k+1} = x_k + (τ_{k+1} − τ_k) · v(x_k, τ_k): the deterministic sampler on stepflow's grid."""
    cond = policy.encode(prompts)
    tau = _grid(policy, steps)
    x = latents.clone().float()
    for k in range(steps):
        v = policy.velocity(x, tau[k], cond, guidance=guidance)
        x = x + (tau[k + 1] - tau[k]) * v
    return x


def _pipe_latents(policy, prompts, latents, steps, guidance, output_type="latent"):
    out = policy.pipe(prompts, num_inference_steps=steps, height=H, width=H, guidance_scale=guidance,
                      max_sequence_length=SEQ, latents=latents.clone(), output_type=output_type)
    return out.images


def test_loaded_attributes(policy):
    assert policy.latent_shape == (16, H // 8, H // 8)
    assert any(".attn2." in n for n, _ in policy.transformer.named_modules())  # SD3.5-Medium's dual attention
    assert policy.shift == 3.0 and policy.timestep_scale == 1000.0
    assert policy.dtype == torch.float32
    assert not any(p.requires_grad for m in [policy.vae, *policy.text_encoders] for p in m.parameters())
    # the grid the policy uses is the scheduler's
    s = policy.pipe.scheduler
    s.set_timesteps(10)
    assert torch.allclose(_grid(policy, 10), s.sigmas.float(), atol=1e-6)


@pytest.mark.parametrize("guidance", [4.5, 1.0])
def test_euler_ode_matches_pipeline(policy, guidance):
    """The policy's ODE sampler == StableDiffusion3Pipeline.__call__ (same prompts, latents, steps, CFG)."""
    steps = 4
    latents = torch.randn(len(PROMPTS), *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    ours = _euler(policy, PROMPTS, latents, steps, guidance)
    ref = _pipe_latents(policy, PROMPTS, latents, steps, guidance)
    err = (ours - ref).abs().max().item()
    print(f"max-abs ODE vs pipeline (guidance={guidance}): {err:.3e}")
    assert err <= 1e-4
    assert (ours - latents).abs().max() > 1e-2  # it actually moved
    # the images too: decode(ours) == pipeline's "pt" output
    img = _pipe_latents(policy, PROMPTS, latents, steps, guidance, output_type="pt")
    with torch.no_grad():
        ours_img = policy.decode(ours)
    assert ours_img.shape == (2, 3, H, H) and ours_img.dtype == torch.float32
    assert (ours_img - img).abs().max().item() <= 1e-4


def test_cfg_changes_the_result(policy):
    latents = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(2))
    assert (_euler(policy, PROMPTS, latents, 2, 4.5) - _euler(policy, PROMPTS, latents, 2, 1.0)).abs().max() > 1e-3


def test_encode_cache_and_negative(policy):
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in policy.text_encoders]
    try:
        policy.clear_prompt_cache()
        c1 = policy.encode(["a cat", "a dog", "a cat"])
        n1 = len(calls)
        assert n1 == 3  # one batch through each of the three encoders (duplicates encoded once)
        c2 = policy.encode(["a dog", "a cat"])
        assert len(calls) == n1  # cached: no encoder ran
        neg1 = policy.negative_cond(3)
        n2 = len(calls)
        neg2 = policy.negative_cond(2)
        assert len(calls) == n2  # negative computed once
    finally:
        for h in hooks:
            h.remove()
    assert isinstance(c1, Cond) and c1.tokens.shape == (3, 77 + SEQ, 32) and c1.pooled.shape == (3, 32)
    assert torch.equal(c1.tokens[0], c1.tokens[2]) and torch.equal(c2.tokens[0], c1.tokens[1])
    assert neg1.tokens.shape[0] == 3 and torch.equal(neg1.tokens[0], neg2.tokens[1])
    # the cache holds what the pipeline's encode_prompt gives
    ref, _, pooled, _ = policy.pipe.encode_prompt("a dog", None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=SEQ)
    assert torch.allclose(c2.tokens[0], ref[0]) and torch.allclose(c2.pooled[0], pooled[0])
    assert not torch.allclose(c1.tokens[0], c1.tokens[1])


def test_decode_matches_vae(policy):
    z = torch.randn(3, *policy.latent_shape, generator=torch.Generator().manual_seed(3))
    vae = policy.vae
    with torch.no_grad():
        ref = vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        ref = policy.pipe.image_processor.postprocess(ref, output_type="pt")
        policy.decode_batch_size = 2  # chunked decode gives the same
        out = policy.decode(z)
    assert out.shape == (3, 3, H, H) and 0 <= out.min() and out.max() <= 1
    assert (out - ref).abs().max() < 1e-5


def test_lora_targets_save_and_load_with_diffusers(tiny_dir, tmp_path):
    pol = SD3Policy.from_pretrained(str(tiny_dir), dtype="float32", height=H, width=H, max_sequence_length=SEQ,
                                    lora={"rank": 4, "alpha": 16.0})
    names = {n for n, _ in pol.transformer.named_modules() if n.endswith("lora_A")}
    for target in ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]:
        assert any(n.endswith(f"attn.{target}.lora_A") for n in names), target
    trainable = {n for n, p in pol.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # make the adapter non-trivial (gaussian init has B = 0)
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(4))
    ours = _euler(pol, PROMPTS, latents, 3, 4.5)
    with pol.disable_adapter():
        base = _euler(pol, PROMPTS, latents, 3, 4.5)
    assert (ours - base).abs().max() > 1e-3

    pol.save_lora(tmp_path / "lora")
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_dir))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    ref = pipe(PROMPTS, num_inference_steps=3, height=H, width=H, guidance_scale=4.5, max_sequence_length=SEQ,
               latents=latents.clone(), output_type="latent").images
    assert (ours - ref).abs().max().item() <= 1e-4

    # and back into a fresh policy through model.lora.path
    pol2 = SD3Policy.from_pretrained(str(tiny_dir), dtype="float32", height=H, width=H, max_sequence_length=SEQ,
                                     lora={"path": str(tmp_path / "lora")})
    assert pol2.has_lora and all(p.requires_grad for p in pol2.lora_parameters())
    assert (_euler(pol2, PROMPTS, latents, 3, 4.5) - ours).abs().max().item() <= 1e-4


def test_tiny_config_builds_into_cache_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path))
    pol = tiny_sd3_policy(dtype="float32", max_sequence_length=SEQ)
    assert (tmp_path / "sd3_tiny-v1-s0" / "model_index.json").is_file()
    assert isinstance(pol, SD3Policy) and pol.latent_shape == (16, H // 8, H // 8)
    x = torch.randn(1, *pol.latent_shape)
    v = pol.velocity(x, 0.5, pol.encode(["a cat"]))
    assert v.shape == x.shape and v.dtype == torch.float32


def test_bf16_weights_fp32_outputs(tiny_dir):
    pol = SD3Policy.from_pretrained(str(tiny_dir), dtype="bfloat16", height=H, width=H, max_sequence_length=SEQ,
                                    gradient_checkpointing=True, offload_text_encoders=True, lora={"rank": 2})
    assert pol.dtype == torch.bfloat16 and pol.vae.dtype == torch.float32
    assert pol.transformer.is_gradient_checkpointing
    x = torch.randn(2, *pol.latent_shape)
    cond = pol.encode(PROMPTS)
    v = pol.velocity(x, torch.tensor([0.9, 0.3]), cond, guidance=4.5)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    v.float().pow(2).mean().backward()  # grads reach the LoRA through checkpointed blocks
    assert all(p.grad is not None for p in pol.lora_parameters())
    assert pol.decode(x).dtype == torch.float32
    pol.precache(["a blue circle"])
    pol.free_text_encoders()
    assert pol.encode(["a blue circle"]).tokens.shape[0] == 1
    with pytest.raises(RuntimeError, match="precache"):
        pol.encode(["never seen"])


@pytest.mark.parametrize("path", ["/nonexistent/sd35", "stabilityai/not-a-real-model-xyz"])
def test_bad_path_is_one_line_error(path, tmp_path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    with pytest.raises(ModelLoadError) as info:
        SD3Policy.from_pretrained(path)
    msg = str(info.value)
    assert "\n" not in msg and path in msg and "model.path=" in msg
    err = info.value
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)  # no chained traceback


def test_dir_without_model_index_is_one_line_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model_index.json"):
        SD3Policy.from_pretrained(str(tmp_path))


def test_gpu_check_script_runs_tiny_on_cpu(tmp_path):
    """experiments/gpu_check.py --tiny: rollout + estimates + reward + credit + update with stepflow's modules."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "gc.json"
    rc = mod.main(["--tiny", "--device", "cpu", "--iters", "1", "--guidance", "4.5", "--batch", "4", "--group-size", "2",
                   "--substeps", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [r["scheme"] for r in res] == ["uniform", "gain"]
    uni, gain = res
    assert uni["estimate_s"] < gain["estimate_s"] and uni["nfe_estimate"] == 0 and gain["nfe_estimate"] > 0
    assert uni["images_scored"] == 4 and gain["images_scored"] == 4 * 3  # B final images vs B·(T+1)
    assert all(r["finite"] and r["steps_trained"] >= 1 and r["grad_norm"] > 0 for r in res)


def _capture_calls(transformer):
    """Record every forward of ``transformer``: its keyword inputs and its output."""
    calls = []

    def hook(module, args, kwargs, out):
        calls.append({**{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in kwargs.items()},
                      "out": out[0].detach().clone()})

    return calls, transformer.register_forward_hook(hook, with_kwargs=True)


@pytest.fixture(scope="module")
def bf16_pipe_and_policy(tiny_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_dir), dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe, SD3Policy(pipe, height=H, width=H, max_sequence_length=SEQ)  # shares the pipeline's modules


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_bf16_velocity_is_the_pipelines_fp32_timestep(bf16_pipe_and_policy, guidance):
    """bf16 weights: on the very inputs StableDiffusion3Pipeline gives its transformer (fp32 timesteps 1000·σ), the
    policy's velocity is the pipeline's transformer output bit for bit. Rounding the timestep to bf16 (913.35 -> 912,
    602.15 -> 604) changes the velocity of the tiny model by up to 4 %."""
    pipe, pol = bf16_pipe_and_policy
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(5))
    calls, handle = _capture_calls(pipe.transformer)
    try:
        pipe(PROMPTS, num_inference_steps=4, height=H, width=H, guidance_scale=guidance, max_sequence_length=SEQ,
             latents=latents.clone(), output_type="latent")
    finally:
        handle.remove()
    assert len(calls) == 4 and all(c["timestep"].dtype == torch.float32 for c in calls)
    assert any(float(c["timestep"][0]) != torch.tensor(float(c["timestep"][0])).bfloat16().item() for c in calls)
    for c in calls:
        ts = c["timestep"]
        with torch.no_grad():
            v = pol._forward(c["hidden_states"].float(), ts / 1000, Cond(c["encoder_hidden_states"],
                                                                       c["pooled_projections"]))
        assert v.dtype == torch.float32
        err = ((v - c["out"].float()).norm() / c["out"].float().norm()).item()
        assert err <= 1e-6, f"t={float(ts[0]):.2f}: relative velocity difference {err:.2e}"


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_bf16_euler_matches_pipeline_trajectory(bf16_pipe_and_policy, guidance):
    """The policy's Euler ODE in bf16 reproduces StableDiffusion3Pipeline.__call__ in bf16 exactly when it rounds as
    the pipeline does: the CFG combination in bf16, and FlowMatchEulerDiscreteScheduler.step's
    ``(x.float() + dt * v_bf16).to(bf16)`` (a 0-d fp32 ``dt`` times a bf16 tensor is a bf16 product)."""
    pipe, pol = bf16_pipe_and_policy
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    ref = pipe(PROMPTS, num_inference_steps=4, height=H, width=H, guidance_scale=guidance, max_sequence_length=SEQ,
               latents=latents.clone(), output_type="latent").images
    cond = pol.encode(PROMPTS)
    tau = pol.time_grid(4)
    x = latents.clone()
    with torch.no_grad():
        for k in range(4):
            t = tau[k].expand(2)
            if guidance == 1.0:
                v = pol.velocity(x.float(), t, cond).bfloat16()
            else:  # the pipeline's batch [uncond, cond], combined in bf16
                both = pol._forward(torch.cat([x, x]).float(), torch.cat([t, t]), Cond.cat([pol.negative_cond(2), cond]))
                v_u, v_c = both.bfloat16().chunk(2)
                v = v_u + guidance * (v_c - v_u)
            x = (x.float() + (tau[k + 1] - tau[k]) * v).bfloat16()
    err = (x.float() - ref.float()).abs().max().item()
    print(f"max-abs bf16 ODE vs pipeline (guidance={guidance}): {err:.3e}")
    assert err == 0.0
