#!/usr/bin/env python
"""GPU check: one GRPO iteration of SD3.5-Medium size, timed per phase, with peak memory.

What runs (random weights; no downloads, no text encoders):

- the full SD3.5-Medium MMDiT (``SD3Transformer2DModel`` with the published config: 24 layers, 24 heads of 64,
  dual attention in layers 0-12, RMS qk-norm; ~2.5 B parameters) in bf16, LoRA r=32 / alpha=64 on the attention
  projections, gradient checkpointing;
- the SD3 VAE architecture (16 latent channels, 8x, scaling 1.5305 / shift 0.0609) in fp32;
- text encoders replaced by fixed random embeddings of the real shapes: tokens (B, 77 + 256 = 333, 4096) and
  pooled (B, 2048), one per prompt (so the T5-XXL's ~9.5 GB is not counted);
- the training loop's own iteration, :func:`stepflow.algorithm.iteration` (rollout, batched x̂0 estimates, scoring,
  advantages, the clipped-GRPO + KL update; timed per phase by ``stepflow.algorithm.Phases``) over
  :class:`stepflow.policies.sd3.SD3Policy` (velocity + CFG, decode, LoRA);
- a cheap stand-in reward on the decoded images (brightness/colourfulness), so the reward phase measures decoding.

For each ``--advantages`` scheme (default ``uniform,gain``): rollout (T steps, batch B, SDE) -> x̂0 estimates (gain
only: T' Euler substeps for all B·T states) -> decode + reward (uniform: B final images; gain: B·(T+1)) ->
advantages -> one policy update over the trainable steps. ``--iters`` iterations per scheme (the first warms up).
Prints seconds per phase and peak memory; writes JSON to ``--json`` (default ``$OUT/gpu_check.json`` if ``$OUT``).

Usage::

    python experiments/gpu_check.py                 # CUDA: 10 steps, batch 8, 512 px, bf16, flow_sde
    python experiments/gpu_check.py --tiny          # CPU smoke test: tiny config, 2 steps, 64 px
    bash experiments/gpu_check.sh [args]            # the same with diffusers supplied if the image lacks it

Needs torch, peft, diffusers and omegaconf (no hydra, lightning or transformers models).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stepflow.rewards.base import Reward, RewardOut  # noqa: E402

# SD3.5-Medium, transformer/config.json (stabilityai/stable-diffusion-3.5-medium)
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
# SD3 / SD3.5 vae/config.json
SD3_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305,
    shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
)
SD35_TEXT = dict(text_len=77 + 256, text_dim=4096, pooled_dim=2048)

# --tiny: same family, tiny (as stepflow/policies/tiny.py)
TINY_TRANSFORMER = dict(
    sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
    num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
    pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm",
)
TINY_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64,
    scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)
TINY_TEXT = dict(text_len=77 + 16, text_dim=32, pooled_dim=32)

PROMPTS = ["a photo of a red apple and a blue cup", "three green circles", "a cat on the left of a dog",
           "a yellow bus", "a purple umbrella above a bench", "two black squares", "a pink bird", "an orange clock"]


# ----------------------------------------------------------------------------------------------------------------
# model: SD3Policy over random weights, text encoders replaced by fixed random embeddings
# ----------------------------------------------------------------------------------------------------------------
def _require_diffusers():
    try:
        import diffusers  # noqa: F401
        import peft  # noqa: F401
    except ImportError as err:
        sys.exit(f"gpu_check: {err}; run experiments/gpu_check.sh, which supplies diffusers from carried wheels "
                 f"or a copied package folder")


def build_policy(tiny: bool, device: torch.device, dtype: torch.dtype, size: int, lora_rank: int,
                 gradient_checkpointing: bool, decode_batch_size: int):
    """An :class:`SD3Policy` whose transformer/VAE are random SD3.5-M (or tiny) modules and whose ``encode`` returns
    fixed random embeddings of the real shapes."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from stepflow.policies.sd3 import SD3Policy

    tcfg, vcfg, text = (TINY_TRANSFORMER, TINY_VAE, TINY_TEXT) if tiny else (SD35_MEDIUM_TRANSFORMER, SD3_VAE, SD35_TEXT)

    class RandomTextSD3Policy(SD3Policy):
        text_len, text_dim, pooled_dim = text["text_len"], text["text_dim"], text["pooled_dim"]

        def _encode_new(self, prompts):  # stands in for CLIP-L + CLIP-G + T5-XXL
            for p in prompts:
                g = torch.Generator().manual_seed(zlib.crc32(p.encode()))
                tok = torch.randn(self.text_len, self.text_dim, generator=g)
                pooled = torch.randn(self.pooled_dim, generator=g)
                self._prompt_cache[p] = (tok.to(self.device, self.dtype), pooled.to(self.device, self.dtype))
            self.encoder_calls += 1

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device (fast, no 10 GB fp32 copy on the host)
        transformer = SD3Transformer2DModel(**tcfg)
        vae = AutoencoderKL(**vcfg)
    transformer.to(dtype)
    vae.to(torch.float32)
    pipe = SimpleNamespace(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                           text_encoder=None, text_encoder_2=None, text_encoder_3=None,
                           name_or_path="random-sd35-medium" if not tiny else "random-sd3-tiny")
    policy = RandomTextSD3Policy(pipe, height=size, width=size, max_sequence_length=text["text_len"] - 77,
                                 gradient_checkpointing=gradient_checkpointing, decode_batch_size=decode_batch_size,
                                 lora={"rank": lora_rank, "alpha": 2.0 * lora_rank, "init": "gaussian"})
    with torch.no_grad():  # a non-zero adapter, as after some training (gaussian init has B = 0)
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)
    return policy


