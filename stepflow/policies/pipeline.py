"""What the policies over a diffusers text-to-image pipeline share (SD3 / SD3.5, FLUX.1, Qwen-Image).

- :func:`load_pipeline`: ``<Pipeline>.from_pretrained(path)`` from a Hub id or a local diffusers folder, the VAE in its
  own dtype, optionally a fine-tuned transformer from another folder (``transformer_path``), and every failure as
  one actionable line (:class:`~stepflow.errors.ModelLoadError`);
- :class:`PipelinePolicy`: the pipeline's modules (shared, not copied: ``policy.pipe(...)`` samples with the
  policy's transformer, LoRA included), frozen text encoders run once per distinct prompt (a prompt cache, optional
  CPU offload between uses, :meth:`~PipelinePolicy.precache` then :meth:`~PipelinePolicy.free_text_encoders`),
  chunked VAE decoding, LoRA in diffusers' format and the choice of LoRA or full fine-tuning.

A subclass sets ``latent_shape`` and implements ``_encode_chunk`` (prompts -> per-prompt cache rows, with the
pipeline's own ``encode_prompt``), ``_collate`` (cache rows -> :class:`~stepflow.policies.base.Cond`),
``_decode_chunk`` (latents -> images in [-1, 1]) and, unless it is SD3's, ``_forward``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from stepflow.errors import ModelLoadError
from stepflow.policies.base import Cond, FlowPolicy, TimeInputs, lora_load_error
from stepflow.policies.base import check_args as _check_args

__all__ = ["PipelinePolicy", "load_pipeline", "resolve_dtype"]

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32,
                  field: str = "dtype") -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``"float32"``/... or a ``torch.dtype`` -> ``torch.dtype`` (errors name ``field``)."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"{field}: must be one of bfloat16, float16, float32, got {dtype!r}") from None


def _first_line(err: BaseException, limit: int = 240) -> str:
    text = str(err).strip().splitlines()
    line = f"{type(err).__name__}: {text[0] if text else ''}".strip().rstrip(":")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _looks_local(path: str) -> bool:
    """A filesystem path rather than a Hub id (``org/name``)."""
    return Path(path).expanduser().exists() or path.startswith(("/", ".", "~")) or path.count("/") != 1


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def check_json_files(folder: Path, field: str, fix: str) -> None:
    """Every ``*.json`` of a local model folder (``model_index.json``, each component's ``config.json``, tokenizer
    files) and of its direct subfolders must parse, else one line naming ``field`` and the file: diffusers' own
    error names neither."""
    for f in sorted([*folder.glob("*.json"), *folder.glob("*/*.json")]):
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{field}: {f} is not UTF-8 text (byte {e.start}); {fix}") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{field}: {f} is not valid JSON ({e.msg.removesuffix(' at')}, line {e.lineno} "
                                 f"column {e.colno}); {fix}") from None
        except OSError as e:
            raise ModelLoadError(f"{field}: cannot read {f} ({_first_line(e)}); {fix}") from None


#: a diffusers class name's model family (a substring of the name -> the family's name in messages)
#: (the first match wins: ``Flux2`` before ``Flux``)
FAMILIES = (("StableDiffusion3", "SD3"), ("SD3", "SD3"), ("Flux2", "FLUX.2"), ("Flux", "FLUX"),
            ("QwenImage", "Qwen-Image"), ("Wan", "Wan"), ("ZImage", "Z-Image"))


def family(class_name: str) -> str | None:
    """The model family of a diffusers class name (``SD3Transformer2DModel`` -> ``SD3``); None when unknown."""
    return next((fam for part, fam in FAMILIES if part in class_name), None)


def check_family(file: Path, expected, field: str, what: str) -> None:
    """The ``_class_name`` diffusers wrote into ``file`` (``model_index.json`` / a transformer's ``config.json``) is
    of the family of ``expected`` (the class about to load it), else one line naming ``field`` and both families:
    diffusers' own error (missing and unexpected keys) names neither."""
    try:
        found = json.loads(Path(file).read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return
    mine, theirs = family(expected.__name__), family(str(found or ""))
    if mine and theirs and mine != theirs:
        raise ModelLoadError(f"{field}: {file.parent} holds {theirs} weights ({found} in {file.name}), not {what} "
                             f"({expected.__name__}); point {field} at {what} weights, or choose the model those weights "
                             f"are (model=... of the {theirs} family)")


def load_pipeline(pipeline_cls, path: str, dtype: torch.dtype = torch.bfloat16,
                  vae_dtype: torch.dtype = torch.float32, *, what: str, example_id: str, gated: bool = False,
                  transformer_cls=None, transformer_path: str | None = None, **kwargs: Any):
    """``pipeline_cls.from_pretrained(path)`` with a one-line :class:`ModelLoadError` on failure.

    ``path``: a Hub id or a local diffusers folder (with ``model_index.json``). The VAE loads in ``vae_dtype``,
    everything else in ``dtype``. ``transformer_path``: a folder written by ``transformer.save_pretrained`` (e.g. a
    fully fine-tuned run's ``transformer/``, loaded with ``transformer_cls``) that replaces the pipeline's
    transformer. ``what`` names the model in
    messages; ``example_id`` is the Hub id the download hint names; ``gated``: the message mentions the licence.
    """
    path = str(path)
    fix = (f"download it once (e.g. `hf download {path if not _looks_local(path) else example_id} "
           f"--local-dir DIR`) and point at the local copy with model.path=DIR")
    local = Path(path).expanduser()
    if _looks_local(path):
        if not local.is_dir():
            raise ModelLoadError(f"model.path: cannot load the {what} model: no such directory '{path}'; {fix}")
        if not (local / "model_index.json").is_file():
            raise ModelLoadError(f"model.path: cannot load the {what} model: '{path}' has no model_index.json (not a "
                                 f"diffusers pipeline folder); {fix}")
        check_json_files(local, "model.path", f"the {what} model folder is damaged: {fix}")
        check_family(local / "model_index.json", pipeline_cls, "model.path", what)
        path = str(local)
    try:
        from diffusers.pipelines import pipeline_utils
    except ImportError as err:  # pragma: no cover - environment problem
        raise ModelLoadError(f"model.path: cannot load the {what} model '{path}': diffusers is not installed "
                             f"({_first_line(err)})") from None

    # diffusers >= 0.41 renamed torch_dtype to dtype (the old name warns); a dict gives per-component dtypes
    dtype_key = "dtype" if hasattr(pipeline_utils, "_resolve_dtype") else "torch_dtype"
    kwargs[dtype_key] = {"default": dtype, "vae": vae_dtype}
    if transformer_path:
        kwargs["transformer"] = _load_transformer(transformer_cls, str(transformer_path), dtype, dtype_key, what)
    try:
        pipe = pipeline_cls.from_pretrained(path, **kwargs)
    except Exception as err:  # noqa: BLE001 - every loader failure becomes one actionable line
        hint = " (HF_HUB_OFFLINE is set, so only the local cache is searched)" if _offline() and not local.is_dir() else ""
        lic = "; the repo is gated: accept its licence on the Hub and `hf auth login`" if gated else ""
        raise ModelLoadError(f"model.path: cannot load the {what} model '{path}'{hint}: {_first_line(err)}; "
                             f"{fix}{lic}") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_loader(pipeline: str, transformer: str, *, what: str, example_id: str,
                     gated: Callable[[str], bool] | None = None) -> Callable[..., Any]:
    """A family's loader ``load(path, dtype=bf16, vae_dtype=fp32, transformer_path=None, **kwargs)``:
    ``diffusers.<pipeline>.from_pretrained(path)`` (a Hub id or a local diffusers folder) through
    :func:`load_pipeline`, with a one-line :class:`ModelLoadError` on failure; ``transformer_path``: a fine-tuned
    ``diffusers.<transformer>`` folder. ``what`` names the model in messages, ``example_id`` is the Hub id the hint
    names, ``gated(path)``: whether the message mentions the licence."""

    def load(path: str, dtype: torch.dtype = torch.bfloat16, vae_dtype: torch.dtype = torch.float32,
             transformer_path: str | None = None, **kwargs: Any):
        import diffusers

        return load_pipeline(getattr(diffusers, pipeline), path, dtype, vae_dtype, what=what, example_id=example_id,
                             gated=bool(gated and gated(str(path))), transformer_cls=getattr(diffusers, transformer),
                             transformer_path=transformer_path, **kwargs)

    load.__doc__ = (f"``{pipeline}.from_pretrained(path)`` (a Hub id such as ``{example_id}`` or a local diffusers "
                    f"folder) with a one-line ModelLoadError on failure; ``transformer_path``: a fine-tuned "
                    f"``{transformer}`` folder (see stepflow.policies.pipeline.diffusers_loader).")
    return load


def _load_transformer(cls, path: str, dtype: torch.dtype, dtype_key: str, what: str):
    """``cls.from_pretrained(path)``: a transformer folder with ``config.json``."""
    local = Path(path).expanduser()
    fix = ("point model.transformer_path at a folder written by save_trained (a model.finetune=full run's "
           "<run>/transformer), or null for the pipeline's own transformer")
    if not (local / "config.json").is_file():
        raise ModelLoadError(f"model.transformer_path: cannot load the {what} transformer: '{path}' has no "
                             f"config.json (expected a folder written by save_trained / transformer.save_pretrained)")
    check_json_files(local, "model.transformer_path", fix)
    if cls is not None:
        check_family(local / "config.json", cls, "model.transformer_path", what)
    try:
        return cls.from_pretrained(str(local), **{dtype_key: dtype})
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(f"model.transformer_path: cannot load the {what} transformer '{path}': "
                             f"{_first_line(err)}; {fix}") from None


class PipelinePolicy(FlowPolicy):
    """A :class:`FlowPolicy` over a diffusers pipeline (see the module docstring).

    Args:
        pipe: the loaded pipeline (its modules are shared: ``policy.pipe(...)`` uses the policy's transformer).
        max_sequence_length: text tokens of the (last) text encoder.
        gradient_checkpointing: checkpoint the transformer blocks in training forward passes.
        offload_text_encoders: keep the text encoders on the CPU and move them to the device only to encode prompts
            that are not cached yet.
        guidance, eval_guidance: the model's recommended CFG scales for rollouts and for evaluation (1.0 = none).
            Plain attributes for callers; the GRPO loop itself uses ``loop.guidance`` / ``eval.guidance``.
        decode_batch_size: decode in chunks of this many latents; encode_batch_size: encode new prompts in chunks.
        lora: ``None`` or keyword arguments of :meth:`add_lora` (``rank``, ``alpha``, ``targets``, ``init``,
            ``dropout``) plus an optional ``path``: a folder written by :meth:`save_lora` to load the adapter from.
        finetune: ``lora`` (default) or ``full`` (every transformer weight trainable; no adapter).
    """

    #: the pipeline's text-encoder attribute names, in the order they run
    text_encoder_names: tuple[str, ...] = ()

    #: the numeric arguments and their bounds (:func:`~stepflow.policies.base.check_number`), checked by
    #: :meth:`check_args` before anything loads; a subclass extends it with its own
    ARG_RULES: dict[str, dict[str, Any]] = {
        **{k: {"integer": True, "ge": 1, "hint": " (pixels, a multiple of the VAE scale x patch: 16 for every "
                                                 "shipped model)"} for k in ("height", "width")},
        "max_sequence_length": {"integer": True, "ge": 1},
        "guidance": {"ge": 1.0, "hint": " (1 = no CFG)"}, "eval_guidance": {"ge": 1.0, "hint": " (1 = no CFG)"},
        "decode_batch_size": {"integer": True, "ge": 1}, "encode_batch_size": {"integer": True, "ge": 1},
    }

    @classmethod
    def check_args(cls, values: Mapping[str, Any]) -> None:
        """One-line errors (``model.<name>: ...``) for the numeric arguments among ``values`` (a constructor's or
        ``from_pretrained``'s keyword arguments; others are ignored): non-numbers, inf / nan, out of bounds. Called
        before any weights load; the size's multiple needs the pipeline (:func:`check_image_size`)."""
        _check_args(values, cls.ARG_RULES)

    #: the Hub id :meth:`from_pretrained` loads when given no path
    default_path: str | None = None
    #: the family's pipeline loader, ``loader(path, dtype, vae_dtype, transformer_path=...)`` (a function of the
    #: family's module, set as ``loader = staticmethod(load_<family>_pipeline)``)
    loader: Callable[..., Any] | None = None

    @classmethod
    def from_pretrained(cls, path: str | None = None, *, dtype: str | torch.dtype = "bfloat16",
                        vae_dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
                        transformer_path: str | None = None, **kwargs: Any):
        """Load the family's diffusers pipeline (a Hub id or a local folder; ``None``: :attr:`default_path`) through
        :attr:`loader` and wrap it; other keyword arguments go to the class.

        dtype: the transformer's and text encoders' weights (``bfloat16`` for training, ``float32`` for exact tests);
        the SDE math stays fp32 (``velocity`` returns fp32). vae_dtype: the VAE's (fp32 default). device: move the
        modules there (``None`` leaves them on the CPU: Lightning moves the registered modules; text encoders follow
        on first ``encode``). transformer_path: a fully fine-tuned transformer (``save_trained`` of a
        ``finetune=full`` run) to use instead of the pipeline's. Raises :class:`ModelLoadError` (one line) on
        failure; a bad numeric argument is one line before anything loads (:meth:`check_args`)."""
        cls.check_args(kwargs)
        if cls.loader is None:
            raise TypeError(f"{cls.__name__} sets no pipeline `loader` (loader = staticmethod(load_..._pipeline))")
        pipe = cls.loader(path or cls.default_path, resolve_dtype(dtype, torch.bfloat16, "model.dtype"),
                          resolve_dtype(vae_dtype, field="model.vae_dtype"), transformer_path=transformer_path)
        policy = cls(pipe, **kwargs)
        policy._move_to(device)
        return policy

    def __init__(self, pipe, *, name: str | None = None, max_sequence_length: int = 256,
                 gradient_checkpointing: bool = False, offload_text_encoders: bool = False, guidance: float = 1.0,
                 eval_guidance: float = 1.0, decode_batch_size: int = 8, encode_batch_size: int = 16,
                 estimate_vae: str | None = None):
        self.check_args(dict(max_sequence_length=max_sequence_length, guidance=guidance, eval_guidance=eval_guidance,
                             decode_batch_size=decode_batch_size, encode_batch_size=encode_batch_size))
        super().__init__()
        self.pipe = pipe  # plain attribute: not a Module, its modules are registered below or kept out on purpose
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        #: a cheap decoder for the x̂0 estimates of intermediate states (the final image keeps the full VAE)
        self.estimate_vae = self._load_estimate_vae(estimate_vae)
        self.name = name or str(getattr(pipe, "name_or_path", "") or type(self).__name__)
        self.max_sequence_length = int(max_sequence_length)
        self.offload_text_encoders = bool(offload_text_encoders)
        self.guidance = float(guidance)
        self.eval_guidance = float(eval_guidance)
        self.decode_batch_size = int(decode_batch_size)
        self.encode_batch_size = int(encode_batch_size)
        #: prompt -> cache row (a tuple of tensors, see ``_encode_chunk``); filled by :meth:`encode`
        self._prompt_cache: dict[str, tuple[Tensor, ...]] = {}
        #: number of text-encoding calls made (each runs every text encoder on a batch of new prompts)
        self.encoder_calls = 0
        self._neg_cond = None

        # Frozen parts; the transformer's base weights are frozen too until LoRA or full fine-tuning is set up
        for module in (self.vae, *self.text_encoders):
            module.requires_grad_(False)
            module.eval()
        self.transformer.requires_grad_(False)
        if self.offload_text_encoders:
            for module in self.text_encoders:
                module.to("cpu")
        if gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()

    def _setup_training(self, lora: Mapping[str, Any] | None, finetune: str = "lora") -> None:
        """LoRA adapter (added or loaded) or full fine-tuning; called at the end of a subclass' ``__init__``."""
        if finetune == "full":
            if lora:
                raise ValueError("model.finetune=full trains every transformer weight: drop the LoRA settings "
                                 "(model.lora / lora.path), or use model.finetune=lora")
            self.set_finetune("full")
            return
        self.set_finetune(finetune)
        if lora:
            lora = dict(lora)
            lora_path = lora.pop("path", None)
            if lora_path and not lora:
                self.load_lora(lora_path, field="model.lora.path")
            else:
                self.add_lora(**lora)
                if lora_path:
                    self.load_lora(lora_path, field="model.lora.path")

    # ------------------------------------------------------------------ text
    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders that are still loaded."""
        return [m for m in (getattr(self.pipe, n, None) for n in self.text_encoder_names) if m is not None]

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

    def _encode_chunk(self, prompts: list[str]) -> list[tuple[Tensor, ...]]:  # pragma: no cover - interface
        """A batch of prompts -> one cache row per prompt, with the pipeline's own ``encode_prompt``."""
        raise NotImplementedError

    def _collate(self, rows: list[tuple[Tensor, ...]], device: torch.device) -> Cond:
        """Cache rows -> :class:`Cond` on ``device`` (default: rows of (tokens (L, D), pooled (P,)), stacked)."""
        return Cond(tokens=torch.stack([r[0] for r in rows]).to(device),
                    pooled=torch.stack([r[1] for r in rows]).to(device))

    @torch.no_grad()
    def _encode_new(self, prompts: list[str]) -> None:
        if not self.text_encoders:
            raise RuntimeError(f"text encoders were freed (free_text_encoders) and {len(prompts)} prompt(s) are not "
                               f"cached, e.g. {prompts[0]!r}; call precache(all_prompts) before freeing")
        with self._text_encoders_on(self.device):
            for i in range(0, len(prompts), self.encode_batch_size):
                chunk = prompts[i:i + self.encode_batch_size]
                rows = self._encode_chunk(chunk)
                self.encoder_calls += 1
                for p, row in zip(chunk, rows):
                    self._prompt_cache[p] = row

    def encode(self, prompts: Sequence[str]) -> Cond:
        """Prompts -> :class:`Cond` on the policy's device; each distinct prompt is encoded once (later calls read
        the cache)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        new = list(dict.fromkeys(p for p in prompts if p not in self._prompt_cache))
        if new:
            self._encode_new(new)
        return self._collate([self._prompt_cache[p] for p in prompts], self.device)

    def precache(self, prompts: Iterable[str]) -> None:
        """Encode every prompt of a dataset (and the negative prompt for CFG) ahead of time."""
        prompts = list(dict.fromkeys(prompts))
        new = [p for p in prompts + [self.negative_prompt] if p not in self._prompt_cache]
        if new:
            self._encode_new(list(dict.fromkeys(new)))

    def free_text_encoders(self) -> None:
        """Drop the text encoders (T5-XXL alone is ~9.5 GB in bf16); only cached prompts can be encoded after."""
        for name in self.text_encoder_names:
            setattr(self.pipe, name, None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def clear_prompt_cache(self) -> None:
        self._prompt_cache.clear()
        self._neg_cond = None

    # ------------------------------------------------------------------ image
    def _decode_chunk(self, z: Tensor) -> Tensor:
        """Latents (b, C, H, W) fp32 -> the VAE's images (b, 3, H', W') in [-1, 1], as SD3's and FLUX's pipelines:
        ``vae.decode(latents / scaling_factor + shift_factor)`` (Qwen-Image overrides it)."""
        cfg = self.vae.config
        p = self._vae_param()
        z = z / cfg.scaling_factor + cfg.shift_factor
        return self.vae.decode(z.to(p.device, p.dtype), return_dict=False)[0]

    def _own_scheduler_and_time_hook(self, pipe) -> None:
        """A scheduler of our own (``time_grid`` mutates it), the timestep scale, and the :class:`TimeInputs`
        pre-hook on ``transformer.time_text_embed`` that feeds it fp32 times (FLUX.1, Qwen-Image)."""
        self.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        self.timestep_scale = float(self.scheduler.config.get("num_train_timesteps", 1000))
        self._time_inputs = TimeInputs()
        self._time_hook = self._time_inputs.install(self.transformer.time_text_embed)

    def decode(self, latents: Tensor, estimate: bool = False) -> Tensor:
        """latents (B, C, H, W) -> images (B, 3, H', W') in [0, 1], fp32 (in chunks of ``decode_batch_size``), as the
        pipeline's ``output_type="pt"``: ``(vae image / 2 + 0.5).clamp(0, 1)``. ``estimate`` with an
        ``estimate_vae`` (a diffusers ``AutoencoderTiny``, e.g. TAESD3 / TAEF1): decoded by that tiny decoder
        instead, with its own scaling and shift (only x̂0 estimates of intermediate states ask for it)."""
        tiny = self.estimate_vae if estimate else None
        out = []
        for chunk in latents.split(max(1, self.decode_batch_size)):
            img = self._decode_chunk(chunk.float()) if tiny is None else self._decode_tiny(tiny, chunk.float())
            out.append((img.float() / 2 + 0.5).clamp(0, 1))
        return torch.cat(out).to(latents.device)

    def _decode_tiny(self, tiny, z: Tensor) -> Tensor:
        cfg = tiny.config
        p = next(tiny.parameters())
        z = z / cfg.scaling_factor + cfg.shift_factor
        return tiny.decode(z.to(p.device, p.dtype), return_dict=False)[0]

    def _load_estimate_vae(self, path: str | None):
        """The ``estimate_vae`` (``AutoencoderTiny.from_pretrained``), or None; a one-line error when it fails."""
        if not path:
            return None
        from diffusers import AutoencoderTiny

        try:
            vae = AutoencoderTiny.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - offline, wrong path, not a tiny autoencoder
            raise ModelLoadError(f"cannot load model.estimate_vae '{path}' ({_first_line(e)}); download it once "
                                 f"(e.g. `hf download madebyollin/taesd3 --local-dir DIR`) and set "
                                 f"model.estimate_vae=DIR, or null for the full VAE") from None
        if vae.config.latent_channels != self.vae.config.latent_channels:
            raise ModelLoadError(f"model.estimate_vae: '{path}' has {vae.config.latent_channels} latent channels, "
                                 f"the model's VAE {self.vae.config.latent_channels}; use the model's tiny decoder")
        return vae.to(torch.float32).eval().requires_grad_(False)

    def _vae_param(self) -> Tensor:
        return next(self.vae.parameters())

    # ------------------------------------------------------------------ LoRA I/O (diffusers format)
    def load_lora(self, directory: str | os.PathLike, field: str = "lora_path") -> None:
        """Load an adapter written by :meth:`save_lora` (or any diffusers LoRA of this transformer).

        If the policy already has an adapter, its weights are replaced (shapes must match); otherwise one is
        created from the file's metadata. Base weights stay frozen, LoRA weights trainable. A path that is not a
        LoRA of this model (missing, random bytes, another model's adapter) is one line naming ``field``
        (``model.lora.path`` from the constructor, ``lora_path`` for ``stepflow.evaluate``).
        """
        directory = str(directory)
        if not Path(directory).expanduser().exists():
            raise ModelLoadError(f"{field}: cannot load a LoRA: no such file or directory '{directory}'; point "
                                 f"{field} at a run's <run>/lora folder")
        if self.finetune == "full":
            raise ValueError(f"{field}: model.finetune=full takes no LoRA adapter; load a fine-tuned transformer "
                             "with model.transformer_path instead")
        try:
            self._load_lora_weights(str(Path(directory).expanduser()))
        except Exception as e:  # noqa: BLE001 - OSError (not safetensors), KeyError / RuntimeError (another model)
            raise ModelLoadError(lora_load_error(field, directory, e)) from None
        self.transformer.requires_grad_(False)
        for p in self.lora_parameters():
            p.requires_grad_(True)

    def _load_lora_weights(self, directory: str) -> None:
        """Into the existing adapter (same shapes), or a new one from the file (diffusers' ``load_lora_weights``). A
        policy without a diffusers pipeline (the ``*_random`` builders) reads the file with the generic reader."""
        if not hasattr(self.pipe, "load_lora_weights"):
            from stepflow.policies.base import read_lora

            state, info = read_lora(directory)
            if not self.has_lora:
                self.add_lora(rank=info["rank"], alpha=info["alpha"], targets=info["targets"])
            self.load_lora_state_dict(state)
            return
        if self.has_lora:
            from peft.utils import set_peft_model_state_dict

            state = self.pipe.lora_state_dict(directory)
            state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
            result = set_peft_model_state_dict(self.transformer, state)
            missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
            if missing:
                raise ValueError(f"it does not match the policy's adapter: {missing[:3]} ...")
        else:
            self.pipe.load_lora_weights(directory, adapter_name="default")

    def _move_to(self, device: str | torch.device | None) -> None:
        """``from_pretrained(device=...)``: the registered modules and (unless offloaded) the text encoders."""
        if device is None:
            return
        self.to(device)
        if not self.offload_text_encoders:
            for module in self.text_encoders:
                module.to(device)
