"""The FlowPolicy interface shared by every text-to-image flow model in stepflow.

Conventions (all policies):

- time ``t`` is in [0, 1]; ``t = 1`` is pure noise, ``t = 0`` is data (rectified flow ``x_t = (1-t) x0 + t x1``);
- ``velocity`` predicts ``v = dx/dt = x1 - x0`` (method.md §1), so an Euler step towards data is ``x - dt * v``;
- latents are ``(B, C, H, W)``; ``decode`` maps them to images ``(B, 3, H', W')`` in [0, 1]; a model that packs
  latents into patch tokens (FLUX, Qwen-Image) packs and unpacks inside ``_forward``; a video model
  (:attr:`FlowPolicy.modality` ``"video"``, Wan) has latents ``(B, C, F, H, W)`` and decodes to videos
  ``(B, 3, F', H', W')``: the core is rank-generic (trajectories ``(B, T+1, *latent_shape)``, log-probs averaged over
  every non-batch dimension), and rewards say which they score (:attr:`stepflow.rewards.base.Reward.modality`);
- the SDE math is done by the caller in fp32 (``stepflow.math.sde``); ``velocity`` returns fp32;
- the time (and an embedded guidance scale) reaches the transformer's time embedding in fp32, whatever the weights'
  dtype, as diffusers' SD3 pipeline passes it (:class:`TimeInputs` for transformers that cast it to their dtype);
- ``time_grid(N)`` is the model's own sampling grid: ``N + 1`` strictly decreasing times from exactly 1 to exactly 0.

A policy built on a diffusers transformer subclasses :class:`FlowPolicy`, sets ``self.transformer`` and implements
``encode``/``decode`` (and ``_forward`` when the transformer is not SD3's). LoRA, full fine-tuning, the reference
policy, CFG and saving what was trained are shared here.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stepflow.core.data import SOURCE_KEY  # the records' source-image key (re-exported)
from stepflow.errors import StepflowError

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

#: what ``finetune`` may be: ``lora`` (adapter on ``lora.targets``, base frozen) or ``full`` (every transformer weight)
FINETUNE_MODES = ("lora", "full")


@dataclass
class Cond:
    """Prompt conditioning for a batch.

    tokens: (B, L, D) token states; pooled: (B, P) pooled vector (P may be 0: Qwen-Image has none);
    mask: optional (B, L) bool (True = real token; None = every token is real);
    image: optional (B, C, h, w) latents of each row's condition image (an editing model's source image, encoded once
    per distinct source and carried by every step, log-prob and x̂0 of its group; None: text-only conditioning);
    negative: optional, the rows' own unconditional conditioning for CFG where it depends on the row (an editing
    model whose negative prompt is encoded together with the row's source image); None: the policy's negative prompt,
    the same for every row (:meth:`FlowPolicy.negative_for`).
    Every batch operation (``index``, ``repeat``, ``to``, ``cat``) applies to every field (``negative`` recursively).
    """

    tokens: Tensor
    pooled: Tensor
    mask: Tensor | None = None
    image: Tensor | None = None
    negative: "Cond | None" = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def _map(self, fn, sub) -> "Cond":
        """``fn`` on every tensor field, ``sub`` on a nested :class:`Cond` (``negative``); None stays None."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = None if v is None else (sub(v) if isinstance(v, Cond) else fn(v))
        return Cond(**out)

    def index(self, idx: Tensor | slice | Sequence[int]) -> "Cond":
        """Select rows (a batch index, slice or index list)."""
        return self._map(lambda v: v[idx], lambda c: c.index(idx))

    def repeat(self, n: int) -> "Cond":
        """Repeat every row ``n`` times along the batch (``[a, b] -> [a, a, b, b]`` for n=2)."""
        return self._map(lambda v: v.repeat_interleave(n, 0), lambda c: c.repeat(n))

    def to(self, *args, **kwargs) -> "Cond":
        return self._map(lambda v: v.to(*args, **kwargs), lambda c: c.to(*args, **kwargs))

    def pad_to(self, length: int) -> "Cond":
        """Zero-pad the tokens to ``length`` with ``mask`` False on the padding (a no-op at the current length)."""
        b, cur = self.tokens.shape[:2]
        if cur == length:
            return self
        if cur > length:
            raise ValueError(f"Cond.pad_to: {cur} tokens do not fit in {length}")
        mask = self.mask if self.mask is not None else torch.ones(b, cur, dtype=torch.bool, device=self.tokens.device)
        pad = self.tokens.new_zeros(b, length - cur, *self.tokens.shape[2:])
        return replace(self, tokens=torch.cat([self.tokens, pad], 1),
                       mask=torch.cat([mask, mask.new_zeros(b, length - cur)], 1))

    @staticmethod
    def cat(conds: Sequence["Cond"]) -> "Cond":
        """Concatenate along the batch; token sequences of different lengths are padded (with a mask) to the longest.
        ``negative`` is concatenated when every part has one, else dropped (the parts' unconditional rows are then
        the policy's negative prompt); condition images must have one shape."""
        length = max(c.tokens.shape[1] for c in conds)
        if any(c.tokens.shape[1] != length for c in conds):
            conds = [c.pad_to(length) for c in conds]
        if any(c.mask is not None for c in conds) and any(c.mask is None for c in conds):
            conds = [c if c.mask is not None else replace(c, mask=torch.ones(
                c.tokens.shape[:2], dtype=torch.bool, device=c.tokens.device)) for c in conds]
        if any(c.negative is None for c in conds):
            conds = [replace(c, negative=None) for c in conds]
        if any(c.image is not None for c in conds):
            if any(c.image is None for c in conds):
                raise ValueError("Cond.cat: some parts have a condition image and some none")
            shapes = {tuple(c.image.shape[1:]) for c in conds}
            if len(shapes) > 1:
                raise ValueError(f"Cond.cat: condition images of different shapes {sorted(shapes)} cannot share a "
                                 "batch")
        first = conds[0]
        out = {}
        for f in fields(first):
            v = getattr(first, f.name)
            if v is None:
                out[f.name] = None
            elif isinstance(v, Cond):
                out[f.name] = Cond.cat([getattr(c, f.name) for c in conds])
            else:
                out[f.name] = torch.cat([getattr(c, f.name) for c in conds])
        return Cond(**out)


