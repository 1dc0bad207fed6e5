"""Z-Image (Turbo and the base model) as a :class:`~stepflow.policies.base.FlowPolicy`, over diffusers'
``ZImagePipeline``.

What it takes from the pipeline (and how this policy reproduces ``ZImagePipeline.__call__``, diffusers 0.42.1):

- **text**: Qwen3-4B's second-to-last hidden states (``hidden_states[-2]``) of the prompt inside Qwen3's chat template
  (a user turn, ``add_generation_prompt=True, enable_thinking=True``), the padding dropped: the pipeline's own
  ``_encode_prompt``, once per distinct prompt, at each prompt's own length (at most ``max_sequence_length``). A batch
  is zero-padded to its longest prompt with ``Cond.mask`` marking the real tokens; ``_forward`` hands the transformer
  the list of unpadded rows, as the pipeline does; there is no pooled vector (``Cond.pooled`` is ``(B, 0)``);
- **latents**: ``(B, 16, H/8, W/8)`` as the pipeline draws them (FLUX.1's VAE; the transformer patchifies 2x2 itself);
  ``_forward`` adds the frame axis the transformer takes (a list of ``(C, 1, h, w)``); ``decode`` is
  ``vae.decode(z / scaling_factor + shift_factor)``;
- **time and sign**: the transformer is trained on the reversed time ``1 − σ`` and predicts ``x0 − x1``: the pipeline
  feeds ``(1000 − 1000 σ) / 1000`` and steps with ``−output``; ``_forward`` feeds the same value (bit for bit in fp32)
  and returns ``v = −output`` (stepflow's ``v = x1 − x0``);
- **CFG**: the pipeline's ``guidance_scale`` w (Z-Image-Turbo: 0, off; the base model: a few) computes
  ``v_c + w (v_c − v_u)`` with the negative prompt (default ""); stepflow's scale is ``g = 1 + w`` (``v_u + g (v_c −
  v_u)``, the same velocity; :meth:`ZImagePolicy._guide` evaluates it in the pipeline's order); the pipeline's
  ``cfg_normalization`` (cap ``‖v‖`` at ``cfg_normalization · ‖v_c‖``, per sample) and ``cfg_truncation`` (no CFG,
  conditional only, where ``1 − σ > cfg_truncation``) are the policy's arguments of the same names;
- **time grid**: ``torch.linspace(1, 1/N, N)`` through the scheduler (Z-Image-Turbo: the static shift 3; with
  ``use_dynamic_shifting``, μ of ``calculate_shift`` on the image tokens), then 0; it starts at exactly 1.0.

Load with ``ZImagePolicy.from_pretrained("Tongyi-MAI/Z-Image-Turbo")`` or a local diffusers folder
(``model.path=DIR``); a load failure is a one-line :class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from stepflow.policies.base import Cond, check_image_size, check_number, check_time_grid
from stepflow.policies.pipeline import PipelinePolicy, diffusers_loader

__all__ = ["LORA_TARGETS_ZIMAGE", "ZIMAGE_TURBO", "ZImagePolicy", "load_zimage_pipeline", "zimage_mu"]

ZIMAGE_TURBO = "Tongyi-MAI/Z-Image-Turbo"

#: Flow-Factory's Z-Image LoRA targets (models/z_image/z_image.py): the attention projections and the SwiGLU
#: feed-forward of every block (main layers and both refiners)
LORA_TARGETS_ZIMAGE: tuple[str, ...] = (
    "attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
)


def zimage_mu(image_seq_len: int, scheduler_config: Mapping[str, Any]) -> float:
    """``calculate_shift`` of ``ZImagePipeline`` (μ linear in the image tokens, ``base_shift`` at
    ``base_image_seq_len`` to ``max_shift`` at ``max_image_seq_len``; used only with ``use_dynamic_shifting``)."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * m + (base_shift - m * base_len)


load_zimage_pipeline = diffusers_loader("ZImagePipeline", "ZImageTransformer2DModel",
                                        what="Z-Image", example_id=ZIMAGE_TURBO)


