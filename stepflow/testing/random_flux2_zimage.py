"""Random-weight builds of FLUX.2-dev and Z-Image(-Turbo) at their published size (or tiny), without downloads: the
``model=flux2_random`` / ``model=zimage_random`` configs and the memory estimate of docs/guide.md, "Video, editing and the newest image models".

As :mod:`stepflow.testing.random_policies` does for SD3.5 / FLUX.1 / Qwen-Image (and with its helpers): the real
transformer and VAE architectures with random weights, built on the target device directly in their dtype, the text
encoder replaced by fixed random embeddings of the real shapes (one per prompt, seeded by the prompt), wrapped in
stepflow's own :class:`~stepflow.policies.flux2.Flux2Policy` / :class:`~stepflow.policies.zimage.ZImagePolicy` over a
``SimpleNamespace`` "pipeline".

========  ===============================================================================  ====================
``model``  transformer (published config)                                                   text
========  ===============================================================================  ====================
``flux2``  ``Flux2Transformer2DModel``: 8 double + 48 single blocks, 48 heads of 128,         (512, 15360): Mistral
           joint_attention_dim 15360, guidance embedding (32.2 B); ``AutoencoderKLFlux2``     layers 10/20/30
``zimage`` ``ZImageTransformer2DModel``: 30 layers + 2 + 2 refiners, 30 heads of 128,         (L, 2560): Qwen3-4B,
           cap_feat_dim 2560 (6.15 B); FLUX.1's VAE (16 ch)                                    per-prompt length
========  ===============================================================================  ====================

``python -m stepflow.testing.random_flux2_zimage`` prints the per-GPU memory table (exact parameter counts on the
meta device) for LoRA and full fine-tuning under DDP / FSDP2 / DeepSpeed.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from stepflow.policies.base import check_image_size
from stepflow.testing.random_policies import FLUX_VAE, _default_dtype, _device, _RandomText, memory_table
from stepflow.testing.tiny_flux2_zimage import FLUX2_SCHEDULER, ZIMAGE_SCHEDULER

__all__ = ["MODELS", "SPECS", "TINY_SPECS", "build_modules", "lora_targets", "param_counts", "random_policy"]

MODELS = ("flux2", "zimage")

#: FLUX.2-dev transformer/config.json (black-forest-labs/FLUX.2-dev; the diffusers defaults of Flux2Transformer2DModel)
FLUX2_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128, num_attention_heads=48,
    joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000, guidance_embeds=True,
)
#: FLUX.2 vae/config.json (the diffusers defaults of AutoencoderKLFlux2: 32 latent channels, 2x2 patches, batch norm)
FLUX2_VAE: dict[str, Any] = dict(latent_channels=32, block_out_channels=(128, 256, 512, 512), layers_per_block=2)
FLUX2_TEXT = dict(text_len=512, text_dim=15360)

#: Z-Image(-Turbo) transformer/config.json (Tongyi-MAI/Z-Image-Turbo; the diffusers defaults of ZImageTransformer2DModel)
ZIMAGE_TRANSFORMER = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30,
    n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
    axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512],
)
ZIMAGE_TEXT = dict(text_len=512, text_dim=2560)

_TINY_FLUX2 = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
                   axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
_TINY_FLUX2_VAE = dict(latent_channels=4, block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4,
                       sample_size=64)
_TINY_ZIMAGE = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
                    n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[256, 32, 32])
_TINY_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64,
    scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)

#: what each model is built from (as random_policies.SPECS) and its published transformer size (billions)
SPECS: dict[str, dict[str, Any]] = {
    "flux2": dict(family="flux2", transformer=FLUX2_DEV_TRANSFORMER, vae=FLUX2_VAE, scheduler=FLUX2_SCHEDULER,
                  text=FLUX2_TEXT, published_b=32.2),
    "zimage": dict(family="zimage", transformer=ZIMAGE_TRANSFORMER, vae=FLUX_VAE, scheduler=ZIMAGE_SCHEDULER,
                   text=ZIMAGE_TEXT, published_b=6.15),
}
TINY_SPECS: dict[str, dict[str, Any]] = {
    "flux2": {**SPECS["flux2"], "transformer": _TINY_FLUX2, "vae": _TINY_FLUX2_VAE,
              "text": dict(text_len=64, text_dim=48)},
    "zimage": {**SPECS["zimage"], "transformer": _TINY_ZIMAGE, "vae": _TINY_VAE, "text": dict(text_len=64, text_dim=32)},
}


def _spec(model: str, tiny: bool) -> dict[str, Any]:
    if model not in SPECS:
        raise ValueError(f"model: must be one of {', '.join(MODELS)}, got {model!r}")
    return (TINY_SPECS if tiny else SPECS)[model]


def _classes(model: str):
    """(transformer class, VAE class) of ``model``."""
    from diffusers import AutoencoderKL, AutoencoderKLFlux2, Flux2Transformer2DModel, ZImageTransformer2DModel

    return (Flux2Transformer2DModel, AutoencoderKLFlux2) if model == "flux2" else (ZImageTransformer2DModel,
                                                                                    AutoencoderKL)


def lora_targets(model: str) -> tuple[str, ...]:
    """The family's LoRA targets (as ``recipe/<model>.yaml``)."""
    _spec(model, False)
    if model == "flux2":
        from stepflow.policies.flux2 import LORA_TARGETS_FLUX2

        return LORA_TARGETS_FLUX2
    from stepflow.policies.zimage import LORA_TARGETS_ZIMAGE

    return LORA_TARGETS_ZIMAGE


