"""BLIP's ViT image encoder (inference only), parameter names as in BLIP's ``models/vit.py``.

x (B, 3, S, S) -> patch conv ``patch_embed.proj`` -> prepend ``cls_token`` -> add ``pos_embed`` -> ``blocks``
(pre-norm: x + attn(norm1(x)); x + mlp(norm2(x)), LayerNorm eps 1e-6, exact GELU) -> ``norm`` -> (B, 1 + N, D).
ImageReward uses ``vit='large'``: patch 16, D 1024, depth 24, 16 heads, at 224 px.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class PatchEmbed(nn.Module):
    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.img_size, self.patch_size = img_size, patch_size
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, N, D)


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"ViT width {dim} is not a multiple of {num_heads} heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        x = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(d)) v
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True, eps: float = 1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """BLIP ViT. ``from_state_dict`` infers every size except the head count from a checkpoint."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, embed_dim: int = 1024, depth: int = 24,
                 num_heads: int = 16, mlp_ratio: float = 4.0, qkv_bias: bool = True, in_chans: int = 3):
        super().__init__()
        self.img_size = img_size
        self.embed_dim = embed_dim
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, qkv_bias) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @staticmethod
    def sizes_from_state_dict(sd: dict[str, Tensor], prefix: str = "") -> dict[str, int | float]:
        """img_size, patch_size, embed_dim, depth, mlp_ratio of the ViT stored under ``prefix`` in ``sd``."""
        w = sd[prefix + "patch_embed.proj.weight"]  # (D, 3, P, P)
        embed_dim, patch = w.shape[0], w.shape[-1]
        grid = int(round((sd[prefix + "pos_embed"].shape[1] - 1) ** 0.5))
        depth = 1 + max(int(k[len(prefix):].split(".")[1]) for k in sd if k.startswith(prefix + "blocks."))
        hidden = sd[prefix + "blocks.0.mlp.fc1.weight"].shape[0]
        return dict(img_size=grid * patch, patch_size=patch, embed_dim=embed_dim, depth=depth,
                    mlp_ratio=hidden / embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, 3, S, S) normalized pixels -> (B, 1 + (S/P)^2, D) token features."""
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed[:, : x.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)