class TimeInputs:
    """Feeds fp32 times to a transformer's ``time_text_embed`` (a forward pre-hook).

    diffusers' FLUX and Qwen-Image transformers cast ``timestep`` (and ``guidance``) to the hidden states' dtype
    before the time embedding, so in bf16 a time of 0.91335 reaches the sinusoid as 0.9140625 (FLUX: ×1000 → 912),
    a change of several percent in the velocity of the same state. The policy puts the exact fp32 values here for the
    duration of one forward (:meth:`feeding`); the hook replaces the first positional arguments of
    ``time_text_embed`` with them. Outside :meth:`feeding` (e.g. ``policy.pipe(...)``) it does nothing.

    On its first use it checks that what it replaces is the same quantity (equal up to the dtype's rounding), so a
    diffusers version that changes the time scale fails loudly instead of being fed a wrong time.
    """

    def __init__(self) -> None:
        self.values: list[Tensor] | None = None
        self.checked = False

    @contextlib.contextmanager
    def feeding(self, values: Sequence[Tensor]):
        self.values = [v.float() for v in values]
        try:
            yield
        finally:
            self.values = None

    def install(self, module: nn.Module):
        return module.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple):
        if self.values is None:
            return None
        new = list(args)
        for i, v in enumerate(self.values):
            got = new[i]
            v = v.to(got.device)
            if not self.checked and (got.shape != v.shape or not torch.allclose(got.float(), v, rtol=1 / 64, atol=1e-2)):
                raise RuntimeError(f"TimeInputs: argument {i} of {type(module).__name__} is not the time the policy "
                                   f"passed ({got.flatten()[:3].tolist()} vs {v.flatten()[:3].tolist()}); the "
                                   f"transformer's time scaling changed (diffusers version?)")
            new[i] = v
        self.checked = True
        return tuple(new)


