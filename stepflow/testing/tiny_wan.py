"""Tiny and random-weight Wan 2.1 / 2.2 text-to-video pipelines: ``model=wan21_t2v_tiny`` / ``wan22_t2v_tiny`` (tests,
CPU smoke runs) and ``model=wan21_t2v_random`` / ``wan22_t2v_random`` (GPU memory checks at the published size).

Tiny (:func:`build_tiny_wan_pipeline`): a real ``WanPipeline`` with a 2-layer ``WanTransformer3DModel`` (2 heads of 12,
RMS qk-norm across heads, 16 latent channels), the causal 3-D ``AutoencoderKLWan`` (z_dim 16, 8x spatial, 4x temporal,
non-trivial per-channel ``latents_mean`` / ``latents_std``), a 1-layer UMT5 encoder (d_model 32) with the tiny T5
tokenizer, and the Hub's scheduler kind (``UniPCMultistepScheduler`` with flow sigmas and ``flow_shift``); Wan 2.2
(``variant="2.2"``) has a second transformer (``transformer_2``, other weights) and ``boundary_ratio=0.875``. Written
with ``save_pretrained`` once into ``$STEPFLOW_CACHE`` and loaded through ``WanPolicy.from_pretrained``.

Random (:func:`random_wan_policy`): the published transformer configs (Wan 2.1 T2V 1.3B; Wan 2.2 T2V A14B: two 14 B
experts) and the Wan VAE with random weights, the UMT5-XXL encoder replaced by fixed random (512, 4096) states per
prompt; :func:`wan_param_counts` counts them on the meta device for the memory table.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stepflow.testing.tiny_policies import keeps_rng, make_t5_tokenizer

__all__ = ["WAN_VARIANTS", "WAN_SPECS", "build_tiny_wan_pipeline", "save_tiny_wan", "tiny_wan_dir", "tiny_wan_policy",
           "random_wan_policy", "wan_param_counts", "wan_memory_table"]

TINY_WAN_VERSION = 1
WAN_VARIANTS = ("2.1", "2.2")
TINY_SIZE, TINY_FRAMES = 32, 9  # 32 x 32 px, 9 frames: latents (16, 3, 4, 4)

_TINY_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                         out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                         qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
_TINY_VAE = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                 latents_mean=[round(0.1 * i - 0.8, 4) for i in range(16)],
                 latents_std=[round(1.0 + 0.1 * i, 4) for i in range(16)])

#: Wan2.1-T2V-1.3B transformer/config.json (Wan-AI/Wan2.1-T2V-1.3B-Diffusers)
WAN21_1_3B_TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                              out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
#: Wan2.1-T2V-14B and each expert of Wan2.2-T2V-A14B (40 heads of 128, 40 layers, ffn 13824)
WAN_14B_TRANSFORMER = {**WAN21_1_3B_TRANSFORMER, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}
#: the Wan 2.1 VAE (also Wan 2.2 A14B's): the diffusers defaults of AutoencoderKLWan
WAN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])

#: model -> transformer config, experts (1 or 2), flow shift, boundary ratio, published size (B, per expert)
WAN_SPECS: dict[str, dict[str, Any]] = {
    "wan21_t2v": dict(transformer=WAN21_1_3B_TRANSFORMER, experts=1, shift=3.0, boundary_ratio=None, published_b=1.42),
    "wan22_t2v": dict(transformer=WAN_14B_TRANSFORMER, experts=2, shift=12.0, boundary_ratio=0.875, published_b=14.3),
}


def _unipc(flow_shift: float):
    """The scheduler kind the Hub's Wan pipelines ship (UniPC with flow sigmas); the policy takes its ``flow_shift``."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift,
                                   num_train_timesteps=1000)


