"""Tiny, randomly initialised diffusers pipelines for tests and CPU smoke runs: SD3.5-Medium / -Large, FLUX.1-dev /
-schnell and Qwen-Image.

Each has its model's architecture family, only tiny, so the real loading code (``SD3Policy`` / ``FluxPolicy`` /
``QwenImagePolicy.from_pretrained``) is exercised end to end without any download: ``save_tiny_*(dir)`` writes a normal
diffusers pipeline folder, ``tiny_*_dir()`` builds one once into ``$STEPFLOW_CACHE`` and ``model=*_tiny`` loads it:

- SD3 (``variant="medium"``): three text encoders, joint-attention MMDiT with a dual-attention block (SD3.5-Medium's
  MMDiT-X) and RMS qk-norm, a 16-channel 8x VAE with SD3's ``scaling_factor``/``shift_factor``; ``variant="large"``:
  the same without dual attention (SD3.5-Large);
- FLUX (``variant="dev"``): CLIP (pooled) + T5, a double- and a single-stream block with 3-axis RoPE, the guidance
  embedding, 64 packed input channels, FLUX's VAE factors and its dynamic-shift scheduler config;
  ``variant="schnell"``: no guidance embedding, no shift;
- Qwen-Image: a Qwen2.5-VL text encoder whose tokenizer splits the pipeline's chat template into exactly the 34
  prefix tokens the pipeline drops (as Qwen's own), the double-stream MMDiT, the causal 3-D VAE with per-channel
  latent mean/std and Qwen-Image's scheduler config (dynamic shift, ``shift_terminal``).

Tokenizers are built in memory (transformers 5 tokenizers accept a vocab and merges directly); see
``environment.md`` §2.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch

#: bump when a tiny architecture changes, so cached copies are rebuilt
TINY_VERSION = 1

SD3_VARIANTS = ("medium", "large")
FLUX_VARIANTS = ("dev", "schnell")

TINY_HEIGHT = 64  # default image size of the tiny model (latent 8x8 with the 8x VAE)
_CLIP_H = 16  # two CLIPs concatenated = 32 = joint_attention_dim = T5 d_model
_WORDS = ["a", "the", "cat", "dog", "photo", "of", "red", "blue", "green", "circle", "square", "on", "and"]


def keeps_rng(fn):
    """Build under a forked torch RNG: a builder seeds and draws from torch's global generator, and whether it runs
    (a cache miss) or not (a hit) must not change what the caller draws next (a test's or a run's noise)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return fn(*args, **kwargs)

    return wrapped


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> unicode table of a byte-level BPE: printable bytes map to themselves, the rest
    to code points >= 256; in the order of the 256 one-character tokens (printable bytes first)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def make_clip_tokenizer(model_max_length: int = 77):
    """A byte-level BPE ``CLIPTokenizer`` with a handful of merges (about 520 tokens)."""
    from transformers import CLIPTokenizer

    chars = list(bytes_to_unicode().values())
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


@keeps_rng
def build_tiny_sd3_pipeline(seed: int = 0, variant: str = "medium"):
    """Random tiny ``StableDiffusion3Pipeline`` (fp32, CPU), deterministic in ``seed``.

    Transformer: 2 layers, 2 heads of 8, RMS qk-norm, 16 latent channels; ``variant="medium"``: the first layer with
    SD3.5-Medium's dual attention; ``"large"``: none (SD3.5-Large's plain MMDiT).
    VAE: 4 blocks (8x downsample), 16 latent channels, ``scaling_factor=1.5305``, ``shift_factor=0.0609`` (SD3's).
    """
    if variant not in SD3_VARIANTS:
        raise ValueError(f"variant: must be one of {SD3_VARIANTS}, got {variant!r}")
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
                                        dual_attention_layers=(0,) if variant == "medium" else (),
                                        qk_norm="rms_norm")
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


def _vae_8x(latent_channels: int, scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
                         layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
                         sample_size=TINY_HEIGHT, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=shift_factor, scaling_factor=scaling_factor)


