"""WanPolicy (Wan 2.1 / 2.2 text-to-video) on tiny random Wan pipelines (fp32, CPU), loaded through the real loader.

The key tests: the core's ODE rollout reproduces ``WanPipeline.__call__`` on the same noise, every frame, as latents and
as decoded videos (Δ ≤ 2e-6), with and without CFG, on Wan 2.2's two experts with ``guidance_scale_2``; the grid is the
Euler scheduler's that the pipeline calls its transformer at; the trajectory, the SDE steps, the log-probs and the x̂0
estimates hold (B, C, F, H, W) latents; a saved LoRA loads into diffusers' ``WanPipeline.load_lora_weights`` (Wan 2.2:
one file per expert); full fine-tuning round-trips; the video rewards (``reward=frames``, over HTTP) and the refusals.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from stepflow.errors import StepflowError  # noqa: E402
from stepflow.policies.wan import EXPERT_LORA_FILES, LORA_TARGETS_WAN, WanExperts, WanPolicy  # noqa: E402
from stepflow.testing.harness import base_parameters, random_config_policies  # noqa: E402
from stepflow.testing.tiny_wan import TINY_FRAMES, TINY_SIZE, tiny_wan_dir  # noqa: E402

PROMPTS = ["a photo of a red circle", "a blue square on the green"]
H, F, SEQ = TINY_SIZE, TINY_FRAMES, 16
CFG = 4.5
TOL = 2e-6  # fp32: the rollout's ODE vs WanPipeline on the same noise


def _tol(cfg: float, ref: torch.Tensor) -> float:
    """2e-6 without CFG (measured: 0, bit for bit); with CFG 2e-6 relative to the latents' size: the policy runs the
    unconditional and conditional rows in one doubled batch where the pipeline makes two calls, which moves each
    fp32 forward by ~1 ulp (3e-7 .. 5e-7 measured), and the scale 4.5 and 4 steps carry that to ~4 ulp of values ~4."""
    return TOL if cfg == 1.0 else TOL * max(1.0, ref.abs().max().item())


def _load(variant="2.1", **kw):
    kw = {"dtype": "float32", "height": H, "width": H, "num_frames": F, "max_sequence_length": SEQ, **kw}
    return WanPolicy.from_pretrained(str(tiny_wan_dir(variant=variant)), **kw)


@pytest.fixture(scope="module")
def wan21():
    return _load("2.1")


@pytest.fixture(scope="module")
def wan22():
    return _load("2.2", guidance_2=3.0)


def _euler_pipe(policy):
    """The policy's WanPipeline with diffusers' own Euler scheduler at the checkpoint's flow_shift (built here from the
    pipeline's UniPC config, independently of the policy's code)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    shift = policy.pipe.scheduler.config.flow_shift
    comps = {k: v for k, v in policy.pipe.components.items() if k != "scheduler"}
    return WanPipeline(**comps, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                       boundary_ratio=policy.pipe.config.boundary_ratio)


def _plan(seeds=(3, 4)):
    from stepflow.core.data import IterationPlan

    s = torch.tensor(list(seeds))
    return IterationPlan(PROMPTS, [{}, {}], torch.tensor([0, 1]), s + 10, s)


def _ode_rollout(policy, steps, guidance):
    from stepflow.core.rollout import rollout
    from stepflow.math.sde import SamplerConfig

    return rollout(policy, _plan(), SamplerConfig(name="ode"), steps, guidance)


def _pipeline(policy, noise, steps, cfg, output_type="latent", cfg_2=None):
    extra = {"negative_prompt": ""} if cfg != 1.0 else {}
    if cfg_2 is not None:
        extra["guidance_scale_2"] = cfg_2
    out = _euler_pipe(policy)(prompt=PROMPTS, height=H, width=H, num_frames=F, num_inference_steps=steps,
                              guidance_scale=cfg, latents=noise.clone(), output_type=output_type,
                              max_sequence_length=SEQ, **extra)
    return out.frames


