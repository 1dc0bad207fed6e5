"""Random-weight builds of every model family stepflow supports, at the published size or tiny, without downloads.

For GPU checks of memory and speed (``experiments/gpu_check.py``, ``model=*_random`` in ``python -m stepflow.train``):
the real transformer and VAE *architectures* with random weights, the text encoders replaced by fixed random
embeddings of the real shapes (one per prompt, seeded by the prompt), wrapped in stepflow's own policies
(:class:`~stepflow.policies.sd3.SD3Policy`, :class:`~stepflow.policies.flux.FluxPolicy`,
:class:`~stepflow.policies.qwen_image.QwenImagePolicy`) over a ``SimpleNamespace`` "pipeline"; the subclasses here
replace only the text encoding (and, optionally, skip writing gigabytes of random fully fine-tuned weights).

========================  ==============================================================================  =========
``model``                 transformer (published config)                                                  text
========================  ==============================================================================  =========
``sd35_medium``           ``SD3Transformer2DModel``: 24 layers, 24 heads of 64, dual attention 0-12,      (333, 4096)
                          qk rms_norm, pos_embed_max_size 384 (2.47 B); SD3 VAE (16 ch)                   + (2048,)
``sd35_large``            ``SD3Transformer2DModel``: 38 layers, 38 heads of 64, no dual attention,        (333, 4096)
                          qk rms_norm, caption_projection_dim 2432, pos_embed_max_size 192 (8.15 B)       + (2048,)
``flux_dev``              ``FluxTransformer2DModel``: 19 double + 38 single blocks, 24 heads of 128,      (512, 4096)
                          guidance embedding (11.9 B); FLUX VAE (16 ch, scaling 0.3611, shift 0.1159)     + (768,)
``qwen_image``            ``QwenImageTransformer2DModel``: 60 layers, 24 heads of 128,                    (L, 3584)
                          joint_attention_dim 3584 (20.4 B); ``AutoencoderKLQwenImage``                   + mask
========================  ==============================================================================  =========

(SD3.5: CLIP-L + CLIP-G + T5-XXL give 77 + 256 token states and a pooled 2048; FLUX: T5-XXL's 512 tokens and CLIP-L's
pooled 768; Qwen-Image: Qwen2.5-VL-7B's hidden states of the prompt, a few tokens more than its words, with a mask.)

Builds happen on the target device (``with torch.device(device)``) with the transformer constructed directly in
its dtype (bf16: no fp32 copy), so a 20 B model is ready on a GPU in seconds. ``tiny=True`` gives the same classes
at toy sizes (the CPU tests). :func:`param_counts` builds on the meta device (no memory) for exact parameter counts,
and :func:`memory_table` turns them into a per-GPU memory estimate per strategy.
"""

from __future__ import annotations

import contextlib
import math
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from stepflow.policies.base import LORA_TARGETS_SD3, check_image_size
from stepflow.rewards.base import Reward, RewardOut

__all__ = ["MODELS", "SPECS", "TINY_SPECS", "StandInReward", "build_modules", "random_policy", "param_counts",
           "memory_estimate", "memory_table", "transformer_class", "lora_targets",
           "peak_memory_callback"]

MODELS = ("sd35_medium", "sd35_large", "flux_dev", "qwen_image")

# ---------------------------------------------------------------------------------------------- published configs
#: SD3.5-Medium, transformer/config.json (stabilityai/stable-diffusion-3.5-medium)
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
#: SD3.5-Large, transformer/config.json (stabilityai/stable-diffusion-3.5-large): 38 x 64 = 2432 wide, no dual attention
SD35_LARGE_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
    joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=192, dual_attention_layers=(), qk_norm="rms_norm",
)
#: SD3 / SD3.5 vae/config.json
SD3_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305,
    shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True,
)
SD3_SCHEDULER = dict(shift=3.0)
SD35_TEXT = dict(text_len=77 + 256, text_dim=4096, pooled_dim=2048)

#: FLUX.1-dev, transformer/config.json (black-forest-labs/FLUX.1-dev)
FLUX_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
#: FLUX.1 vae/config.json: the SD3 layout with FLUX's latent normalisation
FLUX_VAE = {**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
#: FLUX.1-dev scheduler/scheduler_config.json
FLUX_DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                          num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
FLUX_TEXT = dict(text_len=512, text_dim=4096, pooled_dim=768)

#: Qwen-Image, transformer/config.json (Qwen/Qwen-Image)
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
#: Qwen-Image vae/config.json (the diffusers defaults of AutoencoderKLQwenImage are Qwen-Image's own)
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)
#: Qwen-Image scheduler/scheduler_config.json
QWEN_IMAGE_SCHEDULER = dict(
    base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192, max_shift=0.9,
    num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, stochastic_sampling=False,
    time_shift_type="exponential", use_beta_sigmas=False, use_dynamic_shifting=True, use_exponential_sigmas=False,
    use_karras_sigmas=False)
