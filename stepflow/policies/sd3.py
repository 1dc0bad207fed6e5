"""Stable Diffusion 3 / 3.5 (Medium, Large) as a :class:`~stepflow.policies.base.FlowPolicy`.

Built on diffusers' ``StableDiffusion3Pipeline`` components:

- ``transformer`` (``SD3Transformer2DModel``): the velocity model; the only module with trainable (LoRA) weights;
- ``vae`` (``AutoencoderKL``, 16 latent channels, 8x): frozen, fp32 by default; ``decode`` undoes SD3's latent
  normalisation, ``latents / scaling_factor + shift_factor``;
- three text encoders (CLIP-L, CLIP-G, T5-XXL) through the pipeline's own ``encode_prompt``: frozen, run once per
  distinct prompt (a prompt -> (tokens row, pooled row) cache), optionally kept on the CPU between uses
  (``offload_text_encoders``) or freed after :meth:`SD3Policy.precache` (:meth:`SD3Policy.free_text_encoders`);
- the scheduler config only for ``shift`` (SD3.5: 3.0) and the timestep scale (1000).

Time runs from 1 (noise) to 0 (data) and ``velocity`` predicts ``x1 - x0`` (base.py conventions). The plain Euler ODE
``x_{k+1} = x_k + (τ_{k+1} - τ_k) · v(x_k, τ_k)`` on ``time_grid(N)`` reproduces ``StableDiffusion3Pipeline.__call__``
(tested to 1e-4 on the tiny pipeline, with and without CFG).

Load with ``SD3Policy.from_pretrained("stabilityai/stable-diffusion-3.5-medium")`` or a local diffusers folder
(``model.path=/local/dir`` in Hydra). A load failure is a one-line :class:`ModelLoadError`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from stepflow.policies.base import LORA_TARGETS_SD3, Cond, FlowPolicy

__all__ = ["ModelLoadError", "SD3Policy", "default_lora", "load_sd3_pipeline", "resolve_dtype"]

SD35_MEDIUM = "stabilityai/stable-diffusion-3.5-medium"

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


try:  # the entry points print StepflowError (a ValueError) as one line
    from stepflow.cli import StepflowError as _UserError
except ImportError:  # pragma: no cover - stepflow.cli absent (e.g. a stripped copy on a GPU box)
    _UserError = ValueError


class ModelLoadError(_UserError):
    """A model could not be loaded. The message is one line: what, where from, and how to fix it.

    A ``ValueError`` (a ``stepflow.cli.StepflowError``): entry points print it as that one line, not a traceback.
    """


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``"float32"``/... or a ``torch.dtype`` -> ``torch.dtype``."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype={dtype!r}: use one of bfloat16, float16, float32") from None


def _first_line(err: BaseException, limit: int = 240) -> str:
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0] if text else ''}".strip().rstrip(":")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a Hub id (``org/name``)."""
    return Path(path).expanduser().exists() or path.startswith(("/", ".", "~")) or path.count("/") != 1