@keeps_rng
def build_tiny_flux_pipeline(seed: int = 0, variant: str = "dev"):
    """Random tiny ``FluxPipeline`` (fp32, CPU), deterministic in ``seed``.

    Transformer: one double- and one single-stream block, 2 heads of 16, RoPE axes (4, 6, 6), 64 packed input
    channels (16 latent channels x 2x2); ``variant="dev"``: guidance embedding and FLUX.1-dev's scheduler (dynamic
    exponential shift, 0.5 .. 1.15 over 256 .. 4096 tokens); ``"schnell"``: neither (shift 1). Text: CLIP (pooled,
    32) and T5 (d_model 32). VAE: 8x, 16 channels, FLUX's ``scaling_factor=0.3611``, ``shift_factor=0.1159``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    if variant not in FLUX_VARIANTS:
        raise ValueError(f"variant: must be one of {FLUX_VARIANTS}, got {variant!r}")
    clip_tok, t5_tok = make_clip_tokenizer(), make_t5_tokenizer()
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=2 * _CLIP_H, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id))
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=2 * _CLIP_H, d_kv=8, d_ff=64, num_layers=1,
                                             num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                             pad_token_id=0, eos_token_id=1))
    dev = variant == "dev"
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=2 * _CLIP_H,
                                         pooled_projection_dim=2 * _CLIP_H, guidance_embeds=dev, axes_dims_rope=(4, 6, 6))
    vae = _vae_8x(16, scaling_factor=0.3611, shift_factor=0.1159)
    if dev:
        scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                    max_shift=1.15, shift=3.0, use_dynamic_shifting=True)
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                                                    max_shift=1.15, shift=1.0, use_dynamic_shifting=False)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip_tok,
                        text_encoder_2=text_encoder_2, tokenizer_2=t5_tok, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: Qwen-Image's chat template (QwenImagePipeline.prompt_template_encode), whose first 34 tokens the pipeline drops
QWEN_TEMPLATE_WORDS = ["system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color",
                       " shape", " size", " texture", " quantity", " text", " spatial", " relationships", " of",
                       " objects", " and", " background"]
_QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def make_qwen_tokenizer():
    """A byte-level BPE ``Qwen2Tokenizer`` with whole-word merges for the template and the tiny world's words, so
    Qwen-Image's template splits as with Qwen's own tokenizer (34 tokens before the prompt)."""
    from transformers import Qwen2Tokenizer

    byte_char = bytes_to_unicode()
    chars = list(byte_char.values())
    vocab = {c: i for i, c in enumerate(chars)}
    merges: list[tuple[str, str]] = []
    for word in QWEN_TEMPLATE_WORDS + [" " + w for w in _WORDS]:
        pieces = [byte_char[b] for b in word.encode()]
        cur = pieces[0]
        for ch in pieces[1:]:
            if (cur, ch) not in merges:
                merges.append((cur, ch))
            cur += ch
            vocab.setdefault(cur, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": _QWEN_SPECIAL})
    return tok


@keeps_rng
def build_tiny_qwen_image_pipeline(seed: int = 0):
    """Random tiny ``QwenImagePipeline`` (fp32, CPU), deterministic in ``seed``.

    Text: Qwen2.5-VL (2 layers, hidden 32, M-RoPE sections (2, 3, 3), a 1-block vision tower that text prompts never
    use) with :func:`make_qwen_tokenizer`. Transformer: 2 double-stream blocks, 2 heads of 16, RoPE axes (4, 6, 6),
    64 packed input channels, 16 output channels. VAE: ``AutoencoderKLQwenImage``, z_dim 16, 8x spatial, with
    non-trivial per-channel ``latents_mean``/``latents_std``. Scheduler: Qwen-Image's config (dynamic exponential
    shift 0.5 .. 0.9 over 256 .. 8192 tokens, ``shift_terminal=0.02``).
    """
    from diffusers import QwenImagePipeline

    tok = make_qwen_tokenizer()
    text_encoder, transformer, vae, scheduler = tiny_qwen_image_parts(tok, seed)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tok,
                             transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_qwen_image_parts(tok, seed: int = 0, *, max_position_embeddings: int = 1024,
                          video_token: str = "<|image_pad|>", fullatt_block_indexes: list[int] | None = None):
    """``(text_encoder, transformer, vae, scheduler)`` of the tiny Qwen-Image family (fp32, CPU), drawn in this order
    after ``torch.manual_seed(seed)``: Qwen2.5-VL over ``tok`` (2 layers, hidden 32, M-RoPE sections (2, 3, 3), a
    1-block vision tower: ``fullatt_block_indexes`` ``None`` keeps Qwen2.5-VL's default, which a 1-block tower never
    reaches, i.e. window attention only), the 2-block transformer, the causal 3-D VAE with per-channel latent
    mean/std, and Qwen-Image's scheduler. Qwen-Image and Qwen-Image-Edit (``stepflow.testing.tiny_edit``) share it;
    the edit model's text encoder sees images, so it takes a longer context, its own video token and a full-attention
    vision block."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tok.convert_tokens_to_ids(t) for t in _QWEN_SPECIAL + ["<|endoftext|>", video_token]}
    torch.manual_seed(seed)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 2 * _CLIP_H}
    if fullatt_block_indexes is not None:
        vision["fullatt_block_indexes"] = list(fullatt_block_indexes)
    cfg = Qwen2_5_VLConfig(
        text_config={"hidden_size": 2 * _CLIP_H, "intermediate_size": 48, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tok),
                     "max_position_embeddings": max_position_embeddings, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},
                     "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                     "pad_token_id": ids["<|endoftext|>"]},
        vision_config=vision,
        hidden_size=2 * _CLIP_H, vocab_size=len(tok), bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        vision_token_id=ids["<|image_pad|>"], image_token_id=ids["<|image_pad|>"], video_token_id=ids[video_token])
    text_encoder = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2,
                                              joint_attention_dim=2 * _CLIP_H, axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True],
                                 latents_mean=[round(0.1 * i - 0.8, 4) for i in range(16)],
                                 latents_std=[round(1.0 + 0.1 * i, 4) for i in range(16)])
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192, max_shift=0.9,
        num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, stochastic_sampling=False,
        time_shift_type="exponential", use_beta_sigmas=False, use_dynamic_shifting=True, use_exponential_sigmas=False,
        use_karras_sigmas=False)
    return text_encoder, transformer, vae, scheduler