#: Qwen2.5-VL-7B hidden size; lengths vary per prompt (pooled_dim None: no pooled vector, a mask instead)
QWEN_TEXT = dict(text_len=512, text_dim=3584, pooled_dim=None)

# ---------------------------------------------------------------------------------------------- tiny configs
_TINY_SD3 = dict(
    sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
    num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
    pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm",
)
_TINY_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16), layers_per_block=1, latent_channels=16, norm_num_groups=4, sample_size=64,
    scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)
_TINY_FLUX = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
                  axes_dims_rope=(4, 6, 6))
_TINY_QWEN = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
_TINY_QWEN_VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                      temperal_downsample=[False, True, True])

#: what each model is built from: family (which policy), transformer / VAE configs, scheduler, text shapes, LoRA
#: targets (Flow-GRPO's per family), and the published size of the transformer (billions of parameters + buffers, as
#: in its bf16 safetensors) for checks
SPECS: dict[str, dict[str, Any]] = {
    "sd35_medium": dict(family="sd3", transformer=SD35_MEDIUM_TRANSFORMER, vae=SD3_VAE, scheduler=SD3_SCHEDULER,
                        text=SD35_TEXT, published_b=2.47),
    "sd35_large": dict(family="sd3", transformer=SD35_LARGE_TRANSFORMER, vae=SD3_VAE, scheduler=SD3_SCHEDULER,
                       text=SD35_TEXT, published_b=8.15),
    "flux_dev": dict(family="flux", transformer=FLUX_DEV_TRANSFORMER, vae=FLUX_VAE, scheduler=FLUX_DEV_SCHEDULER,
                     text=FLUX_TEXT, published_b=11.9),
    "qwen_image": dict(family="qwen_image", transformer=QWEN_IMAGE_TRANSFORMER, vae=QWEN_IMAGE_VAE,
                       scheduler=QWEN_IMAGE_SCHEDULER, text=QWEN_TEXT, published_b=20.4),
}
TINY_SPECS: dict[str, dict[str, Any]] = {
    "sd35_medium": {**SPECS["sd35_medium"], "transformer": _TINY_SD3, "vae": _TINY_VAE,
                    "text": dict(text_len=77 + 16, text_dim=32, pooled_dim=32)},
    "sd35_large": {**SPECS["sd35_large"], "transformer": {**_TINY_SD3, "dual_attention_layers": ()}, "vae": _TINY_VAE,
                   "text": dict(text_len=77 + 16, text_dim=32, pooled_dim=32)},
    "flux_dev": {**SPECS["flux_dev"], "transformer": _TINY_FLUX, "vae": {**_TINY_VAE, "scaling_factor": 0.3611,
                                                                         "shift_factor": 0.1159},
                 "text": dict(text_len=32, text_dim=32, pooled_dim=32)},
    "qwen_image": {**SPECS["qwen_image"], "transformer": _TINY_QWEN, "vae": _TINY_QWEN_VAE,
                   "text": dict(text_len=64, text_dim=32, pooled_dim=None)},
}


def _spec(model: str, tiny: bool) -> dict[str, Any]:
    if model not in SPECS:
        raise ValueError(f"model: must be one of {', '.join(MODELS)}, got {model!r}")
    return (TINY_SPECS if tiny else SPECS)[model]


def transformer_class(model: str):
    """The diffusers transformer class of ``model``'s family."""
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel

    return {"sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel,
            "qwen_image": QwenImageTransformer2DModel}[_spec(model, False)["family"]]


def vae_class(model: str):
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage

    return AutoencoderKLQwenImage if _spec(model, False)["family"] == "qwen_image" else AutoencoderKL


