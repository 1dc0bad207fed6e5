"""Tiny, randomly initialised diffusers pipelines of the newest image families: FLUX.2-dev (``Flux2Pipeline``) and
Z-Image(-Turbo) (``ZImagePipeline``), for tests and CPU smoke runs.

As :mod:`stepflow.testing.tiny_policies` does for SD3 / FLUX.1 / Qwen-Image: the real architectures at toy sizes,
``save_tiny_*(dir)`` writes a normal diffusers pipeline folder, ``tiny_*_dir()`` builds one once into
``$STEPFLOW_CACHE`` and ``model=*_tiny`` loads it through the policy's own ``from_pretrained``:

- FLUX.2: a ``Mistral3ForConditionalGeneration`` text encoder (30 text layers of width 16, so the pipeline's default
  hidden-state layers (10, 20, 30) exist; a one-layer Pixtral vision tower that text prompts never use) behind a
  ``PixtralProcessor`` whose tokenizer has whole-word tokens for the pipeline's system message (38 tokens before the
  padding for a short prompt), a ``Flux2Transformer2DModel`` (one double- and one single-stream block, 2 heads of 16,
  4-axis RoPE, guidance embedding), an ``AutoencoderKLFlux2`` (8x, 4 latent channels, 2x2 patches: 16 channels) whose
  batch-norm running statistics are non-trivial, and FLUX.2-dev's scheduler config (dynamic exponential shift);
- Z-Image: a ``Qwen3Model`` text encoder (2 layers, width 32) with a Qwen tokenizer and Qwen3's chat template for a
  user turn (``<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n``), a ``ZImageTransformer2DModel``
  (one noise and one context refiner, two main layers, 2 heads of 16, 3-axis RoPE), FLUX.1's 16-channel VAE layout and
  factors (as Z-Image ships it), and Z-Image-Turbo's scheduler config (static shift 3).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from stepflow.testing.tiny_policies import _WORDS, TINY_HEIGHT, bytes_to_unicode, keeps_rng, make_qwen_tokenizer

#: bump when a tiny architecture changes, so cached copies are rebuilt
TINY_VERSION = 1

#: FLUX.2-dev scheduler/scheduler_config.json (the pipeline's compute_empirical_mu feeds its dynamic shift)
FLUX2_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                       num_train_timesteps=1000, shift=3.0, time_shift_type="exponential", use_dynamic_shifting=True)
#: Z-Image-Turbo scheduler/scheduler_config.json (static shift 3, no dynamic shift)
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)

_MISTRAL_SPECIAL = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]

#: Mistral-Small-3's chat template for what Flux2Pipeline sends (a system turn and a user turn of text parts)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}")

#: Qwen3's chat template for a user turn (as Qwen3's own renders it; enable_thinking=False adds the empty think block)
QWEN3_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def make_mistral_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` (Mistral's special tokens, ``<pad>``) with a whole-word token for
    every word of ``Flux2Pipeline``'s system message and the tiny world's words (unknown words fall back to bytes)."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_char = bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(byte_char.values())}
    merges: list[tuple[str, str]] = []
    words = sorted(set(re.findall(r"\w+|[^\w\s]", SYSTEM_MESSAGE)) | set(_WORDS))
    for w in words:
        for word in (w, " " + w):
            pieces = [byte_char[b] for b in word.encode()]
            cur = pieces[0]
            for ch in pieces[1:]:
                if (cur, ch) not in merges:
                    merges.append((cur, ch))
                cur += ch
                vocab.setdefault(cur, len(vocab))
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)  # a whole word in the vocabulary is one token
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", additional_special_tokens=_MISTRAL_SPECIAL)


def make_pixtral_processor():
    """FLUX.2's ``tokenizer`` component: a ``PixtralProcessor`` over :func:`make_mistral_tokenizer` with the chat
    template Flux2Pipeline renders (``<s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]prompt[/INST]``)."""
    from transformers import PixtralImageProcessor, PixtralProcessor

    return PixtralProcessor(image_processor=PixtralImageProcessor(), tokenizer=make_mistral_tokenizer(),
                            chat_template=MISTRAL_TEMPLATE, patch_size=16, spatial_merge_size=1)


def make_qwen3_tokenizer():
    """Z-Image's tokenizer: the tiny Qwen BPE of :func:`stepflow.testing.tiny_policies.make_qwen_tokenizer` with
    Qwen3's chat template."""
    tok = make_qwen_tokenizer()
    tok.chat_template = QWEN3_TEMPLATE
    return tok