@keeps_rng
def build_tiny_wan_pipeline(seed: int = 0, variant: str = "2.1", expand_timesteps: bool = False):
    """Random tiny ``WanPipeline`` (fp32, CPU), deterministic in ``seed`` (see the module docstring)."""
    if variant not in WAN_VARIANTS:
        raise ValueError(f"variant: must be one of {WAN_VARIANTS}, got {variant!r}")
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tok = make_t5_tokenizer(64)
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                               num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1)).eval()
    transformer = WanTransformer3DModel(**_TINY_TRANSFORMER)
    transformer_2 = WanTransformer3DModel(**_TINY_TRANSFORMER) if variant == "2.2" else None
    vae = AutoencoderKLWan(**_TINY_VAE)
    two = variant == "2.2"
    pipe = WanPipeline(tokenizer=tok, text_encoder=text_encoder, vae=vae, scheduler=_unipc(12.0 if two else 3.0),
                       transformer=transformer, transformer_2=transformer_2, boundary_ratio=0.875 if two else None,
                       expand_timesteps=expand_timesteps)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_wan(directory: str | os.PathLike, seed: int = 0, variant: str = "2.1") -> Path:
    """Build the tiny Wan pipeline and write it as a diffusers folder."""
    directory = Path(directory)
    build_tiny_wan_pipeline(seed, variant).save_pretrained(directory, safe_serialization=True)
    return directory


def tiny_wan_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None, variant: str = "2.1") -> Path:
    """The cached tiny Wan pipeline (``wan21_t2v_tiny-v1-s0`` / ``wan22_t2v_tiny-v1-s0``), built atomically once."""
    root = Path(cache_dir or os.environ.get("STEPFLOW_CACHE") or Path.home() / ".cache" / "stepflow").expanduser()
    kind = f"wan{variant.replace('.', '')}_t2v_tiny"
    target = root / f"{kind}-v{TINY_WAN_VERSION}-s{seed}"
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    try:
        save_tiny_wan(tmp, seed, variant)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_wan_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, variant: str = "2.1",
                    **kwargs):
    """``model=wan21_t2v_tiny`` / ``model=wan22_t2v_tiny``: build (once) the tiny pipeline and load it through
    ``WanPolicy.from_pretrained`` (keyword arguments go there; 32 px, 9 frames by default)."""
    from stepflow.policies.wan import WanPolicy

    kwargs.setdefault("height", TINY_SIZE)
    kwargs.setdefault("width", TINY_SIZE)
    kwargs.setdefault("num_frames", TINY_FRAMES)
    WanPolicy.check_args(kwargs)  # before the tiny pipeline is built into the cache
    return WanPolicy.from_pretrained(path or str(tiny_wan_dir(seed, cache_dir, variant)), **kwargs)


# ---------------------------------------------------------------------------------------------- random, full size
def _spec(model: str) -> dict[str, Any]:
    if model not in WAN_SPECS:
        raise ValueError(f"model: must be one of {', '.join(WAN_SPECS)}, got {model!r}")
    return WAN_SPECS[model]