def lora_targets(model: str) -> tuple[str, ...]:
    """Flow-GRPO's LoRA targets of the family (as ``recipe/<model>.yaml`` of the real models)."""
    fam = _spec(model, False)["family"]
    if fam == "flux":
        from stepflow.policies.flux import LORA_TARGETS_FLUX

        return LORA_TARGETS_FLUX
    if fam == "qwen_image":
        from stepflow.policies.qwen_image import LORA_TARGETS_QWEN_IMAGE

        return LORA_TARGETS_QWEN_IMAGE
    return LORA_TARGETS_SD3


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def vae_scale(spec: Mapping[str, Any]) -> int:
    """The spatial downsampling of a spec's VAE (what the pipeline calls ``vae_scale_factor``)."""
    if spec["family"] == "qwen_image":
        return 2 ** len(spec["vae"]["temperal_downsample"])
    return 2 ** (len(spec["vae"]["block_out_channels"]) - 1)


def build_modules(model: str, tiny: bool = False, device: str | torch.device | None = "auto",
                  dtype: torch.dtype = torch.bfloat16, vae_dtype: torch.dtype = torch.float32, seed: int = 0):
    """A ``SimpleNamespace`` pipeline of random modules: ``transformer`` (in ``dtype``), ``vae`` (``vae_dtype``),
    ``scheduler``, no text encoders, and what the policies read off a pipeline (``vae_scale_factor``,
    ``name_or_path``). Built on ``device`` (``auto``: CUDA when available) directly in the final dtype."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    spec = _spec(model, tiny)
    dev = _device(device)
    torch.manual_seed(seed)
    with torch.device(dev):
        with _default_dtype(dtype):
            transformer = transformer_class(model)(**spec["transformer"])
        with _default_dtype(vae_dtype):
            vae = vae_class(model)(**spec["vae"])
    # buffers made in fp32 (SD3's pos_embed) follow, as with from_pretrained(dtype=); nn.Module.to: diffusers' own
    # .to() warns about casting modules it would keep in fp32 (none here)
    torch.nn.Module.to(transformer, dtype)
    torch.nn.Module.to(vae, vae_dtype)
    scale = vae_scale(spec)
    return SimpleNamespace(transformer=transformer, vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(**spec["scheduler"]),
                           text_encoder=None, text_encoder_2=None, text_encoder_3=None, vae_scale_factor=scale,
                           name_or_path=f"random-{model}{'-tiny' if tiny else ''}")


# ---------------------------------------------------------------------------------------------- policies
def _qwen_len(prompt: str) -> int:
    """Qwen2.5-VL tokens of a prompt after the template's 34 are dropped: about one per word or mark, plus the 5 of
    ``<|im_end|>\\n<|im_start|>assistant\\n``."""
    return 5 + len(re.findall(r"\w+|[^\w\s]", prompt))


class _RandomText:
    """Mixin: ``_encode_new`` gives each prompt fixed random embeddings of the text encoders' shapes (seeded by the
    prompt's crc32), instead of running text encoders; ``save_weights=False`` writes only the transformer's config
    (not gigabytes of random weights) when fully fine-tuned."""

    text_len: int = 0
    text_dim: int = 0
    pooled_dim: int | None = None
    save_weights: bool = True

    def _random_row(self, prompt: str) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        if self.pooled_dim is None:  # Qwen-Image: per-prompt length, no pooled vector (the policy pads + masks)
            n = min(self.max_sequence_length, _qwen_len(prompt))
            return (torch.randn(n, self.text_dim, generator=g),)
        tok = torch.randn(self.text_len, self.text_dim, generator=g)
        return tok, torch.randn(self.pooled_dim, generator=g)

    def _encode_new(self, prompts: list[str]) -> None:  # stands in for the text encoders
        for p in prompts:
            self._prompt_cache[p] = tuple(t.to(self.device, self.dtype) for t in self._random_row(p))
        self.encoder_calls += 1

    def save_trained(self, directory, state_dict=None) -> Path:
        if self.finetune != "full" or self.save_weights:
            return super().save_trained(directory, state_dict)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.transformer.save_config(str(directory))
        (directory / "NOT_SAVED.txt").write_text("random-weight check model (model.save_weights=false): the fully "
                                                 "fine-tuned weights were not written\n")
        return directory


def _policy_classes():
    from stepflow.policies.flux import FluxPolicy
    from stepflow.policies.qwen_image import QwenImagePolicy
    from stepflow.policies.sd3 import SD3Policy

    class RandomTextSD3Policy(_RandomText, SD3Policy):
        """SD3Policy whose text encoders are fixed random embeddings (CLIP-L + CLIP-G + T5-XXL shapes)."""

    class RandomTextFluxPolicy(_RandomText, FluxPolicy):
        """FluxPolicy whose text encoders are fixed random embeddings (T5-XXL tokens, CLIP-L pooled)."""

    class RandomTextQwenImagePolicy(_RandomText, QwenImagePolicy):
        """QwenImagePolicy whose text encoder is fixed random hidden states (Qwen2.5-VL's width, per-prompt lengths)."""

    return {"sd3": RandomTextSD3Policy, "flux": RandomTextFluxPolicy, "qwen_image": RandomTextQwenImagePolicy}


def random_policy(model: str = "sd35_medium", *, tiny: bool = False, device: str | None = "auto",
                  dtype: str | torch.dtype = "bfloat16", vae_dtype: str | torch.dtype = "float32", seed: int = 0,
                  height: int | None = None, width: int | None = None, max_sequence_length: int | None = None,
                  finetune: str = "lora", lora: Mapping[str, Any] | None = None, gradient_checkpointing: bool = True,
                  decode_batch_size: int = 8, guidance: float | None = None, eval_guidance: float | None = None,
                  embedded_guidance: float = 3.5, save_weights: bool = True, name: str | None = None):
    """A stepflow policy over random modules of ``model`` (one of :data:`MODELS`), built on ``device``.

    The ``_target_`` of ``model=<model>_random`` (then ``lora`` stays None: ``stepflow.train.build_policy`` adds the
    ``lora:`` group's adapter) and what ``experiments/gpu_check.py`` builds (with ``lora`` = add_lora's arguments).
    ``height``/``width`` default to 512 (64 with ``tiny``); ``max_sequence_length``: the text tokens (SD3.5: T5's 256,
    FLUX: 512, Qwen-Image: the cap on a prompt's length); ``guidance``/``eval_guidance``: the policy's CFG scales for
    callers (default: the family's); ``save_weights=False``: a fully fine-tuned run writes only the config.
    """
    from stepflow.policies.pipeline import resolve_dtype

    spec = _spec(model, tiny)
    fam, text = spec["family"], spec["text"]
    size = 64 if tiny else 512
    cls = _policy_classes()[fam]
    # every argument is checked before the (possibly many-GB) random modules are built (None: the family's default)
    given = dict(max_sequence_length=max_sequence_length, decode_batch_size=decode_batch_size, guidance=guidance,
                 eval_guidance=eval_guidance, embedded_guidance=embedded_guidance if fam == "flux" else None)
    cls.check_args({k: v for k, v in given.items() if v is not None})
    scale = vae_scale(spec)
    patch = 2  # SD3's patch_size, FLUX's and Qwen-Image's 2x2 packing
    height, width = check_image_size(size if height is None else height, size if width is None else width,
                                     scale * patch, f"VAE scale {scale} x patch {patch}")
    pipe = build_modules(model, tiny, device, resolve_dtype(dtype, torch.bfloat16, "model.dtype"),
                         resolve_dtype(vae_dtype, field="model.vae_dtype"), seed)
    kw: dict[str, Any] = dict(height=height, width=width, gradient_checkpointing=gradient_checkpointing,
                              decode_batch_size=decode_batch_size, finetune=finetune, lora=lora,
                              name=name or pipe.name_or_path)
    if guidance is not None:
        kw["guidance"] = float(guidance)
    if eval_guidance is not None:
        kw["eval_guidance"] = float(eval_guidance)
    if fam == "sd3":
        seq = max_sequence_length or text["text_len"] - 77
        kw["max_sequence_length"] = seq
        text_len = 77 + seq
    elif fam == "flux":
        seq = max_sequence_length or text["text_len"]
        kw.update(max_sequence_length=seq, embedded_guidance=embedded_guidance)
        text_len = seq
    else:
        seq = max_sequence_length or text["text_len"]
        kw["max_sequence_length"] = seq
        text_len = seq
    policy = cls(pipe, **kw)
    policy.text_len, policy.text_dim, policy.pooled_dim = text_len, text["text_dim"], text["pooled_dim"]
    policy.save_weights = bool(save_weights)
    return policy


class StandInReward(Reward):
    """Cheap image reward on decoded images (B, 3, H, W) in [0, 1]: colourfulness − |brightness − 0.5| (so the
    reward phase measures decoding, not a reward model).
    ``reward._target_=stepflow.testing.random_policies.StandInReward`` on the training command line (after
    ``~reward``)."""

    name = "stand_in"
    batch_size = 256

    def score(self, images, prompts, meta):
        bright = images.mean(dim=(1, 2, 3))
        colour = images.std(dim=1).mean(dim=(1, 2))
        return RewardOut(colour - (bright - 0.5).abs(), {"brightness": bright})


def peak_memory_callback(dirpath: str | None = None, filename: str = "memory.csv"):
    """A Lightning callback that writes, per GRPO iteration (one training batch), the CUDA peak memory allocated and
    reserved (GiB) and the iteration's wall seconds to ``<run dir>/memory.csv`` (``dirpath`` is the checkpoint
    folder that ``stepflow.train.build_trainer`` hands every callback; the file goes beside it). Enable it with
    ``+callbacks.memory._target_=stepflow.testing.random_policies.peak_memory_callback``. On the CPU the memory
    columns are empty."""
    import time

    from lightning.pytorch.callbacks import Callback

    class PeakMemory(Callback):
        def __init__(self) -> None:
            self.path = (Path(dirpath).parent if dirpath else Path(".")) / filename
            self.t0 = 0.0

        def _cuda(self, pl_module) -> torch.device | None:
            dev = pl_module.device
            return dev if dev.type == "cuda" else None

        def on_train_start(self, trainer, pl_module) -> None:
            if trainer.global_rank != 0:
                return
            dev = self._cuda(pl_module)
            alloc = f"{torch.cuda.memory_allocated(dev) / 2**30:.3f}" if dev is not None else ""
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w") as fh:
                fh.write("iteration,peak_allocated_gib,peak_reserved_gib,wall_s,allocated_at_start_gib\n")
                fh.write(f"start,,,,{alloc}\n")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            dev = self._cuda(pl_module)
            if dev is not None:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_rank != 0:
                return
            dev = self._cuda(pl_module)
            peak = res = ""
            if dev is not None:
                torch.cuda.synchronize(dev)
                peak = f"{torch.cuda.max_memory_allocated(dev) / 2**30:.3f}"
                res = f"{torch.cuda.max_memory_reserved(dev) / 2**30:.3f}"
            with self.path.open("a") as fh:
                fh.write(f"{getattr(pl_module, 'iteration', batch_idx)},{peak},{res},{time.perf_counter() - self.t0:.3f},\n")

    return PeakMemory()


# ---------------------------------------------------------------------------------------------- memory estimates
def param_counts(model: str, lora_rank: int = 32, targets: Sequence[str] | None = None, tiny: bool = False
                 ) -> dict[str, int]:
    """Exact parameter counts of the transformer (``transformer``; ``buffers``: its persistent buffers, e.g. SD3's
    fixed 2-D position table, 226 M values in SD3.5-Medium, which its published size counts), its LoRA (rank
    ``lora_rank`` on ``targets``, default the family's) and the VAE, built on the meta device (no memory, about a
    second for 20 B)."""
    from peft import LoraConfig

    spec = _spec(model, tiny)
    targets = tuple(targets or lora_targets(model))
    with torch.device("meta"), _default_dtype(torch.bfloat16):
        tr = transformer_class(model)(**spec["transformer"])
        vae = vae_class(model)(**spec["vae"])
        n_tr = sum(p.numel() for p in tr.parameters())
        n_buf = sum(b.numel() for b in tr.buffers())
        present = {n for n, _ in tr.named_modules()}
        wanted = sorted(t for t in targets if any(n.endswith(t) for n in present))
        tr.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=wanted))
        n_lora = sum(p.numel() for n, p in tr.named_parameters() if "lora_" in n)
    return {"transformer": n_tr, "buffers": n_buf, "lora": n_lora, "vae": sum(p.numel() for p in vae.parameters())}