class ZImagePolicy(PipelinePolicy):
    """Z-Image policy over a ``ZImagePipeline`` (see the module docstring).

    Args:
        pipe: the loaded pipeline (modules shared: ``policy.pipe(...)`` samples with the policy's transformer).
        height, width: image size in pixels (multiples of 16); ``latent_shape = (16, H/8, W/8)``.
        max_sequence_length: Qwen3 tokens of the templated prompt (the pipeline's 512); the padding is dropped.
        negative_prompt: the unconditional prompt of CFG (the pipeline's default "").
        cfg_normalization: 0 (off, the pipeline's default) or the cap ``c``: ``‖v‖ <= c ‖v_c‖`` per sample.
        cfg_truncation: CFG only where ``1 − σ <= cfg_truncation`` (the pipeline's default 1.0: everywhere).
        guidance, eval_guidance: stepflow's CFG scales, ``1 + guidance_scale`` of the pipeline (Z-Image-Turbo: 1.0,
            no CFG).
        lora, finetune, gradient_checkpointing, offload_text_encoders, decode_batch_size, encode_batch_size:
            see :class:`~stepflow.policies.pipeline.PipelinePolicy`.
    """

    text_encoder_names = ("text_encoder",)
    ARG_RULES = {**PipelinePolicy.ARG_RULES,
                 "max_sequence_length": {"integer": True, "ge": 1, "le": 4096,
                                         "hint": " (Qwen3 tokens of the templated prompt; ZImagePipeline: 512)"},
                 "guidance": {"ge": 1.0, "hint": " (1 + ZImagePipeline's guidance_scale; 1 = no CFG, Turbo's)"},
                 "eval_guidance": {"ge": 1.0, "hint": " (1 + ZImagePipeline's guidance_scale; 1 = no CFG, Turbo's)"},
                 "cfg_normalization": {"ge": 0.0, "hint": " (0 = off; c caps |v| at c |v_cond|)"},
                 "cfg_truncation": {"ge": 0.0, "hint": " (CFG where 1 - t <= it; 1 = everywhere)"}}

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, max_sequence_length: int = 512,
                 negative_prompt: str = "", cfg_normalization: float = 0.0, cfg_truncation: float = 1.0,
                 gradient_checkpointing: bool = False, offload_text_encoders: bool = False, guidance: float = 1.0,
                 eval_guidance: float = 1.0, decode_batch_size: int = 8, encode_batch_size: int = 16,
                 lora: Mapping[str, Any] | None = None, finetune: str = "lora", name: str | None = None):
        self.check_args(locals())  # the numeric arguments, before a LoRA loads
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        tcfg = pipe.transformer.config
        patch = int(tcfg.all_patch_size[0])
        height, width = check_image_size(height, width, vae_scale * patch, f"VAE scale {vae_scale} x patch {patch}")
        if tcfg.in_channels != pipe.vae.config.latent_channels:
            raise ValueError("transformer in_channels != VAE latent channels: not a Z-Image pipeline")
        super().__init__(pipe, name=name or str(getattr(pipe, "name_or_path", "") or "zimage"),
                         max_sequence_length=max_sequence_length, gradient_checkpointing=gradient_checkpointing,
                         offload_text_encoders=offload_text_encoders, guidance=guidance, eval_guidance=eval_guidance,
                         decode_batch_size=decode_batch_size, encode_batch_size=encode_batch_size)
        self.height, self.width = int(height), int(width)
        self.vae_scale_factor = vae_scale
        self.patch_size = patch
        self.latent_shape = (int(tcfg.in_channels), self.height // vae_scale, self.width // vae_scale)
        self.image_seq_len = (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)  # as the pipeline counts
        self.negative_prompt = str(negative_prompt)
        self.cfg_normalization = float(check_number("model.cfg_normalization", float(cfg_normalization), ge=0.0))
        self.cfg_truncation = float(cfg_truncation)
        self.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # our own: time_grid mutates it
        self.timestep_scale = float(self.scheduler.config.get("num_train_timesteps", 1000))
        self._cfg_off: Tensor | None = None  # rows of the current velocity call past cfg_truncation
        self._setup_training(lora, finetune)

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = ZIMAGE_TURBO
    loader = staticmethod(load_zimage_pipeline)

    # ------------------------------------------------------------------ time grid
    def time_grid(self, num_steps: int) -> Tensor:
        """``ZImagePipeline``'s grid plus the trailing 0 (num_steps + 1,), from 1 to 0 (method.md §1):
        ``torch.linspace(1, 1/N, N)`` (as the pipeline makes it, in fp32) through the scheduler."""
        if int(num_steps) != num_steps or num_steps < 1:
            raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
        n = int(num_steps)
        sigmas = torch.linspace(1.0, 1 / n, n).tolist()
        self.scheduler.set_timesteps(sigmas=sigmas, mu=zimage_mu(self.image_seq_len, self.scheduler.config))
        return check_time_grid(self.scheduler.sigmas.clone(), f"{type(self).__name__}.time_grid")

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """Unpadded prompt rows and ``(C, 1, h, w)`` latents as lists, the pipeline's reversed time, ``v = −out``."""
        net = self.net
        dt = next(net.parameters()).dtype
        scale = self.timestep_scale
        t_model = (scale - t.float() * scale) / scale  # the pipeline's (1000 - timestep) / 1000, bit for bit
        tokens = cond.tokens.to(dt)
        if cond.mask is None:
            caps = list(tokens.unbind(0))
        else:
            caps = [row[m] for row, m in zip(tokens, cond.mask.to(tokens.device))]
        xs = list(x.to(dt).unsqueeze(2).unbind(0))
        out = net(xs, t_model, caps, patch_size=self.patch_size, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def velocity(self, x: Tensor, t: Tensor | float, cond: Cond, guidance: float = 1.0,
                 detach_uncond: bool = True) -> Tensor:
        """:meth:`FlowPolicy.velocity` with the pipeline's ``cfg_truncation``: rows with ``1 − t > cfg_truncation``
        take the conditional velocity alone."""
        if guidance == 1.0 or self.cfg_truncation >= 1.0:
            return super().velocity(x, t, cond, guidance, detach_uncond)
        tt = torch.as_tensor(t, dtype=torch.float32, device=x.device).expand(x.shape[0])
        scale = self.timestep_scale
        self._cfg_off = (scale - tt * scale) / scale > self.cfg_truncation
        try:
            return super().velocity(x, t, cond, guidance, detach_uncond)
        finally:
            self._cfg_off = None

    def _guide(self, v_u: Tensor, v_c: Tensor, guidance: float) -> Tensor:
        """``v_c + (g − 1)(v_c − v_u)`` (the pipeline's order of operations), the norm cap of ``cfg_normalization``
        and the rows past ``cfg_truncation`` left conditional."""
        v = v_c + (guidance - 1.0) * (v_c - v_u)
        if self.cfg_normalization > 0.0:
            dims = tuple(range(1, v.ndim))
            cap = torch.linalg.vector_norm(v_c, dim=dims, keepdim=True) * self.cfg_normalization
            norm = torch.linalg.vector_norm(v, dim=dims, keepdim=True)
            v = torch.where(norm > cap, v * (cap / norm), v)
        if self._cfg_off is not None:
            v = torch.where(self._cfg_off.view(-1, *([1] * (v.ndim - 1))), v_c, v)
        return v

    # ------------------------------------------------------------------ text
    def _encode_chunk(self, prompts: list[str]) -> list[tuple[Tensor]]:
        rows = self.pipe._encode_prompt(prompt=list(prompts), device=self.device,
                                        max_sequence_length=self.max_sequence_length)
        return [(r,) for r in rows]

    def _collate(self, rows: list[tuple[Tensor, ...]], device: torch.device) -> Cond:
        """Rows of (tokens (L_i, D),) -> tokens zero-padded to max L_i, mask (None if all L_i are equal), pooled
        (B, 0)."""
        lengths = [r[0].shape[0] for r in rows]
        longest = max(lengths)
        tokens = torch.stack([torch.cat([r[0], r[0].new_zeros(longest - n, r[0].shape[1])]) for r, n in
                              zip(rows, lengths)]).to(device)
        mask = None
        if min(lengths) != longest:
            mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).to(device)
        return Cond(tokens=tokens, pooled=tokens.new_zeros(len(rows), 0), mask=mask)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, negative_prompt={self.negative_prompt!r}, "
                f"max_sequence_length={self.max_sequence_length}, lora={self.has_lora}, finetune={self.finetune!r}")
