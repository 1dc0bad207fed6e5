"""The embedded world's text-to-image flow model: a tiny SD3 transformer in pixel space + a word-level text encoder.

Latent space = pixel space: ``x`` is the RGB image mapped to [-1, 1], shape ``(3, 32, 32)``; the transformer
(diffusers' ``SD3Transformer2DModel``, patch size 4 -> 64 image tokens) predicts the rectified-flow velocity
``v = x1 - x0`` with ``x_t = (1 - t) x0 + t x1`` (``x1`` = noise). ``decode`` is ``((x + 1) / 2).clamp(0, 1)``.

The text encoder is a small bidirectional transformer over a closed word vocabulary (the prompt grammar of
``stepflow.shapes``, stored in ``config.json``): a prompt becomes ``[BOS] w1 ... wn [PAD]...`` (fixed length
``max_length``, unknown words -> ``[UNK]``); token states ``(B, L, D)`` are zero at padding and the pooled vector
``(B, P)`` is a projection of the ``[BOS]`` state. The empty prompt ``""`` (classifier-free guidance's negative)
is just ``[BOS]``. It is trained jointly with the transformer in pretraining and frozen afterwards (RL adapts the
transformer with LoRA on SD3.5's attention projections, see ``stepflow.policies.base.LORA_TARGETS_SD3``).

Files (``save_pretrained`` / ``from_pretrained``): ``config.json`` + ``model.safetensors`` (keys ``transformer.*``
and ``text_encoder.*``). ``ShapesPolicy.from_pretrained()`` with no path loads the shipped base model in
``stepflow/assets/shapes_base``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stepflow.policies.base import Cond, FlowPolicy, _user_error, check_args

ASSET_NAME = "shapes_base"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SPECIALS = ("[PAD]", "[BOS]", "[UNK]")
PAD, BOS, UNK = 0, 1, 2
_WORD = re.compile(r"[a-z0-9]+")


def default_asset_dir() -> Path:
    """The shipped base model (package data, found through importlib.resources)."""
    return Path(str(resources.files("stepflow") / "assets" / ASSET_NAME))


def tokenize_words(prompt: str) -> list[str]:
    """Lower-case word split used by the vocabulary and the tokenizer (punctuation dropped)."""
    return _WORD.findall(prompt.lower())


def build_vocab(prompts: Sequence[str]) -> list[str]:
    """Sorted word vocabulary (specials first) of a prompt collection."""
    words = sorted({w for p in prompts for w in tokenize_words(p)})
    return list(SPECIALS) + words


def world_vocab() -> tuple[list[str], int]:
    """Vocabulary and longest prompt (in words) of the shapes world: every prompt its grammar can produce plus the
    prompt files."""
    from stepflow import shapes
    from stepflow.shapes.prompts import iter_all_prompts

    prompts = [r.to_meta()["prompt"] for r in iter_all_prompts()]
    for split in ("train", "eval"):
        try:
            prompts += [r["prompt"] for r in shapes.load_prompts(split)]
        except (FileNotFoundError, OSError):  # pragma: no cover - prompt files not generated
            pass
    return build_vocab(prompts), max(len(tokenize_words(p)) for p in prompts)


@dataclass
class ShapesConfig:
    """Everything needed to rebuild a :class:`ShapesPolicy` (serialised to ``config.json``)."""

    vocab: list[str] = field(default_factory=lambda: list(SPECIALS))
    #: token positions including [BOS]; longer prompts are truncated
    max_length: int = 20
    image_size: int = 32
    patch_size: int = 4
    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 24
    qk_norm: str | None = "rms_norm"
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 4
    pooled_dim: int = 64
    #: time-grid shift for sampling (``stepflow.math.sde.time_grid``)
    shift: float = 1.0
    #: what the transformer outputs: "v" (velocity, as SD3) or "x" (the clean image x0; ``velocity`` converts it
    #: to ``v = (x_t - x0) / max(t, t_eps)``, "x-prediction" as in JiT, Li & He 2025)
    prediction: str = "v"
    t_eps: float = 0.05
    #: weight init of a fresh model: "dit" (DiT's adaLN-Zero: zero modulation and output layers, xavier linears;
    #: what pretraining uses) or "default" (diffusers' own init: a random model with non-zero outputs, for tests)
    init: str = "default"
    #: free-form training record (steps, seed, metrics) written by the pretraining script
    meta: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShapesConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    #: the numeric fields and their bounds (:func:`~stepflow.policies.base.check_number`)
    RULES = {**{k: {"integer": True, "ge": 1} for k in ("max_length", "image_size", "patch_size", "num_layers",
                                                         "num_attention_heads", "attention_head_dim", "text_dim",
                                                         "text_layers", "text_heads", "pooled_dim")},
             "shift": {"gt": 0.0, "hint": " (the time-grid shift; 1 = none)"},
             "t_eps": {"gt": 0.0, "le": 1.0, "hint": " (the floor on t in the x-prediction velocity)"}}

    def check(self, prefix: str = "model.") -> None:
        """One-line errors naming ``prefix + field`` (``model.`` in training, ``arch.`` in pretraining) for a
        value the model cannot be built with: a non-positive size, inf / nan, a patch that does not tile the
        image, a text width the heads do not divide, an unknown ``init`` or ``prediction``."""
        check_args(asdict(self), self.RULES, prefix)
        if self.image_size % self.patch_size:
            raise _user_error(f"{prefix}image_size: {self.image_size} is not a multiple of {prefix}patch_size="
                              f"{self.patch_size}; use {self.image_size // self.patch_size * self.patch_size or self.patch_size}")
        if self.text_dim % self.text_heads:
            raise _user_error(f"{prefix}text_dim: {self.text_dim} is not divisible by {prefix}text_heads="
                              f"{self.text_heads}")
        if self.init not in ("dit", "default"):
            raise _user_error(f"{prefix}init: unknown {self.init!r}; use dit or default")
        if self.prediction not in ("v", "x"):
            raise _user_error(f"{prefix}prediction: unknown {self.prediction!r}; use v or x")


class WordTextEncoder(nn.Module):
    """Word-level tokenizer + small bidirectional transformer encoder.

    ``forward(ids (B, L) long) -> (tokens (B, L, D), pooled (B, P))``; padding positions of ``tokens`` are zero.
    """

    def __init__(self, vocab: Sequence[str], max_length: int, dim: int, layers: int, heads: int, pooled_dim: int):
        super().__init__()
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.max_length = max_length
        self.embed = nn.Embedding(len(self.vocab), dim, padding_idx=PAD)
        self.pos = nn.Parameter(torch.zeros(max_length, dim))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.pool = nn.Linear(dim, pooled_dim)

    def tokenize(self, prompts: Sequence[str]) -> Tensor:
        """prompts -> ids (B, max_length): ``[BOS] words... [PAD]...``."""
        ids = torch.full((len(prompts), self.max_length), PAD, dtype=torch.long)
        for i, p in enumerate(prompts):
            row = [BOS] + [self.index.get(w, UNK) for w in tokenize_words(p)]
            row = row[: self.max_length]
            ids[i, : len(row)] = torch.tensor(row)
        return ids

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        mask = ids != PAD
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        h = self.encoder(h, src_key_padding_mask=~mask)
        h = self.norm(h) * mask.unsqueeze(-1)
        return h, self.pool(h[:, 0])


def dit_init(tr: nn.Module) -> None:
    """DiT's initialisation (Peebles & Xie 2023) for a diffusers ``SD3Transformer2DModel``: xavier-uniform linears
    and patch embedding, N(0, 0.02) timestep MLP, and zero adaLN modulation and output projection (adaLN-Zero:
    every block starts as the identity and the model's output as 0)."""
    for m in tr.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    w = tr.pos_embed.proj.weight
    nn.init.xavier_uniform_(w.view(w.shape[0], -1))
    nn.init.zeros_(tr.pos_embed.proj.bias)
    te = tr.time_text_embed.timestep_embedder
    for lin in (te.linear_1, te.linear_2):
        nn.init.normal_(lin.weight, std=0.02)
    for blk in tr.transformer_blocks:
        for norm in (blk.norm1, blk.norm1_context):
            nn.init.zeros_(norm.linear.weight)
            if norm.linear.bias is not None:
                nn.init.zeros_(norm.linear.bias)
    for lin in (tr.norm_out.linear, tr.proj_out):
        nn.init.zeros_(lin.weight)
        nn.init.zeros_(lin.bias)


class ShapesPolicy(FlowPolicy):
    """Tiny pixel-space SD3 flow model of the shapes world (see the module docstring)."""

    def __init__(self, config: ShapesConfig, prefix: str = "model."):
        config.check(prefix)  # before any module is built; ``prefix``: how errors name the fields
        super().__init__()
        from diffusers import SD3Transformer2DModel

        self.config = config
        c = config
        self.transformer = SD3Transformer2DModel(
            sample_size=c.image_size, patch_size=c.patch_size, in_channels=3, out_channels=3, num_layers=c.num_layers,
            attention_head_dim=c.attention_head_dim, num_attention_heads=c.num_attention_heads,
            joint_attention_dim=c.text_dim, caption_projection_dim=c.num_attention_heads * c.attention_head_dim,
            pooled_projection_dim=c.pooled_dim, pos_embed_max_size=c.image_size // c.patch_size, qk_norm=c.qk_norm)
        self.text_encoder = WordTextEncoder(c.vocab, c.max_length, c.text_dim, c.text_layers, c.text_heads, c.pooled_dim)
        if c.init == "dit":
            dit_init(self.transformer)
        self.latent_shape = (3, c.image_size, c.image_size)
        self.shift = float(c.shift)
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}
        self._neg_cond = None

    # ------------------------------------------------------------------ construction / io
    @classmethod
    def build(cls, vocab: Sequence[str] | None = None, max_length: int | None = None, prefix: str = "model.",
              **overrides: Any) -> "ShapesPolicy":
        """A randomly initialised policy; the vocabulary defaults to the shapes world's. ``prefix``: how errors name
        the fields (``model.`` for ``model=shapes_tiny``, ``arch.`` for pretraining)."""
        if vocab is None:
            vocab, longest = world_vocab()
            max_length = max_length or longest + 1
        unknown = sorted(set(overrides) - set(ShapesConfig.__dataclass_fields__))
        if unknown:
            raise _user_error(f"{prefix}{unknown[0]}: not a ShapesConfig field; use one of "
                              f"{', '.join(f for f in ShapesConfig.__dataclass_fields__ if f != 'vocab')}")
        cfg = ShapesConfig(vocab=list(vocab), **({"max_length": max_length} if max_length else {}), **overrides)
        return cls(cfg, prefix)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike | None = None, map_location: str = "cpu") -> "ShapesPolicy":
        """Load ``config.json`` + ``model.safetensors`` from ``path`` (default: the shipped base model)."""
        from safetensors.torch import load_file

        from stepflow.errors import ModelLoadError

        path = Path(path) if path is not None else default_asset_dir()
        cfg_file, w_file = path / CONFIG_NAME, path / WEIGHTS_NAME
        fix = "point model.path at a directory written by ShapesPolicy.save_pretrained (null: the shipped model)"
        if not cfg_file.is_file() or not w_file.is_file():
            raise FileNotFoundError(f"model.path: {path} must contain {CONFIG_NAME} and {WEIGHTS_NAME}; {fix}")
        try:
            raw = json.loads(cfg_file.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
            raise ModelLoadError(f"model.path: {cfg_file} is not JSON ({getattr(e, 'msg', e)}{where}); {fix}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"model.path: {cfg_file} is not a ShapesPolicy config (a JSON object); {fix}")
        cfg = ShapesConfig.from_dict(raw)
        policy = cls(cfg)
        try:
            weights = load_file(str(w_file), device=map_location)
        except Exception as e:  # noqa: BLE001 - safetensors' own error type: a damaged or foreign file
            raise ModelLoadError(f"model.path: {w_file} cannot be read as safetensors ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:160]}); {fix}") from None
        try:
            policy.load_state_dict(weights, strict=True)
        except RuntimeError as e:
            raise ModelLoadError(f"model.path: {w_file} does not hold the weights {cfg_file.name} describes "
                                 f"({' '.join(str(e).split())[:200]}); {fix}") from None
        return policy.eval()

    def save_pretrained(self, path: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (fp32, base weights only: a LoRA is not merged)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = asdict(self.config)
        if meta:
            cfg["meta"] = {**cfg.get("meta", {}), **meta}
        (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=1) + "\n")
        # with a peft adapter attached, base weights live under "...base_layer."; store them under their plain names
        state = {k.replace(".base_layer.", "."): v.detach().float().cpu().contiguous()
                 for k, v in self.state_dict().items() if "lora_" not in k}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        return path

    # ------------------------------------------------------------------ FlowPolicy
    def _forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        out = super()._forward(x, t, cond)
        if self.config.prediction == "x":  # the transformer predicts x0: v = (x_t - x0) / t
            tt = t.float().clamp_min(self.config.t_eps).view(-1, 1, 1, 1)
            out = (x.float() - out) / tt
        return out

    def encode(self, prompts: Sequence[str]) -> Cond:
        """Prompts -> Cond (tokens (B, L, D), pooled (B, P), mask (B, L)). Cached per prompt while the text encoder
        is frozen (eval mode or no grad); in training mode with grad the encoder runs and nothing is cached."""
        prompts = list(prompts)
        dev = self.device
        training = self.text_encoder.training and torch.is_grad_enabled() and any(
            p.requires_grad for p in self.text_encoder.parameters())
        if training:
            ids = self.text_encoder.tokenize(prompts).to(dev)
            tok, pooled = self.text_encoder(ids)
            return Cond(tok, pooled, ids != PAD)
        missing = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if missing:
            with torch.no_grad():
                ids = self.text_encoder.tokenize(missing).to(dev)
                tok, pooled = self.text_encoder(ids)
            for i, p in enumerate(missing):
                self._cache[p] = (tok[i].detach(), pooled[i].detach())
        rows = [self._cache[p] for p in prompts]
        tok = torch.stack([r[0] for r in rows]).to(dev)
        pooled = torch.stack([r[1] for r in rows]).to(dev)
        mask = self.text_encoder.tokenize(prompts).to(dev) != PAD
        return Cond(tok, pooled, mask)

    def clear_cache(self) -> None:
        """Forget cached prompt encodings (call after changing the text encoder's weights)."""
        self._cache.clear()
        self._neg_cond = None

    def decode(self, latents: Tensor, estimate: bool = False) -> Tensor:
        """latents (B, 3, H, W) in ~[-1, 1] -> images (B, 3, H, W) in [0, 1], fp32."""
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    @staticmethod
    def encode_images(images: Tensor) -> Tensor:
        """images (B, 3, H, W) in [0, 1] -> latents x0 in [-1, 1] (the inverse of :meth:`decode`)."""
        return images.float() * 2.0 - 1.0

    def num_parameters(self) -> dict[str, int]:
        return {"transformer": sum(p.numel() for p in self.transformer.parameters()),
                "text_encoder": sum(p.numel() for p in self.text_encoder.parameters())}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.clear_cache()
        return out
