#!/usr/bin/env python
"""GPU check: GRPO iterations of every model stepflow supports at full size (random weights), timed per phase, with
peak memory per phase, for LoRA and full fine-tuning.

What runs (no downloads, no text encoders; the modules are built by :mod:`stepflow.testing.random_policies`):

- ``--model sd35_medium`` (2.47 B MMDiT-X), ``sd35_large`` (8.15 B MMDiT), ``flux_dev`` (11.9 B, 19 double + 38 single
  blocks, guidance embedding) or ``qwen_image`` (20.4 B, 60 blocks): the published transformer config in bf16 with
  random weights, built on the device, and the model's VAE architecture in fp32 (SD3 / FLUX ``AutoencoderKL``,
  ``AutoencoderKLQwenImage``), gradient checkpointing on;
- ``--finetune lora`` (r=32 / alpha=64 on the family's Flow-GRPO targets, the adapter's B made non-zero as after
  some training) or ``full`` (every transformer weight; the reference policy a frozen copy, made when β > 0);
  AdamW, and the EMA of the trained weights (as ``python -m stepflow.train``; ``--no-ema`` drops it);
- text encoders replaced by fixed random embeddings of the real shapes, one per prompt: SD3.5 (B, 77 + 256, 4096) +
  pooled (B, 2048); FLUX T5 (B, 512, 4096) + CLIP pooled (B, 768); Qwen-Image Qwen2.5-VL states (B, L, 3584) with a
  mask (so the text encoders' memory, T5-XXL 9.5 GB / Qwen2.5-VL 16 GB in bf16, is not counted);
- the training loop's own iteration, :func:`stepflow.core.algorithm.iteration` (rollout, batched x̂0 estimates, scoring,
  advantages, the clipped-GRPO + KL update; timed per phase by ``stepflow.core.algorithm.Phases``, which also records
  each phase's peak memory) over stepflow's own policies (``SD3Policy``, ``FluxPolicy``, ``QwenImagePolicy``);
- a cheap stand-in reward on the decoded images (brightness/colourfulness), so the reward phase measures decoding.

For each ``--advantages`` scheme (default ``uniform,gain``): rollout (T steps, batch B, SDE) -> x̂0 estimates (gain
only: T' Euler substeps for all B·T states) -> decode + reward (uniform: B final images; gain: B·(T+1)) ->
advantages -> one policy update over the trainable steps. ``--iters`` iterations per scheme (the first warms up).

``--all`` runs every model × {lora, full} in one process, cheapest first, freeing the GPU between runs; a run whose
weights, gradients, AdamW moments, EMA and reference copy would not fit in the free memory (estimated from exact
parameter counts) is skipped with one line, an out-of-memory run is reported and the next one starts.
``--runs sd35_medium:lora,flux_dev:lora`` picks runs. Results are written to ``--json`` (default
``$OUT/gpu_check.json`` when ``$OUT`` is set) after every run, so a run cut short by a timeout keeps what finished.

Usage::

    python experiments/gpu_check.py                            # CUDA: SD3.5-M LoRA, 10 steps, batch 8, 512 px, bf16
    python experiments/gpu_check.py --model flux_dev --finetune full
    python experiments/gpu_check.py --all --steps 6 --iters 1  # every model x {lora, full}
    python experiments/gpu_check.py --tiny --all               # CPU smoke test: tiny configs, 2 steps, 64 px
    python experiments/gpu_check.py --memory-table             # per-GPU memory estimate for 8 x 80 GB (markdown)
    bash experiments/gpu_check.sh                              # the prepared GPU run (this + the strategies matrix)

Needs torch, peft, diffusers and omegaconf (no hydra, lightning or transformers models).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stepflow.testing.random_policies import (  # noqa: E402, F401  (re-exported: the configs this check builds)
    MODELS,
    SD3_VAE,
    SD35_MEDIUM_TRANSFORMER,
    SD35_TEXT,
    StandInReward,
)

PROMPTS = ["a photo of a red apple and a blue cup", "three green circles", "a cat on the left of a dog",
           "a yellow bus", "a purple umbrella above a bench", "two black squares", "a pink bird", "an orange clock"]

#: ``--all``: every model x {lora, full}, cheapest and most informative first (the full fine-tuning of the largest
#: models last: on one 141 GB GPU FLUX.1-dev and Qwen-Image do not fit and are skipped)
ALL_RUNS = [("sd35_medium", "lora"), ("sd35_medium", "full"), ("sd35_large", "lora"), ("flux_dev", "lora"),
            ("qwen_image", "lora"), ("sd35_large", "full"), ("flux_dev", "full"), ("qwen_image", "full")]
PHASES = ("rollout", "estimate", "reward", "advantage", "update")


def _require_diffusers():
    try:
        import diffusers  # noqa: F401
        import peft  # noqa: F401
    except ImportError as err:
        sys.exit(f"gpu_check: {err}; run experiments/gpu_check.sh, which supplies diffusers from carried wheels "
                 f"or a copied package folder")


def build_policy(tiny: bool, device: torch.device, dtype: torch.dtype, size: int, lora_rank: int,
                 gradient_checkpointing: bool, decode_batch_size: int, model: str = "sd35_medium",
                 finetune: str = "lora"):
    """A stepflow policy over random modules of ``model`` (full size, or tiny), whose ``encode`` returns fixed random
    embeddings of the real shapes (:func:`stepflow.testing.random_policies.random_policy`). LoRA: the family's targets,
    the adapter's B drawn N(0, 1e-3) (a non-zero adapter, as after some training; gaussian init has B = 0)."""
    from stepflow.testing.random_policies import lora_targets, random_policy

    lora = None
    if finetune == "lora":
        lora = {"rank": lora_rank, "alpha": 2.0 * lora_rank, "init": "gaussian", "targets": lora_targets(model)}
    policy = random_policy(model, tiny=tiny, device=device, dtype=dtype, height=size, width=size, finetune=finetune,
                           lora=lora, gradient_checkpointing=gradient_checkpointing, decode_batch_size=decode_batch_size,
                           save_weights=False)
    if finetune == "lora":
        with torch.no_grad():
            for name, p in policy.transformer.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 1e-3)
    return policy


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# one iteration: the training loop's own function (stepflow.core.algorithm.iteration), timed per phase
# ----------------------------------------------------------------------------------------------------------------
def make_learner(policy, reward, scheme, args, optimizer, on_optimizer_step=None, lr: float = 3e-4):
    """A :class:`stepflow.core.algorithm.Learner` of the check's settings (Flow-GRPO's update: clip 1e-4, 9 of 10 steps)."""
    from stepflow.config import LoopConfig, TrainConfig
    from stepflow.core.algorithm import Learner
    from stepflow.core.data import PromptPlanner
    from stepflow.math.advantage import AdvantageConfig, AdvantageEstimator
    from stepflow.math.sde import SamplerConfig

    groups = max(1, args.batch // args.group_size)
    loop = LoopConfig(iterations=args.iters, prompts_per_iter=groups, group_size=args.group_size, num_steps=args.steps,
                      substeps=args.substeps, estimate_chunk=args.estimate_chunk, decode_chunk=args.decode_chunk)
    train = TrainConfig(lr=lr, beta_kl=args.beta_kl, micro_batch_size=args.micro_batch,
                        timestep_fraction=args.timestep_fraction)
    plan = PromptPlanner([{"prompt": p} for p in PROMPTS], groups, args.group_size, seed=0)
    return Learner(policy, reward, SamplerConfig(name=args.sampler), AdvantageEstimator(AdvantageConfig(scheme=scheme)),
                   plan, loop, train, optimizer, guidance=args.guidance, on_optimizer_step=on_optimizer_step)


def run_scheme(learner, it):
    from stepflow.core.algorithm import iteration, iteration_metrics

    res = iteration(learner, it)
    m = iteration_metrics(res, world=1)
    rec: dict = {"scheme": learner.advantage.cfg.scheme, "iteration": it}
    for p in PHASES:
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


def _header() -> str:
    return (f"{'scheme':8s} {'it':>2s} " + " ".join(f"{p[:8] + '_s':>10s}" for p in (*PHASES, "iteration"))
            + "  |" + " ".join(f"{p[:8] + '_GiB':>12s}" for p in PHASES) + "  finite")


def _row(rec: dict) -> str:
    gib = " ".join(f"{rec[p + '_peak_gib']:12.2f}" if p + "_peak_gib" in rec else f"{'-':>12s}" for p in PHASES)
    return (f"{rec['scheme']:8s} {rec['iteration']:2d} "
            + " ".join(f"{rec[p + '_s']:10.3f}" for p in (*PHASES, "iteration")) + "  |" + gib + f"  {rec['finite']}")


def _free_cuda(device) -> float | None:
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.mem_get_info(device)[0] / 2**30


def run_one(model: str, finetune: str, args, device: torch.device, dtype: torch.dtype, dtype_name: str) -> dict:
    """Build ``model`` for ``finetune``, run ``--iters`` iterations of each scheme; a record with ``status`` ok /
    skipped / oom / error and the per-iteration results. Frees everything it built before returning."""
    from stepflow.core.ema import ParamEMA
    from stepflow.testing.random_policies import fits, param_counts

    run: dict = {"model": model, "finetune": finetune, "status": "ok", "results": []}
    free = _free_cuda(device)
    lr = args.lr if args.lr is not None else (3e-4 if finetune == "lora" else 1e-5)
    if device.type == "cuda" and not args.tiny and not args.no_fit_check:
        counts = param_counts(model, args.lora_rank)
        ok, need = fits(counts, finetune, free, ema=not args.no_ema, reference=args.beta_kl > 0)
        run["estimate_gib"] = need
        if not ok:
            run["status"] = "skipped"
            run["reason"] = (f"needs ~{need:.0f} GiB for weights, gradients, AdamW moments"
                             f"{', EMA' if not args.no_ema else ''}{', reference copy' if finetune == 'full' and args.beta_kl > 0 else ''}"
                             f" (estimate, before activations), {free:.0f} GiB free")
            print(f"== skip {model} {finetune}: {run['reason']}", flush=True)
            return run
    t0 = time.perf_counter()
    policy = opt = ema = learner = None
    try:
        policy = build_policy(args.tiny, device, dtype, args.size, args.lora_rank, not args.no_grad_ckpt,
                              args.decode_chunk, model=model, finetune=finetune)
        if args.beta_kl > 0:
            policy.prepare_reference()  # full fine-tuning: the frozen copy of π_ref, as GRPOModule makes it
        params = list(policy.trainable_parameters())
        ema = None if args.no_ema else ParamEMA(params, 0.9)
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
        _sync(device)
        n_tr = sum(p.numel() for p in policy.transformer.parameters())
        n_train = sum(p.numel() for p in params)
        build_s = time.perf_counter() - t0
        model_gib = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
        run.update(transformer_params=n_tr, trained_params=n_train, build_s=build_s, model_gib=model_gib,
                   vae_params=sum(p.numel() for p in policy.vae.parameters()), latent_shape=list(policy.latent_shape),
                   policy=type(policy).__name__, transformer_class=type(policy.transformer).__name__, lr=lr)
        size = f"{n_tr / 1e9:.3f} B" if n_tr >= 1e8 else f"{n_tr / 1e6:.3f} M"
        print(f"== {model} {finetune}: {type(policy.transformer).__name__} {size} params ({dtype_name}), "
              f"trained {n_train / 1e6:.2f} M ({finetune}, lr {lr:g}{', EMA' if ema else ''}), VAE "
              f"{run['vae_params'] / 1e6:.1f} M (fp32), latent {policy.latent_shape}, built in {build_s:.1f} s"
              + (f", {model_gib:.1f} GiB allocated before the first iteration" if model_gib is not None else ""),
              flush=True)
        reward = StandInReward()
        print(_header(), flush=True)
        for scheme in [s.strip() for s in args.advantages.split(",") if s.strip()]:
            learner = make_learner(policy, reward, scheme, args, opt, ema.step if ema is not None else None, lr=lr)
            for it in range(args.iters):
                rec = run_scheme(learner, it)
                rec.update(model=model, finetune=finetune)
                run["results"].append(rec)
                print(_row(rec), flush=True)
    except torch.cuda.OutOfMemoryError as e:
        run["status"] = "oom"
        run["reason"] = str(e).strip().splitlines()[0][:300]
        print(f"== {model} {finetune}: out of memory ({run['reason'][:160]})", flush=True)
    except Exception as e:  # noqa: BLE001 - one run's failure is reported, the next run starts
        run["status"] = "error"
        run["reason"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        print(f"== {model} {finetune}: error: {run['reason']}", flush=True)
        if args.raise_errors:
            raise
    finally:
        del policy, opt, ema, learner
        _free_cuda(device)
    if run["status"] == "ok":
        res = run["results"]
        run["finite"] = all(r["finite"] for r in res)
        peaks = [(r.get(f"{p}_peak_gib", 0.0), p) for r in res for p in PHASES]
        if device.type == "cuda" and peaks:
            run["peak_gib"], run["peak_phase"] = max(peaks)
        for scheme in dict.fromkeys(r["scheme"] for r in res):
            run[f"{scheme}_s"] = [r for r in res if r["scheme"] == scheme][-1]["iteration_s"]
        if not run["finite"]:
            run["status"] = "nonfinite"
    return run


def summary_table(runs: list[dict], schemes: list[str]) -> str:
    cols = [f"{s}_s/it" for s in schemes]
    lines = [f"{'model':12s} {'finetune':8s} {'status':9s} " + " ".join(f"{c:>11s}" for c in cols)
             + f" {'peak_GiB':>9s} {'at':9s} {'est_GiB':>8s} {'build_s':>8s}  note"]
    for r in runs:
        t = " ".join(f"{r[s + '_s']:11.2f}" if s + "_s" in r else f"{'-':>11s}" for s in schemes)
        peak = f"{r['peak_gib']:9.1f}" if "peak_gib" in r else f"{'-':>9s}"
        est = f"{r['estimate_gib']:8.0f}" if "estimate_gib" in r else f"{'-':>8s}"
        build = f"{r['build_s']:8.1f}" if "build_s" in r else f"{'-':>8s}"
        lines.append(f"{r['model']:12s} {r['finetune']:8s} {r['status']:9s} {t} {peak} {r.get('peak_phase', ''):9s} "
                     f"{est} {build}  {r.get('reason', '')[:90]}")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sd35_medium", choices=MODELS)
    ap.add_argument("--finetune", default="lora", choices=("lora", "full"))
    ap.add_argument("--all", action="store_true", help="every model x {lora, full} in one process (see ALL_RUNS)")
    ap.add_argument("--runs", default=None, help="comma-separated model:finetune pairs (overrides --model/--all)")
    ap.add_argument("--tiny", action="store_true", help="tiny configs, 2 steps, 64 px (CPU smoke test)")
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
    ap.add_argument("--lr", type=float, default=None, help="AdamW lr (default 3e-4 LoRA, 1e-5 full)")
    ap.add_argument("--beta-kl", type=float, default=0.04, help="KL weight (0 skips the reference forward and copy)")
    ap.add_argument("--timestep-fraction", type=float, default=0.99, help="train the first int(T·f) steps")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--estimate-chunk", type=int, default=40, help="states per x0-estimate forward")
    ap.add_argument("--decode-chunk", type=int, default=8, help="latents per VAE decode")
    ap.add_argument("--no-grad-ckpt", action="store_true", help="disable gradient checkpointing")
    ap.add_argument("--no-ema", action="store_true", help="no EMA of the trained weights (the CLI keeps one)")
    ap.add_argument("--no-fit-check", action="store_true", help="try every run, even those estimated not to fit")
    ap.add_argument("--time-limit", type=float, default=None, help="start no new run after this many seconds")
    ap.add_argument("--raise-errors", action="store_true", help="re-raise a run's error (debugging)")
    ap.add_argument("--memory-table", action="store_true", help="print the per-GPU memory estimate and exit")
    ap.add_argument("--world", type=int, default=8, help="GPUs of the --memory-table estimate")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="GPU memory of the --memory-table estimate")
    ap.add_argument("--json", default=None, help="write results here (default $OUT/gpu_check.json when $OUT is set)")
    return ap.parse_args(argv)


def _runs(args) -> list[tuple[str, str]]:
    if args.runs:
        out = []
        for item in args.runs.split(","):
            model, _, ft = item.strip().partition(":")
            if model not in MODELS or (ft or "lora") not in ("lora", "full"):
                raise SystemExit(f"gpu_check: --runs: {item!r} is not model:finetune with a model of {', '.join(MODELS)}")
            out.append((model, ft or "lora"))
        return out
    return list(ALL_RUNS) if args.all else [(args.model, args.finetune)]


def main(argv=None) -> int:
    args = parse_args(argv)
    _require_diffusers()
    import diffusers
    import peft

    diffusers.utils.logging.set_verbosity_error()
    if args.memory_table:
        from stepflow.testing.random_policies import memory_table

        print(memory_table(world=args.world, gpu_gib=args.gpu_gib, lora_rank=args.lora_rank))
        return 0
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
    env = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "peft": peft.__version__, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "gpu_total_gib": torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None}
    print("gpu_check:", json.dumps(env))
    print(f"run: T={args.steps} B={args.batch} ({args.batch // args.group_size} prompts x {args.group_size}) "
          f"{args.size}px sampler={args.sampler} cfg={args.guidance} T'={args.substeps} beta_kl={args.beta_kl} "
          f"micro_batch={args.micro_batch} iters/scheme={args.iters} ema={not args.no_ema}", flush=True)
    out = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    schemes = [s.strip() for s in args.advantages.split(",") if s.strip()]
    summary: dict = {"env": env, "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}, "runs": [],
                     "results": []}
    t_start = time.perf_counter()
    for model, finetune in _runs(args):
        if args.time_limit is not None and time.perf_counter() - t_start > args.time_limit:
            run = {"model": model, "finetune": finetune, "status": "skipped",
                   "reason": f"time limit ({args.time_limit:.0f} s) reached"}
            print(f"== skip {model} {finetune}: {run['reason']}", flush=True)
        else:
            run = run_one(model, finetune, args, device, dtype, dtype_name)
        summary["runs"].append(run)
        summary["results"].extend(run.get("results", []))
        if len(summary["runs"]) == 1 and run.get("transformer_params") is not None:  # the single-run layout, kept
            summary["model"] = {"transformer_params": run["transformer_params"], "lora_params": run["trained_params"],
                                "build_s": run["build_s"], "model_gib": run["model_gib"]}
        peaks = [r["peak_gib"] for r in summary["runs"] if "peak_gib" in r]
        if peaks:
            summary["peak_gib_overall"] = max(peaks)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(summary, indent=2))
    print("\nsummary (s/it: the last iteration of each scheme; peak: the highest phase peak, at that phase):")
    print(summary_table(summary["runs"], schemes))
    if out:
        print("wrote", out)
    bad = [r for r in summary["runs"] if r["status"] not in ("ok", "skipped")]
    if bad:
        print("gpu_check: " + ", ".join(f"{r['model']} {r['finetune']}: {r['status']}" for r in bad), file=sys.stderr)
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
