"""Qwen-Image as a :class:`~stepflow.policies.base.FlowPolicy`, over diffusers' ``QwenImagePipeline``.

What it takes from the pipeline (and how this policy reproduces ``QwenImagePipeline.__call__``):

- **text**: Qwen2.5-VL's last hidden states of the prompt inside the pipeline's chat template (``"<|im_start|>system
  \\nDescribe the image by detailing ...<|im_end|>\\n<|im_start|>user\\n{}<|im_end|>\\n<|im_start|>assistant\\n"``),
  with the template's first ``prompt_template_encode_start_idx`` = 34 tokens dropped, truncated to
  ``max_sequence_length``: the pipeline's own ``encode_prompt``, once per distinct prompt (cached at each prompt's own
  length). A batch is zero-padded to its longest prompt with ``Cond.mask`` marking the real tokens (``None`` when all
  have the same length, as the pipeline passes it); there is no pooled vector (``Cond.pooled`` is ``(B, 0)``);
- **latents**: kept unpacked, ``(B, 16, H/8, W/8)``; ``_forward`` packs 2×2 patches to ``(B, H/16 · W/16, 64)``,
  passes ``img_shapes = [(1, H/16, W/16)]`` and unpacks the velocity; ``decode`` adds the VAE's frame axis and undoes
  its per-channel normalisation, ``z · latents_std + latents_mean``;
- **CFG** ("true CFG", ``true_cfg_scale``, default 4.0 with the negative prompt ``" "``): ``v = v_u + w (v_c − v_u)``,
  then rescaled per image token to the norm of the conditional prediction, ``v · ‖v_c‖ / ‖v‖`` (norms over the 64
  packed channels), as the pipeline does (``cfg_renorm=True``);
- **time grid**: the pipeline's ``linspace(1, 1/N, N)`` through the scheduler's dynamic exponential shift
  (μ from ``calculate_shift`` with Qwen-Image's 256 .. 8192 tokens, 0.5 .. 0.9) and its ``shift_terminal`` = 0.02
  stretch, then 0; it starts at exactly 1.0;
- **fp32 time**: the transformer casts ``timestep`` to the weights' dtype before its time embedding; a
  :class:`~stepflow.policies.base.TimeInputs` pre-hook feeds it the fp32 value.

Load with ``QwenImagePolicy.from_pretrained("Qwen/Qwen-Image")`` or a local diffusers folder (``model.path=DIR``);
a load failure is a one-line :class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from stepflow.policies.base import LORA_TARGETS_SD3, Cond, check_image_size
from stepflow.policies.flux import pack_latents, pipeline_time_grid, unpack_latents
from stepflow.policies.pipeline import PipelinePolicy, diffusers_loader

__all__ = ["LORA_TARGETS_QWEN_IMAGE", "QWEN_IMAGE", "QwenImagePolicy", "load_qwen_image_pipeline"]

QWEN_IMAGE = "Qwen/Qwen-Image"

#: Flow-GRPO's Qwen-Image LoRA targets (scripts/train_qwenimage_edit_plus.py): attention of both streams + both MLPs
LORA_TARGETS_QWEN_IMAGE: tuple[str, ...] = LORA_TARGETS_SD3 + (
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)


load_qwen_image_pipeline = diffusers_loader("QwenImagePipeline", "QwenImageTransformer2DModel",
                                            what="Qwen-Image", example_id=QWEN_IMAGE)


class QwenImagePolicy(PipelinePolicy):
    """Qwen-Image policy over a ``QwenImagePipeline`` (see the module docstring).

    Args:
        pipe: the loaded pipeline (modules shared: ``policy.pipe(...)`` samples with the policy's transformer).
        height, width: image size in pixels (multiples of 16); ``latent_shape = (16, H/8, W/8)``.
        max_sequence_length: prompt tokens kept after the template (the pipeline's default 512, at most 1024).
        negative_prompt: the unconditional prompt of true CFG (the model card's ``" "``).
        cfg_renorm: rescale the CFG velocity to the conditional one's norm per token (the pipeline always does).
        guidance, eval_guidance: true-CFG scales for rollouts / evaluation (model card and Flow-GRPO: 4.0).
        lora, finetune, gradient_checkpointing, offload_text_encoders, decode_batch_size, encode_batch_size:
            see :class:`~stepflow.policies.pipeline.PipelinePolicy`.
    """

    text_encoder_names = ("text_encoder",)
    ARG_RULES = {**PipelinePolicy.ARG_RULES,
                 "max_sequence_length": {"integer": True, "ge": 1, "le": 1024,
                                         "hint": " (prompt tokens after the template; QwenImagePipeline: 512)"},
                 "guidance": {"ge": 1.0, "hint": " (true CFG; 1 = no CFG, the model card's 4)"},
                 "eval_guidance": {"ge": 1.0, "hint": " (true CFG; 1 = no CFG, the model card's 4)"}}

    def __init__(self, pipe, *, height: int = 512, width: int = 512, max_sequence_length: int = 512,
                 negative_prompt: str = " ", cfg_renorm: bool = True, gradient_checkpointing: bool = False,
                 offload_text_encoders: bool = False, guidance: float = 4.0, eval_guidance: float = 4.0,
                 decode_batch_size: int = 8, encode_batch_size: int = 16, lora: Mapping[str, Any] | None = None,
                 finetune: str = "lora", name: str | None = None):
        self.check_args(locals())  # the numeric arguments, before a LoRA loads
        vae_scale = int(pipe.vae_scale_factor)
        height, width = check_image_size(height, width, vae_scale * 2, f"VAE scale {vae_scale} x 2x2 packing")
        tcfg = pipe.transformer.config
        if tcfg.in_channels != 4 * pipe.vae.config.z_dim:
            raise ValueError("transformer in_channels != 4 x VAE z_dim: not a Qwen-Image pipeline")
        if tcfg.get("guidance_embeds", False) or tcfg.get("zero_cond_t", False) or tcfg.get("use_additional_t_cond",
                                                                                           False):
            raise ValueError("this Qwen-Image transformer has guidance embeds / zero_cond_t / additional t-cond "
                             "(an edit or layered variant?); QwenImagePolicy supports text-to-image Qwen-Image")
        super().__init__(pipe, name=name or str(getattr(pipe, "name_or_path", "") or "qwen_image"),
                         max_sequence_length=max_sequence_length, gradient_checkpointing=gradient_checkpointing,
                         offload_text_encoders=offload_text_encoders, guidance=guidance, eval_guidance=eval_guidance,
                         decode_batch_size=decode_batch_size, encode_batch_size=encode_batch_size)
        self.height, self.width = int(height), int(width)
        self.vae_scale_factor = vae_scale
        self.latent_shape = (int(pipe.vae.config.z_dim), self.height // vae_scale, self.width // vae_scale)
        self.image_seq_len = (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)
        self.negative_prompt = str(negative_prompt)
        self.cfg_renorm = bool(cfg_renorm)
        self._own_scheduler_and_time_hook(pipe)
        self._setup_training(lora, finetune)

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = QWEN_IMAGE
    loader = staticmethod(load_qwen_image_pipeline)

    # ------------------------------------------------------------------ time grid
    def time_grid(self, num_steps: int) -> Tensor:
        """``QwenImagePipeline``'s grid for this resolution plus the trailing 0 (method.md §1)."""
        return pipeline_time_grid(self.scheduler, num_steps, self.image_seq_len, f"{type(self).__name__}.time_grid")

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        net = self.net
        dt = next(net.parameters()).dtype
        b, _, h, w = x.shape
        t = t.float()
        with self._time_inputs.feeding([t]):
            out = net(hidden_states=pack_latents(x.to(dt)), timestep=t, encoder_hidden_states=cond.tokens.to(dt),
                      encoder_hidden_states_mask=cond.mask, img_shapes=[[(1, h // 2, w // 2)]] * b,
                      return_dict=False)[0]
        return unpack_latents(out.float(), h, w)

    def _guide(self, v_u: Tensor, v_c: Tensor, guidance: float) -> Tensor:
        """True CFG with :attr:`negative_prompt`, then (``cfg_renorm``) each packed token rescaled to the norm of the
        conditional prediction, as ``QwenImagePipeline`` does."""
        v = v_u + guidance * (v_c - v_u)
        if not self.cfg_renorm:
            return v
        h, w = v.shape[-2:]
        pv, pc = pack_latents(v), pack_latents(v_c)
        pv = pv * (pc.norm(dim=-1, keepdim=True) / pv.norm(dim=-1, keepdim=True))
        return unpack_latents(pv, h, w)

    # ------------------------------------------------------------------ text
    def _encode_chunk(self, prompts: list[str]) -> list[tuple[Tensor]]:
        tokens, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device, num_images_per_prompt=1,
                                               max_sequence_length=self.max_sequence_length)
        lengths = [tokens.shape[1]] * len(prompts) if mask is None else mask.sum(1).tolist()
        return [(tok[:n],) for tok, n in zip(tokens, lengths)]

    def _collate(self, rows: list[tuple[Tensor, ...]], device: torch.device) -> Cond:
        """Rows of (tokens (L_i, D),) -> tokens zero-padded to max L_i, mask (None if all L_i are equal),
        pooled (B, 0)."""
        lengths = [r[0].shape[0] for r in rows]
        longest = max(lengths)
        tokens = torch.stack([torch.cat([r[0], r[0].new_zeros(longest - n, r[0].shape[1])]) for r, n in
                              zip(rows, lengths)]).to(device)
        mask = None
        if min(lengths) != longest:
            mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).to(device)
        return Cond(tokens=tokens, pooled=tokens.new_zeros(len(rows), 0), mask=mask)

    # ------------------------------------------------------------------ image
    def _decode_chunk(self, z: Tensor) -> Tensor:
        """As the pipeline: ``vae.decode(z · latents_std + latents_mean)`` on one frame, then the frame dropped."""
        cfg = self.vae.config
        p = self._vae_param()
        z = z.to(p.device, p.dtype).unsqueeze(2)  # (b, C, 1, h, w)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std_inv = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return self.vae.decode(z / std_inv + mean, return_dict=False)[0][:, :, 0]

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, negative_prompt={self.negative_prompt!r}, "
                f"max_sequence_length={self.max_sequence_length}, lora={self.has_lora}, finetune={self.finetune!r}")
