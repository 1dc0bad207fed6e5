"""FLUX.2 (dev) as a :class:`~stepflow.policies.base.FlowPolicy`, over diffusers' ``Flux2Pipeline``.

What differs from FLUX.1 (and how this policy reproduces ``Flux2Pipeline.__call__``, diffusers 0.42.1):

- **text**: one text encoder, Mistral-Small-3.2-24B (``Mistral3ForConditionalGeneration``) behind a
  ``PixtralProcessor``; the prompt goes in as a user turn after the pipeline's system message, padded to
  ``max_sequence_length`` (512) and the hidden states of layers ``text_encoder_out_layers`` = (10, 20, 30) are stacked
  per token (``(L, 3 · 5120)`` = 15360 wide): the pipeline's own ``encode_prompt``, once per distinct prompt. The
  transformer attends to every token, padding included (no mask), so ``Cond.tokens`` is ``(B, L, D)`` with
  ``Cond.mask`` None and no pooled vector (``Cond.pooled`` is ``(B, 0)``); text ids are ``(0, 0, 0, l)``;
- **latents**: the VAE (``AutoencoderKLFlux2``, 32 channels, 8x) is followed by a 2x2 patchify to 128 channels at
  1/16 of the image size and a per-channel batch-norm normalisation; the pipeline draws its noise in that space,
  ``(B, 128, H/16, W/16)``, so that is stepflow's latent (``latent_shape = (4 · C_vae, H/16, W/16)``); ``_forward``
  packs it to ``(B, H/16 · W/16, 128)`` tokens row-major (``Flux2Pipeline._pack_latents``) with the image ids
  ``(0, h, w, 0)`` and unpacks the velocity; ``decode`` undoes the normalisation (``z · sqrt(running_var + eps) +
  running_mean``), unpatchifies and runs the VAE decoder, as the pipeline does;
- **guidance**: FLUX.2-dev is guidance-distilled: ``guidance_scale`` (:attr:`Flux2Policy.embedded_guidance`, the
  pipeline's default 4.0) goes into the transformer's guidance embedding, and the pipeline has no negative branch;
  ``velocity(..., guidance=w)`` with ``w != 1`` is true CFG with the empty negative prompt (off by default);
- **time grid**: ``σ = linspace(1, 1/N, N)`` through the scheduler's dynamic exponential shift with the pipeline's
  ``compute_empirical_mu(image_seq_len, N)`` (:func:`flux2_mu`: BFL's two-line fit, which depends on the number of
  steps as well as the image tokens), then a trailing 0; it starts at exactly 1.0;
- **time inputs**: the pipeline passes ``timestep = (1000 σ) / 1000`` and the transformer multiplies by 1000 again
  after casting to the weights' dtype; ``_forward`` passes the same ``(1000 σ) / 1000`` (so fp32 is bit-identical)
  and a pre-hook on the time projection (:class:`SequentialTimeInputs`) feeds the sinusoid the fp32 values of time
  and guidance (in bf16 the transformer's cast would round 1000·σ to 8 bits of mantissa).

Load with ``Flux2Policy.from_pretrained("black-forest-labs/FLUX.2-dev")`` (gated) or a local diffusers folder
(``model.path=DIR``); a load failure is a one-line :class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from stepflow.policies.base import Cond, TimeInputs, check_image_size, check_time_grid
from stepflow.policies.pipeline import PipelinePolicy, diffusers_loader

__all__ = ["FLUX2_DEV", "LORA_TARGETS_FLUX2", "Flux2Policy", "SequentialTimeInputs", "flux2_mu",
           "load_flux2_pipeline", "pack_tokens", "unpack_tokens"]

FLUX2_DEV = "black-forest-labs/FLUX.2-dev"

#: Flow-Factory's FLUX.2 LoRA targets (models/flux/flux2.py): the attention projections and the feed-forward layers of
#: the double-stream blocks, and the single-stream blocks' fused QKV + MLP-in projection. (A suffix cannot name the
#: single-stream output projection ``attn.to_out``: the double-stream blocks' ``attn.to_out`` is a ModuleList.)
LORA_TARGETS_FLUX2: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)


def flux2_mu(image_seq_len: int, num_steps: int) -> float:
    """``compute_empirical_mu`` of ``Flux2Pipeline`` (BFL's ``flux2/sampling.py``): above 4300 image tokens
    μ = 1.6927e-4 · L + 0.45667; below, μ interpolates linearly in the number of steps between the fits for 10 steps
    (8.7381e-5 · L + 1.89833) and 200 steps (1.6927e-4 · L + 0.45667)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    m_200 = a2 * image_seq_len + b2
    if image_seq_len > 4300:
        return float(m_200)
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    return float(a * num_steps + (m_200 - 200.0 * a))


def pack_tokens(x: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, h · w, C), row-major (``Flux2Pipeline._pack_latents``)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1)