# ---------------------------------------------------------------------------------------------------- saving, cache
def _kind_name(family: str, variant: str) -> str:
    """Cache folder stem: ``sd3_tiny`` (SD3.5-Medium, the historical name), ``sd35_large_tiny``, ``flux_dev_tiny``,
    ``flux_schnell_tiny``, ``qwen_image_tiny``."""
    if family == "sd3":
        return "sd3_tiny" if variant == "medium" else "sd35_large_tiny"
    if family == "flux":
        return f"flux_{variant}_tiny"
    return "qwen_image_tiny"


_BUILDERS = {
    "sd3": lambda seed, variant: build_tiny_sd3_pipeline(seed, variant),
    "flux": lambda seed, variant: build_tiny_flux_pipeline(seed, variant),
    "qwen_image": lambda seed, variant: build_tiny_qwen_image_pipeline(seed),
}


def _save(family: str, directory, seed: int, variant: str) -> Path:
    directory = Path(directory)
    _BUILDERS[family](seed, variant).save_pretrained(directory, safe_serialization=True)
    return directory


def _cached_dir(family: str, seed: int, cache_dir, variant: str) -> Path:
    """The cached tiny pipeline folder, built on first use (atomically, so parallel processes do not race).

    Location: ``cache_dir`` or ``$STEPFLOW_CACHE`` or ``~/.cache/stepflow``, in ``<kind>-v{TINY_VERSION}-s{seed}``.
    """
    root = Path(cache_dir or os.environ.get("STEPFLOW_CACHE") or Path.home() / ".cache" / "stepflow").expanduser()
    kind = _kind_name(family, variant)
    target = root / f"{kind}-v{TINY_VERSION}-s{seed}"
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    try:
        _save(family, tmp, seed, variant)
        try:
            os.replace(tmp, target)  # atomic; fails if another process won the race (target exists, non-empty)
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_tiny_sd3(directory: str | os.PathLike, seed: int = 0, variant: str = "medium") -> Path:
    """Build the tiny SD3 pipeline and write it as a diffusers folder (``model_index.json`` + components)."""
    return _save("sd3", directory, seed, variant)