# ---------------------------------------------------------------------------------------------------- pipeline parity
def test_loaded_attributes(wan21, wan22):
    assert wan21.modality == "video" and wan21.num_frames == F and wan21.latent_shape == (16, 3, H // 8, H // 8)
    assert wan21.shift == 3.0 and wan22.shift == 12.0  # the checkpoints' UniPC flow_shift
    assert wan21.experts is None and isinstance(wan22.experts, WanExperts) and wan22.experts.boundary == 875.0
    assert wan22.transformer.transformer is wan22.pipe.transformer and wan22.transformer.transformer_2 is wan22.pipe.transformer_2
    assert not any(p.requires_grad for m in [wan21.vae, *wan21.text_encoders] for p in m.parameters())


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_time_grid_is_the_euler_pipelines(wan21, steps):
    """The grid = the timesteps WanPipeline (Euler scheduler, the checkpoint's shift) calls its transformer at / 1000,
    then 0; from exactly 1."""
    seen = []
    pipe = _euler_pipe(wan21)
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].clone()),
                                                      with_kwargs=True)
    try:
        pipe(prompt=PROMPTS[:1], height=H, width=H, num_frames=F, num_inference_steps=steps, guidance_scale=1.0,
             output_type="latent", max_sequence_length=SEQ)
    finally:
        hook.remove()
    grid = wan21.time_grid(steps)
    assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0 and grid.shape == (steps + 1,)
    assert torch.equal(grid[:-1] * 1000.0, torch.stack([s[0] for s in seen]))


@pytest.mark.parametrize("cfg", [1.0, CFG])
def test_rollout_ode_matches_wan_pipeline_every_frame(wan21, cfg):
    """The core's ODE rollout == WanPipeline.__call__ on the same initial noise (Euler scheduler at the checkpoint's
    flow_shift; CFG with the empty negative prompt), every latent frame and every decoded frame."""
    steps = 4
    traj = _ode_rollout(wan21, steps, cfg)
    assert traj.latents.shape == (2, steps + 1, *wan21.latent_shape)
    ref = _pipeline(wan21, traj.latents[:, 0], steps, cfg)
    ours = traj.latents[:, -1]
    per_frame = (ours - ref).abs().amax(dim=(0, 1, 3, 4))
    print(f"max-abs Wan 2.1 rollout ODE vs WanPipeline (cfg {cfg}), per latent frame: {per_frame.tolist()}")
    assert per_frame.shape == (3,) and per_frame.max().item() <= _tol(cfg, ref)
    assert (ours - traj.latents[:, 0]).abs().max() > 1e-2
    video = _pipeline(wan21, traj.latents[:, 0], steps, cfg, output_type="pt")  # (B, F, 3, H, W)
    with torch.no_grad():
        mine = wan21.decode(ours)
    assert mine.shape == (2, 3, F, H, H) and mine.dtype == torch.float32
    err = (mine - video.permute(0, 2, 1, 3, 4)).abs().amax(dim=(0, 1, 3, 4))
    print(f"max-abs decoded video vs WanPipeline output_type='pt', per frame: {err.max().item():.3e}")
    assert err.shape == (F,) and err.max().item() <= _tol(cfg, video)


@pytest.mark.parametrize("cfg", [1.0, CFG])
def test_wan22_two_experts_match_the_pipeline(wan22, cfg):
    """Wan 2.2: the high-noise transformer where 1000 σ >= 875, transformer_2 below (both used on this grid), the
    low-noise stage at guidance_scale_2 = 3: the rollout == WanPipeline on the same noise, every frame."""
    steps = 4
    grid = wan22.time_grid(steps)
    high = (grid[:-1] * 1000 >= 875.0).tolist()
    assert any(high) and not all(high)
    calls = {"transformer": 0, "transformer_2": 0}
    hooks = [getattr(wan22.pipe, n).register_forward_hook(lambda *a, n=n: calls.__setitem__(n, calls[n] + 1))
             for n in calls]
    try:
        traj = _ode_rollout(wan22, steps, cfg)
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"transformer": sum(high), "transformer_2": steps - sum(high)}
    ref = _pipeline(wan22, traj.latents[:, 0], steps, cfg, cfg_2=3.0 if cfg != 1.0 else None)
    err = (traj.latents[:, -1] - ref).abs().amax(dim=(0, 1, 3, 4))
    print(f"max-abs Wan 2.2 rollout ODE vs WanPipeline (cfg {cfg}, cfg_2 3), per latent frame: {err.tolist()}")
    assert err.max().item() <= _tol(cfg, ref)