def _user_error(msg: str) -> ValueError:
    """The one-line error of a bad argument (a :class:`stepflow.errors.StepflowError`, a ``ValueError``)."""
    return StepflowError(msg)


def check_number(field: str, value, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
                 integer: bool = False, optional: bool = False, hint: str = ""):
    """``value`` as an int (``integer``) or a finite float within the bounds, else a one-line error naming
    ``field`` (``model.guidance: must be >= 1 (1 = no CFG), got -1``). ``optional``: None passes (and is returned);
    ``hint``: what the bound means, e.g. `` (1 = no CFG)``. Booleans, strings, inf and nan are refused."""
    kind = "an integer" if integer else "a finite number"
    if value is None:
        if optional:
            return None
        raise _user_error(f"{field}: must be {kind}{hint}, got null")
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        v = float(value)
    except (TypeError, ValueError):
        raise _user_error(f"{field}: must be {kind}{hint}, got {value!r}") from None
    if not math.isfinite(v):
        raise _user_error(f"{field}: must be {kind}{hint}, got {value}")
    if integer and v != int(v):
        raise _user_error(f"{field}: must be {kind}{hint}, got {value}")
    if ge is not None and le is not None and not ge <= v <= le:
        raise _user_error(f"{field}: must be {kind} in {ge:g}..{le:g}{hint}, got {value}")
    if ge is not None and v < ge:
        raise _user_error(f"{field}: must be >= {ge:g}{hint}, got {value}")
    if gt is not None and v <= gt:
        raise _user_error(f"{field}: must be > {gt:g}{hint}, got {value}")
    if le is not None and v > le:
        raise _user_error(f"{field}: must be <= {le:g}{hint}, got {value}")
    return int(v) if integer else v


def check_args(values: Mapping[str, object], rules: Mapping[str, Mapping[str, object]], prefix: str = "model.") -> None:
    """:func:`check_number` on every ``values[name]`` that ``rules`` has a rule for (``prefix + name`` is the field):
    a policy calls it on its arguments at the top of its constructor and of ``from_pretrained``, before any weights
    load."""
    for name, rule in rules.items():
        if name in values:
            check_number(prefix + name, values[name], **rule)


def check_image_size(height, width, multiple: int, why: str) -> tuple[int, int]:
    """``(height, width)`` as ints, each a positive multiple of ``multiple`` (``why``: where it comes from, e.g.
    ``VAE scale 8 x patch 2``), else a one-line error naming ``model.height`` / ``model.width`` and the nearest
    valid values."""
    out = []
    for name, value in (("height", height), ("width", width)):
        v = check_number(f"model.{name}", value, integer=True)
        if v < multiple or v % multiple:
            lo = v // multiple * multiple
            near = f"{multiple}" if v < multiple else f"{lo} or {lo + multiple}"
            raise _user_error(f"model.{name}: must be a positive multiple of {multiple} for this model ({why}), got "
                              f"{value}; use {near}")
        out.append(v)
    return out[0], out[1]


def lora_load_error(field: str, directory, err: BaseException) -> str:
    """The one line for a LoRA that did not load from ``directory``: ``field``, the file, why, and the fix."""
    why = " ".join(str(err).split()) or type(err).__name__
    why = why.removeprefix("lora_path: ")
    why = why if len(why) <= 200 else why[:197] + "..."
    return (f"{field}: cannot load a LoRA from '{directory}' ({type(err).__name__}: {why}); point {field} at a LoRA "
            f"saved for this model (a run's <run>/lora folder, or its pytorch_lora_weights.safetensors)")


_LORA_FILES = ("pytorch_lora_weights.safetensors", "adapter_model.safetensors")


