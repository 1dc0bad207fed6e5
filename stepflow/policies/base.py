"""The FlowPolicy interface shared by every text-to-image flow model in stepflow.

Conventions (all policies):

- time ``t`` is in [0, 1]; ``t = 1`` is pure noise, ``t = 0`` is data (rectified flow ``x_t = (1-t) x0 + t x1``);
- ``velocity`` predicts ``v = dx/dt = x1 - x0`` (method.md §1), so an Euler step towards data is ``x - dt * v``;
- latents are ``(B, C, H, W)``; ``decode`` maps them to images ``(B, 3, H', W')`` in [0, 1];
- the SDE math is done by the caller in fp32 (``stepflow.sampler``); ``velocity`` returns fp32.

A policy built on diffusers' ``SD3Transformer2DModel`` subclasses :class:`FlowPolicy`, sets ``self.transformer``
and implements ``encode``/``decode``/``_transformer_inputs``; LoRA, the reference (adapter disabled) context, CFG
and the LoRA state dict are shared here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import Tensor, nn

# The attention projections that LoRA adapts in SD3 / SD3.5 (image stream and the joint context stream).
LORA_TARGETS_SD3: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


@dataclass
class Cond:
    """Prompt conditioning for a batch.

    tokens: (B, L, D) token states; pooled: (B, P) pooled vector; mask: optional (B, L) bool (True = real token).
    """

    tokens: Tensor
    pooled: Tensor
    mask: Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def index(self, idx: Tensor | slice | Sequence[int]) -> "Cond":
        """Select rows (a batch index, slice or index list)."""
        return Cond(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx]) for f in fields(self)})

    def repeat(self, n: int) -> "Cond":
        """Repeat every row ``n`` times along the batch (``[a, b] -> [a, a, b, b]`` for n=2)."""
        return Cond(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).repeat_interleave(n, 0))
                       for f in fields(self)})

    def to(self, *args, **kwargs) -> "Cond":
        return Cond(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(*args, **kwargs))
                       for f in fields(self)})

    @staticmethod
    def cat(conds: Sequence["Cond"]) -> "Cond":
        first = conds[0]
        return Cond(**{f.name: (None if getattr(first, f.name) is None else torch.cat([getattr(c, f.name) for c in conds]))
                       for f in fields(first)})


class FlowPolicy(nn.Module):
    """A text-conditioned flow-matching model that the GRPO loop can roll out and fine-tune with LoRA.

    Subclasses must set ``self.transformer`` (a diffusers ``SD3Transformer2DModel`` or any module taking
    ``hidden_states, encoder_hidden_states, pooled_projections, timestep``), ``self.latent_shape = (C, H, W)``
    and implement :meth:`encode` and :meth:`decode`.
    """

    transformer: nn.Module
    latent_shape: tuple[int, int, int]
    #: the scheduler's shift for :meth:`time_grid` (SD3.5: 3.0)
    shift: float = 3.0
    #: timestep scale the transformer expects (diffusers SD3: t * 1000)
    timestep_scale: float = 1000.0
    #: sample-level transformer evaluations so far (CFG counts twice): the one NFE counter, read by
    #: ``stepflow.algorithm.Phases``
    nfe: int = 0

    # ------------------------------------------------------------------ to implement
    def encode(self, prompts: Sequence[str]) -> Cond:  # pragma: no cover - interface
        """Encode prompts to conditioning (implementations cache per prompt)."""
        raise NotImplementedError

    def decode(self, latents: Tensor) -> Tensor:  # pragma: no cover - interface
        """latents (B, C, H, W) -> images (B, 3, H', W') in [0, 1], fp32."""
        raise NotImplementedError

    def negative_cond(self, batch_size: int) -> Cond:
        """Conditioning of the empty prompt, for classifier-free guidance (computed once, cached)."""
        if getattr(self, "_neg_cond", None) is None:
            self._neg_cond = self.encode([""])
        return self._neg_cond.index([0] * batch_size)

    # ------------------------------------------------------------------ shared
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def time_grid(self, num_steps: int) -> Tensor:
        """The sampling grid (num_steps + 1,), from 1 to 0 (method.md §1)."""
        from stepflow.sampler import time_grid

        return time_grid(num_steps, shift=self.shift)

    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        dt = self.dtype
        out = self.transformer(
            hidden_states=x.to(dt),
            encoder_hidden_states=cond.tokens.to(dt),
            pooled_projections=cond.pooled.to(dt),
            timestep=(t * self.timestep_scale).to(dt),
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, x: Tensor, t: Tensor | float, cond: Cond, guidance: float = 1.0,
                 detach_uncond: bool = True) -> Tensor:
        """Predicted velocity v = x1 - x0.

        x: (B, C, H, W); t: scalar or (B,) in [0, 1]; cond: B rows; guidance: CFG scale (1 = none).
        With guidance > 1 the unconditional branch runs in the same batch and is detached when
        ``detach_uncond`` (Flow-GRPO's training convention). Returns fp32 (B, C, H, W).
        """
        b = x.shape[0]
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device)
        if t.ndim == 0:
            t = t.expand(b)
        self.nfe += b if guidance == 1.0 else 2 * b
        if guidance == 1.0:
            return self._forward(x, t, cond)
        neg = self.negative_cond(b).to(x.device)
        both = self._forward(torch.cat([x, x]), torch.cat([t, t]), Cond.cat([neg, cond]))
        v_u, v_c = both.chunk(2)
        if detach_uncond:
            v_u = v_u.detach()
        return v_u + guidance * (v_c - v_u)

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, rank: int = 32, alpha: float = 64.0, targets: Sequence[str] = LORA_TARGETS_SD3,
                 init: str = "gaussian", dropout: float = 0.0) -> None:
        """Freeze the base weights and add a peft LoRA adapter named ``default`` to the transformer."""
        from peft import LoraConfig

        self.transformer.requires_grad_(False)
        present = {n for n, _ in self.transformer.named_modules()}
        wanted = [t for t in targets if any(n.endswith(t) for n in present)]
        if not wanted:
            raise ValueError(f"lora.targets: none of {list(targets)} exist in the transformer; pick attention projections")
        # peft matches a target by module-name suffix; keep only the last component to match diffusers' convention.
        # peft matches dotted suffixes: "attn.to_q" adapts the joint attention only (not SD3.5's attn2.*), as Flow-GRPO
        cfg = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=init, lora_dropout=dropout,
                         target_modules=sorted(wanted))
        self.transformer.add_adapter(cfg)

    @property
    def has_lora(self) -> bool:
        return bool(getattr(self.transformer, "_hf_peft_config_loaded", False))

    def lora_parameters(self) -> Iterator[nn.Parameter]:
        for n, p in self.transformer.named_parameters():
            if "lora_" in n:
                yield p

    @contextlib.contextmanager
    def disable_adapter(self):
        """Context in which the transformer runs without its LoRA (the reference policy π_ref)."""
        if not self.has_lora:
            yield
            return
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def lora_state_dict(self) -> dict[str, Tensor]:
        """The adapter's weights in peft's key format (what diffusers' ``save_lora_weights`` expects)."""
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(self.transformer)

    def save_lora(self, directory) -> Path:
        """Write the adapter as ``pytorch_lora_weights.safetensors`` that diffusers' ``load_lora_weights`` reads,
        with the peft config (rank, alpha, targets) as metadata so the reloaded scale alpha/rank is right."""
        from diffusers import StableDiffusion3Pipeline

        if not self.has_lora:
            raise ValueError("save_lora: the policy has no LoRA adapter (set lora.rank > 0)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.transformer.peft_config["default"].to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        state = {k: v.detach().cpu().contiguous() for k, v in self.lora_state_dict().items()}
        StableDiffusion3Pipeline.save_lora_weights(str(directory), transformer_lora_layers=state,
                                                   transformer_lora_adapter_metadata=config, safe_serialization=True)
        return directory

    def load_lora_state_dict(self, state: dict[str, Tensor]) -> None:
        from peft.utils import set_peft_model_state_dict

        set_peft_model_state_dict(self.transformer, state)
