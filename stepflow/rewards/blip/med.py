"""BLIP's "med" text encoder: BERT whose layers add cross-attention to image tokens (inference only).

Parameter names mirror BLIP's ``models/med.py`` ``BertModel(add_pooling_layer=False)``:
``embeddings.{word_embeddings,position_embeddings,LayerNorm}`` (no token-type embeddings) and
``encoder.layer.{i}.{attention,crossattention}.{self.{query,key,value},output.{dense,LayerNorm}}``,
``encoder.layer.{i}.intermediate.dense``, ``encoder.layer.{i}.output.{dense,LayerNorm}``.

Per layer (post-norm BERT):  h = LN(h + SelfAttn(h));  [multimodal] h = LN(h + CrossAttn(h, image_tokens));
h = LN(h + W2 act(W1 h)). Padding masks are additive, ``(1 - mask) · -10000`` as in BLIP.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ACT = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class MedConfig:
    """The fields of BLIP's ``med_config.json`` that the encoder uses (the rest of the JSON is ignored)."""

    vocab_size: int = 30524
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    encoder_width: int = 768
    add_cross_attention: bool = True
    position_embedding_type: str = "absolute"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MedConfig":
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        if isinstance(cfg.add_cross_attention, str):  # some med configs write "True"
            cfg.add_cross_attention = cfg.add_cross_attention.lower() == "true"
        if cfg.position_embedding_type != "absolute":
            raise ValueError(f"med config: only absolute position embeddings are supported, "
                             f"got {cfg.position_embedding_type!r}")
        if cfg.hidden_act not in _ACT:
            raise ValueError(f"med config: hidden_act {cfg.hidden_act!r} not in {sorted(_ACT)}")
        return cfg

    @classmethod
    def from_json_file(cls, path: str) -> "MedConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: MedConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: Tensor) -> Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.dropout(self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(pos)[None]))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: MedConfig, is_cross_attention: bool):
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden size {cfg.hidden_size} is not a multiple of {cfg.num_attention_heads} heads")
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        kv_in = cfg.encoder_width if is_cross_attention else cfg.hidden_size
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(kv_in, cfg.hidden_size)
        self.value = nn.Linear(kv_in, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.attention_probs_dropout_prob)

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, h: Tensor, mask: Tensor | None, kv: Tensor | None = None) -> Tensor:
        """h (B, L, H); kv (B, M, E) for cross-attention (else h); mask additive, broadcastable to (B, heads, L, M)."""
        kv = h if kv is None else kv
        q, k, v = self._heads(self.query(h)), self._heads(self.key(kv)), self._heads(self.value(kv))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        ctx = self.dropout(scores.softmax(-1)) @ v
        return ctx.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: MedConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: MedConfig, is_cross_attention: bool = False):
        super().__init__()
        self.self = BertSelfAttention(cfg, is_cross_attention)
        self.output = BertSelfOutput(cfg)

    def forward(self, h: Tensor, mask: Tensor | None, kv: Tensor | None = None) -> Tensor:
        return self.output(self.self(h, mask, kv), h)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: MedConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _ACT[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, cfg: MedConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertLayer(nn.Module):
    def __init__(self, cfg: MedConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        if cfg.add_cross_attention:
            self.crossattention = BertAttention(cfg, is_cross_attention=True)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, h: Tensor, mask: Tensor | None, image: Tensor | None, image_mask: Tensor | None) -> Tensor:
        h = self.attention(h, mask)
        if image is not None:
            h = self.crossattention(h, image_mask, image)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, cfg: MedConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, L) 1 = attend, 0 = ignore -> (B, 1, 1, L) additive mask: 0 or -10000 (BLIP's convention)."""
    return (1.0 - mask[:, None, None, :].to(dtype)) * -10000.0


class MedTextEncoder(nn.Module):
    """BLIP's text encoder (``BertModel(config, add_pooling_layer=False)``); returns the last hidden state."""

    def __init__(self, cfg: MedConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                encoder_hidden_states: Tensor | None = None, encoder_attention_mask: Tensor | None = None,
                mode: str = "multimodal") -> Tensor:
        """input_ids (B, L); encoder_hidden_states (B, M, E) image tokens (used when mode == 'multimodal').
        Returns (B, L, H)."""
        if mode not in ("multimodal", "text"):
            raise ValueError(f"mode must be 'multimodal' or 'text', got {mode!r}")
        h = self.embeddings(input_ids)
        mask = additive_mask(attention_mask if attention_mask is not None else torch.ones_like(input_ids), h.dtype)
        image = image_mask = None
        if mode == "multimodal":
            if encoder_hidden_states is None or not self.config.add_cross_attention:
                raise ValueError("multimodal mode needs encoder_hidden_states and a config with add_cross_attention")
            image = encoder_hidden_states
            if encoder_attention_mask is None:
                encoder_attention_mask = torch.ones(image.shape[:2], dtype=torch.long, device=image.device)
            image_mask = additive_mask(encoder_attention_mask, h.dtype)
        for layer in self.encoder.layer:
            h = layer(h, mask, image, image_mask)
        return h
