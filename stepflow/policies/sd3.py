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

import torch
from torch import Tensor

from stepflow.policies.base import LORA_TARGETS_SD3, check_image_size
from stepflow.policies.pipeline import PipelinePolicy, load_pipeline, resolve_dtype

__all__ = ["SD3Policy", "default_lora", "load_sd3_pipeline", "resolve_dtype"]

SD35_MEDIUM = "stabilityai/stable-diffusion-3.5-medium"
SD35_LARGE = "stabilityai/stable-diffusion-3.5-large"


def load_sd3_pipeline(path: str, dtype: torch.dtype = torch.bfloat16, vae_dtype: torch.dtype = torch.float32,
                      transformer_path: str | None = None, **kwargs: Any):
    """``StableDiffusion3Pipeline.from_pretrained(path)``, a failure being one line
    (:class:`~stepflow.errors.ModelLoadError`).

    ``path``: a Hub id (``stabilityai/stable-diffusion-3.5-medium``) or a local diffusers folder (with
    ``model_index.json``). The VAE loads in ``vae_dtype`` (fp32 by default), everything else in ``dtype``.
    ``transformer_path``: a fine-tuned ``SD3Transformer2DModel`` folder (``save_trained`` with ``finetune=full``).
    """
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    return load_pipeline(StableDiffusion3Pipeline, path, dtype, vae_dtype, what="SD3", example_id=SD35_MEDIUM,
                         gated=str(path).startswith("stabilityai/"), transformer_cls=SD3Transformer2DModel,
                         transformer_path=transformer_path, **kwargs)


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

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str = SD35_MEDIUM, *, dtype: str | torch.dtype = "bfloat16",
                        vae_dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
                        height: int = 512, width: int = 512, max_sequence_length: int = 256,
                        gradient_checkpointing: bool = False, lora: Mapping[str, Any] | None = None,
                        transformer_path: str | None = None, **kwargs: Any) -> "SD3Policy":
        """Load an SD3/SD3.5 diffusers pipeline (Hub id or local folder) and wrap it.

        dtype: weights of the transformer and text encoders (``bfloat16`` for SD3.5 training; ``float32`` for exact
        tests); the SDE math stays fp32 (``velocity`` returns fp32). vae_dtype: the VAE's (fp32 default).
        device: move the transformer, VAE and (unless offloaded) text encoders there; ``None`` leaves them on the CPU
        (Lightning moves the registered modules; text encoders follow on first ``encode``).
        transformer_path: a fine-tuned transformer folder (``save_trained`` of a ``finetune=full`` run) to use.
        Other keyword arguments go to :class:`SD3Policy`. Raises :class:`ModelLoadError` (one line) on failure; a
        bad numeric argument is one line before anything loads.
        """
        cls.check_args(dict(kwargs, height=height, width=width, max_sequence_length=max_sequence_length))
        pipe = load_sd3_pipeline(path, resolve_dtype(dtype, torch.bfloat16, "model.dtype"),
                                 resolve_dtype(vae_dtype, field="model.vae_dtype"), transformer_path=transformer_path)
        policy = cls(pipe, height=height, width=width, max_sequence_length=max_sequence_length,
                     gradient_checkpointing=gradient_checkpointing, lora=lora, **kwargs)
        policy._move_to(device)
        return policy

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
