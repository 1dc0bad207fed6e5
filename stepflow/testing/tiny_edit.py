"""Tiny, randomly initialised editing pipelines (FLUX.1 Kontext, Qwen-Image-Edit) and a tiny edit data set, for tests
and CPU smoke runs, built without any download.

As :mod:`stepflow.testing.tiny_policies` does for the text-to-image families: ``save_tiny_*(dir)`` writes a normal
diffusers pipeline folder, ``tiny_*_dir()`` builds one once into ``$STEPFLOW_CACHE`` and ``model=*_tiny`` loads it
through the policy's own ``from_pretrained``:

- FLUX.1 Kontext: ``FluxKontextPipeline`` over the tiny FLUX.1-dev components (CLIP + T5, a double- and a
  single-stream block, the guidance embedding, FLUX.1-dev's dynamic-shift scheduler config, which Kontext-dev shares);
- Qwen-Image-Edit: ``QwenImageEditPipeline`` with a Qwen2.5-VL text encoder whose (1-block) vision tower sees the
  source image, a ``Qwen2VLProcessor`` (Qwen2.5-VL's patch 14, merge 2, pixel bounds) and a byte-level BPE tokenizer
  that splits the edit pipeline's chat template into exactly the 64 prefix tokens the pipeline drops (as Qwen's
  own: the system prompt and ``<|im_start|>user\\n``, so the kept states start at ``<|vision_start|>``); the
  double-stream MMDiT, causal 3-D VAE and scheduler config of the tiny Qwen-Image.

:func:`write_edit_set` writes a tiny edit data set (small PNGs of coloured shapes and a ``.jsonl`` of
``{"prompt": instruction, "image": path}``, flow_grpo's counting_edit layout); the package ships the one it writes
(``stepflow/assets/edit_tiny``, ``data=edit_tiny``) and tests write their own into ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from stepflow.testing.tiny_policies import (
    _QWEN_SPECIAL,
    _WORDS,
    TINY_HEIGHT,
    build_tiny_flux_pipeline,
    bytes_to_unicode,
    keeps_rng,
    tiny_qwen_image_parts,
)

__all__ = ["QWEN_EDIT_TEMPLATE_WORDS", "build_tiny_flux_kontext_pipeline", "build_tiny_qwen_image_edit_pipeline",
           "make_qwen_edit_tokenizer", "save_tiny_flux_kontext", "save_tiny_qwen_image_edit", "tiny_edit_dir",
           "tiny_flux_kontext_policy", "tiny_qwen_image_edit_policy", "write_edit_set",
           "EDIT_TINY_VERSION"]

#: bump when a tiny edit architecture or the tiny edit set changes, so cached copies are rebuilt
EDIT_TINY_VERSION = 1

#: the words of QwenImageEditPipeline.prompt_template_encode's system prompt, each one token in Qwen's vocabulary
QWEN_EDIT_TEMPLATE_WORDS = [
    "system", "user", "assistant", "Describe", " the", " key", " features", " of", " input", " image", " (", "color",
    ",", " shape", " size", " texture", " objects", " background", "),", " then", " explain", " how", " user", "'s",
    " text", " instruction", " should", " alter", " or", " modify", ".", " Generate", " a", " new", " that", " meets",
    " requirements", " while", " maintaining", " consistency", " with", " original", " where", " appropriate"]


def make_qwen_edit_tokenizer():
    """A byte-level BPE ``Qwen2Tokenizer`` with whole-word merges for the edit template's system prompt and the tiny
    world's words, and Qwen's special tokens, so the edit template splits as with Qwen's own tokenizer (64 tokens
    before ``<|vision_start|>``)."""
    from transformers import Qwen2Tokenizer

    byte_char = bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(byte_char.values())}
    merges: list[tuple[str, str]] = []
    words = QWEN_EDIT_TEMPLATE_WORDS + [" " + w for w in _WORDS + ["make", "bigger", "smaller"]] + ["make"]
    # the space-led words' merges first: a bare word's first pair ("u", "s" of "user") must not outrank the chain of
    # a space-led one (" user"), which would then split
    for word in sorted(dict.fromkeys(words), key=lambda w: not w.startswith(" ")):
        pieces = [byte_char[b] for b in word.encode()]
        cur = pieces[0]
        for ch in pieces[1:]:
            if (cur, ch) not in merges:
                merges.append((cur, ch))
            cur += ch
            vocab.setdefault(cur, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": _QWEN_SPECIAL + ["<|video_pad|>"]})
    return tok


@keeps_rng
def build_tiny_flux_kontext_pipeline(seed: int = 0):
    """Random tiny ``FluxKontextPipeline`` (fp32, CPU), deterministic in ``seed``: the components of the tiny
    FLUX.1-dev pipeline (:func:`~stepflow.testing.tiny_policies.build_tiny_flux_pipeline`)."""
    from diffusers import FluxKontextPipeline

    base = build_tiny_flux_pipeline(seed, "dev")
    pipe = FluxKontextPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=base.text_encoder,
                               tokenizer=base.tokenizer, text_encoder_2=base.text_encoder_2,
                               tokenizer_2=base.tokenizer_2, transformer=base.transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _qwen_vl_processor(tok):
    """Qwen2.5-VL's processor (patch 14, 2x2 merge, temporal patch 2, its pixel bounds 3136 .. 12845056)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    size = {"shortest_edge": 3136, "longest_edge": 12845056}
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(size=size), tokenizer=tok,
                            video_processor=Qwen2VLVideoProcessor(size=size))


