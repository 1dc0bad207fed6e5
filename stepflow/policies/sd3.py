"""Stable Diffusion 3 / 3.5 (Medium, Large) as a :class:`~stepflow.policies.base.FlowPolicy`.

Built on diffusers' ``StableDiffusion3Pipeline`` components:

- ``transformer`` (``SD3Transformer2DModel``): the velocity model; the only module with trainable weights (LoRA, or
  all of them with ``finetune="full"``);
- ``vae`` (``AutoencoderKL``, 16 latent channels, 8x): frozen, fp32 by default; ``decode`` undoes SD3's latent
  normalisation, ``latents / scaling_factor + shift_factor``;
- three text encoders (CLIP-L, CLIP-G, T5-XXL) through the pipeline's own ``encode_prompt``: frozen, run once per
  distinct prompt (a prompt -> (tokens row, pooled row) cache), optionally kept on the CPU between uses
  (``offload_text_encoders``) or freed after :meth:`SD3Policy.precache` (:meth:`SD3Policy.free_text_encoders`);
- the scheduler config only for ``shift`` (SD3.5: 3.0) and the timestep scale (1000).

Time runs from 1 (noise) to 0 (data) and ``velocity`` predicts ``x1 - x0`` (base.py conventions). The plain Euler ODE
``x_{k+1} = x_k + (τ_{k+1} - τ_k) · v(x_k, τ_k)`` on ``time_grid(N)`` reproduces ``StableDiffusion3Pipeline.__call__``
(tested to 1e-4 on the tiny pipeline in fp32, with and without CFG, and bit for bit per transformer call in bf16:
the timestep reaches the time embedding in fp32, as the pipeline passes it).

Load with ``SD3Policy.from_pretrained("stabilityai/stable-diffusion-3.5-medium")`` (or ``-large``) or a local
diffusers folder (``model.path=/local/dir`` in Hydra). A load failure is a one-line
:class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from stepflow.policies.base import LORA_TARGETS_SD3, check_image_size
from stepflow.policies.pipeline import PipelinePolicy, diffusers_loader, resolve_dtype

__all__ = ["SD3Policy", "default_lora", "load_sd3_pipeline", "resolve_dtype"]

SD35_MEDIUM = "stabilityai/stable-diffusion-3.5-medium"
SD35_LARGE = "stabilityai/stable-diffusion-3.5-large"


load_sd3_pipeline = diffusers_loader("StableDiffusion3Pipeline", "SD3Transformer2DModel",
                                     what="SD3", example_id=SD35_MEDIUM,
                                     gated=lambda p: p.startswith("stabilityai/"))


class SD3Policy(PipelinePolicy):
    """SD3 / SD3.5 policy over a ``StableDiffusion3Pipeline``.

    Args:
        pipe: the loaded pipeline (its modules are shared, not copied: ``policy.pipe(...)`` samples with the policy's
            transformer, LoRA included).
        height, width: image size in pixels (multiples of 8 · patch_size = 16); ``latent_shape`` follows.
        max_sequence_length: T5 tokens (SD3.5 / Flow-GRPO: 256; token states are then 77 + 256 = 333 long).
        guidance, eval_guidance: the model's recommended CFG scales for rollouts (1.0 = none; the paper's curves;
            4.5 for its GenEval models) and for evaluation (4.5).
        lora, finetune, gradient_checkpointing, offload_text_encoders, decode_batch_size, encode_batch_size:
            see :class:`~stepflow.policies.pipeline.PipelinePolicy`.
        estimate_vae: a diffusers ``AutoencoderTiny`` (Hub id or folder, e.g. ``madebyollin/taesd3``) that decodes
            the x̂0 estimates of intermediate states; the final image keeps the full VAE. None: the full VAE.
    """

    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    ARG_RULES = {**PipelinePolicy.ARG_RULES,
                 "max_sequence_length": {"integer": True, "ge": 1, "le": 512,
                                         "hint": " (T5 tokens; StableDiffusion3Pipeline takes at most 512)"}}

    def __init__(self, pipe, *, height: int = 512, width: int = 512, max_sequence_length: int = 256,
                 gradient_checkpointing: bool = False, offload_text_encoders: bool = False, guidance: float = 1.0,
                 eval_guidance: float = 4.5, decode_batch_size: int = 8, encode_batch_size: int = 16,
                 lora: Mapping[str, Any] | None = None, finetune: str = "lora", name: str | None = None,
                 estimate_vae: str | None = None):
        self.check_args(locals())  # the numeric arguments, before the estimate decoder or a LoRA loads
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        patch = int(pipe.transformer.config.patch_size)
        height, width = check_image_size(height, width, vae_scale * patch, f"VAE scale {vae_scale} x patch {patch}")
        if pipe.vae.config.latent_channels != pipe.transformer.config.in_channels:
            raise ValueError("VAE latent channels and transformer in_channels differ: not an SD3 pipeline")
        sched = pipe.scheduler.config
        if sched.get("use_dynamic_shifting", False):
            raise ValueError("the scheduler uses dynamic shifting (resolution-dependent mu); stepflow's time grid "
                             "uses a fixed shift: set use_dynamic_shifting=false in scheduler_config.json")
        super().__init__(pipe, name=name or str(getattr(pipe, "name_or_path", "") or "sd3"),
                         max_sequence_length=max_sequence_length, gradient_checkpointing=gradient_checkpointing,
                         offload_text_encoders=offload_text_encoders, guidance=guidance, eval_guidance=eval_guidance,
                         decode_batch_size=decode_batch_size, encode_batch_size=encode_batch_size,
                         estimate_vae=estimate_vae)
        self.height, self.width = int(height), int(width)
        self.vae_scale_factor = vae_scale
        self.latent_shape = (int(pipe.vae.config.latent_channels), self.height // vae_scale, self.width // vae_scale)
        self.shift = float(sched.get("shift", 1.0))
        self.timestep_scale = float(sched.get("num_train_timesteps", 1000))
        self._setup_training(lora, finetune)

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = SD35_MEDIUM
    loader = staticmethod(load_sd3_pipeline)

    # ------------------------------------------------------------------ text
    def _encode_chunk(self, prompts: list[str]) -> list[tuple[Tensor, Tensor]]:
        tokens, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return list(zip(tokens, pooled))

    def encode(self, prompts):
        """Prompts -> ``Cond(tokens (B, 77 + max_sequence_length, 4096), pooled (B, 2048))`` on the policy's device.

        Uses the pipeline's ``encode_prompt`` (CLIP-L + CLIP-G hidden states, zero-padded to T5 width, then T5),
        once per distinct prompt: later calls read the cache.
        """
        return super().encode(prompts)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, shift={self.shift}, "
                f"max_sequence_length={self.max_sequence_length}, lora={self.has_lora}, finetune={self.finetune!r}")


def default_lora(rank: int = 32, alpha: float = 64.0) -> dict[str, Any]:
    """Flow-GRPO's SD3.5 LoRA: r=32, alpha=64, gaussian init, the attention projections of both streams."""
    return {"rank": rank, "alpha": alpha, "init": "gaussian", "targets": list(LORA_TARGETS_SD3)}