def build_modules(model: str, tiny: bool = False, device: str | torch.device | None = "auto",
                  dtype: torch.dtype = torch.bfloat16, vae_dtype: torch.dtype = torch.float32, seed: int = 0):
    """A ``SimpleNamespace`` pipeline of random modules (``transformer`` in ``dtype``, ``vae`` in ``vae_dtype``,
    ``scheduler``, no text encoder), built on ``device`` directly in the final dtype."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    spec = _spec(model, tiny)
    tcls, vcls = _classes(model)
    dev = _device(device)
    torch.manual_seed(seed)
    with torch.device(dev):
        with _default_dtype(dtype):
            transformer = tcls(**spec["transformer"])
        with _default_dtype(vae_dtype):
            vae = vcls(**spec["vae"])
    torch.nn.Module.to(transformer, dtype)
    torch.nn.Module.to(vae, vae_dtype)
    return SimpleNamespace(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(**spec["scheduler"]),
                           text_encoder=None, vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
                           name_or_path=f"random-{model}{'-tiny' if tiny else ''}")


def _zimage_len(prompt: str) -> int:
    """Qwen3 tokens of a prompt in Z-Image's chat template: about one per word or mark, plus the template's 8
    (``<|im_start|>user\\n`` ... ``<|im_end|>\\n<|im_start|>assistant\\n``)."""
    return 8 + len(re.findall(r"\w+|[^\w\s]", prompt))


def _policy_classes():
    from stepflow.policies.flux2 import Flux2Policy
    from stepflow.policies.zimage import ZImagePolicy

    class RandomTextFlux2Policy(_RandomText, Flux2Policy):
        """Flux2Policy whose text encoder is fixed random embeddings (Mistral layers 10/20/30 stacked, padded length)."""

        def _random_row(self, prompt: str) -> tuple[Tensor, ...]:
            g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
            return (torch.randn(self.text_len, self.text_dim, generator=g),)

    class RandomTextZImagePolicy(_RandomText, ZImagePolicy):
        """ZImagePolicy whose text encoder is fixed random hidden states (Qwen3-4B's width, per-prompt lengths)."""

        def _random_row(self, prompt: str) -> tuple[Tensor, ...]:
            g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
            n = min(self.max_sequence_length, _zimage_len(prompt))
            return (torch.randn(n, self.text_dim, generator=g),)

    return {"flux2": RandomTextFlux2Policy, "zimage": RandomTextZImagePolicy}


def random_policy(model: str = "zimage", *, tiny: bool = False, device: str | None = "auto",
                  dtype: str | torch.dtype = "bfloat16", vae_dtype: str | torch.dtype = "float32", seed: int = 0,
                  height: int | None = None, width: int | None = None, max_sequence_length: int | None = None,
                  finetune: str = "lora", lora: Mapping[str, Any] | None = None, gradient_checkpointing: bool = True,
                  decode_batch_size: int = 8, guidance: float | None = None, eval_guidance: float | None = None,
                  embedded_guidance: float = 4.0, save_weights: bool = True, name: str | None = None):
    """A stepflow policy over random modules of ``model`` (``flux2`` / ``zimage``), built on ``device``: the
    ``_target_`` of ``model=<model>_random`` (arguments as :func:`stepflow.testing.random_policies.random_policy`;
    ``embedded_guidance``: FLUX.2's distilled guidance scale)."""
    from stepflow.policies.pipeline import resolve_dtype

    spec = _spec(model, tiny)
    text = spec["text"]
    cls = _policy_classes()[model]
    given = dict(max_sequence_length=max_sequence_length, decode_batch_size=decode_batch_size, guidance=guidance,
                 eval_guidance=eval_guidance, embedded_guidance=embedded_guidance if model == "flux2" else None)
    cls.check_args({k: v for k, v in given.items() if v is not None})  # before the (many-GB) modules are built
    size = 64 if tiny else 512
    height, width = check_image_size(size if height is None else height, size if width is None else width, 16,
                                     "VAE scale 8 x 2x2 patches")
    pipe = build_modules(model, tiny, device, resolve_dtype(dtype, torch.bfloat16, "model.dtype"),
                         resolve_dtype(vae_dtype, field="model.vae_dtype"), seed)
    seq = max_sequence_length or text["text_len"]
    kw: dict[str, Any] = dict(height=height, width=width, gradient_checkpointing=gradient_checkpointing,
                              decode_batch_size=decode_batch_size, finetune=finetune, lora=lora,
                              max_sequence_length=seq, name=name or pipe.name_or_path)
    if guidance is not None:
        kw["guidance"] = float(guidance)
    if eval_guidance is not None:
        kw["eval_guidance"] = float(eval_guidance)
    if model == "flux2":
        kw["embedded_guidance"] = embedded_guidance
    policy = cls(pipe, **kw)
    policy.text_len, policy.text_dim, policy.pooled_dim = seq, text["text_dim"], None
    policy.save_weights = bool(save_weights)
    return policy


def param_counts(model: str, lora_rank: int = 32, targets: Sequence[str] | None = None, tiny: bool = False
                 ) -> dict[str, int]:
    """Exact parameter counts (transformer, its persistent buffers, the LoRA of rank ``lora_rank`` on ``targets``,
    default the family's, and the VAE), built on the meta device (as ``random_policies.param_counts``)."""
    from peft import LoraConfig

    spec = _spec(model, tiny)
    tcls, vcls = _classes(model)
    targets = tuple(targets or lora_targets(model))
    with torch.device("meta"), _default_dtype(torch.bfloat16):
        tr = tcls(**spec["transformer"])
        vae = vcls(**spec["vae"])
        n_tr = sum(p.numel() for p in tr.parameters())
        n_buf = sum(b.numel() for b in tr.buffers())
        present = {n for n, _ in tr.named_modules()}
        wanted = sorted(t for t in targets if any(n.endswith(t) for n in present))
        tr.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=wanted))
        n_lora = sum(p.numel() for n, p in tr.named_parameters() if "lora_" in n)
    return {"transformer": n_tr, "buffers": n_buf, "lora": n_lora, "vae": sum(p.numel() for p in vae.parameters())}


def main(argv: Sequence[str] | None = None) -> int:
    """Print the per-GPU memory estimate of FLUX.2-dev and Z-Image (``--world``, ``--gpu-gib``, ``--lora-rank``)."""
    import argparse

    ap = argparse.ArgumentParser(description="per-GPU memory estimate of FLUX.2-dev and Z-Image (random_policies."
                                             "memory_estimate: weights, grads, AdamW, EMA, reference; no activations)")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--gpu-gib", type=float, default=80.0)
    ap.add_argument("--lora-rank", type=int, default=32)
    args = ap.parse_args(argv)
    counts = {m: param_counts(m, args.lora_rank) for m in MODELS}
    print(memory_table(args.world, args.gpu_gib, args.lora_rank, models=MODELS, counts=counts))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