def tiny_sd3_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None, variant: str = "medium") -> Path:
    """The cached tiny SD3 pipeline (``sd3_tiny-v1-s0``; SD3.5-Large's variant: ``sd35_large_tiny-v1-s0``)."""
    return _cached_dir("sd3", seed, cache_dir, variant)


def tiny_sd3_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, variant: str = "medium",
                    **kwargs):
    """``model=sd3_tiny`` / ``model=sd35_large_tiny``: build (once) the tiny pipeline and load it through
    ``SD3Policy.from_pretrained``.

    ``path``: an existing tiny pipeline folder to load instead of the cached build. Other keyword arguments go to
    :meth:`stepflow.policies.sd3.SD3Policy.from_pretrained` (``dtype``, ``height``, ``lora``, ...).
    """
    from stepflow.policies.sd3 import SD3Policy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    SD3Policy.check_args(kwargs)  # before the tiny pipeline is built into the cache
    return SD3Policy.from_pretrained(path or str(tiny_sd3_dir(seed, cache_dir, variant)), **kwargs)


def save_tiny_flux(directory: str | os.PathLike, seed: int = 0, variant: str = "dev") -> Path:
    """Build the tiny FLUX pipeline and write it as a diffusers folder."""
    return _save("flux", directory, seed, variant)


def tiny_flux_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None, variant: str = "dev") -> Path:
    """The cached tiny FLUX pipeline (``flux_dev_tiny-v1-s0`` / ``flux_schnell_tiny-v1-s0``)."""
    return _cached_dir("flux", seed, cache_dir, variant)


def tiny_flux_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, variant: str = "dev",
                     **kwargs):
    """``model=flux_tiny`` / ``model=flux_schnell_tiny``: build (once) and load through ``FluxPolicy.from_pretrained``
    (keyword arguments go there)."""
    from stepflow.policies.flux import FluxPolicy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    if variant == "schnell":
        kwargs.setdefault("embedded_guidance", None)
    FluxPolicy.check_args(kwargs)  # before the tiny pipeline is built into the cache
    return FluxPolicy.from_pretrained(path or str(tiny_flux_dir(seed, cache_dir, variant)), **kwargs)


def save_tiny_qwen_image(directory: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny Qwen-Image pipeline and write it as a diffusers folder."""
    return _save("qwen_image", directory, seed, "")


def tiny_qwen_image_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny Qwen-Image pipeline (``qwen_image_tiny-v1-s0``)."""
    return _cached_dir("qwen_image", seed, cache_dir, "")


def tiny_qwen_image_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, **kwargs):
    """``model=qwen_image_tiny``: build (once) and load through ``QwenImagePolicy.from_pretrained`` (keyword
    arguments go there)."""
    from stepflow.policies.qwen_image import QwenImagePolicy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    QwenImagePolicy.check_args(kwargs)  # before the tiny pipeline is built into the cache
    return QwenImagePolicy.from_pretrained(path or str(tiny_qwen_image_dir(seed, cache_dir)), **kwargs)


@keeps_rng
def tiny_taesd_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None, latent_channels: int = 16) -> Path:
    """A tiny random ``AutoencoderTiny`` (TAESD layout: 16 latent channels, 8x upsampling, SD3's scaling and shift),
    built once into the cache: the stand-in for TAESD3 / TAEF1 in tests and ``model.estimate_vae`` smoke runs."""
    import torch
    from diffusers import AutoencoderTiny

    root = Path(cache_dir or os.environ.get("STEPFLOW_CACHE") or Path.home() / ".cache" / "stepflow").expanduser()
    target = root / f"taesd_tiny-v{TINY_VERSION}-c{latent_channels}-s{seed}"
    if (target / "config.json").is_file():
        return target
    torch.manual_seed(seed)
    vae = AutoencoderTiny(in_channels=3, out_channels=3, latent_channels=latent_channels,
                          encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                          num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1), scaling_factor=1.5305,
                          shift_factor=0.0609)
    tmp = Path(tempfile.mkdtemp(prefix=".taesd-", dir=root if root.is_dir() else None))
    vae.save_pretrained(str(tmp))
    root.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target