def read_lora(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Read a LoRA saved by peft (``adapter_model.safetensors`` + ``adapter_config.json``), by diffusers'
    ``save_lora_weights`` (``pytorch_lora_weights.safetensors``, keys prefixed ``transformer.``) or a bare
    safetensors file of peft-format keys. Returns ``(state, info)``: ``state`` in peft's key format
    (``transformer_blocks.0.attn.to_q.lora_A.weight``) and ``info`` = ``{"rank", "alpha", "targets"}`` (the adapted
    modules' full names, e.g. ``transformer_blocks.0.attn.to_q``).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        files = [path / f for f in _LORA_FILES if (path / f).is_file()] or sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"lora_path: no LoRA safetensors file in {path}")
        file = files[0]
    elif path.is_file():
        file = path
    else:
        raise FileNotFoundError(f"lora_path: {path} does not exist")
    raw = load_file(str(file))
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata() or {}
    state = {}
    for k, v in raw.items():
        for pre in ("base_model.model.", "transformer."):
            if k.startswith(pre):
                k = k[len(pre):]
        k = k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        state[k] = v
    a_keys = [k for k in state if ".lora_A." in k]
    if not a_keys:
        raise ValueError(f"lora_path: {file} holds no lora_A/lora_B weights")
    rank = int(state[a_keys[0]].shape[0])
    targets = sorted({k.split(".lora_A.")[0] for k in a_keys})  # the adapted modules' full names
    alpha: float | None = None
    cfg_file = file.parent / "adapter_config.json"
    if cfg_file.is_file():
        alpha = float(json.loads(cfg_file.read_text()).get("lora_alpha", rank))
    elif "lora_adapter_metadata" in meta:  # diffusers >= 0.34 stores the LoraConfig in the metadata
        md = json.loads(meta["lora_adapter_metadata"])
        if not isinstance(md, dict):
            md = {}
        elif isinstance(md.get("transformer"), dict):  # nested: {"transformer": {"lora_alpha": ...}}
            md = md["transformer"]
        else:  # flat, as diffusers 0.42 writes it: {"transformer.lora_alpha": ...}
            md = {k.removeprefix("transformer."): v for k, v in md.items()}
        alpha = float(md.get("lora_alpha", rank))
    elif "lora_alpha" in meta:
        alpha = float(meta["lora_alpha"])
    return state, {"rank": rank, "alpha": float(alpha if alpha is not None else rank), "targets": targets}


def check_time_grid(grid: Tensor, what: str = "time_grid") -> Tensor:
    """``grid`` (N+1,) must decrease strictly from exactly 1.0 to exactly 0.0 (the SDE samplers' and estimates'
    contract, method.md §1: the rollout starts from pure noise at t = 1, and the t = 1 guard of ``stepflow.math.sde``
    keys on the exact value). Returns it as fp32 on the CPU."""
    grid = torch.as_tensor(grid).detach().float().cpu()
    if grid.ndim != 1 or grid.numel() < 2:
        raise ValueError(f"{what}: expected a 1-d grid of at least 2 times, got shape {tuple(grid.shape)}")
    if float(grid[0]) != 1.0 or float(grid[-1]) != 0.0:
        raise ValueError(f"{what}: the grid must run from exactly 1.0 to exactly 0.0, got {float(grid[0])!r} .. "
                         f"{float(grid[-1])!r} (a scheduler option such as karras/exponential sigmas?)")
    if not bool((grid[1:] < grid[:-1]).all()):
        raise ValueError(f"{what}: the grid must decrease strictly, got {grid.tolist()}")
    return grid




def takes_source(obj) -> bool | None:
    """The :attr:`FlowPolicy.takes_source` capability of a policy, a policy class, or the ``_target_`` of a model
    config (a class, a ``Class.from_pretrained`` classmethod, or a factory function that carries a ``takes_source``
    attribute), read without building anything; None when ``obj`` does not say (an unknown factory)."""
    for o in (obj, getattr(obj, "__self__", None)):
        flag = getattr(o, "takes_source", None)
        if isinstance(flag, bool):
            return flag
    return None


def encode_rows(policy, prompts: Sequence[str], meta: Sequence[Mapping[str, Any]] | None = None) -> Cond:
    """The conditioning of a batch of prompt records: ``policy.encode(prompts)``, and for a :attr:`takes_source`
    policy ``policy.encode(prompts, sources=...)`` with each record's source image (``meta[i][SOURCE_KEY]``). A
    record without one is one line (an edit model on a text-only data set)."""
    if not getattr(policy, "takes_source", False):
        return policy.encode(list(prompts))
    missing = [i for i, m in enumerate(meta or [None] * len(prompts)) if not m or not m.get(SOURCE_KEY)]
    if missing:
        name = getattr(policy, "name", type(policy).__name__)
        raise StepflowError(f"data.source_key: model {name} edits a source image, but prompt {prompts[missing[0]]!r} "
                            "has none; use an edit data set (records with a source image path, data.source_key="
                            "image, e.g. data=edit_tiny) or a text-to-image model")
    return policy.encode(list(prompts), sources=[m[SOURCE_KEY] for m in meta])


class FlowPolicy(nn.Module):
    """A text-conditioned flow-matching model that the GRPO loop can roll out and fine-tune (LoRA or full).

    Subclasses must set ``self.transformer`` (a diffusers ``SD3Transformer2DModel`` or any module taking
    ``hidden_states, encoder_hidden_states, pooled_projections, timestep``; others override :meth:`_forward`),
    ``self.latent_shape = (C, H, W)`` and implement :meth:`encode` and :meth:`decode`.

    Training interface (what the GRPO loop calls): :meth:`trainable_parameters` (the optimizer's, EMA's and gradient
    clipping's parameters), :meth:`reference` (π_ref for the KL term), :meth:`prepare_reference` (once, before the
    first update, when β > 0), :meth:`save_trained` into ``run_dir / policy.trained_subdir``.
    """

    transformer: nn.Module
    #: (C, H, W) for an image model, (C, F, H, W) for a video model
    latent_shape: tuple[int, ...]
    #: what :meth:`decode` returns: ``"image"`` (B, 3, H, W) or ``"video"`` (B, 3, F, H, W); the reward must score
    #: the same (:func:`stepflow.rewards.base.check_modality`), the sample grids show a video as a strip of frames
    modality: str = "image"
    #: the scheduler's shift for :meth:`time_grid` (SD3.5: 3.0)
    shift: float = 3.0
    #: timestep scale the transformer expects (diffusers SD3: t * 1000)
    timestep_scale: float = 1000.0
    #: sample-level transformer evaluations so far (CFG counts twice): the one NFE counter, read by
    #: ``stepflow.core.algorithm.Phases``; ``nfe_grad``: those made with autograd on (each also costs a backward)
    nfe: int = 0
    nfe_grad: int = 0
    #: the prompt whose encoding is the unconditional branch of CFG
    negative_prompt: str = ""
    #: ``lora`` (adapter on the attention projections, base frozen) or ``full`` (every transformer weight trained)
    finetune: str = "lora"
    #: capability: the model edits a source image (an instruction-based editing model): :meth:`encode` takes each
    #: row's source image, ``encode(prompts, sources=[...])``, and the conditioning carries it (``Cond.image``). The
    #: loop reads the sources off the prompt records (:func:`encode_rows`); the data set must have them
    #: (``data.source_key``). False: text-to-image, ``encode(prompts)``
    takes_source: bool = False

    # ------------------------------------------------------------------ to implement
    def encode(self, prompts: Sequence[str]) -> Cond:  # pragma: no cover - interface
        """Encode prompts to conditioning (implementations cache per prompt). A :attr:`takes_source` policy:
        ``encode(prompts, sources)``, ``sources`` one source image per prompt (a path, a PIL image or a (3, H, W)
        tensor in [0, 1])."""
        raise NotImplementedError

    def decode(self, latents: Tensor, estimate: bool = False) -> Tensor:  # pragma: no cover - interface
        """latents (B, C, H, W) -> images (B, 3, H', W') in [0, 1], fp32. ``estimate``: the latents are x̂0 estimates
        of intermediate states (a policy with a cheap estimate decoder may use it; the final image never does)."""
        raise NotImplementedError

    def negative_cond(self, batch_size: int) -> Cond:
        """Conditioning of :attr:`negative_prompt`, for classifier-free guidance (computed once, cached)."""
        if getattr(self, "_neg_cond", None) is None:
            self._neg_cond = self.encode([self.negative_prompt])
        return self._neg_cond.index([0] * batch_size)

    def negative_for(self, cond: Cond) -> Cond:
        """The unconditional rows of CFG for the rows of ``cond``: their own (``cond.negative``, e.g. an editing
        model's negative prompt encoded with each row's source image), else :meth:`negative_cond`; either way with
        the rows' condition image (``cond.image``), which both branches of the editing pipelines see."""
        neg = cond.negative if cond.negative is not None else self.negative_cond(len(cond)).to(cond.tokens.device)
        if cond.image is not None and neg.image is None:
            neg = replace(neg, image=cond.image)
        return neg

    # ------------------------------------------------------------------ shared
    @property
    def net(self) -> nn.Module:
        """The transformer that :meth:`_forward` runs: the trained one, or the frozen reference inside
        :meth:`reference` when fine-tuning fully."""
        ref = getattr(self, "_ref_active", None)
        return ref[0] if ref else self.transformer

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.net.parameters()).dtype

    def time_grid(self, num_steps: int) -> Tensor:
        """The sampling grid (num_steps + 1,), from 1 to 0 (method.md §1): SD3's shifted grid with :attr:`shift`."""
        from stepflow.math.sde import time_grid

        return check_time_grid(time_grid(num_steps, shift=self.shift))

    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        """One transformer evaluation: x (B, C, H, W), t (B,) fp32 in [0, 1] -> v (B, C, H, W) fp32.

        The weights' dtype is applied to the states and the conditioning; the timestep ``t · timestep_scale`` stays
        fp32 (SD3's time embedding computes its sinusoid from it in fp32 and casts the result to the weights' dtype,
        as ``StableDiffusion3Pipeline`` does).
        """
        net = self.net
        dt = next(net.parameters()).dtype
        out = net(
            hidden_states=x.to(dt),
            encoder_hidden_states=cond.tokens.to(dt),
            pooled_projections=cond.pooled.to(dt),
            timestep=t.float() * self.timestep_scale,
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
        n = b if guidance == 1.0 else 2 * b
        self.nfe += n
        if torch.is_grad_enabled():
            self.nfe_grad += n
        if guidance == 1.0:
            return self._forward(x, t, cond)
        neg = self.negative_for(cond).to(x.device)
        both = self._forward(torch.cat([x, x]), torch.cat([t, t]), Cond.cat([neg, cond]))
        v_u, v_c = both.chunk(2)
        if detach_uncond:
            v_u = v_u.detach()
        return self._guide(v_u, v_c, guidance)

    def _guide(self, v_u: Tensor, v_c: Tensor, guidance: float) -> Tensor:
        """Classifier-free guidance ``v_u + w·(v_c − v_u)`` (a model whose pipeline rescales it overrides this)."""
        return v_u + guidance * (v_c - v_u)

    def _freeze_encoders(self) -> None:
        """Every module but the transformer (text encoders, VAE) is frozen: GRPO trains the transformer only, and a
        trained-weights checkpoint (``requires_grad``) must not carry the encoders."""
        mods = dict(self.named_children()) if isinstance(self, nn.Module) else {}
        mods.update({k: v for k, v in vars(self).items() if isinstance(v, nn.Module)})
        for mod in mods.values():
            if mod is not self.transformer:
                mod.requires_grad_(False)

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, rank: int = 32, alpha: float = 64.0, targets: Sequence[str] = LORA_TARGETS_SD3,
                 init: str = "gaussian", dropout: float = 0.0) -> None:
        """Freeze the base weights and add a peft LoRA adapter named ``default`` to the transformer."""
        from peft import LoraConfig

        if self.finetune == "full":
            raise ValueError("model.finetune=full trains every transformer weight: it takes no LoRA adapter "
                             "(set lora.rank=0, or model.finetune=lora)")
        self.transformer.requires_grad_(False)
        self._freeze_encoders()
        present = {n for n, _ in self.transformer.named_modules()}
        wanted = [t for t in targets if any(n.endswith(t) for n in present)]
        if not wanted:
            raise ValueError(f"lora.targets: none of {list(targets)} exist in the transformer; pick attention projections")
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

    def lora_state_dict(self, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
        """The adapter's weights in peft's key format (what diffusers' ``save_lora_weights`` expects); ``state_dict``:
        the LoRA weights to convert instead of the live ones (keys as ``transformer.state_dict()``, e.g. gathered
        from FSDP2 shards)."""
        from peft.utils import get_peft_model_state_dict

        return get_peft_model_state_dict(self.transformer, state_dict=state_dict)

    def _lora_writer(self):
        """The diffusers pipeline class whose ``save_lora_weights`` writes this model's LoRA files (its own
        pipeline's; SD3's for policies without one)."""
        pipe = getattr(self, "pipe", None)
        if pipe is not None and hasattr(type(pipe), "save_lora_weights"):
            return type(pipe)
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline

    def save_lora(self, directory, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Write the adapter as ``pytorch_lora_weights.safetensors`` that diffusers' ``load_lora_weights`` reads,
        with the peft config (rank, alpha, targets) as metadata so the reloaded scale alpha/rank is right."""
        if not self.has_lora:
            raise ValueError("save_lora: the policy has no LoRA adapter (set lora.rank > 0)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.transformer.peft_config["default"].to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        state = {k: v.detach().cpu().contiguous() for k, v in self.lora_state_dict(state_dict).items()}
        self._lora_writer().save_lora_weights(str(directory), transformer_lora_layers=state,
                                              transformer_lora_adapter_metadata=config, safe_serialization=True)
        return directory

    def load_lora(self, directory, field: str = "lora_path") -> None:
        """Add a LoRA adapter and load it from ``directory`` (a diffusers ``save_lora_weights`` folder, a peft adapter
        folder or a ``.safetensors`` file; :func:`read_lora`), on exactly the modules it adapts.
        Pipeline policies load through their pipeline's own ``load_lora_weights``. A file that is not a LoRA of
        this model (random bytes, another model's) is one line naming ``field``."""
        if self.finetune == "full":
            raise _user_error(f"{field}: model.finetune=full takes no LoRA adapter; load a fine-tuned transformer "
                              "with model.transformer_path instead")
        try:
            state, info = read_lora(directory)
            self.add_lora(rank=info["rank"], alpha=info["alpha"], targets=info["targets"])
            self.load_lora_state_dict(state)
        except Exception as e:  # noqa: BLE001 - SafetensorError, a missing file, another model's adapter
            raise _user_error(lora_load_error(field, directory, e)) from None
        if hasattr(self, "clear_cache"):
            self.clear_cache()

    def load_lora_state_dict(self, state: dict[str, Tensor]) -> None:
        from peft.utils import set_peft_model_state_dict

        set_peft_model_state_dict(self.transformer, state)

    # ------------------------------------------------------------------ fine-tuning (LoRA or full)
    def set_finetune(self, mode: str) -> None:
        """``lora``: only adapter weights train (base frozen; :meth:`add_lora` adds them). ``full``: every
        transformer weight trains; the reference policy is then a frozen copy of the initial weights, made the first
        time it is needed (:meth:`prepare_reference`), never when β = 0."""
        if mode not in FINETUNE_MODES:
            raise ValueError(f"model.finetune: must be one of {', '.join(FINETUNE_MODES)}, got {mode!r}")
        if mode == "full":
            if self.has_lora:
                raise ValueError("model.finetune=full: the transformer already has a LoRA adapter (lora.path or "
                                 "lora.rank > 0); full fine-tuning starts from the base weights")
            self.transformer.requires_grad_(True)
            self._initial_versions = self._weight_versions()
        else:
            self.transformer.requires_grad_(False)
            for p in self.lora_parameters():
                p.requires_grad_(True)
        self._freeze_encoders()
        self.finetune = mode
        self._ref_copy = None

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        """What the optimizer updates: the LoRA weights (``finetune=lora``) or every transformer weight (``full``)."""
        if self.finetune == "full":
            yield from (p for p in self.transformer.parameters() if p.requires_grad)
        else:
            yield from self.lora_parameters()

    def _weight_versions(self) -> list[int]:
        """In-place update counters of the transformer's weights (an optimizer step bumps them, ``.to()`` does not)."""
        return [p._version for p in self.transformer.parameters()]

    def prepare_reference(self) -> None:
        """Make the full-fine-tuning reference now: a frozen copy of the transformer, which must still hold its
        initial weights (call before the first optimizer step and before any EMA swap). LoRA: nothing to do."""
        if self.finetune != "full" or getattr(self, "_ref_copy", None) is not None:
            return
        if self._weight_versions() != getattr(self, "_initial_versions", None):
            raise RuntimeError("reference: the transformer's weights changed since model.finetune=full was set, so a "
                               "copy would not be the initial policy; call policy.prepare_reference() before the "
                               "first update (the loop does when train.beta_kl > 0)")
        ref = copy.deepcopy(self.transformer)
        ref.requires_grad_(False)
        ref.eval()
        self._ref_copy = [ref]  # a list: not registered (not in state_dict, not moved or wrapped by Lightning)

    @contextlib.contextmanager
    def reference(self):
        """Context in which :meth:`velocity` is the reference policy π_ref (method.md §2's KL anchor): LoRA disabled
        (``finetune=lora``), or the frozen copy of the initial transformer (``full``, made on first use)."""
        if self.finetune != "full":
            with self.disable_adapter():
                yield
            return
        self.prepare_reference()
        ref = self._ref_copy[0]
        if next(ref.parameters()).device != self.device:
            ref.to(self.device)
        self._ref_active = [ref]
        try:
            yield
        finally:
            self._ref_active = None

    @property
    def trained_subdir(self) -> str:
        """Where in a run directory :meth:`save_trained` writes: ``lora`` or ``transformer``."""
        return "transformer" if self.finetune == "full" else "lora"

    def save_trained(self, directory, state_dict: dict[str, Tensor] | None = None) -> Path:
        """Write what was trained in diffusers format: the LoRA (``pytorch_lora_weights.safetensors``,
        ``pipe.load_lora_weights(directory)``) or, fully fine-tuned, the transformer (``transformer.save_pretrained``:
        ``<TransformerClass>.from_pretrained(directory)``, then ``<Pipeline>.from_pretrained(base, transformer=...)``).

        ``state_dict``: the transformer's weights to write instead of the live ones (every weight when fine-tuned
        fully, the LoRA weights otherwise), e.g. gathered from FSDP2 shards on rank 0, or EMA weights (keys as
        ``transformer.state_dict()``).
        """
        if self.finetune != "full":
            return self.save_lora(directory, state_dict)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        model = self.transformer
        if state_dict is not None:
            with torch.device("meta"):
                model = type(self.transformer).from_config(self.transformer.config)
            model.load_state_dict(state_dict, strict=True, assign=True)
        model.save_pretrained(str(directory), safe_serialization=True)
        return directory
