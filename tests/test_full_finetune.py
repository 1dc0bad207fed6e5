"""Full fine-tuning, policy side (``finetune="full"``), on the tiny SD3 / FLUX / Qwen-Image pipelines.

The interface the GRPO loop uses, in both modes: ``trainable_parameters()`` (optimizer, EMA, clipping),
``reference()`` (π_ref of the KL term: LoRA disabled, or a frozen copy of the initial transformer made on first use),
``prepare_reference()`` (before the first update when β > 0), ``save_trained(run_dir / trained_subdir)`` (diffusers
format: the LoRA, or the transformer folder that the pipeline loads).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.testing.tiny_policies import TINY_HEIGHT  # noqa: E402

PROMPTS = ["a photo of a cat", "a red dog on the square"]
H = TINY_HEIGHT
FAMILIES = ["sd3", "flux", "qwen_image"]


@pytest.fixture(scope="module")
def dirs(tiny_pipeline):
    return {"sd3": tiny_pipeline("sd3"), "flux": tiny_pipeline("flux_dev"), "qwen_image": tiny_pipeline("qwen_image")}


def _policy_cls(family):
    if family == "sd3":
        from stepflow.policies.sd3 import SD3Policy

        return SD3Policy
    if family == "flux":
        from stepflow.policies.flux import FluxPolicy

        return FluxPolicy
    from stepflow.policies.qwen_image import QwenImagePolicy

    return QwenImagePolicy


def _load(family, path, **kw):
    kw.setdefault("dtype", "float32")
    if family == "sd3":
        kw.setdefault("max_sequence_length", 16)
    return _policy_cls(family).from_pretrained(str(path), height=H, width=H, **kw)


def _pipeline(family, path, transformer=None):
    from diffusers import FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline

    cls = {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline, "qwen_image": QwenImagePipeline}[family]
    pipe = cls.from_pretrained(str(path), **({"transformer": transformer} if transformer is not None else {}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipe_latents(family, pipe, policy, latents, steps):
    from stepflow.policies.flux import pack_latents, unpack_latents

    kw = dict(num_inference_steps=steps, height=H, width=H, output_type="latent")
    if family == "sd3":
        return pipe(PROMPTS, guidance_scale=1.0, max_sequence_length=policy.max_sequence_length,
                    latents=latents.clone(), **kw).images
    if family == "flux":
        kw.update(guidance_scale=policy.embedded_guidance, max_sequence_length=policy.max_sequence_length)
    else:
        kw.update(true_cfg_scale=1.0)
    return unpack_latents(pipe(PROMPTS, latents=pack_latents(latents.clone()), **kw).images, *latents.shape[-2:])


@torch.no_grad()
def _euler(policy, latents, steps):
    cond = policy.encode(PROMPTS)
    tau = policy.time_grid(steps)
    x = latents.clone()
    for k in range(steps):
        x = x + (tau[k + 1] - tau[k]) * policy.velocity(x, tau[k], cond)
    return x


def _sgd_like_step(policy, lr=1e-2):
    """One AdamW step over ``trainable_parameters()`` on a velocity loss (stands in for the GRPO update)."""
    params = list(policy.trainable_parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(9))
    policy.velocity(x, torch.tensor([0.8, 0.4]), policy.encode(PROMPTS)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_switch_makes_every_transformer_weight_trainable(dirs, family):
    pol = _load(family, dirs[family], finetune="full")
    assert pol.finetune == "full" and pol.trained_subdir == "transformer" and not pol.has_lora
    trainable = list(pol.trainable_parameters())
    assert len(trainable) == len(list(pol.transformer.parameters())) and all(p.requires_grad for p in trainable)
    frozen = [p for m in [pol.vae, *pol.text_encoders] for p in m.parameters()]
    assert frozen and not any(p.requires_grad for p in frozen)
    with pytest.raises(ValueError, match="lora.rank=0"):  # what the loop's build_policy would call with lora.rank > 0
        pol.add_lora(rank=4)
    with pytest.raises(ValueError, match="finetune=full"):
        _load(family, dirs[family], finetune="full", lora={"rank": 4})
    with pytest.raises(ValueError, match="model.finetune: must be one of lora, full"):
        _load(family, dirs[family], finetune="everything")


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_mode_keeps_the_adapter_interface(dirs, family, tmp_path):
    pol = _load(family, dirs[family], lora={"rank": 2, "alpha": 4.0})
    assert pol.finetune == "lora" and pol.trained_subdir == "lora"
    assert [id(p) for p in pol.trainable_parameters()] == [id(p) for p in pol.lora_parameters()]
    with torch.no_grad():
        for p in pol.lora_parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(1, *pol.latent_shape)
    cond = pol.encode(PROMPTS[:1])
    with torch.no_grad(), pol.disable_adapter():
        base = pol.velocity(x, 0.6, cond)
    with torch.no_grad(), pol.reference():
        ref = pol.velocity(x, 0.6, cond)
    with torch.no_grad():
        cur = pol.velocity(x, 0.6, cond)
    assert torch.equal(ref, base) and (cur - base).abs().max() > 1e-4
    out = pol.save_trained(tmp_path / pol.trained_subdir)
    assert (out / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_is_a_lazy_frozen_copy_of_the_initial_transformer(dirs, family):
    pol = _load(family, dirs[family], finetune="full")
    x = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([0.9, 0.3])
    cond = pol.encode(PROMPTS)
    with torch.no_grad():
        v0 = pol.velocity(x, t, cond)
    assert pol._ref_copy is None  # nothing copied while no reference was asked for (β = 0 costs no memory)
    pol.prepare_reference()
    ref = pol._ref_copy[0]
    assert ref is not pol.transformer and not any(p.requires_grad for p in ref.parameters())
    n_params = len(list(pol.parameters()))
    assert n_params == len(list(pol.transformer.parameters())) + len(list(pol.vae.parameters()))  # not registered
    assert not any(k.startswith("_ref") for k in pol.state_dict())
    _sgd_like_step(pol)
    with torch.no_grad():
        v1 = pol.velocity(x, t, cond)
        with pol.reference():
            v_ref = pol.velocity(x, t, cond)
        v1_again = pol.velocity(x, t, cond)
    assert (v1 - v0).abs().max() > 1e-4  # the update changed the policy
    assert torch.equal(v_ref, v0) and torch.equal(v1_again, v1)  # π_ref is the initial policy; context restores π_θ

    late = _load(family, dirs[family], finetune="full")
    _sgd_like_step(late)
    with pytest.raises(RuntimeError, match="prepare_reference"):  # a copy now would not be the initial policy
        with late.reference():
            pass


@pytest.mark.parametrize("family", FAMILIES)
def test_save_trained_full_loads_into_the_pipeline(dirs, family, tmp_path):
    """``save_trained`` writes the transformer in diffusers format: ``<Transformer>.from_pretrained(dir)`` passed to
    the pipeline reproduces the fine-tuned policy's ODE, and ``from_pretrained(transformer_path=dir)`` reloads it."""
    pol = _load(family, dirs[family], finetune="full")
    _sgd_like_step(pol)
    out = pol.save_trained(tmp_path / pol.trained_subdir)
    assert (out / "config.json").is_file() and (out / "diffusion_pytorch_model.safetensors").is_file()
    latents = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(5))
    ours = _euler(pol, latents, 3)
    transformer = type(pol.transformer).from_pretrained(str(out))
    ref = _pipe_latents(family, _pipeline(family, dirs[family], transformer), pol, latents, 3)
    err = (ours - ref).abs().max().item()
    print(f"max-abs {family} full-FT policy vs pipeline with the saved transformer: {err:.3e}")
    assert err <= 1e-4
    base = _pipe_latents(family, _pipeline(family, dirs[family]), pol, latents, 3)
    assert (base - ref).abs().max() > 1e-3  # the saved weights are the trained ones, not the base
    again = _load(family, dirs[family], transformer_path=str(out))
    assert (_euler(again, latents, 3) - ours).abs().max().item() <= 1e-5