def test_experts_route_each_row_by_its_own_time(wan22):
    """A batch mixing high- and low-noise rows (the update's and the estimates' batches): each row is its expert's."""
    x = torch.randn(3, *wan22.latent_shape, generator=torch.Generator().manual_seed(5))
    cond = wan22.encode(PROMPTS + PROMPTS[:1])
    t = torch.tensor([0.95, 0.3, 0.875])
    with torch.no_grad():
        mixed = wan22.velocity(x, t, cond)
        rows = [wan22.velocity(x[i:i + 1], t[i:i + 1], cond.index([i])) for i in range(3)]
        low_only = wan22.pipe.transformer_2(hidden_states=x[1:2], timestep=t[1:2] * 1000,
                                            encoder_hidden_states=cond.tokens[1:2], return_dict=False)[0]
        high_only = wan22.pipe.transformer(hidden_states=x[2:3], timestep=t[2:3] * 1000,
                                           encoder_hidden_states=cond.tokens[2:3], return_dict=False)[0]
    assert (mixed - torch.cat(rows)).abs().max() <= 1e-5
    assert torch.allclose(mixed[1:2], low_only, atol=1e-5) and torch.allclose(mixed[2:3], high_only, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- video in the core
def test_trajectory_sde_logprobs_and_estimates_hold_video_latents(wan21):
    """flow_sde rollout: latents (B, T+1, C, F, H, W), finite (B, T) log-probs; x̂0 estimates (B, T+1, C, F, H, W);
    the SDE step's mean and log-prob on a video latent are those of the same numbers laid out 4-d (the log-prob is a
    mean over every non-batch dimension, frames included)."""
    from stepflow.core.rollout import estimate_states, rollout, score
    from stepflow.math.sde import SamplerConfig, sde_step
    from stepflow.rewards.frames import FrameReward
    from stepflow.testing.random_policies import StandInReward

    steps = 4
    traj = rollout(wan21, _plan(), SamplerConfig(name="flow_sde"), steps, 1.0)
    assert traj.latents.shape == (2, steps + 1, 16, 3, H // 8, H // 8) and traj.velocities.shape[2:] == traj.latents.shape[2:]
    assert traj.log_probs.shape == (2, steps) and torch.isfinite(traj.log_probs).all()
    x0 = estimate_states(wan21, traj, substeps=2, guidance=1.0)
    assert x0.shape == traj.latents.shape and torch.isfinite(x0).all()
    scores = score(wan21, FrameReward(StandInReward()), traj, x0)
    assert scores.rewards.shape == (2, steps + 1) and torch.isfinite(scores.rewards).all()
    k = 1
    x, nxt, v = traj.latents[:, k], traj.latents[:, k + 1], traj.velocities[:, k]
    g = traj.times
    five = sde_step(SamplerConfig(name="flow_sde"), x, v, g[k], g[k + 1], t_guard=g[1], prev_sample=nxt)
    flat = sde_step(SamplerConfig(name="flow_sde"), x.flatten(1, 2), v.flatten(1, 2), g[k], g[k + 1], t_guard=g[1],
                    prev_sample=nxt.flatten(1, 2))
    assert torch.allclose(five.mean.flatten(1, 2), flat.mean) and torch.allclose(five.log_prob, flat.log_prob)
    assert torch.allclose(five.log_prob, traj.log_probs[:, k], atol=1e-5)


# ---------------------------------------------------------------------------------------------------- LoRA, full FT
def _perturb(policy):
    with torch.no_grad():
        for p in policy.lora_parameters():
            p.normal_(0.0, 0.2)


@pytest.mark.parametrize("variant", ["2.1", "2.2"])
def test_saved_lora_loads_into_diffusers_wan_pipeline(variant, tmp_path):
    """The adapter on attn1/attn2 written by save_trained is what WanPipeline.load_lora_weights reads (Wan 2.2: a file
    per expert, the second with load_into_transformer_2=True); the pipeline then equals the adapted policy."""
    from diffusers import WanPipeline

    pol = _load(variant, lora={"rank": 2, "alpha": 4, "targets": list(LORA_TARGETS_WAN)})
    _perturb(pol)
    names = {n for n, _ in pol.transformer.named_parameters() if "lora_A" in n}
    assert names and all(any(t in n for t in LORA_TARGETS_WAN) for n in names)
    out = pol.save_trained(tmp_path / "lora")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == (sorted(EXPERT_LORA_FILES.values()) if variant == "2.2" else ["pytorch_lora_weights.safetensors"])
    pipe = WanPipeline.from_pretrained(str(tiny_wan_dir(variant=variant)))
    pipe.load_lora_weights(str(out))
    if variant == "2.2":
        pipe.load_lora_weights(str(out), weight_name=EXPERT_LORA_FILES["transformer_2"], load_into_transformer_2=True)
    x = torch.randn(2, *pol.latent_shape, generator=torch.Generator().manual_seed(7))
    cond = pol.encode(PROMPTS)
    for t in (0.95, 0.3):
        net = pipe.transformer if variant == "2.1" or t * 1000 >= 875 else pipe.transformer_2
        with torch.no_grad():
            theirs = net(hidden_states=x, timestep=torch.full((2,), t * 1000), encoder_hidden_states=cond.tokens,
                         return_dict=False)[0]
            ours = pol.velocity(x, t, cond)
            with pol.disable_adapter():
                base = pol.velocity(x, t, cond)
        assert (ours - theirs).abs().max() <= 1e-5 and (ours - base).abs().max() > 1e-4


@pytest.mark.parametrize("variant", ["2.1", "2.2"])
def test_full_finetuning_trains_every_transformer_weight_and_round_trips(variant, tmp_path):
    pol = _load(variant, finetune="full")
    n_all = sum(p.numel() for p in pol.transformer.parameters())
    assert sum(p.numel() for p in pol.trainable_parameters()) == n_all and not pol.has_lora
    if variant == "2.2":
        assert {id(p) for p in pol.pipe.transformer_2.parameters()} <= {id(p) for p in pol.trainable_parameters()}
    pol.prepare_reference()
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.01 * torch.randn_like(p))
    x = torch.randn(1, *pol.latent_shape, generator=torch.Generator().manual_seed(8))
    cond = pol.encode(PROMPTS[:1])
    with torch.no_grad():
        ours = [pol.velocity(x, t, cond) for t in (0.95, 0.3)]
        with pol.reference():
            ref = [pol.velocity(x, t, cond) for t in (0.95, 0.3)]
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(ours, ref))
    out = pol.save_trained(tmp_path / "transformer")
    back = _load(variant, transformer_path=str(out))
    with torch.no_grad():
        again = [back.velocity(x, t, back.encode(PROMPTS[:1])) for t in (0.95, 0.3)]
    assert all((a - b).abs().max() <= 1e-6 for a, b in zip(ours, again))