@keeps_rng
def build_tiny_flux2_pipeline(seed: int = 0):
    """Random tiny ``Flux2Pipeline`` (fp32, CPU), deterministic in ``seed`` (see the module docstring)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    proc = make_pixtral_processor()
    tok = proc.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<s>", "</s>", "<pad>", "[IMG]"]}
    torch.manual_seed(seed)
    text_hidden = 16
    cfg = Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": text_hidden, "intermediate_size": 32,
                     "num_hidden_layers": 30, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                     "vocab_size": len(tok), "max_position_embeddings": 1024, "rope_theta": 1000000.0,
                     "sliding_window": None, "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
                     "pad_token_id": ids["<pad>"]},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 8, "patch_size": 16, "image_size": 64},
        image_token_index=ids["[IMG]"], spatial_merge_size=1)
    text_encoder = Mistral3ForConditionalGeneration(cfg).eval()
    latent_channels = 4
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=4 * latent_channels, num_layers=1,
                                          num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                          joint_attention_dim=3 * text_hidden, timestep_guidance_channels=32,
                                          axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=latent_channels,
                             norm_num_groups=4, sample_size=TINY_HEIGHT)
    with torch.no_grad():  # FLUX.2's latent normalisation: non-trivial per-channel mean and variance
        n = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, n))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, n))
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER), vae=vae,
                         text_encoder=text_encoder, tokenizer=proc, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@keeps_rng
def build_tiny_zimage_pipeline(seed: int = 0):
    """Random tiny ``ZImagePipeline`` (fp32, CPU), deterministic in ``seed`` (see the module docstring)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tok = make_qwen3_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|im_end|>"]}
    torch.manual_seed(seed)
    text_hidden = 32
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, rope_theta=1000000.0,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])).eval()
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                           cap_feat_dim=text_hidden, axes_dims=[4, 6, 6], axes_lens=[256, 32, 32])
    with torch.no_grad():  # the pad tokens are zeros at init (trained in the real model): make them count
        transformer.x_pad_token.normal_(0.0, 0.5)
        transformer.cap_pad_token.normal_(0.0, 0.5)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
                        layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=TINY_HEIGHT,
                        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER), vae=vae,
                          text_encoder=text_encoder, tokenizer=tok, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_BUILDERS = {"flux2": build_tiny_flux2_pipeline, "zimage": build_tiny_zimage_pipeline}


def save_tiny(family: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny pipeline of ``family`` (``flux2`` / ``zimage``) and write it as a diffusers folder."""
    directory = Path(directory)
    _BUILDERS[family](seed).save_pretrained(directory, safe_serialization=True)
    return directory


def tiny_dir(family: str, seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached tiny pipeline folder ``<cache>/<family>_tiny-v{TINY_VERSION}-s{seed}``, built (atomically) on first
    use; ``cache_dir`` or ``$STEPFLOW_CACHE`` or ``~/.cache/stepflow``."""
    if family not in _BUILDERS:
        raise ValueError(f"family: one of {', '.join(_BUILDERS)}, got {family!r}")
    root = Path(cache_dir or os.environ.get("STEPFLOW_CACHE") or Path.home() / ".cache" / "stepflow").expanduser()
    kind = f"{family}_tiny"
    target = root / f"{kind}-v{TINY_VERSION}-s{seed}"
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=root))
    try:
        save_tiny(family, tmp, seed)
        try:
            os.replace(tmp, target)  # atomic; fails if another process won the race
        except OSError:
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tiny_flux2_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, **kwargs):
    """``model=flux2_tiny``: build (once) the tiny FLUX.2 pipeline and load it through ``Flux2Policy.from_pretrained``
    (``path``: an existing tiny folder instead; other keyword arguments go to ``from_pretrained``)."""
    from stepflow.policies.flux2 import Flux2Policy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    Flux2Policy.check_args(kwargs)  # before the tiny pipeline is built into the cache
    return Flux2Policy.from_pretrained(path or str(tiny_dir("flux2", seed, cache_dir)), **kwargs)


def tiny_zimage_policy(path: str | None = None, seed: int = 0, cache_dir: str | None = None, **kwargs):
    """``model=zimage_tiny``: build (once) the tiny Z-Image pipeline and load it through
    ``ZImagePolicy.from_pretrained`` (keyword arguments go there)."""
    from stepflow.policies.zimage import ZImagePolicy

    kwargs.setdefault("height", TINY_HEIGHT)
    kwargs.setdefault("width", TINY_HEIGHT)
    ZImagePolicy.check_args(kwargs)
    return ZImagePolicy.from_pretrained(path or str(tiny_dir("zimage", seed, cache_dir)), **kwargs)