@keeps_rng
def build_tiny_qwen_image_edit_pipeline(seed: int = 0):
    """Random tiny ``QwenImageEditPipeline`` (fp32, CPU), deterministic in ``seed``.

    Text: Qwen2.5-VL (2 layers, hidden 32, M-RoPE sections (2, 3, 3)) with a 1-block vision tower (patch 14, 2x2
    merge to 32 wide) that sees the source image, :func:`make_qwen_edit_tokenizer` and Qwen2.5-VL's processor.
    Transformer, VAE and scheduler: the tiny Qwen-Image's (2 double-stream blocks, the causal 3-D VAE with
    per-channel latent mean/std, dynamic shift with ``shift_terminal``).
    """
    from diffusers import QwenImageEditPipeline

    tok = make_qwen_edit_tokenizer()
    text_encoder, transformer, vae, scheduler = tiny_qwen_image_parts(
        tok, seed, max_position_embeddings=4096, video_token="<|video_pad|>", fullatt_block_indexes=[0])
    pipe = QwenImageEditPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                                 processor=_qwen_vl_processor(tok), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_BUILDERS = {"flux_kontext": build_tiny_flux_kontext_pipeline, "qwen_image_edit": build_tiny_qwen_image_edit_pipeline}


def _cache_root(cache_dir=None) -> Path:
    return Path(cache_dir or os.environ.get("STEPFLOW_CACHE") or Path.home() / ".cache" / "stepflow").expanduser()


def _atomic_build(target: Path, marker: str, write) -> Path:
    """Build into a temporary folder beside ``target`` with ``write(folder)`` and move it into place atomically (a
    parallel process that won the race keeps its copy)."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_tiny_flux_kontext(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny FLUX.1 Kontext pipeline and write it as a diffusers folder."""
    _BUILDERS["flux_kontext"](seed).save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def save_tiny_qwen_image_edit(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny Qwen-Image-Edit pipeline and write it as a diffusers folder (with its processor)."""
    _BUILDERS["qwen_image_edit"](seed).save_pretrained(directory, safe_serialization=True)
    return Path(directory)


def tiny_edit_dir(kind: str, seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny pipeline folder of ``kind`` (``flux_kontext`` / ``qwen_image_edit``), built on first use:
    ``<cache>/<kind>_tiny-v{EDIT_TINY_VERSION}-s{seed}``."""
    if kind not in _BUILDERS:
        raise ValueError(f"kind: must be one of {sorted(_BUILDERS)}, got {kind!r}")
    target = _cache_root(cache_dir) / f"{kind}_tiny-v{EDIT_TINY_VERSION}-s{seed}"
    return _atomic_build(target, "model_index.json",
                         lambda d: _BUILDERS[kind](seed).save_pretrained(d, safe_serialization=True))


def tiny_flux_kontext_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, **kwargs):
    """``model=flux_kontext_tiny``: build (once) the tiny pipeline and load it through
    ``FluxKontextPolicy.from_pretrained`` (keyword arguments go there)."""
    from stepflow.policies.flux_kontext import FluxKontextPolicy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    FluxKontextPolicy.check_args(kwargs)  # before the tiny pipeline is built into the cache
    return FluxKontextPolicy.from_pretrained(path or str(tiny_edit_dir("flux_kontext", seed, cache_dir)), **kwargs)


def tiny_qwen_image_edit_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, **kwargs):
    """``model=qwen_image_edit_tiny``: build (once) and load through ``QwenImageEditPolicy.from_pretrained``."""
    from stepflow.policies.qwen_image_edit import QwenImageEditPolicy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    QwenImageEditPolicy.check_args(kwargs)
    return QwenImageEditPolicy.from_pretrained(path or str(tiny_edit_dir("qwen_image_edit", seed, cache_dir)),
                                               **kwargs)


# the factories build editing policies: the requirement rows read this before anything is built
tiny_flux_kontext_policy.takes_source = True
tiny_qwen_image_edit_policy.takes_source = True


# ---------------------------------------------------------------------------------------------- a tiny edit set
#: (shape, colour) of the tiny set's source images and the instructions that edit them
_SOURCES = [("circle", "red"), ("square", "blue"), ("circle", "green"), ("square", "red")]
_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220)}


def _shape_png(path: Path, shape: str, colour: str, size: int) -> None:
    import numpy as np
    from PIL import Image

    yy, xx = np.mgrid[0:size, 0:size]
    c, r = (size - 1) / 2, size * 0.3
    inside = ((yy - c) ** 2 + (xx - c) ** 2 <= r * r) if shape == "circle" else (
        (abs(yy - c) <= r) & (abs(xx - c) <= r))
    img = np.full((size, size, 3), 235, dtype=np.uint8)
    img[inside] = _COLOURS[colour]
    Image.fromarray(img).save(path)


def write_edit_set(directory: str | os.PathLike, size: int = 64, n_eval: int = 2) -> Path:
    """A tiny edit data set in ``directory``: ``images/*.png`` (``size`` px coloured shapes) and ``train.jsonl`` /
    ``eval.jsonl`` of ``{"prompt": "<instruction>", "image": "images/<name>.png", "tag": ...}`` (paths relative to
    the files, flow_grpo's counting_edit layout). Returns ``directory``."""
    d = Path(directory)
    (d / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for shape, colour in _SOURCES:
        name = f"{colour}_{shape}.png"
        _shape_png(d / "images" / name, shape, colour, size)
        other = next(c for c in _COLOURS if c != colour)
        rows.append({"prompt": f"make the {shape} {other}", "image": f"images/{name}", "tag": "colour_edit"})
        rows.append({"prompt": f"make the {shape} bigger", "image": f"images/{name}", "tag": "size_edit"})
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:n_eval]))
    return d