# ---------------------------------------------------------------------------------------------------- rewards
class _Brightness:
    """A plain image reward for checking FrameReward's arithmetic: the mean pixel of each image."""

    @staticmethod
    def build():
        from stepflow.rewards.base import Reward, RewardOut

        class Bright(Reward):
            name = "bright"

            def score(self, images, prompts, meta):
                m = images.mean(dim=(1, 2, 3))
                return RewardOut(m, {"double": 2 * m})

        return Bright()


def _video(b=2, f=9):
    g = torch.Generator().manual_seed(0)
    return torch.rand(b, 3, f, 8, 8, generator=g)


@pytest.mark.parametrize("frames,kw,expect", [
    ("stride", {"stride": 4}, [0, 4, 8]), ("first", {}, [0]), ("last", {}, [8]), ("all", {}, list(range(9))),
    ("spaced", {"count": 3}, [0, 4, 8]), ("indices", {"indices": [1, -1]}, [1, 8])])
def test_frame_reward_is_the_mean_of_the_sampled_frames(frames, kw, expect):
    from stepflow.rewards.frames import FrameReward

    r = FrameReward(_Brightness.build(), frames=frames, **kw)
    v = _video()
    out = r(v, ["a", "b"])
    want = torch.stack([v[:, :, i].mean(dim=(1, 2, 3)) for i in expect], 1).mean(1)
    assert r.modality == "video" and r.sampled(9) == expect
    assert torch.allclose(out.scores, want, atol=1e-6) and torch.allclose(out.components["double"], 2 * want, atol=1e-6)