#: strategies of :func:`memory_estimate`
STRATEGIES = ("ddp", "fsdp", "deepspeed")  #: conf/trainer/<name>.yaml


def memory_estimate(counts: Mapping[str, int], finetune: str, strategy: str = "ddp", world: int = 1,
                    ema: bool = True, reference: bool = True, bytes_per: int = 2) -> dict[str, float]:
    """Per-GPU memory (GiB) of the persistent state of a run, activations not included, from ``counts``
    (:func:`param_counts`). N = transformer weights and buffers, n = trained weights (LoRA or the transformer's
    parameters), b = ``bytes_per`` (bf16: 2):

    - weights N·b (fp32 VAE: 4 bytes per VAE weight), gradients n·b, AdamW's two moments 2n·b (torch keeps them in
      the parameters' dtype), the EMA's shadow n·b (``ema.enabled``), the reference policy's frozen copy N·b
      (full fine-tuning with β > 0; LoRA's reference is the adapter switched off);
    - the optimizer step's temporary: torch's foreach AdamW allocates one more copy of the second moment's square
      root (n·b, of the shard it steps);
    - ``ddp``: all of that on every GPU, plus DDP's gradient buckets n·b;
    - ``fsdp`` (FSDP2, ``fully_shard`` per transformer block, ``reduce_every_backward=auto``): weights, moments, the
      EMA shadow and the reference copy (both made on the sharded weights) divided by ``world``; gradients sharded
      when fine-tuning fully, whole for LoRA (accumulated on each rank, reduced once per step);
    - ``deepspeed`` (ZeRO-2): weights replicated; gradients, an fp32 master copy and fp32 moments of the trained
      weights partitioned: (4 + 4 + 8)·n / world, plus a reduce bucket (Lightning's 2e8 elements) in bf16; LoRA
      accumulates its whole gradient on each rank before the one reduction per step (n·b more).
    """
    gib = 2.0**30
    N, V = counts["transformer"] + counts.get("buffers", 0), counts["vae"]
    n = counts["transformer"] if finetune == "full" else counts["lora"]
    w = max(1, int(world))
    parts = {"weights": N * bytes_per, "vae": V * 4.0}
    if strategy == "ddp":
        parts.update(grads=n * bytes_per, buckets=n * bytes_per, adam=2 * n * bytes_per, adam_step=n * bytes_per)
    elif strategy == "fsdp":
        parts.update(weights=N * bytes_per / w, grads=n * bytes_per / (w if finetune == "full" else 1),
                     adam=2 * n * bytes_per / w, adam_step=n * bytes_per / w)
    elif strategy == "deepspeed":
        parts.update(grads=4.0 * n / w + min(n, 2e8) * bytes_per + (0.0 if finetune == "full" else n * bytes_per),
                     master=4.0 * n / w, adam=8.0 * n / w, adam_step=4.0 * n / w)
    else:
        raise ValueError(f"strategy: one of {', '.join(STRATEGIES)}, got {strategy!r}")
    shard = w if strategy == "fsdp" else 1  # FSDP2: the EMA and the reference are built on the sharded weights
    if ema:
        parts["ema"] = n * bytes_per / shard
    if reference and finetune == "full":
        parts["reference"] = N * bytes_per / shard
    out = {k: v / gib for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def memory_table(world: int = 8, gpu_gib: float = 80.0, lora_rank: int = 32, models: Sequence[str] = MODELS,
                 counts: Mapping[str, Mapping[str, int]] | None = None) -> str:
    """Markdown: per-GPU GiB of each model × fine-tuning mode × strategy on ``world`` GPUs (:func:`memory_estimate`,
    EMA on, reference copy for full fine-tuning), marked where it exceeds ``gpu_gib`` before any activation."""
    counts = dict(counts or {m: param_counts(m, lora_rank) for m in models})
    head = ("| model | transformer | fine-tuning (trained) | " + " | ".join(f"{s} ×{world}" for s in STRATEGIES)
            + " |\n|---|---|---|" + "---|" * len(STRATEGIES))
    rows = [head]
    for m in models:
        c = counts[m]
        for ft in ("lora", "full"):
            n = c["transformer"] if ft == "full" else c["lora"]
            cells = []
            for s in STRATEGIES:
                t = memory_estimate(c, ft, s, world)["total"]
                cells.append(f"{t:.0f}" + ("" if t <= gpu_gib else " ✗"))
            trained = f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M"
            mode = f"LoRA r={lora_rank} ({trained})" if ft == "lora" else f"full ({trained})"
            size = (c["transformer"] + c.get("buffers", 0)) / 1e9
            rows.append(f"| {m} | {size:.2f} B | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def fits(counts: Mapping[str, int], finetune: str, free_gib: float, ema: bool = True, reference: bool = True,
         margin: float = 0.85) -> tuple[bool, float]:
    """Whether one GPU with ``free_gib`` free holds the persistent state (:func:`memory_estimate`, no DDP buckets)
    within ``margin`` of it, leaving the rest for activations; returns (fits, the estimate in GiB)."""
    est = memory_estimate(counts, finetune, "ddp", 1, ema=ema, reference=reference)
    need = est["total"] - est.get("buckets", 0.0)
    return need <= margin * free_gib and math.isfinite(need), need
