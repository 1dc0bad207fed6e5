"""ZImagePolicy on a tiny random Z-Image-Turbo pipeline (fp32, CPU), loaded through the real loader.

The key tests: the policy's plain Euler ODE on its own grid, and the rollout's ODE sampler, reproduce
``ZImagePipeline.__call__`` from the same noise (the reversed time and the negated output, per-prompt caption lengths;
CFG with its ``guidance_scale`` w as stepflow's 1 + w, ``cfg_normalization`` and ``cfg_truncation``; Δ <= 2e-6); the
grid is the one the pipeline calls its transformer at; the prompt encoding is the pipeline's; the LoRA round-trips
through ``ZImagePipeline.load_lora_weights``; full fine-tuning saves a transformer the pipeline loads; the SDE
rollouts' log-probs and x̂0 estimates are well defined; bad paths are one line naming the field.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.errors import ModelLoadError, StepflowError  # noqa: E402
from stepflow.policies.zimage import LORA_TARGETS_ZIMAGE, ZImagePolicy  # noqa: E402
from stepflow.testing.tiny_flux2_zimage import tiny_dir  # noqa: E402
from stepflow.testing.tiny_policies import TINY_HEIGHT  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog on the square"]  # different lengths: the batch needs a mask
SEQ = 64
H = TINY_HEIGHT
TOL = 2e-6  # the bound (fp32)
#: measured: bit-identical on the CPU in fp32 (the pipeline's operations in its order), held exactly so that a change of
#: the arithmetic (the reversed time computed as 1 - t, the CFG combination in another order) is seen
EXACT = 0.0


@pytest.fixture(scope="module")
def path():
    return tiny_dir("zimage")


def _load(path, **kw):
    kw.setdefault("dtype", "float32")
    return ZImagePolicy.from_pretrained(str(path), height=H, width=H, max_sequence_length=SEQ, **kw)


@pytest.fixture(scope="module")
def policy(path):
    return _load(path)


def _noise(policy, seed=1, b=2):
    return torch.randn(b, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _euler(policy, latents, steps, guidance=1.0):
    cond = policy.encode(PROMPTS)
    tau = policy.time_grid(steps)
    x = latents.clone().float()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond, guidance=guidance)
    return x


def _pipe(policy, latents, steps, w=0.0, output_type="latent", pipe=None, **kw):
    """ZImagePipeline.__call__ from the same latents (its guidance_scale w; a copy of the prompt list: the pipeline
    templates the list it is given in place)."""
    pipe = pipe or policy.pipe
    return pipe(prompt=list(PROMPTS), height=H, width=H, num_inference_steps=steps, guidance_scale=w,
                max_sequence_length=SEQ, latents=latents.clone(), output_type=output_type, **kw).images


def test_loaded_attributes(policy):
    assert policy.latent_shape == (16, H // 8, H // 8) and policy.image_seq_len == (H // 16) ** 2
    assert policy.negative_prompt == "" and policy.guidance == 1.0 and policy.cfg_truncation == 1.0
    assert policy.dtype == torch.float32 and len(policy.text_encoders) == 1
    assert not any(p.requires_grad for m in [policy.vae, *policy.text_encoders] for p in m.parameters())


@pytest.mark.parametrize("steps", [1, 3, 9, 28])
def test_time_grid_is_the_pipelines(policy, steps):
    """The grid's times, reversed as the transformer takes them (1 − σ, captured from the pipeline's call), + 0; the
    static shift 3σ / (1 + 2σ) of σ = linspace(1, 1/N, N); starts at exactly 1."""
    seen = []
    handle = policy.pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(a[1].detach().clone()),
                                                               with_kwargs=True)
    try:
        _pipe(policy, _noise(policy, b=1)[:1].expand(2, -1, -1, -1), steps)
    finally:
        handle.remove()
    grid = policy.time_grid(steps)
    assert grid.shape == (steps + 1,) and float(grid[0]) == 1.0 and float(grid[-1]) == 0.0
    called = torch.stack([s[0] for s in seen])
    assert torch.equal((1000 - grid[:-1] * 1000) / 1000, called)
    sig = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64)
    assert torch.allclose(grid[:-1].double(), 3 * sig / (1 + 2 * sig), atol=1e-6)


@pytest.mark.parametrize("steps,w", [(1, 0.0), (4, 0.0), (4, 3.0)])
def test_euler_ode_matches_the_pipeline(policy, steps, w):
    """guidance_scale w of the pipeline (0: off, Turbo's) is stepflow's guidance 1 + w."""
    latents = _noise(policy)
    ours = _euler(policy, latents, steps, guidance=1.0 + w)
    ref = _pipe(policy, latents, steps, w)
    err = (ours - ref).abs().max().item()
    print(f"max-abs Z-Image ODE vs ZImagePipeline ({steps} steps, guidance_scale {w}): {err:.3e}")
    assert err <= TOL and err == EXACT and (ours - latents).abs().max() > 1e-2
    img = _pipe(policy, latents, steps, w, output_type="pt")
    with torch.no_grad():
        ours_img = policy.decode(ours)
    assert ours_img.shape == (2, 3, H, H) and (ours_img - img).abs().max().item() <= TOL


def test_cfg_normalization_and_truncation_match_the_pipeline(path, policy):
    latents = _noise(policy, seed=3)
    plain = _euler(policy, latents, 4, guidance=6.0)
    for kw in ({"cfg_normalization": 1.0}, {"cfg_truncation": 0.2}, {"cfg_normalization": 1.2, "cfg_truncation": 0.2}):
        pol = _load(path, **kw)
        ours = _euler(pol, latents, 4, guidance=6.0)
        err = (ours - _pipe(pol, latents, 4, 5.0, **kw)).abs().max().item()
        print(f"max-abs Z-Image CFG {kw} vs ZImagePipeline: {err:.3e}")
        assert err <= TOL and (ours - plain).abs().max() > 1e-4, kw
    with pytest.raises(StepflowError, match=r"^model.cfg_normalization: must be >= 0"):
        _load(path, cfg_normalization=-1)


def test_rollout_ode_matches_the_pipeline_and_sde_rollouts_are_well_defined(policy):
    from stepflow.core.data import IterationPlan
    from stepflow.core.rollout import estimate_states, rollout
    from stepflow.math.sde import SamplerConfig

    seeds = torch.tensor([3, 4])
    plan = IterationPlan(list(PROMPTS), [{}, {}], torch.tensor([0, 1]), seeds + 10, seeds)
    for g in (1.0, 4.0):
        traj = rollout(policy, plan, SamplerConfig(name="ode"), 4, g)
        err = (traj.latents[:, -1] - _pipe(policy, traj.latents[:, 0], 4, g - 1.0)).abs().max().item()
        print(f"max-abs Z-Image rollout ODE (guidance {g}) vs ZImagePipeline: {err:.3e}")
        assert err <= TOL and err == EXACT
    for name in ("flow_sde", "ddim_sde", "cps"):
        n0 = policy.nfe
        traj = rollout(policy, plan, SamplerConfig(name=name), 4, 1.0)
        assert torch.equal(traj.times, policy.time_grid(4)) and policy.nfe - n0 == 8
        assert torch.isfinite(traj.log_probs).all() and traj.trainable[:, 1:-1].all()
    x0 = estimate_states(policy, traj, substeps=1, guidance=1.0)
    tweedie = traj.latents[:, :-1] - traj.times[:-1].view(1, -1, 1, 1, 1) * traj.velocities
    assert torch.allclose(x0[:, :-1], tweedie, atol=1e-6) and torch.equal(x0[:, -1], traj.latents[:, -1])


def test_encode_is_the_pipelines_with_a_mask(policy):
    policy.clear_prompt_cache()
    c = policy.encode(PROMPTS)
    ref = policy.pipe._encode_prompt(list(PROMPTS), max_sequence_length=SEQ)
    lengths = [r.shape[0] for r in ref]
    assert lengths[0] != lengths[1] and c.mask is not None and c.mask.sum(1).tolist() == lengths
    for i, r in enumerate(ref):
        assert torch.equal(c.tokens[i, :lengths[i]], r) and not c.tokens[i, lengths[i]:].any()
    assert c.pooled.shape == (2, 0)
    one = policy.encode(PROMPTS[:1])
    assert one.mask is None and one.tokens.shape[1] == lengths[0]  # a batch of one: no padding, as the pipeline
    with torch.no_grad():
        assert torch.allclose(policy.velocity(_noise(policy)[:1], 0.6, one),
                              policy.velocity(_noise(policy), 0.6, c)[:1], atol=1e-6)  # the padding is not seen


def test_lora_targets_save_and_load_with_diffusers(path, tmp_path):
    from diffusers import ZImagePipeline

    pol = _load(path, lora={"rank": 4, "alpha": 8.0, "targets": list(LORA_TARGETS_ZIMAGE)})
    names = {n for n, _ in pol.transformer.named_modules() if n.endswith("lora_A")}
    for block in ("layers.0.", "noise_refiner.0.", "context_refiner.0."):
        for target in LORA_TARGETS_ZIMAGE:
            assert any(n.startswith(block) and n.endswith(f"{target}.lora_A") for n in names), (block, target)
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    latents = _noise(pol, seed=4)
    ours = _euler(pol, latents, 3)
    with pol.disable_adapter():
        assert (_euler(pol, latents, 3) - ours).abs().max() > 1e-3
    pol.save_trained(tmp_path / "lora")
    pipe = ZImagePipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    err = (ours - _pipe(pol, latents, 3, pipe=pipe)).abs().max().item()
    print(f"max-abs Z-Image LoRA policy vs ZImagePipeline.load_lora_weights: {err:.3e}")
    assert err <= TOL
    again = _load(path, lora={"path": str(tmp_path / "lora")})
    assert again.has_lora and (_euler(again, latents, 3) - ours).abs().max().item() <= TOL


def test_full_finetuning_saves_a_transformer_the_pipeline_loads(path, tmp_path):
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    pol = _load(path, finetune="full")
    trainable = list(pol.trainable_parameters())
    assert len(trainable) == len(list(pol.transformer.parameters())) and not pol.has_lora
    pol.prepare_reference()
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    pol.velocity(_noise(pol, seed=9), torch.tensor([0.8, 0.4]), pol.encode(PROMPTS)).pow(2).mean().backward()
    opt.step()
    latents = _noise(pol, seed=5)
    ours = _euler(pol, latents, 2)
    with pol.reference():
        assert (_euler(pol, latents, 2) - ours).abs().max() > 1e-4
    out = pol.save_trained(tmp_path / "transformer")
    pipe = ZImagePipeline.from_pretrained(str(path), transformer=ZImageTransformer2DModel.from_pretrained(str(out)))
    pipe.set_progress_bar_config(disable=True)
    assert (ours - _pipe(pol, latents, 2, pipe=pipe)).abs().max().item() <= TOL
    assert (_euler(_load(path, transformer_path=str(out)), latents, 2) - ours).abs().max().item() <= TOL


def test_bf16_runs_with_fp32_time_and_gradient_checkpointing(path):
    pol = _load(path, dtype="bfloat16", gradient_checkpointing=True, lora={"rank": 2, "targets": list(LORA_TARGETS_ZIMAGE)})
    seen = []
    handle = pol.transformer.t_embedder.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    try:
        v = pol.velocity(torch.randn(2, *pol.latent_shape), torch.tensor([0.91335, 0.3]), pol.encode(PROMPTS))
    finally:
        handle.remove()
    assert seen[0].dtype == torch.float32  # (1 − t) · 1000 reaches the sinusoid in fp32
    assert v.dtype == torch.float32 and torch.isfinite(v).all() and pol.transformer.is_gradient_checkpointing
    v.pow(2).mean().backward()
    assert all(p.grad is not None for p in pol.lora_parameters())


# ---------------------------------------------------------------------------------------------------- bad input
def test_a_missing_or_wrong_family_path_is_one_line(path, tmp_path):
    from stepflow.testing.tiny_policies import tiny_qwen_image_dir

    with pytest.raises(ModelLoadError) as info:
        ZImagePolicy.from_pretrained(str(tmp_path / "nowhere"))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("model.path:") and "Z-Image" in msg and "nowhere" in msg
    with pytest.raises(ModelLoadError) as info:
        ZImagePolicy.from_pretrained(str(tiny_qwen_image_dir()), dtype="float32")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("model.path:") and "holds Qwen-Image weights" in msg, msg
    with pytest.raises(ModelLoadError, match=r"^model.transformer_path: .* holds FLUX.2 weights"):
        _load(path, transformer_path=str(tiny_dir("flux2") / "transformer"))


def test_bad_arguments_are_one_line(path):
    with pytest.raises(StepflowError, match=r"^model.guidance: must be >= 1"):
        _load(path, guidance=0.0)
    with pytest.raises(StepflowError, match=r"^model.width: must be a positive multiple of 16"):
        ZImagePolicy.from_pretrained(str(path), height=H, width=40, dtype="float32")


def test_the_cli_with_a_missing_model_is_one_line(cli, tmp_path):
    from stepflow.testing.harness import one_line_error

    r = cli("stepflow.train", "experiment=smoke_zimage", f"model.path={tmp_path / 'nowhere'}",
            f"hydra.run.dir={tmp_path / 'run'}")
    assert "model.path" in one_line_error(r, str(tmp_path / "nowhere"))