def test_save_trained_writes_a_given_state_dict(dirs, tmp_path):
    """The loop can pass the weights to write (an FSDP full state dict gathered on rank 0, or EMA weights)."""
    pol = _load("flux", dirs["flux"], finetune="full")
    state = {k: v + 0.01 for k, v in pol.transformer.state_dict().items()}
    out = pol.save_trained(tmp_path / "t", state_dict=state)
    loaded = type(pol.transformer).from_pretrained(str(out)).state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert not torch.equal(next(iter(pol.transformer.parameters())), next(iter(loaded.values())))  # live untouched
    # a LoRA: the given LoRA weights (keys as transformer.state_dict(), e.g. gathered from FSDP2 shards) are written
    lora = _load("flux", dirs["flux"], lora={"rank": 2})
    given = {k: v + 0.5 for k, v in lora.transformer.state_dict().items() if "lora_" in k}
    from safetensors.torch import load_file

    written = load_file(str(lora.save_trained(tmp_path / "l", state_dict=given) / "pytorch_lora_weights.safetensors"))
    assert len(written) == len(given) > 0
    live = {k: v for k, v in lora.lora_state_dict().items()}
    for k, v in lora.lora_state_dict(given).items():
        assert torch.equal(written[f"transformer.{k}" if f"transformer.{k}" in written else k], v)
        assert not torch.equal(v, live[k])


