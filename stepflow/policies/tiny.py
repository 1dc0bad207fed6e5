"""A tiny, randomly initialised Stable Diffusion 3 pipeline for tests and CPU smoke runs.

Same architecture family as SD3.5-Medium (three text encoders, joint-attention MMDiT with a dual-attention
block and RMS qk-norm, a 16-channel 8x VAE with SD3's ``scaling_factor``/``shift_factor``), only tiny, so the
real loading code (``SD3Policy.from_pretrained``) is exercised end to end without any download:
``save_tiny_sd3(dir)`` writes a normal diffusers pipeline folder and ``model=sd3_tiny`` loads it back.

Tokenizers are built in memory (transformers 5 tokenizers accept a vocab and merges directly); see
``environment.md`` §2.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

#: bump when the tiny architecture changes, so cached copies are rebuilt
TINY_VERSION = 1

TINY_HEIGHT = 64  # default image size of the tiny model (latent 8x8 with the 8x VAE)
_CLIP_H = 16  # two CLIPs concatenated = 32 = joint_attention_dim = T5 d_model
_WORDS = ["a", "the", "cat", "dog", "photo", "of", "red", "blue", "green", "circle", "square", "on", "and"]


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP's reversible byte -> unicode table."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def make_clip_tokenizer(model_max_length: int = 77):
    """A byte-level BPE ``CLIPTokenizer`` with a handful of merges (about 520 tokens)."""
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    tokens = chars + [c + "</w>" for c in chars]
    merges = ["t h", "th e</w>", "o n</w>", "c a", "ca t</w>", "d o", "do g</w>", "r e", "re d</w>"]
    tokens += ["".join(m.split()) for m in merges if "".join(m.split()) not in tokens]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges],
                         model_max_length=model_max_length)


def make_t5_tokenizer(model_max_length: int = 256):
    """A Unigram ``T5Tokenizer``: pad=0, eos=1, unk=2, lower-case letters and a few whole words."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(c), -5.0) for c in range(97, 123)]
    pieces += [("\u2581" + w, -3.0) for w in _WORDS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


def build_tiny_sd3_pipeline(seed: int = 0):
    """Random tiny ``StableDiffusion3Pipeline`` (fp32, CPU), deterministic in ``seed``.

    Transformer: 2 layers (the first with SD3.5's dual attention), 2 heads of 8, RMS qk-norm, 16 latent channels.
    VAE: 4 blocks (8x downsample), 16 latent channels, ``scaling_factor=1.5305``, ``shift_factor=0.0609`` (SD3's).
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    clip_tok, t5_tok = make_clip_tokenizer(), make_t5_tokenizer()
    torch.manual_seed(seed)
    clip_cfg = CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=_CLIP_H, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, max_position_embeddings=77, projection_dim=_CLIP_H,
                              bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
                              pad_token_id=clip_tok.pad_token_id)
    text_encoder = CLIPTextModelWithProjection(clip_cfg)
    text_encoder_2 = CLIPTextModelWithProjection(clip_cfg)
    text_encoder_3 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=2 * _CLIP_H, d_kv=8, d_ff=64, num_layers=1,
                                             num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                             pad_token_id=0, eos_token_id=1))
    transformer = SD3Transformer2DModel(sample_size=TINY_HEIGHT // 8, patch_size=2, in_channels=16, out_channels=16,
                                        num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                        joint_attention_dim=2 * _CLIP_H, caption_projection_dim=16,
                                        pooled_projection_dim=2 * _CLIP_H, pos_embed_max_size=32,
                                        dual_attention_layers=(0,), qk_norm="rms_norm")
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
                        layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=TINY_HEIGHT,
                        use_quant_conv=False, use_post_quant_conv=False,
                        shift_factor=0.0609, scaling_factor=1.5305)  # shift_factor must be set for SD3 decode
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=clip_tok, text_encoder_2=text_encoder_2, tokenizer_2=clip_tok,
        text_encoder_3=text_encoder_3, tokenizer_3=t5_tok)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_sd3(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny pipeline and write it as a diffusers folder (``model_index.json`` + components)."""
    directory = Path(directory)
    build_tiny_sd3_pipeline(seed).save_pretrained(directory, safe_serialization=True)
    return directory


def tiny_sd3_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny pipeline folder, built on first use (atomically, so parallel processes do not race).

    Location: ``cache_dir`` or ``$STEPFLOW_CACHE`` or ``~/.cache/stepflow``, in ``sd3_tiny-v{TINY_VERSION}-s{seed}``.
    """
    root = Path(cache_dir or os.environ.get("STEPFLOW_CACHE") or Path.home() / ".cache" / "stepflow").expanduser()
    target = root / f"sd3_tiny-v{TINY_VERSION}-s{seed}"
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".sd3_tiny-", dir=root))
    try:
        save_tiny_sd3(tmp, seed)
        try:
            os.replace(tmp, target)  # atomic; fails if another process won the race (target exists, non-empty)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_sd3_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, **kwargs):
    """``model=sd3_tiny``: build (once) the tiny pipeline and load it through ``SD3Policy.from_pretrained``.

    ``path``: an existing tiny pipeline folder to load instead of the cached build. Other keyword arguments go to
    :meth:`stepflow.policies.sd3.SD3Policy.from_pretrained` (``dtype``, ``height``, ``lora``, ...).
    """
    from stepflow.policies.sd3 import SD3Policy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    return SD3Policy.from_pretrained(path or str(tiny_sd3_dir(seed, cache_dir)), **kwargs)
