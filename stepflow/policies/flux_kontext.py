"""FLUX.1 Kontext (instruction-based editing) as a :class:`~stepflow.policies.base.FlowPolicy`, over diffusers'
``FluxKontextPipeline``.

What it adds to :class:`~stepflow.policies.flux.FluxPolicy` (and how it reproduces ``FluxKontextPipeline.__call__``):

- **source image**: resized to the output's ``height × width`` (flow_grpo's Kontext task resizes every source to the
  training resolution; the pipeline with ``_auto_resize=False`` on a source of that size does the same), through the
  pipeline's ``image_processor.resize`` / ``preprocess`` (to [-1, 1]) and ``_encode_vae_image`` (the VAE's mode,
  ``(z − shift_factor) · scaling_factor``), once per distinct source (:class:`~stepflow.policies.edit.SourceImages`);
  held unpacked in ``Cond.image`` (B, 16, H/8, W/8);
- **latent concatenation**: ``_forward`` packs the noisy latents and the source latents into 2×2 tokens and runs the
  transformer on ``[x tokens, source tokens]`` with the ids ``[latent ids (0, i, j), image ids (1, i, j)]`` (the
  pipeline's ``prepare_latents``: the source's first id axis set to 1), then keeps the first ``H/16 · W/16`` output
  tokens (``noise_pred[:, : latents.size(1)]``);
- **guidance**: FLUX.1 Kontext-dev is guidance-distilled: :attr:`embedded_guidance` (the model card's 2.5; the
  pipeline's default ``guidance_scale`` is 3.5) goes into the guidance embedding; ``velocity(..., guidance=w)`` with
  ``w != 1`` is the pipeline's true CFG (``true_cfg_scale`` with ``negative_prompt``), both branches seeing the source;
- **time grid**: the pipeline's ``linspace(1, 1/N, N)`` through the dynamic exponential shift with μ of the *output*
  tokens (``image_seq_len = latents.shape[1]``, before the source tokens are appended), then 0; it starts at 1.0.

Load with ``FluxKontextPolicy.from_pretrained("black-forest-labs/FLUX.1-Kontext-dev")`` (gated: accept the licence) or
a local diffusers folder (``model.path=DIR``); a load failure is a one-line :class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from stepflow.errors import StepflowError
from stepflow.policies.base import Cond
from stepflow.policies.edit import SourceImages
from stepflow.policies.flux import LORA_TARGETS_FLUX, FluxPolicy, pack_latents, unpack_latents
from stepflow.policies.pipeline import diffusers_loader

__all__ = ["FLUX_KONTEXT", "LORA_TARGETS_FLUX_KONTEXT", "FluxKontextPolicy", "load_flux_kontext_pipeline",
           "kontext_ids"]

FLUX_KONTEXT = "black-forest-labs/FLUX.1-Kontext-dev"

#: flow_grpo's Kontext LoRA targets (scripts/train_flux_kontext.py): FLUX's (attention of both streams, the
#: double-stream MLPs) and the single-stream blocks' ``proj_mlp``
LORA_TARGETS_FLUX_KONTEXT: tuple[str, ...] = LORA_TARGETS_FLUX + ("proj_mlp",)


load_flux_kontext_pipeline = diffusers_loader("FluxKontextPipeline", "FluxTransformer2DModel",
                                              what="FLUX.1 Kontext", example_id=FLUX_KONTEXT,
                                              gated=lambda p: p == FLUX_KONTEXT)


def kontext_ids(h: int, w: int, hs: int, ws: int, device, dtype) -> Tensor:
    """The transformer's ids of ``h × w`` output tokens then ``hs × ws`` source tokens ((h·w + hs·ws, 3)): (0, i, j)
    for the output, (1, i, j) for the source (``FluxKontextPipeline.prepare_latents``)."""
    def grid(a: int, b: int, first: float) -> Tensor:
        ids = torch.zeros(a, b, 3)
        ids[..., 0] = first
        ids[..., 1] += torch.arange(a)[:, None]
        ids[..., 2] += torch.arange(b)[None, :]
        return ids.reshape(-1, 3)

    return torch.cat([grid(h, w, 0.0), grid(hs, ws, 1.0)]).to(device, dtype)


class FluxKontextPolicy(SourceImages, FluxPolicy):
    """FLUX.1 Kontext policy over a ``FluxKontextPipeline`` (see the module docstring); ``encode(prompts, sources)``.

    Args: as :class:`~stepflow.policies.flux.FluxPolicy` (``height``/``width`` are the edited image's and the resized
    source's size; ``embedded_guidance``: Kontext-dev's distilled guidance, 2.5 on the model card).
    """

    takes_source = True

    def __init__(self, pipe, *, height: int = 512, width: int = 512, max_sequence_length: int = 512,
                 embedded_guidance: float | None = 2.5, **kwargs: Any):
        super().__init__(pipe, height=height, width=width, max_sequence_length=max_sequence_length,
                         embedded_guidance=embedded_guidance, **kwargs)
        if kwargs.get("name") is None:
            self.name = str(getattr(pipe, "name_or_path", "") or "flux_kontext")

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = FLUX_KONTEXT
    loader = staticmethod(load_flux_kontext_pipeline)

    # ------------------------------------------------------------------ source images
    def _encode_sources(self, images: list, ids: list[str]) -> list[Tensor]:
        """PIL sources -> the pipeline's latents (16, H/8, W/8) each: resized to the output size, preprocessed to
        [-1, 1], the VAE's mode normalised by its shift and scaling factors."""
        proc = self.pipe.image_processor
        p = self._vae_param()
        out = []
        for img in images:
            pre = proc.preprocess(proc.resize(img, self.height, self.width), self.height, self.width)
            lat = self.pipe._encode_vae_image(pre.to(p.device, p.dtype), generator=None)
            out.append(lat[0].float())
        return out

    def _encode_edit(self, prompts: list[str], ids: list[str], image: Tensor) -> Cond:
        return replace(self.encode_text(prompts), image=image)

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """Pack ``[x, source]`` tokens, run the transformer (fp32 time and guidance into its time embedding), keep the
        output tokens, unpack; fp32 out."""
        if cond.image is None:
            raise StepflowError(f"{type(self).__name__}: the conditioning has no source image (Cond.image); encode "
                                "with encode(prompts, sources)")
        net = self.net
        dt = next(net.parameters()).dtype
        b, _, h, w = x.shape
        hs, ws = cond.image.shape[-2:]
        dev = x.device
        hidden = torch.cat([pack_latents(x.to(dt)), pack_latents(cond.image.to(dev, dt))], 1)
        img_ids = kontext_ids(h // 2, w // 2, hs // 2, ws // 2, dev, dt)
        txt_ids = torch.zeros(cond.tokens.shape[1], 3, device=dev, dtype=dt)
        t = t.float()
        feed = [t * 1000.0]
        guidance = None
        if net.config.guidance_embeds:
            guidance = torch.full((b,), self.embedded_guidance, device=dev, dtype=torch.float32)
            feed.append(guidance * 1000.0)
        with self._time_inputs.feeding(feed):
            out = net(hidden_states=hidden, timestep=t, guidance=guidance, pooled_projections=cond.pooled.to(dt),
                      encoder_hidden_states=cond.tokens.to(dt), txt_ids=txt_ids, img_ids=img_ids,
                      return_dict=False)[0]
        return unpack_latents(out[:, : (h // 2) * (w // 2)].float(), h, w)
