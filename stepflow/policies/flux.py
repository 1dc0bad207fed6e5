"""FLUX.1 (dev, schnell) as a :class:`~stepflow.policies.base.FlowPolicy`, over diffusers' ``FluxPipeline``.

What differs from SD3 (and how this policy reproduces ``FluxPipeline.__call__``):

- **text**: CLIP-L's pooled output (``pooled``, 768) and T5-XXL's token states (``tokens``, ``max_sequence_length``
  × 4096) from the pipeline's own ``encode_prompt``, once per distinct prompt (the prompt cache of
  :class:`~stepflow.policies.pipeline.PipelinePolicy`); text ids are zeros (``(L, 3)``);
- **latents**: stepflow keeps them unpacked, ``(B, 16, H/8, W/8)``; ``_forward`` packs 2×2 patches into the
  transformer's ``(B, H/16 · W/16, 64)`` tokens (``FluxPipeline._pack_latents``), passes the image ids of that grid
  (``_prepare_latent_image_ids``) and unpacks the velocity; packing is a permutation, so N(0, I) noise and the
  per-dimension-mean log-probs of ``stepflow.math.sde`` are the same in either layout;
- **guidance**: FLUX.1-dev is guidance-distilled: the scale (:attr:`FluxPolicy.embedded_guidance`, 3.5) goes into the
  transformer's guidance embedding and there is no negative branch; ``velocity(..., guidance=w)`` with ``w != 1`` is
  true CFG with the empty negative prompt (``FluxPipeline``'s ``true_cfg_scale`` with ``negative_prompt=""``);
  FLUX.1-schnell has no guidance embedding;
- **time grid**: the pipeline's, ``σ = linspace(1, 1/N, N)`` then the scheduler's dynamic (resolution-dependent)
  exponential shift ``σ' = e^μ / (e^μ + 1/σ − 1)`` with ``μ = calculate_shift(image_seq_len, base_image_seq_len,
  max_image_seq_len, base_shift, max_shift)`` (dev: 0.5 .. 1.15 over 256 .. 4096 tokens, so 512 px → μ = 0.63,
  1024 px → μ = 1.15), then a trailing 0 (method.md §1); schnell: no shift. It starts at exactly 1.0, so the t = 1
  guard of ``stepflow.math.sde`` applies as on SD3's grid;
- **fp32 time**: the FLUX transformer casts ``timestep`` and ``guidance`` to the weights' dtype before its time
  embedding; a :class:`~stepflow.policies.base.TimeInputs` pre-hook feeds it the fp32 values instead (in bf16,
  ``FluxPipeline`` itself rounds 1000·t to bf16, e.g. 913.35 -> 912; in fp32 both are the same).

Load with ``FluxPolicy.from_pretrained("black-forest-labs/FLUX.1-dev")`` or a local diffusers folder
(``model.path=DIR``); a load failure is a one-line :class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from stepflow.policies.base import LORA_TARGETS_SD3, Cond, check_image_size, check_time_grid
from stepflow.policies.pipeline import PipelinePolicy, diffusers_loader

__all__ = ["FLUX_DEV", "FLUX_SCHNELL", "LORA_TARGETS_FLUX", "FluxPolicy", "flux_mu", "load_flux_pipeline",
           "pack_latents", "pipeline_time_grid", "unpack_latents"]

FLUX_DEV = "black-forest-labs/FLUX.1-dev"
FLUX_SCHNELL = "black-forest-labs/FLUX.1-schnell"

#: Flow-GRPO's FLUX LoRA targets (scripts/train_flux.py): the attention of both streams (also the single-stream
#: blocks' attn.to_q/k/v, which share the names) and the feed-forward layers of the double-stream blocks
LORA_TARGETS_FLUX: tuple[str, ...] = LORA_TARGETS_SD3 + (
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)


def pack_latents(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 · W/2, 4C): FLUX / Qwen-Image's 2×2 patch tokens (``FluxPipeline._pack_latents``)."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: Tensor, height: int, width: int) -> Tensor:
    """(B, h/2 · w/2, 4C) -> (B, C, h, w) for a latent grid of ``height × width`` (the inverse of
    :func:`pack_latents`)."""
    b, _, ch = x.shape
    return x.view(b, height // 2, width // 2, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, ch // 4, height, width)


def flux_mu(image_seq_len: int, scheduler_config: Mapping[str, Any]) -> float:
    """``calculate_shift`` of ``FluxPipeline``: μ linear in the number of image tokens, from ``base_shift`` at
    ``base_image_seq_len`` to ``max_shift`` at ``max_image_seq_len`` (defaults 0.5, 1.15, 256, 4096)."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


