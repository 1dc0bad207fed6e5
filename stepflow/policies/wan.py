"""Wan 2.1 / 2.2 text-to-video as a :class:`~stepflow.policies.base.FlowPolicy`, over diffusers' ``WanPipeline``.

What it takes from the pipeline (and how this policy reproduces ``WanPipeline.__call__``):

- **video latents**: ``(B, z_dim, F_lat, H/8, W/8)`` with ``F_lat = (F − 1) / 4 + 1`` (the VAE compresses time 4x:
  ``num_frames − 1`` must be a multiple of ``vae_scale_factor_temporal``; the pipeline silently rounds a wrong count,
  this policy refuses it in one line). The trajectory, the SDE steps, the log-probs (a mean over every latent
  dimension, frames included) and the x̂0 estimates hold these 5-D tensors as they are; :attr:`WanPolicy.modality` is
  ``"video"`` and :meth:`WanPolicy.decode` returns videos ``(B, 3, F, H, W)`` in [0, 1] (the pipeline's
  ``output_type="pt"`` gives ``(B, F, 3, H, W)``: the same values, frames on another axis);
- **text**: UMT5-XXL's last hidden states of the cleaned prompt (``prompt_clean``), cut at its length and zero-padded
  to ``max_sequence_length`` (512), from the pipeline's own ``encode_prompt``, once per distinct prompt; no pooled
  vector (``Cond.pooled`` is ``(B, 0)``), no mask (the pipeline passes none);
- **time grid**: a first-order rollout (Euler ODE / SDE steps) on ``FlowMatchEulerDiscreteScheduler(shift=s)``'s
  sigmas plus the trailing 0 (``σ = shift(linspace(1, σ_min, N))``, the grid WanPipeline samples on with that
  scheduler, as diffusers' own Wan tests and DanceGRPO's Wan recipe use it). The Hub checkpoints ship
  ``UniPCMultistepScheduler`` (a second-order multistep solver) with ``flow_shift`` (Wan 2.1 480p: 3.0, 720p: 5.0):
  ``s`` is that ``flow_shift`` (or ``model.shift``). UniPC's own grid starts at ``shift(0.999) < 1`` and is not a
  one-step chain, so it cannot be the SDE samplers' grid (which starts at exactly 1); the reference this policy
  equals (Δ ≤ 2e-6 in fp32, every frame) is ``WanPipeline`` with that Euler scheduler;
- **timestep**: ``1000 · σ`` in fp32 (Wan's time embedding takes it as given, no cast before the sinusoid);
- **CFG**: ``v_u + w (v_c − v_u)`` with the negative prompt (the pipeline's default ``""``);
- **Wan 2.2 (A14B)**: two transformers, ``transformer`` (high noise) for ``1000 σ ≥ boundary_ratio · 1000`` and
  ``transformer_2`` (low noise) below, exactly the pipeline's test ``t >= boundary_timestep``; both are trained (LoRA
  on both, or both fully) as one module (:class:`WanExperts`), each batch row routed by its own time, and the
  low-noise stage takes ``guidance_2`` (the pipeline's ``guidance_scale_2``; None: the same scale);
- **decode**: ``vae.decode(z · latents_std + latents_mean)``, as the pipeline (per-channel normalisation).

LoRA (:data:`LORA_TARGETS_WAN`, the self- and cross-attention projections) is written as diffusers' ``WanPipeline``
reads it: ``pipe.load_lora_weights(dir)`` (Wan 2.2: plus ``pipe.load_lora_weights(dir, weight_name=
"pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True)``).

Load with ``WanPolicy.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")`` or a local diffusers folder
(``model.path=DIR``); a load failure is a one-line :class:`~stepflow.errors.ModelLoadError`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stepflow.errors import ModelLoadError, StepflowError
from stepflow.policies.base import Cond, check_image_size, check_number, check_time_grid
from stepflow.policies.pipeline import PipelinePolicy, _load_transformer, load_pipeline

__all__ = ["LORA_TARGETS_WAN", "WAN21_T2V", "WAN22_T2V", "WanExperts", "WanPolicy", "check_num_frames",
           "load_wan_pipeline"]

WAN21_T2V = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
WAN22_T2V = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"

#: the attention projections of every Wan block: self-attention (attn1) and text cross-attention (attn2); the modules
#: Flow-GRPO's Wan 2.1 target list ("to_q", "to_k", "to_v", "to_out.0", ...) adapts in a text-to-video transformer
LORA_TARGETS_WAN: tuple[str, ...] = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
)

#: the LoRA file of each expert in a saved Wan 2.2 adapter folder
EXPERT_LORA_FILES = {"transformer": "pytorch_lora_weights.safetensors",
                     "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}


def check_num_frames(num_frames, temporal: int, field: str = "model.num_frames") -> int:
    """``num_frames`` as an int with ``(num_frames − 1) % temporal == 0`` (the VAE's temporal compression), else one
    line naming ``field`` and the nearest valid counts."""
    n = check_number(field, num_frames, integer=True, ge=1)
    if (n - 1) % temporal:
        lo = (n - 1) // temporal * temporal + 1
        raise StepflowError(f"{field}: must be 1 + a multiple of {temporal} for this model (its VAE compresses time "
                            f"{temporal}x: (F - 1) % {temporal} == 0), got {n}; use {lo} or {lo + temporal}")
    return n


class WanExperts(nn.Module):
    """Wan 2.2's two transformers as the one trained module of the policy: ``transformer`` (high noise) evaluates the
    rows whose timestep is ``>= boundary`` (``boundary_ratio · num_train_timesteps``), ``transformer_2`` (low noise)
    the others, as ``WanPipeline`` switches. LoRA, freezing, the reference copy and the optimizer see both."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary: float):
        super().__init__()
        self.transformer = high
        self.transformer_2 = low
        self.boundary = float(boundary)

    @property
    def experts(self) -> dict[str, nn.Module]:
        return {"transformer": self.transformer, "transformer_2": self.transformer_2}

    @property
    def config(self):
        return self.transformer.config

    def high_rows(self, timestep: Tensor) -> Tensor:
        """(B,) bool: the rows the high-noise expert evaluates (``timestep >= boundary``, the pipeline's test)."""
        t = timestep if timestep.ndim == 1 else timestep[:, 0]
        return t >= self.boundary

    def _lockstep(self) -> bool:
        """Sharded (FSDP2): every rank calls both experts (an empty batch where it has no row) so the collectives
        match across ranks."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) for p in self.transformer.patch_embedding.parameters())

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                return_dict: bool = False, **kwargs: Any):
        high = self.high_rows(timestep)
        lock = self._lockstep()
        if not lock and bool(high.all()):
            return self.transformer(hidden_states=hidden_states, timestep=timestep,
                                    encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)
        if not lock and not bool(high.any()):
            return self.transformer_2(hidden_states=hidden_states, timestep=timestep,
                                      encoder_hidden_states=encoder_hidden_states, return_dict=False, **kwargs)
        idx_h, idx_l = high.nonzero().flatten(), (~high).nonzero().flatten()
        outs = [net(hidden_states=hidden_states[i], timestep=timestep[i], encoder_hidden_states=encoder_hidden_states[i],
                    return_dict=False, **kwargs)[0] for net, i in ((self.transformer, idx_h), (self.transformer_2, idx_l))]
        order = torch.argsort(torch.cat([idx_h, idx_l]))
        return (torch.cat(outs)[order],)

    # what FlowPolicy asks of a diffusers transformer, for both experts
    def add_adapter(self, config) -> None:
        for net in self.experts.values():
            net.add_adapter(copy.deepcopy(config))

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return all(getattr(n, "_hf_peft_config_loaded", False) for n in self.experts.values())

    @property
    def peft_config(self):
        return self.transformer.peft_config

    def disable_adapters(self) -> None:
        for net in self.experts.values():
            net.disable_adapters()

    def enable_adapters(self) -> None:
        for net in self.experts.values():
            net.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for net in self.experts.values():
            net.enable_gradient_checkpointing()

    def save_pretrained(self, directory, **kwargs) -> None:
        """``<directory>/transformer`` and ``<directory>/transformer_2`` (each ``WanTransformer3DModel.save_pretrained``),
        what ``model.transformer_path`` loads back."""
        for name, net in self.experts.items():
            net.save_pretrained(str(Path(directory) / name), **kwargs)


def _wan_classes():
    from diffusers import WanPipeline, WanTransformer3DModel

    return WanPipeline, WanTransformer3DModel


def load_wan_pipeline(path: str, dtype: torch.dtype = torch.bfloat16, vae_dtype: torch.dtype = torch.float32,
                      transformer_path: str | None = None, example_id: str | None = None, **kwargs: Any):
    """``WanPipeline.from_pretrained(path)`` (Hub id or local diffusers folder) with a one-line
    :class:`~stepflow.errors.ModelLoadError` on failure (``example_id``: the Hub id its hint names; ``None``: Wan 2.2's
    where the path says 2.2, else Wan 2.1's). ``transformer_path``: a fully fine-tuned transformer folder
    (``save_trained``): Wan 2.1's ``config.json`` folder, or Wan 2.2's folder holding ``transformer/`` and
    ``transformer_2/``."""
    pipe_cls, tr_cls = _wan_classes()
    if transformer_path and not (Path(transformer_path).expanduser() / "config.json").is_file():
        root = Path(transformer_path).expanduser()
        if not (root / "transformer" / "config.json").is_file():
            raise ModelLoadError(f"model.transformer_path: cannot load the Wan transformer: '{transformer_path}' has "
                                 "no config.json (Wan 2.1) nor transformer/config.json (Wan 2.2's two experts); point "
                                 "it at a folder written by save_trained (a model.finetune=full run's <run>/transformer)")
        key = "dtype"
        kwargs["transformer"] = _load_transformer(tr_cls, str(root / "transformer"), dtype, key, "Wan")
        if (root / "transformer_2" / "config.json").is_file():
            kwargs["transformer_2"] = _load_transformer(tr_cls, str(root / "transformer_2"), dtype, key, "Wan")
        transformer_path = None
    example_id = example_id or (WAN22_T2V if "2.2" in str(path) else WAN21_T2V)
    return load_pipeline(pipe_cls, path, dtype, vae_dtype, what="Wan", example_id=example_id,
                         transformer_cls=tr_cls, transformer_path=transformer_path, **kwargs)


def _euler_scheduler(scheduler, shift: float | None):
    """The policy's own ``FlowMatchEulerDiscreteScheduler``: the pipeline's when it is one (copied: ``time_grid``
    mutates it), else one with the pipeline scheduler's ``flow_shift`` (UniPC / DPM++ with flow sigmas, as the Hub
    ships Wan) and its ``num_train_timesteps``; ``shift`` overrides."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg = dict(scheduler.config)
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        if cfg.get("use_dynamic_shifting", False):
            raise StepflowError("model.path: the scheduler uses dynamic shifting (resolution-dependent mu), which "
                                "WanPipeline does not pass; set use_dynamic_shifting=false in scheduler_config.json")
        if shift is not None:
            cfg["shift"] = float(shift)
        return FlowMatchEulerDiscreteScheduler.from_config(cfg)
    s = float(shift if shift is not None else cfg.get("flow_shift", cfg.get("shift", 1.0)) or 1.0)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=int(cfg.get("num_train_timesteps", 1000)), shift=s)