def load_sd3_pipeline(path: str, dtype: torch.dtype = torch.bfloat16, vae_dtype: torch.dtype = torch.float32,
                      **kwargs: Any):
    """``StableDiffusion3Pipeline.from_pretrained(path)`` with a one-line :class:`ModelLoadError` on failure.

    ``path``: a Hub id (``stabilityai/stable-diffusion-3.5-medium``) or a local diffusers folder (with
    ``model_index.json``). The VAE loads in ``vae_dtype`` (fp32 by default), everything else in ``dtype``.
    """
    path = str(path)
    fix = (f"download it once (e.g. `huggingface-cli download {path if not _looks_local(path) else SD35_MEDIUM} "
           f"--local-dir DIR`) and point at the local copy with model.path=DIR")
    local = Path(path).expanduser()
    if _looks_local(path):
        if not local.is_dir():
            raise ModelLoadError(f"cannot load the SD3 model: no such directory '{path}'; {fix}")
        if not (local / "model_index.json").is_file():
            raise ModelLoadError(f"cannot load the SD3 model: '{path}' has no model_index.json (not a diffusers "
                                 f"pipeline folder); {fix}")
        path = str(local)
    try:
        from diffusers import StableDiffusion3Pipeline
    except ImportError as err:  # pragma: no cover - environment problem
        raise ModelLoadError(f"cannot load the SD3 model '{path}': diffusers is not installed ({_first_line(err)})") \
            from None
    from diffusers.pipelines import pipeline_utils

    # diffusers >= 0.41 renamed torch_dtype to dtype (the old name warns); a dict gives per-component dtypes
    dtype_key = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    kwargs[dtype_key] = {"default": dtype, "vae": vae_dtype}
    try:
        pipe = StableDiffusion3Pipeline.from_pretrained(path, **kwargs)
    except Exception as err:  # noqa: BLE001 - every loader failure becomes one actionable line
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        hint = " (HF_HUB_OFFLINE is set, so only the local cache is searched)" if offline and not local.is_dir() else ""
        gated = "; the SD3.5 repos are gated: accept the licence and `huggingface-cli login`" \
            if path.startswith("stabilityai/") else ""
        raise ModelLoadError(f"cannot load the SD3 model '{path}'{hint}: {_first_line(err)}; {fix}{gated}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe


class SD3Policy(FlowPolicy):
    """SD3 / SD3.5 policy over a ``StableDiffusion3Pipeline``.

    Args:
        pipe: the loaded pipeline (its modules are shared, not copied: ``policy.pipe(...)`` samples with the policy's
            transformer, LoRA included).
        height, width: image size in pixels (multiples of 8 · patch_size = 16); ``latent_shape`` follows.
        max_sequence_length: T5 tokens (SD3.5 / Flow-GRPO: 256; token states are then 77 + 256 = 333 long).
        gradient_checkpointing: checkpoint the transformer blocks in training forward passes.
        offload_text_encoders: keep the text encoders on the CPU and move them to the device only to encode
            prompts that are not cached yet.
        guidance, eval_guidance: the model's recommended CFG scales for rollouts (1.0 = none; the paper's curves;
            4.5 for its GenEval models) and for evaluation (4.5). Plain attributes for callers; the GRPO loop itself
            uses ``loop.guidance`` / ``eval.guidance``.
        decode_batch_size: decode in chunks of this many latents (a 512 px fp32 VAE decode is memory hungry).
        encode_batch_size: encode uncached prompts in chunks of this many.
        lora: ``None`` or keyword arguments of :meth:`add_lora` (``rank``, ``alpha``, ``targets``, ``init``, ``dropout``)
            plus an optional ``path``: a folder written by :meth:`save_lora` to load the adapter weights from.
    """

    def __init__(self, pipe, *, height: int = 512, width: int = 512, max_sequence_length: int = 256,
                 gradient_checkpointing: bool = False, offload_text_encoders: bool = False, guidance: float = 1.0,
                 eval_guidance: float = 4.5, decode_batch_size: int = 8, encode_batch_size: int = 16,
                 lora: Mapping[str, Any] | None = None, name: str | None = None):
        super().__init__()
        vae_scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        multiple = vae_scale * pipe.transformer.config.patch_size
        if height % multiple or width % multiple:
            raise ValueError(f"height/width ({height}x{width}) must be multiples of {multiple} for this model")
        if pipe.vae.config.latent_channels != pipe.transformer.config.in_channels:
            raise ValueError("VAE latent channels and transformer in_channels differ: not an SD3 pipeline")
        sched = pipe.scheduler.config
        if sched.get("use_dynamic_shifting", False):
            raise ValueError("the scheduler uses dynamic shifting (resolution-dependent mu); stepflow's time grid "
                             "uses a fixed shift: set use_dynamic_shifting=false in scheduler_config.json")

        self.pipe = pipe  # plain attribute: not a Module, its modules are registered below or kept out on purpose
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.name = name or str(getattr(pipe, "name_or_path", "") or "sd3")
        self.height, self.width = int(height), int(width)
        self.vae_scale_factor = vae_scale
        self.latent_shape = (int(pipe.vae.config.latent_channels), self.height // vae_scale, self.width // vae_scale)
        self.shift = float(sched.get("shift", 1.0))
        self.timestep_scale = float(sched.get("num_train_timesteps", 1000))
        self.max_sequence_length = int(max_sequence_length)
        self.offload_text_encoders = bool(offload_text_encoders)
        self.guidance = float(guidance)
        self.eval_guidance = float(eval_guidance)
        self.decode_batch_size = int(decode_batch_size)
        self.encode_batch_size = int(encode_batch_size)
        #: prompt -> (tokens (L, D), pooled (P,)); filled by :meth:`encode`
        self._prompt_cache: dict[str, tuple[Tensor, Tensor]] = {}
        #: number of ``encode_prompt`` calls made (each runs all three text encoders on a batch of new prompts)
        self.encoder_calls = 0
        self._neg_cond = None

        # Frozen parts. The transformer's base weights are frozen too: stepflow trains LoRA adapters.
        for module in (self.vae, *self.text_encoders):
            module.requires_grad_(False)
            module.eval()
        self.transformer.requires_grad_(False)
        if self.offload_text_encoders:
            for module in self.text_encoders:
                module.to("cpu")
        if gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()
        if lora:
            lora = dict(lora)
            lora_path = lora.pop("path", None)
            if lora_path and not lora:
                self.load_lora(lora_path)
            else:
                self.add_lora(**lora)
                if lora_path:
                    self.load_lora(lora_path)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str = SD35_MEDIUM, *, dtype: str | torch.dtype = "bfloat16",
                        vae_dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
                        height: int = 512, width: int = 512, max_sequence_length: int = 256,
                        gradient_checkpointing: bool = False, lora: Mapping[str, Any] | None = None,
                        **kwargs: Any) -> "SD3Policy":
        """Load an SD3/SD3.5 diffusers pipeline (Hub id or local folder) and wrap it.

        dtype: weights of the transformer and text encoders (``bfloat16`` for SD3.5 training; ``float32`` for exact
        tests); the SDE math stays fp32 (``velocity`` returns fp32). vae_dtype: the VAE's (fp32 default).
        device: move the transformer, VAE and (unless offloaded) text encoders there; ``None`` leaves them on the CPU
        (Lightning moves the registered modules; text encoders follow on first ``encode``).
        Other keyword arguments go to :class:`SD3Policy`. Raises :class:`ModelLoadError` (one line) on failure.
        """
        pipe = load_sd3_pipeline(path, resolve_dtype(dtype, torch.bfloat16), resolve_dtype(vae_dtype))
        policy = cls(pipe, height=height, width=width, max_sequence_length=max_sequence_length,
                     gradient_checkpointing=gradient_checkpointing, lora=lora, **kwargs)
        if device is not None:
            policy.to(device)
            if not policy.offload_text_encoders:
                for module in policy.text_encoders:
                    module.to(device)
        return policy

    # ------------------------------------------------------------------ text
    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders that are still loaded (CLIP-L, CLIP-G, T5)."""
        return [m for m in (self.pipe.text_encoder, self.pipe.text_encoder_2, self.pipe.text_encoder_3) if m is not None]

    @contextlib.contextmanager
    def _text_encoders_on(self, device: torch.device):
        encoders = self.text_encoders
        home = [next(m.parameters()).device for m in encoders]
        for m in encoders:
            if next(m.parameters()).device != device:
                m.to(device)
        try:
            yield
        finally:
            if self.offload_text_encoders:
                for m, d in zip(encoders, home):
                    m.to("cpu" if d == device else d)

    @torch.no_grad()
    def _encode_new(self, prompts: list[str]) -> None:
        if self.pipe.text_encoder is None:
            raise RuntimeError(f"text encoders were freed (free_text_encoders) and {len(prompts)} prompt(s) are not "
                               f"cached, e.g. {prompts[0]!r}; call precache(all_prompts) before freeing")
        device = self.device
        with self._text_encoders_on(device):
            for i in range(0, len(prompts), self.encode_batch_size):
                chunk = prompts[i:i + self.encode_batch_size]
                tokens, _, pooled, _ = self.pipe.encode_prompt(
                    prompt=chunk, prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=1,
                    do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
                self.encoder_calls += 1
                for p, tok, pool in zip(chunk, tokens, pooled):
                    self._prompt_cache[p] = (tok, pool)

    def encode(self, prompts: Sequence[str]) -> Cond:
        """Prompts -> ``Cond(tokens (B, 77 + max_sequence_length, 4096), pooled (B, 2048))`` on the policy's device.

        Uses the pipeline's ``encode_prompt`` (CLIP-L + CLIP-G hidden states, zero-padded to T5 width, then T5),
        once per distinct prompt: later calls read the cache.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        new = list(dict.fromkeys(p for p in prompts if p not in self._prompt_cache))
        if new:
            self._encode_new(new)
        device = self.device
        tokens = torch.stack([self._prompt_cache[p][0] for p in prompts]).to(device)
        pooled = torch.stack([self._prompt_cache[p][1] for p in prompts]).to(device)
        return Cond(tokens=tokens, pooled=pooled)

    def precache(self, prompts: Iterable[str]) -> None:
        """Encode every prompt of a dataset (and the empty prompt for CFG) ahead of time."""
        prompts = list(dict.fromkeys(prompts))
        new = [p for p in prompts + [""] if p not in self._prompt_cache]
        if new:
            self._encode_new(new)

    def free_text_encoders(self) -> None:
        """Drop the text encoders (T5-XXL alone is ~9.5 GB in bf16); only cached prompts can be encoded after."""
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            setattr(self.pipe, name, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def clear_prompt_cache(self) -> None:
        self._prompt_cache.clear()
        self._neg_cond = None

    # ------------------------------------------------------------------ image
    def decode(self, latents: Tensor) -> Tensor:
        """latents (B, 16, H/8, W/8) -> images (B, 3, H, W) in [0, 1], fp32 (in chunks of ``decode_batch_size``).

        Same as the pipeline: ``vae.decode(latents / scaling_factor + shift_factor)`` then ``(x / 2 + 0.5).clamp(0, 1)``.
        """
        cfg = self.vae.config
        vae_param = next(self.vae.parameters())
        out = []
        for chunk in latents.split(max(1, self.decode_batch_size)):
            z = chunk.float() / cfg.scaling_factor + cfg.shift_factor
            img = self.vae.decode(z.to(vae_param.device, vae_param.dtype), return_dict=False)[0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out).to(latents.device)

    # ------------------------------------------------------------------ LoRA I/O (diffusers format)
    def load_lora(self, directory: str | os.PathLike) -> None:
        """Load an adapter written by :meth:`save_lora` (or any diffusers SD3 transformer LoRA).

        If the policy already has an adapter, its weights are replaced (shapes must match); otherwise one is
        created from the file's metadata. Base weights stay frozen, LoRA weights trainable.
        """
        directory = str(directory)
        if not Path(directory).exists():
            raise ModelLoadError(f"cannot load LoRA: no such file or directory '{directory}'")
        if self.has_lora:
            from peft.utils import set_peft_model_state_dict

            state = self.pipe.lora_state_dict(directory)
            state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
            result = set_peft_model_state_dict(self.transformer, state)
            missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
            if missing:
                raise ValueError(f"LoRA in '{directory}' does not match the policy's adapter: {missing[:3]} ...")
        else:
            self.pipe.load_lora_weights(directory, adapter_name="default")
        self.transformer.requires_grad_(False)
        for p in self.lora_parameters():
            p.requires_grad_(True)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, shift={self.shift}, "
                f"max_sequence_length={self.max_sequence_length}, lora={self.has_lora}")


def default_lora(rank: int = 32, alpha: float = 64.0) -> dict[str, Any]:
    """Flow-GRPO's SD3.5 LoRA: r=32, alpha=64, gaussian init, the attention projections of both streams."""
    return {"rank": rank, "alpha": alpha, "init": "gaussian", "targets": list(LORA_TARGETS_SD3)}