def unpack_tokens(x: Tensor, h: int, w: int) -> Tensor:
    """(B, h · w, C) -> (B, C, h, w): the inverse of :func:`pack_tokens`."""
    b, _, c = x.shape
    return x.permute(0, 2, 1).reshape(b, c, h, w)


class SequentialTimeInputs(TimeInputs):
    """:class:`~stepflow.policies.base.TimeInputs` for a module called once per time input: FLUX.2's
    ``time_guidance_embed`` runs its ``time_proj`` on the timestep, then on the guidance, and casts each sinusoid to
    the input's dtype before the (weights'-dtype) MLP; this pre-hook on ``time_proj`` gives its n-th call this
    forward's n-th fp32 value (the sinusoid is computed in fp32, the weights' dtype applied after)."""

    def __init__(self) -> None:
        super().__init__()
        self._calls = 0

    def feeding(self, values: Sequence[Tensor]):
        self._calls = 0
        return super().feeding(values)

    def __call__(self, module: nn.Module, args: tuple):
        if self.values is None:
            return None
        i = self._calls
        self._calls += 1
        if i >= len(self.values):
            raise RuntimeError(f"SequentialTimeInputs: {type(module).__name__} was called {i + 1} times in one forward, "
                               f"expected {len(self.values)} (diffusers version?)")
        value, self.values = self.values, [self.values[i]]
        try:
            out = super().__call__(module, args)
        finally:
            self.values = value
        return out


load_flux2_pipeline = diffusers_loader("Flux2Pipeline", "Flux2Transformer2DModel",
                                       what="FLUX.2", example_id=FLUX2_DEV, gated=lambda p: p == FLUX2_DEV)