def build_random_wan_pipeline(model: str = "wan21_t2v", tiny: bool = False, device: str | torch.device = "cpu",
                              dtype: torch.dtype = torch.bfloat16, vae_dtype: torch.dtype = torch.float32,
                              seed: int = 0):
    """A ``WanPipeline`` of random modules (no text encoder: the random policy stands in for it), built on ``device``
    directly in its dtype: the published transformer(s) and VAE, or (``tiny``) the tiny ones."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from stepflow.testing.random_policies import _default_dtype

    spec = _spec(model)
    tcfg, vcfg = (_TINY_TRANSFORMER, _TINY_VAE) if tiny else (spec["transformer"], WAN_VAE)
    torch.manual_seed(seed)
    with torch.device(device):
        with _default_dtype(dtype):
            experts = [WanTransformer3DModel(**tcfg) for _ in range(spec["experts"])]
        with _default_dtype(vae_dtype):
            vae = AutoencoderKLWan(**vcfg)
    for e in experts:
        torch.nn.Module.to(e, dtype)
    torch.nn.Module.to(vae, vae_dtype)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=_unipc(spec["shift"]),
                       transformer=experts[0], transformer_2=experts[1] if len(experts) > 1 else None,
                       boundary_ratio=spec["boundary_ratio"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _random_class():
    from stepflow.policies.wan import WanPolicy
    from stepflow.testing.random_policies import _RandomText

    class RandomTextWanPolicy(_RandomText, WanPolicy):
        """WanPolicy whose UMT5-XXL is fixed random (512, 4096) states per prompt."""

    return RandomTextWanPolicy


def random_wan_policy(model: str = "wan21_t2v", *, tiny: bool = False, device: str | None = "auto",
                      dtype: str | torch.dtype = "bfloat16", vae_dtype: str | torch.dtype = "float32", seed: int = 0,
                      height: int | None = None, width: int | None = None, num_frames: int | None = None,
                      max_sequence_length: int | None = None, finetune: str = "lora",
                      lora: Mapping[str, Any] | None = None, gradient_checkpointing: bool = True,
                      decode_batch_size: int = 1, guidance: float | None = None, eval_guidance: float | None = None,
                      save_weights: bool = True, name: str | None = None):
    """``model=wan21_t2v_random`` / ``wan22_t2v_random``: a :class:`~stepflow.policies.wan.WanPolicy` over random
    modules of the published size (``tiny``: the tiny ones), built on ``device`` (``auto``: CUDA when available).
    Defaults: 480 x 832, 33 frames (tiny: 32 x 32, 9 frames), 512 text tokens (tiny: 16)."""
    from stepflow.policies.pipeline import resolve_dtype
    from stepflow.policies.wan import WanPolicy, check_num_frames
    from stepflow.testing.random_policies import _device

    _spec(model)
    given = dict(max_sequence_length=max_sequence_length, decode_batch_size=decode_batch_size, guidance=guidance,
                 eval_guidance=eval_guidance, num_frames=num_frames)
    WanPolicy.check_args({k: v for k, v in given.items() if v is not None})
    num_frames = check_num_frames(num_frames or (TINY_FRAMES if tiny else 33), 4)
    pipe = build_random_wan_pipeline(model, tiny, _device(device), resolve_dtype(dtype, torch.bfloat16, "model.dtype"),
                                     resolve_dtype(vae_dtype, field="model.vae_dtype"), seed)
    seq = max_sequence_length or (16 if tiny else 512)
    kw: dict[str, Any] = dict(height=height or (TINY_SIZE if tiny else 480), width=width or (TINY_SIZE if tiny else 832),
                              num_frames=num_frames, max_sequence_length=seq,
                              gradient_checkpointing=gradient_checkpointing, decode_batch_size=decode_batch_size,
                              finetune=finetune, lora=lora, name=name or f"random-{model}{'-tiny' if tiny else ''}")
    if guidance is not None:
        kw["guidance"] = float(guidance)
    if eval_guidance is not None:
        kw["eval_guidance"] = float(eval_guidance)
    policy = _random_class()(pipe, **kw)
    policy.text_len, policy.text_dim, policy.pooled_dim = seq, 32 if tiny else 4096, 0
    policy.save_weights = bool(save_weights)
    return policy


def wan_param_counts(model: str, lora_rank: int = 32, tiny: bool = False) -> dict[str, int]:
    """Exact parameter counts on the meta device: the transformer(s) (Wan 2.2: both experts), their LoRA (rank
    ``lora_rank`` on :data:`~stepflow.policies.wan.LORA_TARGETS_WAN`) and the VAE (the keys of
    :func:`stepflow.testing.random_policies.memory_estimate`)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from peft import LoraConfig

    from stepflow.policies.wan import LORA_TARGETS_WAN
    from stepflow.testing.random_policies import _default_dtype

    spec = _spec(model)
    tcfg = _TINY_TRANSFORMER if tiny else spec["transformer"]
    with torch.device("meta"), _default_dtype(torch.bfloat16):
        tr = WanTransformer3DModel(**tcfg)
        vae = AutoencoderKLWan(**(_TINY_VAE if tiny else WAN_VAE))
        n_tr = sum(p.numel() for p in tr.parameters())
        tr.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=list(LORA_TARGETS_WAN)))
        n_lora = sum(p.numel() for n, p in tr.named_parameters() if "lora_" in n)
    k = spec["experts"]
    return {"transformer": k * n_tr, "buffers": 0, "lora": k * n_lora,
            "vae": sum(p.numel() for p in vae.parameters())}


def wan_memory_table(world: int = 8, gpu_gib: float = 80.0, lora_rank: int = 32) -> str:
    """The memory table's Wan rows (:func:`stepflow.testing.random_policies.memory_table` over
    :func:`wan_param_counts`): persistent per-GPU state, activations not included."""
    from stepflow.testing.random_policies import memory_table

    models = list(WAN_SPECS)
    return memory_table(world, gpu_gib, lora_rank, models=models,
                        counts={m: wan_param_counts(m, lora_rank) for m in models})