class StandInReward(Reward):
    """Cheap image reward on decoded images (B, 3, H, W) in [0, 1]: colourfulness − |brightness − 0.5|."""

    name = "stand_in"
    batch_size = 256

    def score(self, images, prompts, meta):
        bright = images.mean(dim=(1, 2, 3))
        colour = images.std(dim=1).mean(dim=(1, 2))
        return RewardOut(colour - (bright - 0.5).abs(), {"brightness": bright})


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# one iteration: the training loop's own function (stepflow.algorithm.iteration), timed per phase
# ----------------------------------------------------------------------------------------------------------------
def make_learner(policy, reward, scheme, args, optimizer):
    """A :class:`stepflow.algorithm.Learner` of the check's settings (Flow-GRPO's update: clip 1e-4, 9 of 10 steps)."""
    from stepflow.advantage import AdvantageConfig, AdvantageEstimator
    from stepflow.algorithm import Learner
    from stepflow.config import LoopConfig, TrainConfig
    from stepflow.data import GroupSampler
    from stepflow.sde import SamplerConfig

    groups = max(1, args.batch // args.group_size)
    loop = LoopConfig(iterations=args.iters, prompts_per_iter=groups, group_size=args.group_size, num_steps=args.steps,
                      substeps=args.substeps, estimate_chunk=args.estimate_chunk, decode_chunk=args.decode_chunk)
    train = TrainConfig(lr=3e-4, beta_kl=args.beta_kl, micro_batch_size=args.micro_batch,
                        timestep_fraction=args.timestep_fraction)
    plan = GroupSampler([{"prompt": p} for p in PROMPTS], groups, args.group_size, seed=0)
    return Learner(policy, reward, SamplerConfig(name=args.sampler), AdvantageEstimator(AdvantageConfig(scheme=scheme)),
                   plan, loop, train, optimizer, guidance=args.guidance)


def run_scheme(learner, it):
    from stepflow.algorithm import iteration, iteration_metrics

    res = iteration(learner, it)
    m = iteration_metrics(res, world=1)
    rec: dict = {"scheme": learner.advantage.cfg.scheme, "iteration": it}
    for p in ("rollout", "estimate", "reward", "advantage", "update"):
        rec[f"{p}_s"] = m[f"time/{p}_s"]
        if p in res.phases.peak_gib:
            rec[f"{p}_peak_gib"] = res.phases.peak_gib[p]
    rec["iteration_s"] = m["time/iteration_s"]
    rec.update(nfe=m["cost/nfe"], nfe_rollout=m["cost/nfe_rollout"], nfe_estimate=m["cost/nfe_estimate"],
               images_scored=m["cost/reward_images"], reward_final_mean=m["train/reward_final"],
               **{k.removeprefix("train/"): v for k, v in m.items() if k in (
                   "train/kl", "train/clip_frac", "train/grad_norm", "train/steps_trained", "train/samples_trained")})
    rec["finite"] = all(math.isfinite(float(v)) for v in m.values()) and bool(torch.isfinite(res.rewards[:, -1]).all())
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny config, 2 steps, 64 px (CPU smoke test)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", default=None, help="transformer dtype (default bfloat16; float32 with --tiny)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps T (default 10; 2 with --tiny)")
    ap.add_argument("--batch", type=int, default=8, help="trajectories per iteration")
    ap.add_argument("--group-size", type=int, default=4, help="trajectories per prompt")
    ap.add_argument("--size", type=int, default=None, help="image size in px (default 512; 64 with --tiny)")
    ap.add_argument("--substeps", type=int, default=5, help="T', Euler substeps of the x0 estimate")
    ap.add_argument("--guidance", type=float, default=1.0, help="CFG scale (1 = off; the paper's GenEval runs: 4.5)")
    ap.add_argument("--sampler", default="flow_sde", help="flow_sde | ddim_sde | cps")
    ap.add_argument("--advantages", default="uniform,gain", help="comma-separated credit schemes")
    ap.add_argument("--iters", type=int, default=2, help="iterations per scheme (the first includes warm-up)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--beta-kl", type=float, default=0.04, help="KL weight (0 skips the reference forward)")
    ap.add_argument("--timestep-fraction", type=float, default=0.99, help="train the first int(T·f) steps")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--estimate-chunk", type=int, default=40, help="states per x0-estimate forward")
    ap.add_argument("--decode-chunk", type=int, default=8, help="latents per VAE decode")
    ap.add_argument("--no-grad-ckpt", action="store_true", help="disable gradient checkpointing")
    ap.add_argument("--json", default=None, help="write results here (default $OUT/gpu_check.json when $OUT is set)")
    args = ap.parse_args(argv)

    _require_diffusers()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tiny:
        args.steps = args.steps or 2
        args.size = args.size or 64
        dtype_name = args.dtype or "float32"
    else:
        args.steps = args.steps or 10
        args.size = args.size or 512
        dtype_name = args.dtype or "bfloat16"
    dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}[dtype_name]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    import diffusers
    import peft

    diffusers.utils.logging.set_verbosity_error()
    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "peft": peft.__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print("gpu_check:", json.dumps(env))
    t0 = time.perf_counter()
    policy = build_policy(args.tiny, device, dtype, args.size, args.lora_rank, not args.no_grad_ckpt,
                          args.decode_chunk)
    _sync(device)
    n_tr = sum(p.numel() for p in policy.transformer.parameters())
    n_lora = sum(p.numel() for p in policy.lora_parameters())
    build_s = time.perf_counter() - t0
    model_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(f"model: transformer {n_tr / 1e6:.3f} M params ({dtype_name}), LoRA {n_lora / 1e6:.2f} M trainable, "
          f"VAE {sum(p.numel() for p in policy.vae.parameters()) / 1e6:.1f} M (fp32), latent {policy.latent_shape}, "
          f"built in {build_s:.1f} s" + (f", {model_gib:.1f} GiB allocated" if model_gib is not None else ""))
    print(f"run: T={args.steps} B={args.batch} ({args.batch // args.group_size} prompts x {args.group_size}) "
          f"{args.size}px sampler={args.sampler} cfg={args.guidance} T'={args.substeps} beta_kl={args.beta_kl}")
    opt = torch.optim.AdamW(list(policy.lora_parameters()), lr=3e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
    reward = StandInReward()
    results = []
    cols = ["rollout", "estimate", "reward", "advantage", "update", "iteration"]
    print(f"{'scheme':8s} {'it':>2s} " + " ".join(f"{c + '_s':>11s}" for c in cols) + "  peak_GiB  finite")
    for scheme in [s.strip() for s in args.advantages.split(",") if s.strip()]:
        learner = make_learner(policy, reward, scheme, args, opt)
        for it in range(args.iters):
            rec = run_scheme(learner, it)
            results.append(rec)
            peak = max((v for k, v in rec.items() if k.endswith("_peak_gib")), default=float("nan"))
            print(f"{scheme:8s} {it:2d} " + " ".join(f"{rec[c + '_s']:11.3f}" for c in cols)
                  + f"  {peak:8.2f}  {rec['finite']}", flush=True)
    summary = {"env": env, "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
               "model": {"transformer_params": n_tr, "lora_params": n_lora, "build_s": build_s,
                         "model_gib": model_gib},
               "results": results}
    if device.type == "cuda":
        summary["peak_gib_overall"] = max(r.get(f"{c}_peak_gib", 0.0) for r in results for c in cols[:-1])
        print(f"peak memory over all phases: {summary['peak_gib_overall']:.2f} GiB")
    for scheme in {r["scheme"] for r in results}:
        last = [r for r in results if r["scheme"] == scheme][-1]
        print(f"{scheme}: {last['iteration_s']:.2f} s/iteration (last iteration; "
              + ", ".join(f"{c} {last[c + '_s']:.2f}" for c in cols[:-1]) + ")")
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=2))
        print("wrote", out)
    ok = all(r["finite"] for r in results)
    if not ok:
        print("gpu_check: non-finite values in some iteration", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