def test_missing_transformer_path_is_one_line_error(dirs, tmp_path):
    from stepflow.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="has no config.json .*save_trained") as info:
        _load("flux", dirs["flux"], transformer_path=str(tmp_path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_one_full_finetune_grpo_update(dirs, family):
    """What the loop does in one GRPO update with ``finetune=full``: roll out (π_old), recompute log π_θ at the
    rollout's actions (ratio 1 on the first update), KL to ``reference()``, one AdamW step over
    ``trainable_parameters()``; every transformer weight that gets a gradient moves, the reference does not."""
    from stepflow.core.data import IterationPlan
    from stepflow.core.rollout import rollout
    from stepflow.math.loss import policy_loss
    from stepflow.math.sde import SamplerConfig, sde_step

    pol = _load(family, dirs[family], finetune="full")
    pol.prepare_reference()  # the loop: once at setup when train.beta_kl > 0
    ref_before = {k: v.clone() for k, v in pol._ref_copy[0].state_dict().items()}
    before = {n: p.detach().clone() for n, p in pol.transformer.named_parameters()}
    sampler = SamplerConfig(name="flow_sde", a=0.7)
    cond = pol.encode(PROMPTS * 2)
    seeds = torch.arange(4)
    plan = IterationPlan(PROMPTS * 2, [{}] * 4, torch.tensor([0, 1, 0, 1]), seeds + 7, seeds)
    traj = rollout(pol, plan, sampler, 3, 1.0)
    adv = torch.tensor([1.0, -1.0, -0.5, 0.5])
    params = list(pol.trainable_parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    times = traj.times
    ratios = []
    for k in range(2):
        x_k = traj.latents[:, k]
        v = pol.velocity(x_k, times[k], cond)
        out = sde_step(sampler, x_k, v, times[k], times[k + 1], t_guard=times[1], prev_sample=traj.latents[:, k + 1])
        with torch.no_grad(), pol.reference():
            v_ref = pol.velocity(x_k, times[k], cond)
            ref_mean = sde_step(sampler, x_k, v_ref, times[k], times[k + 1], t_guard=times[1],
                                prev_sample=traj.latents[:, k + 1]).mean
        lo = policy_loss(out.log_prob, traj.log_probs[:, k], adv, clip_eps=1e-4, mean=out.mean, ref_mean=ref_mean,
                         std=out.std, kl_scale=out.kl_scale, beta=0.04)
        (lo.loss / 2).backward()
        ratios += [float(lo.ratio_min), float(lo.ratio_max)]
        assert float(lo.kl) < 1e-10  # π_θ = π_ref before the first step
    assert all(abs(r - 1) < 1e-5 for r in ratios)
    gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert torch.isfinite(gn) and gn > 0
    opt.step()
    moved = [n for n, p in pol.transformer.named_parameters() if not torch.equal(p.detach(), before[n])]
    with_grad = [n for n, p in pol.transformer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert with_grad and set(with_grad) <= set(moved)
    assert len(moved) > 0.9 * len(before)  # practically every weight of the transformer is trained
    assert all(torch.equal(v, ref_before[k]) for k, v in pol._ref_copy[0].state_dict().items())


@pytest.mark.parametrize("beta_kl", [0.0, 0.04])
def test_full_finetune_through_the_training_loop(tmp_path, monkeypatch, beta_kl, tiny_clip_dir):
    """model.finetune=full end to end (python -m stepflow.train's run): every transformer weight is trained (no LoRA),
    the KL reference is the frozen initial transformer, checkpoints hold the trained weights, and the run writes the
    (EMA) transformer in diffusers format, which the pipeline's transformer class loads."""
    from diffusers import SD3Transformer2DModel

    from stepflow.testing.harness import smoke_config
    from stepflow.train import run

    monkeypatch.setenv("STEPFLOW_CACHE", str(tmp_path / "cache"))
    module = run(smoke_config("model=sd3_tiny", "model.finetune=full", "loop.iterations=2", "loop.num_steps=3",
                          "reward=pickscore", f"reward.model_path={tiny_clip_dir}", f"reward.processor_path={tiny_clip_dir}",
                          "eval.max_prompts=2", "eval.guidance=1", f"train.beta_kl={beta_kl}", "train.lr=1e-2",
                          "sampler=flow_sde"), tmp_path / "run")
    pol = module.policy
    assert not pol.has_lora and pol.finetune == "full"
    n_train = sum(p.numel() for p in pol.trainable_parameters())
    assert n_train == sum(p.numel() for p in pol.transformer.parameters())
    assert module.learner.opt_steps == 2
    out = tmp_path / "run" / "transformer"
    assert (out / "config.json").is_file() and not (tmp_path / "run" / "lora").exists()
    saved = SD3Transformer2DModel.from_pretrained(str(out))
    initial = SD3Transformer2DModel.from_pretrained(str(pol.pipe.name_or_path), subfolder="transformer")
    moved = [n for n, p in saved.named_parameters() if not torch.equal(p, dict(initial.named_parameters())[n])]
    assert moved  # the saved (EMA) weights differ from the initial ones
    ck = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert len(ck["state_dict"]) == len(list(pol.transformer.parameters()))  # every trained weight, nothing else
    if beta_kl > 0:
        ref = pol._ref_copy[0]
        assert all(torch.equal(p, dict(initial.named_parameters())[n]) for n, p in ref.named_parameters())
    assert "train/kl" in (tmp_path / "run" / "metrics.csv").read_text()