def test_video_reward_refusals_are_one_line():
    from stepflow.rewards.base import check_modality
    from stepflow.rewards.frames import FrameReward

    img, vid = _Brightness.build(), FrameReward(_Brightness.build())
    check_modality("video", vid)
    check_modality("image", img)
    for model, reward, words in (("video", img, "reward=frames"), ("image", vid, "makes images")):
        with pytest.raises(StepflowError) as info:
            check_modality(model, reward, "model=x")
        assert "\n" not in str(info.value) and words in str(info.value) and "model=x" in str(info.value)
    with pytest.raises(ValueError, match="reward=frames reward.image"):  # a video handed to an image reward
        img(_video(), ["a", "b"])
    with pytest.raises(StepflowError, match=r"reward.indices: frame 12 is outside a video of 9 frames"):
        FrameReward(img, frames="indices", indices=[12])(_video(), ["a", "b"])
    with pytest.raises(StepflowError, match="reward.frames: must be one of"):
        FrameReward(img, frames="middle")
    with pytest.raises(StepflowError, match="already scores videos"):
        FrameReward(vid)


def test_video_reward_served_over_http_equals_the_local_one():
    """serve_reward with a video reward (reward=frames) + RemoteReward(video=True): each video travels as a list of
    PNG frames and scores as the local reward on the uint8-rounded frames."""
    import threading

    from stepflow.rewards.frames import FrameReward
    from stepflow.rewards.remote import RemoteReward
    from stepflow.serve_reward import make_server

    local = FrameReward(_Brightness.build())
    server = make_server(local, "127.0.0.1", 0)
    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        remote = RemoteReward(url=f"http://127.0.0.1:{server.server_address[1]}", video=True, request_batch_size=1)
        assert remote.modality == "video"
        v = _video(3)
        got = remote(v, ["a", "b", "c"])
        want = local((v * 255).round() / 255, ["a", "b", "c"])
        assert torch.allclose(got.scores, want.scores, atol=1e-6) and set(got.components) == {"double"}
        image_remote = RemoteReward(url=remote.url)  # an image client sends frames the video reward cannot take
        with pytest.raises(Exception, match="422|cannot score"):
            image_remote(v[:, :, 0], ["a", "b", "c"])
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------------- grids, errors
def test_eval_grid_of_videos_is_frame_strips_and_gifs(tmp_path):
    from PIL import Image

    from stepflow.core.heldout import frame_strips, save_gif, save_grid

    v = _video(2, 9)
    strips = frame_strips(v, max_frames=5)
    assert strips.shape == (2, 3, 8, 5 * 8 + 4) and torch.equal(strips[:, :, :, :8], v[:, :, 0])
    assert torch.equal(strips[:, :, :, -8:], v[:, :, -1])
    assert save_grid(v, ["a", "b"], tmp_path / "g.png").is_file()
    with Image.open(save_gif(v[0], tmp_path / "v.gif")) as im:
        assert im.n_frames == 9


def test_frame_count_and_size_refusals_are_one_line():
    for bad, words in ((10, "use 9 or 13"), (0, ">= 1")):
        with pytest.raises(StepflowError) as info:
            _load("2.1", num_frames=bad)
        assert "model.num_frames" in str(info.value) and words in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(StepflowError, match="model.height: must be a positive multiple of 16"):
        _load("2.1", height=40)
    with pytest.raises(StepflowError, match="model.guidance_2: only Wan 2.2"):
        _load("2.1", guidance_2=3.0)


def test_cli_refuses_an_image_reward_on_a_video_model(compose):
    from stepflow.train import build_module

    cfg = compose("train", ["model=wan21_t2v_tiny", "reward=pickscore_tiny"])
    with pytest.raises(StepflowError, match="makes videos .* reward=frames reward.image="):
        build_module(cfg, __import__("pathlib").Path("/tmp/unused"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wan21_t2v_random", "wan22_t2v_random"])
def test_random_configs_build_tiny_and_at_the_published_size(name):
    """model=wan*_random: tiny on the CPU (the contract's twin), and at full size on the meta device with exactly the
    parameters wan_param_counts counts for the memory table (Wan 2.2: two 14 B experts)."""
    from stepflow.testing.tiny_wan import wan_param_counts

    model = name.removesuffix("_random")
    tiny, big = random_config_policies(name)
    assert isinstance(tiny, WanPolicy) and tiny.has_lora and tiny.latent_shape == (16, 3, 4, 4)
    assert (tiny.experts is not None) == (model == "wan22_t2v")
    n = base_parameters(big.transformer)
    counts = wan_param_counts(model)
    assert n == counts["transformer"] and big.latent_shape == (16, 9, 60, 104)
    assert sum(p.numel() for p in big.lora_parameters()) == counts["lora"]  # rank 32 (the lora group's default)