class WanPolicy(PipelinePolicy):
    """Wan 2.1 / 2.2 text-to-video policy over a ``WanPipeline`` (see the module docstring).

    Args:
        pipe: the loaded pipeline (modules shared: ``policy.pipe(...)`` samples with the policy's transformers).
        height, width: frame size in pixels (multiples of VAE scale x patch = 16); num_frames: frames per video,
            ``1 + 4k`` (Wan's VAE); ``latent_shape = (z_dim, (F − 1)/4 + 1, H/8, W/8)``.
        max_sequence_length: UMT5 tokens (the pipeline's 512); negative_prompt: the unconditional prompt of CFG.
        shift: the time shift of the Euler grid (None: the pipeline scheduler's ``flow_shift`` / ``shift``).
        guidance, eval_guidance: CFG scales for callers (WanPipeline's default 5.0); guidance_2: Wan 2.2's low-noise
            stage scale (``guidance_scale_2``; None: the same as the high-noise stage's).
        lora, finetune, gradient_checkpointing, offload_text_encoders, decode_batch_size, encode_batch_size:
            see :class:`~stepflow.policies.pipeline.PipelinePolicy`.
    """

    #: what :meth:`decode` returns: videos (B, 3, F, H, W) (the rewards' and the grids' capability flag)
    modality = "video"
    text_encoder_names = ("text_encoder",)
    ARG_RULES = {**PipelinePolicy.ARG_RULES,
                 "max_sequence_length": {"integer": True, "ge": 1, "le": 4096,
                                         "hint": " (UMT5 tokens; WanPipeline: 512)"},
                 "num_frames": {"integer": True, "ge": 1, "hint": " (1 + a multiple of 4 for Wan's VAE)"},
                 "shift": {"gt": 0.0, "optional": True},
                 "guidance_2": {"ge": 1.0, "optional": True, "hint": " (Wan 2.2's low-noise stage; 1 = no CFG)"}}

    def __init__(self, pipe, *, height: int = 480, width: int = 832, num_frames: int = 81,
                 max_sequence_length: int = 512, negative_prompt: str = "", shift: float | None = None,
                 gradient_checkpointing: bool = False, offload_text_encoders: bool = False, guidance: float = 1.0,
                 eval_guidance: float = 5.0, guidance_2: float | None = None, decode_batch_size: int = 2,
                 encode_batch_size: int = 16, lora: Mapping[str, Any] | None = None, finetune: str = "lora",
                 name: str | None = None):
        self.check_args(locals())  # the numeric arguments, before a LoRA loads
        spatial = int(getattr(pipe, "vae_scale_factor_spatial", 8))
        temporal = int(getattr(pipe, "vae_scale_factor_temporal", 4))
        high, low = getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)
        boundary_ratio = pipe.config.get("boundary_ratio") if hasattr(pipe, "config") else None
        if high is None:
            raise StepflowError("model.path: this Wan pipeline has no `transformer` (only a low-noise transformer_2); "
                                "WanPolicy needs the high-noise transformer (Wan 2.1's only one, Wan 2.2's first)")
        if (low is None) != (boundary_ratio is None):
            raise StepflowError(f"model.path: the Wan pipeline has boundary_ratio={boundary_ratio} but "
                                f"{'no' if low is None else 'a'} transformer_2; Wan 2.2 needs both (two experts), Wan "
                                "2.1 neither")
        patch = tuple(high.config.patch_size)
        height, width = check_image_size(height, width, spatial * patch[1], f"VAE scale {spatial} x patch {patch[1]}")
        num_frames = check_num_frames(num_frames, temporal)
        if patch[0] != 1:
            raise StepflowError(f"model.path: a Wan transformer with a temporal patch of {patch[0]} is not supported")
        super().__init__(pipe, name=name or str(getattr(pipe, "name_or_path", "") or "wan"),
                         max_sequence_length=max_sequence_length, gradient_checkpointing=gradient_checkpointing,
                         offload_text_encoders=offload_text_encoders, guidance=guidance, eval_guidance=eval_guidance,
                         decode_batch_size=decode_batch_size, encode_batch_size=encode_batch_size)
        self.height, self.width, self.num_frames = int(height), int(width), int(num_frames)
        self.vae_scale_factor, self.vae_scale_factor_temporal = spatial, temporal
        z_dim = int(pipe.vae.config.z_dim)
        self.latent_shape = (z_dim, (self.num_frames - 1) // temporal + 1, self.height // spatial, self.width // spatial)
        self.negative_prompt = str(negative_prompt)
        self.scheduler = _euler_scheduler(pipe.scheduler, shift)
        self.shift = float(self.scheduler.config.shift)
        self.timestep_scale = float(self.scheduler.config.num_train_timesteps)
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False)) if hasattr(pipe, "config") else False
        self.guidance_2 = None if guidance_2 is None else float(guidance_2)
        if low is not None:
            low.requires_grad_(False)
            if gradient_checkpointing:
                low.enable_gradient_checkpointing()
            self.transformer = WanExperts(high, low, float(boundary_ratio) * self.timestep_scale)
        elif guidance_2 is not None:
            raise StepflowError("model.guidance_2: only Wan 2.2 (two experts, boundary_ratio) has a low-noise stage; "
                                "set it to null for this model")
        self._setup_training(lora, finetune)

    @property
    def experts(self) -> WanExperts | None:
        """Wan 2.2's two transformers (None for Wan 2.1)."""
        return self.transformer if isinstance(self.transformer, WanExperts) else None

    # ------------------------------------------------------------------ loading (PipelinePolicy.from_pretrained)
    default_path = WAN21_T2V
    loader = staticmethod(load_wan_pipeline)

    @classmethod
    def from_pretrained(cls, path: str | None = None, **kwargs: Any) -> "WanPolicy":
        """:meth:`PipelinePolicy.from_pretrained`, with ``num_frames`` checked against Wan's VAE (4k + 1) before the
        weights load (the pipeline's own temporal factor is checked again once it has loaded)."""
        if kwargs.get("num_frames") is not None:
            check_num_frames(kwargs["num_frames"], 4)
        return super().from_pretrained(path, **kwargs)

    # ------------------------------------------------------------------ time grid
    def time_grid(self, num_steps: int) -> Tensor:
        """``FlowMatchEulerDiscreteScheduler(shift)``'s sigmas with the trailing 0 (num_steps + 1,), from exactly 1 to
        exactly 0: the grid ``WanPipeline`` samples on with that scheduler (``set_timesteps(num_steps)``)."""
        if int(num_steps) != num_steps or num_steps < 1:
            raise ValueError(f"num_steps: must be a positive integer, got {num_steps!r}")
        self.scheduler.set_timesteps(int(num_steps))
        return check_time_grid(self.scheduler.sigmas.clone(), f"{type(self).__name__}.time_grid")

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """x (B, C, F, h, w), t (B,) -> v (B, C, F, h, w) fp32; the timestep ``1000 t`` in fp32 (Wan 2.2 TI2V's
        ``expand_timesteps``: one per patch token, all equal for text-to-video)."""
        net = self.net
        dt = next(net.parameters()).dtype
        timestep = t.float() * self.timestep_scale
        if self.expand_timesteps:
            _, _, f, h, w = x.shape
            timestep = timestep[:, None].expand(-1, f * (h // 2) * (w // 2))
        out = net(hidden_states=x.to(dt), timestep=timestep, encoder_hidden_states=cond.tokens.to(dt),
                  return_dict=False)[0]
        return out.float()

    def velocity(self, x: Tensor, t: Tensor | float, cond: Cond, guidance: float = 1.0,
                 detach_uncond: bool = True) -> Tensor:
        """:meth:`FlowPolicy.velocity`; Wan 2.2 with ``guidance_2``: the rows in the low-noise stage take that scale
        (the pipeline's ``guidance_scale_2``) whenever CFG is on (``guidance != 1``)."""
        if self.guidance_2 is None or guidance == 1.0 or self.experts is None:
            return super().velocity(x, t, cond, guidance, detach_uncond)
        tt = torch.as_tensor(t, dtype=torch.float32, device=x.device)
        tt = tt.expand(x.shape[0]) if tt.ndim == 0 else tt
        low = ~self.experts.high_rows(tt * self.timestep_scale)
        w = torch.where(low, torch.full_like(tt, self.guidance_2), torch.full_like(tt, float(guidance)))
        self._row_guidance = w.view(-1, *([1] * (x.ndim - 1)))
        try:
            return super().velocity(x, tt, cond, guidance, detach_uncond)
        finally:
            self._row_guidance = None

    def _guide(self, v_u: Tensor, v_c: Tensor, guidance: float) -> Tensor:
        w = getattr(self, "_row_guidance", None)
        return v_u + (guidance if w is None else w) * (v_c - v_u)

    # ------------------------------------------------------------------ text
    def _encode_chunk(self, prompts: list[str]) -> list[tuple[Tensor]]:
        tokens, _ = self.pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, num_videos_per_prompt=1,
                                            max_sequence_length=self.max_sequence_length, device=self.device)
        return [(tok,) for tok in tokens]

    def _collate(self, rows: list[tuple[Tensor, ...]], device: torch.device) -> Cond:
        """Rows of (tokens (L, D),) (zero-padded to ``max_sequence_length`` by the pipeline) -> pooled (B, 0)."""
        tokens = torch.stack([r[0] for r in rows]).to(device)
        return Cond(tokens=tokens, pooled=tokens.new_zeros(len(rows), 0))

    # ------------------------------------------------------------------ video
    def _decode_chunk(self, z: Tensor) -> Tensor:
        """As the pipeline: ``vae.decode(z · latents_std + latents_mean)`` -> (b, 3, F, H, W) in [-1, 1]."""
        cfg = self.vae.config
        p = self._vae_param()
        z = z.to(p.device, p.dtype)
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std_inv = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return self.vae.decode(z / std_inv + mean, return_dict=False)[0]

    def decode(self, latents: Tensor, estimate: bool = False) -> Tensor:
        """latents (B, C, F_lat, h, w) -> videos (B, 3, F, H, W) in [0, 1], fp32 (``decode_batch_size`` videos at a
        time); the pipeline's ``output_type="pt"`` holds the same values as (B, F, 3, H, W)."""
        return super().decode(latents, estimate)

    # ------------------------------------------------------------------ LoRA I/O of the two experts (Wan 2.2)
    def _expert_states(self, state_dict: dict[str, Tensor] | None) -> dict[str, dict[str, Tensor]]:
        from peft.utils import get_peft_model_state_dict

        out = {}
        for name, net in self.experts.experts.items():
            sub = None if state_dict is None else {k[len(name) + 1:]: v for k, v in state_dict.items()
                                                   if k.startswith(name + ".")}
            out[name] = get_peft_model_state_dict(net, state_dict=sub)
        return out

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        if self.experts is None:
            return super().lora_state_dict(state_dict)
        return {f"{name}.{k}": v for name, st in self._expert_states(state_dict).items() for k, v in st.items()}

    def save_lora(self, directory, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Wan 2.1: as every policy. Wan 2.2: one file per expert in ``directory`` (:data:`EXPERT_LORA_FILES`), what
        ``pipe.load_lora_weights(dir)`` and ``pipe.load_lora_weights(dir, weight_name=..._transformer_2.safetensors,
        load_into_transformer_2=True)`` load."""
        if self.experts is None:
            return super().save_lora(directory, state_dict)
        if not self.has_lora:
            raise ValueError("save_lora: the policy has no LoRA adapter (set lora.rank > 0)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        pipe_cls, _ = _wan_classes()
        for name, state in self._expert_states(state_dict).items():
            net = self.experts.experts[name]
            config = net.peft_config["default"].to_dict()
            config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
            pipe_cls.save_lora_weights(str(directory), transformer_lora_layers={k: v.detach().cpu().contiguous()
                                                                                 for k, v in state.items()},
                                       transformer_lora_adapter_metadata=config, weight_name=EXPERT_LORA_FILES[name],
                                       safe_serialization=True)
        return directory

    def _load_lora_weights(self, directory: str) -> None:
        if self.experts is None:
            return super()._load_lora_weights(directory)
        d = Path(directory)
        if not d.is_dir() or not all((d / f).is_file() for f in EXPERT_LORA_FILES.values()):
            raise FileNotFoundError(f"a Wan 2.2 adapter is a folder with {' and '.join(EXPERT_LORA_FILES.values())} "
                                    "(one per expert, as save_trained writes it)")
        from peft.utils import set_peft_model_state_dict

        from stepflow.policies.base import read_lora

        for name, file in EXPERT_LORA_FILES.items():
            net = self.experts.experts[name]
            if not getattr(net, "_hf_peft_config_loaded", False) and hasattr(self.pipe, "load_lora_weights"):
                self.pipe.load_lora_weights(str(d), weight_name=file, adapter_name="default",
                                            load_into_transformer_2=name == "transformer_2")
                continue
            state, info = read_lora(d / file)
            if not getattr(net, "_hf_peft_config_loaded", False):  # a policy without a diffusers pipeline
                from peft import LoraConfig

                net.add_adapter(LoraConfig(r=info["rank"], lora_alpha=info["alpha"], target_modules=info["targets"]))
            result = set_peft_model_state_dict(net, state)
            bad = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
            if bad:
                raise ValueError(f"{file} does not match the policy's adapter: {bad[:3]} ...")

    # ------------------------------------------------------------------ full fine-tuning of the two experts
    def save_trained(self, directory, state_dict: dict[str, Tensor] | None = None) -> Path:
        """:meth:`FlowPolicy.save_trained`; Wan 2.2 fully fine-tuned: ``directory/transformer`` and
        ``directory/transformer_2`` (``model.transformer_path=directory`` loads both back)."""
        if self.experts is None or self.finetune != "full":
            return super().save_trained(directory, state_dict)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, net in self.experts.experts.items():
            model = net
            if state_dict is not None:
                with torch.device("meta"):
                    model = type(net).from_config(net.config)
                model.load_state_dict({k[len(name) + 1:]: v for k, v in state_dict.items() if k.startswith(name + ".")},
                                      strict=True, assign=True)
            model.save_pretrained(str(directory / name), safe_serialization=True)
        return directory

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, latent_shape={self.latent_shape}, num_frames={self.num_frames}, "
                f"shift={self.shift}, experts={self.experts is not None}, lora={self.has_lora}, "
                f"finetune={self.finetune!r}")