class Flux2Policy(PipelinePolicy):
    """FLUX.2 policy over a ``Flux2Pipeline`` (see the module docstring).

    Args:
        pipe: the loaded pipeline (modules shared: ``policy.pipe(...)`` samples with the policy's transformer).
        height, width: image size in pixels (multiples of 16); ``latent_shape = (4 · C_vae, H/16, W/16)``.
        max_sequence_length: Mistral tokens, system message included (the pipeline's 512). FLUX.2 attends to the
            padding, so this changes the samples, not only the cost.
        text_encoder_out_layers: the text encoder's hidden-state layers stacked per token (the pipeline's (10, 20,
            30)); their number times the text width must be the transformer's ``joint_attention_dim``.
        embedded_guidance: the distilled guidance scale fed to the guidance embedding (``Flux2Pipeline``'s default
            ``guidance_scale`` 4.0); ``None`` for a transformer without one.
        guidance, eval_guidance: true-CFG scales for rollouts / evaluation (1.0: none, as the pipeline).
        lora, finetune, gradient_checkpointing, offload_text_encoders, decode_batch_size, encode_batch_size:
            see :class:`~stepflow.policies.pipeline.PipelinePolicy`.
    """

    text_encoder_names = ("text_encoder",)
    ARG_RULES = {**PipelinePolicy.ARG_RULES,
                 "max_sequence_length": {"integer": True, "ge": 1, "le": 2048,
                                         "hint": " (Mistral tokens incl. the system message; Flux2Pipeline: 512)"},
                 "embedded_guidance": {"optional": True, "ge": 0.0,
                                       "hint": " (the distilled guidance the transformer embeds: FLUX.2-dev 4.0)"}}

    def __init__(self, pipe, *, height: int = 1024, width: int = 1024, max_sequence_length: int = 512,
                 text_encoder_out_layers: Sequence[int] = (10, 20, 30), embedded_guidance: float | None = 4.0,
                 gradient_checkpointing: bool = False, offload_text_encoders: bool = False, guidance: float = 1.0,
                 eval_guidance: float = 1.0, decode_batch_size: int = 8, encode_batch_size: int = 16,
                 lora: Mapping[str, Any] | None = None, finetune: str = "lora", name: str | None = None):
        self.check_args(locals())  # the numeric arguments, before a LoRA loads
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        height, width = check_image_size(height, width, vae_scale * 2, f"VAE scale {vae_scale} x 2x2 patches")
        tcfg = pipe.transformer.config
        channels = 4 * int(pipe.vae.config.latent_channels)
        if tcfg.in_channels != channels or tcfg.patch_size != 1:
            raise ValueError("transformer in_channels != 4 x VAE latent channels (or patch_size != 1): not a FLUX.2 "
                             "pipeline")
        layers = tuple(int(i) for i in text_encoder_out_layers)
        if not layers:
            raise ValueError("model.text_encoder_out_layers: give the text encoder's hidden-state layers to stack "
                             "(Flux2Pipeline: [10, 20, 30])")
        if tcfg.guidance_embeds and embedded_guidance is None:
            raise ValueError("model.embedded_guidance: this FLUX.2 transformer is guidance-distilled (FLUX.2-dev); "
                             "give the scale it embeds (4.0)")
        super().__init__(pipe, name=name or str(getattr(pipe, "name_or_path", "") or "flux2"),
                         max_sequence_length=max_sequence_length, gradient_checkpointing=gradient_checkpointing,
                         offload_text_encoders=offload_text_encoders, guidance=guidance, eval_guidance=eval_guidance,
                         decode_batch_size=decode_batch_size, encode_batch_size=encode_batch_size)
        self.height, self.width = int(height), int(width)
        self.vae_scale_factor = vae_scale
        self.text_encoder_out_layers = layers
        self.latent_shape = (channels, self.height // (vae_scale * 2), self.width // (vae_scale * 2))
        self.image_seq_len = self.latent_shape[1] * self.latent_shape[2]
        self.embedded_guidance = float(embedded_guidance) if tcfg.guidance_embeds else None
        self.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # our own: time_grid mutates it
        self.timestep_scale = float(self.scheduler.config.get("num_train_timesteps", 1000))
        self._time_inputs = SequentialTimeInputs()
        self._time_hook = self._time_inputs.install(self.transformer.time_guidance_embed.time_proj)
        self._setup_training(lora, finetune)

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = FLUX2_DEV
    loader = staticmethod(load_flux2_pipeline)

    # ------------------------------------------------------------------ time grid
    def time_grid(self, num_steps: int) -> Tensor:
        """``Flux2Pipeline``'s grid for this resolution and number of steps, plus the trailing 0 (num_steps + 1,), from
        1 to 0 (method.md §1): ``linspace(1, 1/N, N)`` through the scheduler with ``mu = flux2_mu(image_seq_len, N)``."""
        if int(num_steps) != num_steps or num_steps < 1:
            raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
        n = int(num_steps)
        sigmas = None if self.scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / n, n)
        self.scheduler.set_timesteps(n if sigmas is None else None, sigmas=sigmas,
                                     mu=flux2_mu(self.image_seq_len, n))
        return check_time_grid(self.scheduler.sigmas.clone(), f"{type(self).__name__}.time_grid")

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """Pack, run the transformer (fp32 time and guidance into its time projection), unpack; fp32 out."""
        net = self.net
        dt = next(net.parameters()).dtype
        b, _, h, w = x.shape
        dev = x.device
        scale = self.timestep_scale
        ts = (t.float() * scale) / scale  # the pipeline's timestep / 1000 of the scheduler's 1000 σ, bit for bit
        img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1)).to(dev)
        txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1),
                                       torch.arange(cond.tokens.shape[1])).to(dev)
        feed = [ts * 1000.0]
        guidance = None
        if net.config.guidance_embeds:
            guidance = torch.full((b,), self.embedded_guidance, device=dev, dtype=torch.float32)
            feed.append(guidance * 1000.0)
        with self._time_inputs.feeding(feed):
            out = net(hidden_states=pack_tokens(x.to(dt)), encoder_hidden_states=cond.tokens.to(dt), timestep=ts,
                      guidance=guidance, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        return unpack_tokens(out.float(), h, w)

    # ------------------------------------------------------------------ text
    def _encode_chunk(self, prompts: list[str]) -> list[tuple[Tensor]]:
        tokens, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device, num_images_per_prompt=1,
                                            max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=self.text_encoder_out_layers)
        return [(tok,) for tok in tokens]

    def _collate(self, rows: list[tuple[Tensor, ...]], device: torch.device) -> Cond:
        tokens = torch.stack([r[0] for r in rows]).to(device)
        return Cond(tokens=tokens, pooled=tokens.new_zeros(len(rows), 0))

    # ------------------------------------------------------------------ image
    def _decode_chunk(self, z: Tensor) -> Tensor:
        """As the pipeline: ``z · sqrt(bn.running_var + eps) + bn.running_mean``, unpatchify 2x2, ``vae.decode``."""
        vae = self.vae
        p = self._vae_param()
        z = z.to(p.device, p.dtype)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = z * std + mean
        b, c, h, w = z.shape
        z = z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
        return vae.decode(z, return_dict=False)[0]

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, embedded_guidance={self.embedded_guidance}, "
                f"max_sequence_length={self.max_sequence_length}, lora={self.has_lora}, finetune={self.finetune!r}")
