"""LAION aesthetic predictor v2 ("improved-aesthetic-predictor", Schuhmann 2022) as a reward.

score = MLP(e / ||e||), e the CLIP ViT-L/14 image embedding (``openai/clip-vit-large-patch14``, projected, 768-d).
The MLP is the released ``sac+logos+ava1-l14-linearMSE.pth``: Linear 768→1024, Dropout 0.2, Linear →128,
Dropout 0.2, Linear →64, Dropout 0.1, Linear →16, Linear →1 (no nonlinearities, as released). Raw scores are on
the AVA 1-10 scale (typically 4-7). This is Flow-GRPO's ``aesthetic`` reward.

Image path (the official one): Flow-GRPO's ``aesthetic_score`` rounds the float image to uint8 and its
``aesthetic_scorer.py::AestheticScorer`` runs transformers' ``CLIPProcessor`` (the PIL processor in transformers 4);
stepflow does the same through :class:`~stepflow.rewards.clip_based.CLIPEmbedder` (uint8 -> PIL ->
``CLIPImageProcessorPil``: PIL bicubic resize of the short side to 224, center crop, CLIP mean/std). The
predictor's own ``simple_inference.py`` embeds with OpenAI ``clip``'s preprocess (torchvision ``Resize``/``CenterCrop``
on the PIL image): the same resampling; only its crop offset rounds ``(d / 2)`` where transformers floors it, which
differs by one pixel when the overhang ``d = long - 224`` is 3 mod 4 (never for square images).

``reward.dtype=bfloat16`` runs CLIP in bf16; the normalization and the MLP stay fp32. The MLP file is read with
``torch.load(weights_only=True)`` (it is a plain state dict of tensors).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.clip_based import CLIPEmbedder
from stepflow.rewards.loading import check_keys, load_guard, load_state_dict, resolve_file

AESTHETIC_URL = ("https://github.com/christophschuhmann/improved-aesthetic-predictor/raw/main/"
                 "sac%2Blogos%2Bava1-l14-linearMSE.pth")
AESTHETIC_FILE = "sac+logos+ava1-l14-linearMSE.pth"


class AestheticMLP(nn.Module):
    """The released head; ``layers.{0,2,4,6,7}`` are the Linear layers (state-dict keys match the .pth file)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.input_size = input_size
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class AestheticScore(Reward):
    """clip_path: a CLIPModel (HF id or local dir); mlp_path: the MLP weights as a local file, a local dir holding
    ``mlp_filename``, a URL (default: the GitHub release), or an HF repo id holding ``mlp_filename`` (for example
    ``trl-lib/ddpo-aesthetic-predictor`` with ``mlp_filename: aesthetic-model.pth``).
    ``scale`` multiplies the raw 1-10 score (``0.1`` maps it to about [0, 1]). Component: ``raw``."""

    name = "aesthetic"

    def __init__(self, clip_path: str = "openai/clip-vit-large-patch14", mlp_path: str = AESTHETIC_URL,
                 mlp_filename: str = AESTHETIC_FILE, scale: float = 1.0, device: str = "auto",
                 dtype: str = "float32", batch_size: int = 32):
        self.clip = CLIPEmbedder(clip_path, None, device, dtype, text=False, what="aesthetic CLIP",
                                 model_key="clip_path")
        path = resolve_file(mlp_path, mlp_filename, "aesthetic MLP", "reward.mlp_path")
        sd = load_state_dict(path, "aesthetic MLP", "reward.mlp_path")
        with load_guard("aesthetic MLP", path, "reward.mlp_path"):
            self.mlp = AestheticMLP(sd["layers.0.weight"].shape[1])
            check_keys(self.mlp.load_state_dict(sd, strict=False).missing_keys, "aesthetic MLP", path,
                       "reward.mlp_path")
        self.mlp = self.mlp.eval().to(self.clip.device, torch.float32).requires_grad_(False)
        self.scale, self.batch_size = float(scale), batch_size

    @torch.no_grad()
    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        emb = F.normalize(self.clip.image_embeds(images), dim=-1)
        raw = self.mlp(emb.float()).squeeze(-1)
        return RewardOut(self.scale * raw, {"raw": raw})
