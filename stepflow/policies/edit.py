"""What the instruction-based editing policies share (FLUX.1 Kontext, Qwen-Image-Edit): source images in, encoded once.

An editing policy sets :attr:`~stepflow.policies.base.FlowPolicy.takes_source`; its ``encode(prompts, sources)``
takes one source image per prompt (a file path, a PIL image, or a (3, H, W) tensor in [0, 1]) and returns a
:class:`~stepflow.policies.base.Cond` whose ``image`` holds each row's source latents (the pipeline's own VAE
encoding), so every velocity of the group (rollout steps, log-probs, x̂0 estimates, the update) sees them without
encoding again. Sources are cached by identity (a path's resolved name, or a hash of the pixels): a source is
VAE-encoded (and, for Qwen-Image-Edit, seen by the vision-language encoder) once per distinct source and instruction,
however many groups, steps and iterations use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from stepflow.errors import StepflowError

__all__ = ["SourceImages", "source_id", "to_pil"]


def source_id(src: Any) -> str:
    """A cache key of a source image: ``path:<resolved path>`` for a path, else ``sha1:<hash of the pixels>``."""
    if isinstance(src, (str, Path)):
        return "path:" + str(Path(src).expanduser().resolve())
    if isinstance(src, Tensor):
        t = src.detach().float().cpu().contiguous()
        return "sha1:" + hashlib.sha1(str(tuple(t.shape)).encode() + t.numpy().tobytes()).hexdigest()
    pil = to_pil(src)
    return "sha1:" + hashlib.sha1(f"{pil.size}".encode() + pil.tobytes()).hexdigest()


def to_pil(src: Any):
    """A source image as an RGB PIL image: a path (read through the data layer's cache), a PIL image, or a (3, H, W)
    tensor in [0, 1]."""
    from PIL import Image

    if isinstance(src, (str, Path)):
        from stepflow.core.data import load_source_image

        return load_source_image(str(Path(src).expanduser().resolve()))
    if isinstance(src, Tensor):
        if src.ndim != 3 or src.shape[0] != 3:
            raise ValueError(f"a source image tensor must be (3, H, W) in [0, 1], got {tuple(src.shape)}")
        arr = (src.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        return Image.fromarray(arr)
    if isinstance(src, Image.Image):
        return src.convert("RGB")
    raise TypeError(f"a source image must be a path, a PIL image or a (3, H, W) tensor, got {type(src).__name__}")


class SourceImages:
    """Mixin of the editing policies (before the pipeline policy in the bases): the ``encode(prompts, sources)``
    contract, the text-only negative prompt, and the source-latent cache. A subclass implements
    :meth:`_encode_sources` (new sources -> one latent row (C, h, w) each) and :meth:`_encode_edit` (prompts, their
    source ids, the batch's source latents -> :class:`Cond`)."""

    takes_source = True

    def _source_cache(self) -> dict[str, Tensor]:
        cache = self.__dict__.get("_sources")
        if cache is None:
            cache = self.__dict__["_sources"] = {}
        return cache

    def encode(self, prompts: Sequence[str], sources: Sequence[Any] | None = None):
        """Prompts (edit instructions) and one source image per prompt -> :class:`Cond` with ``image`` = the sources'
        latents (B, C, h, w). Each distinct source is encoded once (cached)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if sources is None:
            raise StepflowError(f"{type(self).__name__} edits a source image: encode(prompts, sources=[one source "
                                f"image per prompt]); a text-only prompt set needs a text-to-image model")
        sources = list(sources)
        if len(sources) != len(prompts):
            raise ValueError(f"encode: {len(prompts)} prompts but {len(sources)} source images")
        ids = [source_id(s) for s in sources]
        cache = self._source_cache()
        new = {i: s for i, s in zip(ids, sources) if i not in cache}
        if new:
            with torch.no_grad():
                rows = self._encode_sources([to_pil(s) for s in new.values()], list(new))
            for i, row in zip(new, rows):
                cache[i] = row
        shapes = {tuple(cache[i].shape) for i in ids}
        if len(shapes) > 1:
            raise StepflowError(f"model: the source images of one batch encode to latents of different sizes "
                                f"{sorted(shapes)} (their aspect ratios differ); {self._mixed_sizes_fix()}")
        image = torch.stack([cache[i] for i in ids]).to(self.device)
        return self._encode_edit(list(prompts), ids, image)

    def _mixed_sizes_fix(self) -> str:
        return "resize the data set's source images to one aspect ratio"

    def encode_text(self, prompts: Sequence[str]):
        """The text-only conditioning (the pipeline policy's prompt cache), without a source image."""
        return super().encode(prompts)

    def negative_cond(self, batch_size: int):
        """The negative prompt's text-only conditioning (its rows get each row's source latents in
        :meth:`~stepflow.policies.base.FlowPolicy.negative_for`), encoded once."""
        if getattr(self, "_neg_cond", None) is None:
            self._neg_cond = self.encode_text([self.negative_prompt])
        return self._neg_cond.index([0] * batch_size)

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        self._source_cache().clear()

    def _encode_sources(self, images: list, ids: list[str]) -> list[Tensor]:  # pragma: no cover - interface
        """New sources (RGB PIL images, their source ids) -> one latent row (C, h, w) each."""
        raise NotImplementedError

    def _encode_edit(self, prompts: list[str], ids: list[str], image: Tensor):  # pragma: no cover - interface
        raise NotImplementedError
