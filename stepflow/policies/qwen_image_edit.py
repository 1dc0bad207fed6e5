"""Qwen-Image-Edit (instruction-based editing) as a :class:`~stepflow.policies.base.FlowPolicy`, over diffusers'
``QwenImageEditPipeline``.

What it adds to :class:`~stepflow.policies.qwen_image.QwenImagePolicy` (and how it reproduces
``QwenImageEditPipeline.__call__``):

- **image sizing**: the source is resized (the pipeline's ``image_processor.resize``) to ``calculate_dimensions(
  source_area, width / height)``: the source's aspect ratio at an area of ``source_area`` pixels (the pipeline's fixed
  1024², the default), sides rounded to multiples of 32 (``source_fit=aspect``); or, ``source_fit=output``, to the
  output's ``height × width`` (every source the same size, so a batch may mix aspect ratios; flow_grpo resizes its
  Kontext sources so). The edited image has the policy's ``height × width`` (the pipeline's ``height``/``width``);
- **text + image**: Qwen2.5-VL reads the edit template (``"<|im_start|>system\\nDescribe the key features of the
  input image ...<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\\n<|im_start|>assistant
  \\n"``) with the resized source (Qwen2VLProcessor's patches), the first 64 states dropped: the pipeline's own
  ``encode_prompt(prompt, image)``, once per distinct (instruction, source); the kept states include the source's
  vision tokens. The negative prompt (``" "``) is encoded with each row's source too (the pipeline does), held in
  ``Cond.negative``;
- **source latents**: the pipeline's ``_encode_vae_image`` of the preprocessed source (the VAE's mode, ``(z − mean)
  / std`` per channel), once per distinct source, held unpacked in ``Cond.image`` (B, 16, h_s, w_s);
- **transformer**: ``[x tokens, source tokens]`` with ``img_shapes = [(1, H/16, W/16), (1, h_s/2, w_s/2)]``, the
  output tokens kept; **true CFG** with the per-token norm rescale as Qwen-Image (both branches see the source);
- **time grid**: Qwen-Image's (dynamic shift with μ of the *output* tokens, ``shift_terminal``), then 0.

Load with ``QwenImageEditPolicy.from_pretrained("Qwen/Qwen-Image-Edit")`` or a local diffusers folder
(``model.path=DIR``); a load failure is a one-line :class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from stepflow.errors import StepflowError
from stepflow.policies.base import Cond
from stepflow.policies.edit import SourceImages
from stepflow.policies.flux import pack_latents, unpack_latents
from stepflow.policies.pipeline import diffusers_loader
from stepflow.policies.qwen_image import QwenImagePolicy

__all__ = ["QWEN_IMAGE_EDIT", "QwenImageEditPolicy", "load_qwen_image_edit_pipeline", "SOURCE_FITS"]

QWEN_IMAGE_EDIT = "Qwen/Qwen-Image-Edit"
#: how a source image is sized: its own aspect ratio at ``source_area`` (the pipeline's), or the output's size
SOURCE_FITS = ("aspect", "output")


load_qwen_image_edit_pipeline = diffusers_loader("QwenImageEditPipeline", "QwenImageTransformer2DModel",
                                                 what="Qwen-Image-Edit", example_id=QWEN_IMAGE_EDIT)


class QwenImageEditPolicy(SourceImages, QwenImagePolicy):
    """Qwen-Image-Edit policy over a ``QwenImageEditPipeline`` (see the module docstring); ``encode(prompts,
    sources)``.

    Args (besides :class:`~stepflow.policies.qwen_image.QwenImagePolicy`'s):
        source_area: the pixel area a source is resized to, keeping its aspect ratio (``source_fit=aspect``): the
            pipeline's 1024 × 1024.
        source_fit: ``aspect`` (the pipeline's sizing) or ``output`` (the output's height × width).
    """

    takes_source = True
    ARG_RULES = {**QwenImagePolicy.ARG_RULES,
                 "source_area": {"integer": True, "ge": 32 * 32,
                                 "hint": " (pixels; QwenImageEditPipeline: 1048576 = 1024 x 1024)"}}

    def __init__(self, pipe, *, height: int = 512, width: int = 512, source_area: int = 1024 * 1024,
                 source_fit: str = "aspect", **kwargs: Any):
        self.check_args({"source_area": source_area, **kwargs})
        if source_fit not in SOURCE_FITS:
            raise StepflowError(f"model.source_fit: must be one of {', '.join(SOURCE_FITS)}, got {source_fit!r}")
        super().__init__(pipe, height=height, width=width, **kwargs)
        if kwargs.get("name") is None:
            self.name = str(getattr(pipe, "name_or_path", "") or "qwen_image_edit")
        self.source_area = int(source_area)
        self.source_fit = source_fit

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = QWEN_IMAGE_EDIT
    loader = staticmethod(load_qwen_image_edit_pipeline)

    # ------------------------------------------------------------------ source images
    def source_size(self, image) -> tuple[int, int]:
        """(height, width) a PIL source is resized to: ``calculate_dimensions(source_area, w / h)`` (multiples of 32,
        the pipeline's) or the output's size."""
        if self.source_fit == "output":
            return self.height, self.width
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        w, h, _ = calculate_dimensions(self.source_area, image.size[0] / image.size[1])
        m = self.vae_scale_factor * 2
        return int(h) // m * m, int(w) // m * m

    def _mixed_sizes_fix(self) -> str:
        return ("resize the data set's source images to one aspect ratio, or set model.source_fit=output (every "
                "source at the output's size)")

    def _resized(self, image):
        h, w = self.source_size(image)
        return self.pipe.image_processor.resize(image, h, w), h, w

    def _encode_sources(self, images: list, ids: list[str]) -> list[Tensor]:
        """PIL sources -> the pipeline's source latents (16, h/8, w/8) each; the resized images, which the
        vision-language encoder reads, are kept by source id (:meth:`_encode_edit`)."""
        proc = self.pipe.image_processor
        p = self._vae_param()
        out = []
        for img, sid in zip(images, ids):
            resized, h, w = self._resized(img)
            pre = proc.preprocess(resized, h, w).unsqueeze(2)  # (1, 3, 1, h, w)
            lat = self.pipe._encode_vae_image(pre.to(p.device, p.dtype), generator=None)  # (1, 16, 1, h/8, w/8)
            self._vl_images()[sid] = resized
            out.append(lat[0, :, 0].float())
        return out

    def _vl_images(self) -> dict:
        """source id -> the resized source (PIL) the vision-language encoder reads."""
        return self.__dict__.setdefault("_vl_by_source", {})

    def _pair_cache(self) -> dict:
        return self.__dict__.setdefault("_pairs", {})

    @torch.no_grad()
    def _encode_pairs(self, pairs: list[tuple[str, str]]) -> None:
        """(instruction, source id) pairs not cached yet -> the pipeline's ``encode_prompt(prompt, image)`` states,
        kept per pair at its own length (chunks of ``encode_batch_size``)."""
        cache = self._pair_cache()
        new = [pr for pr in dict.fromkeys(pairs) if pr not in cache]
        if not new:
            return
        if not self.text_encoders:
            raise RuntimeError(f"text encoders were freed and {len(new)} (instruction, source) pair(s) are not cached")
        with self._text_encoders_on(self.device):
            for i in range(0, len(new), self.encode_batch_size):
                chunk = new[i:i + self.encode_batch_size]
                tokens, mask = self.pipe.encode_prompt(prompt=[p for p, _ in chunk],
                                                       image=[self._vl_images()[s] for _, s in chunk],
                                                       device=self.device, num_images_per_prompt=1)
                self.encoder_calls += 1
                lengths = [tokens.shape[1]] * len(chunk) if mask is None else mask.sum(1).tolist()
                for pr, tok, n in zip(chunk, tokens, lengths):
                    cache[pr] = (tok[:n],)

    def _encode_edit(self, prompts: list[str], ids: list[str], image: Tensor) -> Cond:
        neg = self.negative_prompt
        self._encode_pairs([(p, s) for p, s in zip(prompts, ids)] + [(neg, s) for s in ids])
        cache = self._pair_cache()
        cond = self._collate([cache[(p, s)] for p, s in zip(prompts, ids)], self.device)
        negative = self._collate([cache[(neg, s)] for s in ids], self.device)
        return replace(cond, image=image, negative=replace(negative, image=image))

    def negative_cond(self, batch_size: int):
        raise StepflowError("Qwen-Image-Edit encodes its negative prompt with each row's source image: use "
                            "negative_for(cond) (Cond.negative) of an encode(prompts, sources)")

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        self._pair_cache().clear()
        self._vl_images().clear()

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        if cond.image is None:
            raise StepflowError(f"{type(self).__name__}: the conditioning has no source image (Cond.image); encode "
                                "with encode(prompts, sources)")
        net = self.net
        dt = next(net.parameters()).dtype
        b, _, h, w = x.shape
        hs, ws = cond.image.shape[-2:]
        hidden = torch.cat([pack_latents(x.to(dt)), pack_latents(cond.image.to(x.device, dt))], 1)
        t = t.float()
        with self._time_inputs.feeding([t]):
            out = net(hidden_states=hidden, timestep=t, encoder_hidden_states=cond.tokens.to(dt),
                      encoder_hidden_states_mask=cond.mask,
                      img_shapes=[[(1, h // 2, w // 2), (1, hs // 2, ws // 2)]] * b, return_dict=False)[0]
        return unpack_latents(out[:, : (h // 2) * (w // 2)].float(), h, w)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, source_fit={self.source_fit!r}, "
                f"source_area={self.source_area}, negative_prompt={self.negative_prompt!r}, lora={self.has_lora}, "
                f"finetune={self.finetune!r}")