def pipeline_time_grid(scheduler, num_steps: int, image_seq_len: int, what: str = "time_grid") -> Tensor:
    """The sigmas ``FluxPipeline`` / ``QwenImagePipeline`` sample on, with the trailing 0 (num_steps + 1,), checked to
    run from exactly 1 to exactly 0 (method.md §1): ``linspace(1, 1/N, N)`` through ``scheduler.set_timesteps(sigmas=,
    mu=flux_mu(image_seq_len))`` (dynamic exponential shift when ``use_dynamic_shifting``, else the static ``shift``;
    then ``shift_terminal`` stretching if configured). ``scheduler`` is mutated (pass the policy's own copy)."""
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
    n = int(num_steps)
    cfg = scheduler.config
    sigmas = None if cfg.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
    scheduler.set_timesteps(n if sigmas is None else None, sigmas=sigmas, mu=flux_mu(image_seq_len, cfg))
    return check_time_grid(scheduler.sigmas.clone(), what)


load_flux_pipeline = diffusers_loader("FluxPipeline", "FluxTransformer2DModel",
                                      what="FLUX", example_id=FLUX_DEV, gated=lambda p: p == FLUX_DEV)


class FluxPolicy(PipelinePolicy):
    """FLUX.1 policy over a ``FluxPipeline`` (see the module docstring).

    Args:
        pipe: the loaded pipeline (modules shared: ``policy.pipe(...)`` samples with the policy's transformer).
        height, width: image size in pixels (multiples of 16); ``latent_shape = (16, H/8, W/8)``.
        max_sequence_length: T5 tokens (``FluxPipeline``'s default 512; schnell: 256). FLUX attends to the padding,
            so this changes the samples, not only the cost.
        embedded_guidance: the distilled guidance scale fed to the guidance embedding (FLUX.1-dev: 3.5, Flow-GRPO
            and the model card); ignored (``None``) for a transformer without one (schnell).
        guidance, eval_guidance: true-CFG scales for rollouts / evaluation (1.0: none, the FLUX.1 default).
        lora, finetune, gradient_checkpointing, offload_text_encoders, decode_batch_size, encode_batch_size:
            see :class:`~stepflow.policies.pipeline.PipelinePolicy`.
    """

    text_encoder_names = ("text_encoder", "text_encoder_2")
    ARG_RULES = {**PipelinePolicy.ARG_RULES,
                 "max_sequence_length": {"integer": True, "ge": 1, "le": 512,
                                         "hint": " (T5 tokens; FluxPipeline: 512, schnell: 256)"},
                 "embedded_guidance": {"optional": True, "ge": 0.0,
                                       "hint": " (the distilled guidance the transformer embeds: FLUX.1-dev 3.5; null "
                                               "for schnell)"}}

    def __init__(self, pipe, *, height: int = 512, width: int = 512, max_sequence_length: int = 512,
                 embedded_guidance: float | None = 3.5, gradient_checkpointing: bool = False,
                 offload_text_encoders: bool = False, guidance: float = 1.0, eval_guidance: float = 1.0,
                 decode_batch_size: int = 8, encode_batch_size: int = 16, lora: Mapping[str, Any] | None = None,
                 finetune: str = "lora", name: str | None = None,
                 estimate_vae: str | None = None):
        self.check_args(locals())  # the numeric arguments, before the estimate decoder or a LoRA loads
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        height, width = check_image_size(height, width, vae_scale * 2, f"VAE scale {vae_scale} x 2x2 packing")
        if pipe.transformer.config.in_channels != 4 * pipe.vae.config.latent_channels:
            raise ValueError("transformer in_channels != 4 x VAE latent channels: not a FLUX pipeline")
        if pipe.transformer.config.guidance_embeds and embedded_guidance is None:
            raise ValueError("model.embedded_guidance: this FLUX transformer is guidance-distilled (FLUX.1-dev); "
                             "give the scale it embeds (3.5)")
        super().__init__(pipe, name=name or str(getattr(pipe, "name_or_path", "") or "flux"),
                         max_sequence_length=max_sequence_length, gradient_checkpointing=gradient_checkpointing,
                         offload_text_encoders=offload_text_encoders, guidance=guidance, eval_guidance=eval_guidance,
                         decode_batch_size=decode_batch_size, encode_batch_size=encode_batch_size,
                         estimate_vae=estimate_vae)
        self.height, self.width = int(height), int(width)
        self.vae_scale_factor = vae_scale
        self.latent_shape = (int(pipe.vae.config.latent_channels), self.height // vae_scale, self.width // vae_scale)
        self.image_seq_len = (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)
        if pipe.transformer.config.guidance_embeds:
            self.embedded_guidance: float | None = float(embedded_guidance)
        else:
            self.embedded_guidance = None
        self._own_scheduler_and_time_hook(pipe)
        self._setup_training(lora, finetune)

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = FLUX_DEV
    loader = staticmethod(load_flux_pipeline)

    # ------------------------------------------------------------------ time grid
    def time_grid(self, num_steps: int) -> Tensor:
        """``FluxPipeline``'s grid for this resolution, plus the trailing 0 (num_steps + 1,), from 1 to 0 (method.md
        §1): ``sigmas = linspace(1, 1/N, N)`` shifted by the scheduler with ``mu = flux_mu(image_seq_len)``."""
        return pipeline_time_grid(self.scheduler, num_steps, self.image_seq_len, f"{type(self).__name__}.time_grid")

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """Pack, run the transformer (fp32 time and guidance into its time embedding), unpack; fp32 out."""
        net = self.net
        dt = next(net.parameters()).dtype
        b, _, h, w = x.shape
        dev = x.device
        img_ids = torch.zeros(h // 2, w // 2, 3)
        img_ids[..., 1] += torch.arange(h // 2)[:, None]
        img_ids[..., 2] += torch.arange(w // 2)[None, :]
        img_ids = img_ids.reshape(-1, 3).to(dev, dt)
        txt_ids = torch.zeros(cond.tokens.shape[1], 3, device=dev, dtype=dt)
        t = t.float()
        feed = [t * 1000.0]
        guidance = None
        if net.config.guidance_embeds:
            guidance = torch.full((b,), self.embedded_guidance, device=dev, dtype=torch.float32)
            feed.append(guidance * 1000.0)
        with self._time_inputs.feeding(feed):
            out = net(hidden_states=pack_latents(x.to(dt)), timestep=t, guidance=guidance,
                      pooled_projections=cond.pooled.to(dt), encoder_hidden_states=cond.tokens.to(dt),
                      txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return unpack_latents(out.float(), h, w)

    # ------------------------------------------------------------------ text
    def _encode_chunk(self, prompts: list[str]) -> list[tuple[Tensor, Tensor]]:
        tokens, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                    num_images_per_prompt=1,
                                                    max_sequence_length=self.max_sequence_length)
        return list(zip(tokens, pooled))

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, embedded_guidance={self.embedded_guidance}, "
                f"max_sequence_length={self.max_sequence_length}, lora={self.has_lora}, finetune={self.finetune!r}")
