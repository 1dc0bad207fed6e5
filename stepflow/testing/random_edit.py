"""Random-weight builds of the editing families (FLUX.1 Kontext, Qwen-Image-Edit) at their published size or tiny,
without downloads: ``model=flux_kontext_random`` / ``model=qwen_image_edit_random``, for GPU checks of memory and
speed and the memory table (as :mod:`stepflow.testing.random_policies` does for the text-to-image families).

The transformers are the text-to-image twins' exactly (FLUX.1 Kontext-dev's ``transformer/config.json`` is
FLUX.1-dev's, 11.9 B; Qwen-Image-Edit's is Qwen-Image's, 20.4 B), the VAEs too; what differs is the sequence: the
source's tokens follow the output's (twice the image tokens at equal sizes). The text encoders are replaced by fixed
random embeddings of the real shapes (seeded by the prompt; Qwen-Image-Edit's also by the source, with the number of
vision tokens Qwen2.5-VL gives the resized source), the source images are VAE-encoded for real (random weights).

========================  =========================================================  =================================
``model``                 transformer                                                text (+ source)
========================  =========================================================  =================================
``flux_kontext``          ``FluxTransformer2DModel``, FLUX.1-dev's config (11.9 B)   T5 (512, 4096) + CLIP (768)
``qwen_image_edit``       ``QwenImageTransformer2DModel``, Qwen-Image's (20.4 B)     Qwen2.5-VL (L + vision, 3584)
========================  =========================================================  =================================
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stepflow.policies.base import check_image_size
from stepflow.testing import random_policies as rp

__all__ = ["EDIT_MODELS", "EDIT_SPECS", "random_edit_policy", "edit_param_counts", "edit_memory_table"]

EDIT_MODELS = ("flux_kontext", "qwen_image_edit")
#: the published configs: the text-to-image twin's spec (random_policies.SPECS) of each editing model
EDIT_SPECS: dict[str, str] = {"flux_kontext": "flux_dev", "qwen_image_edit": "qwen_image"}


def _twin(model: str) -> str:
    if model not in EDIT_SPECS:
        raise ValueError(f"model: must be one of {', '.join(EDIT_MODELS)}, got {model!r}")
    return EDIT_SPECS[model]


def _policy_class(model: str):
    from stepflow.policies.flux_kontext import FluxKontextPolicy
    from stepflow.policies.qwen_image_edit import QwenImageEditPolicy

    if model == "flux_kontext":
        class RandomTextFluxKontextPolicy(rp._RandomText, FluxKontextPolicy):
            """FluxKontextPolicy whose text encoders are fixed random embeddings (T5-XXL tokens, CLIP-L pooled)."""

        return RandomTextFluxKontextPolicy

    class RandomTextQwenImageEditPolicy(rp._RandomText, QwenImageEditPolicy):
        """QwenImageEditPolicy whose Qwen2.5-VL is fixed random hidden states: the prompt's tokens and the resized
        source's vision tokens (a 14-px patch grid merged 2x2, as Qwen2VLProcessor cuts it), per (prompt, source)."""

        def _encode_pairs(self, pairs: list[tuple[str, str]]) -> None:
            cache = self._pair_cache()
            for p, sid in dict.fromkeys(pairs):
                if (p, sid) in cache:
                    continue
                w, h = self._vl_images()[sid].size
                vision = max(1, round(h / 28)) * max(1, round(w / 28))
                n = rp._qwen_len(p) + vision + 2  # + <|vision_start|> <|vision_end|>
                g = torch.Generator().manual_seed(zlib.crc32(f"{p}\0{sid}".encode()))
                cache[(p, sid)] = (torch.randn(n, self.text_dim, generator=g).to(self.device, self.dtype),)
            self.encoder_calls += 1

    return RandomTextQwenImageEditPolicy


def random_edit_policy(model: str = "flux_kontext", *, tiny: bool = False, device: str | None = "auto",
                       dtype: str | torch.dtype = "bfloat16", vae_dtype: str | torch.dtype = "float32", seed: int = 0,
                       height: int | None = None, width: int | None = None, max_sequence_length: int | None = None,
                       finetune: str = "lora", lora: Mapping[str, Any] | None = None,
                       gradient_checkpointing: bool = True, decode_batch_size: int = 8,
                       guidance: float | None = None, eval_guidance: float | None = None,
                       embedded_guidance: float = 2.5, source_area: int | None = None, source_fit: str = "aspect",
                       save_weights: bool = True, name: str | None = None):
    """An editing policy over random modules of ``model`` (one of :data:`EDIT_MODELS`), built on ``device``: the
    ``_target_`` of ``model=<model>_random``. Arguments as :func:`stepflow.testing.random_policies.random_policy`;
    ``embedded_guidance``: Kontext's distilled guidance (2.5); ``source_area`` / ``source_fit``: Qwen-Image-Edit's
    source sizing (None: the pipeline's 1024², 64² with ``tiny``)."""
    from stepflow.policies.pipeline import resolve_dtype

    twin = _twin(model)
    spec = rp._spec(twin, tiny)
    text = spec["text"]
    cls = _policy_class(model)
    given = dict(max_sequence_length=max_sequence_length, decode_batch_size=decode_batch_size, guidance=guidance,
                 eval_guidance=eval_guidance)
    if model == "flux_kontext":
        given["embedded_guidance"] = embedded_guidance
    else:
        source_area = source_area or (64 * 64 if tiny else 1024 * 1024)
        given["source_area"] = source_area
    cls.check_args({k: v for k, v in given.items() if v is not None})
    size = 64 if tiny else 512
    scale = rp.vae_scale(spec)
    height, width = check_image_size(size if height is None else height, size if width is None else width,
                                     scale * 2, f"VAE scale {scale} x 2x2 packing")
    pipe = rp.build_modules(twin, tiny, device, resolve_dtype(dtype, torch.bfloat16, "model.dtype"),
                            resolve_dtype(vae_dtype, field="model.vae_dtype"), seed)
    pipe.name_or_path = f"random-{model}{'-tiny' if tiny else ''}"
    pipe.image_processor = _image_processor(scale)
    pipe._encode_vae_image = _vae_encoder(pipe, model)
    kw: dict[str, Any] = dict(height=height, width=width, gradient_checkpointing=gradient_checkpointing,
                              decode_batch_size=decode_batch_size, finetune=finetune, lora=lora,
                              name=name or pipe.name_or_path)
    for k in ("guidance", "eval_guidance"):
        if given[k] is not None:
            kw[k] = float(given[k])
    seq = max_sequence_length or text["text_len"]
    kw["max_sequence_length"] = seq
    if model == "flux_kontext":
        kw["embedded_guidance"] = embedded_guidance
    else:
        kw.update(source_area=source_area, source_fit=source_fit)
    policy = cls(pipe, **kw)
    policy.text_len, policy.text_dim, policy.pooled_dim = seq, text["text_dim"], text["pooled_dim"]
    policy.save_weights = bool(save_weights)
    return policy


random_edit_policy.takes_source = True


def _image_processor(vae_scale: int):
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=vae_scale * 2)


def _vae_encoder(pipe, model: str):
    """The pipeline's ``_encode_vae_image`` for a ``SimpleNamespace`` pipeline: the VAE's mode, normalised as the
    model's pipeline does (FLUX: shift / scaling factors; Qwen-Image: per-channel mean / std)."""
    vae = pipe.vae

    def encode(image: Tensor, generator=None) -> Tensor:
        z = vae.encode(image).latent_dist.mode()
        cfg = vae.config
        if model == "flux_kontext":
            return (z - cfg.shift_factor) * cfg.scaling_factor
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(z.device, z.dtype)
        return (z - mean) / std

    return encode


def edit_param_counts(model: str, lora_rank: int = 32, targets: Sequence[str] | None = None) -> dict[str, int]:
    """Exact parameter counts (:func:`stepflow.testing.random_policies.param_counts`) of ``model``'s transformer, its
    LoRA (rank ``lora_rank`` on the family's targets: Kontext's add the single-stream ``proj_mlp``) and VAE: the
    text-to-image twin's modules."""
    if targets is None and model == "flux_kontext":
        from stepflow.policies.flux_kontext import LORA_TARGETS_FLUX_KONTEXT

        targets = LORA_TARGETS_FLUX_KONTEXT
    return rp.param_counts(_twin(model), lora_rank, targets)


def edit_memory_table(world: int = 8, gpu_gib: float = 80.0, lora_rank: int = 32,
                      models: Sequence[str] = EDIT_MODELS) -> str:
    """:func:`stepflow.testing.random_policies.memory_table` rows of the editing models (persistent state per GPU;
    the activations, with twice the image tokens of the text-to-image twin, come on top)."""
    return rp.memory_table(world, gpu_gib, lora_rank, models,
                           counts={m: edit_param_counts(m, lora_rank) for m in models})
